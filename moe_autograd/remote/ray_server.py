"""Expert servers as named Ray actors: :class:`RayExpertServer`.

Why: on Ray, an expert server is an actor that Ray places (by resources),
names (clients find it with ``ray.get_actor``) and ends with its owner or
node. The actor hosts :class:`~.server.ExpertServer` (s) built by an experts
factory, exactly as an RPC worker does, and has ONE method, ``handle``,
which serves sealed frames (:func:`~.ray_engine.serve_frame`): no method of
it runs a function it was sent, reports anything, or changes anything
without the job's secret. Draining and closing are sealed operations too
(``drain``, ``close``), so another job on the cluster cannot stop it.

How the actor gets the job's secret: from a file on its node, never from a
message or an argument Ray would store. ``secret_file`` (or the driver's
``MOE_AUTOGRAD_SECRET_FILE``) names it; the path travels, the key does not.
A driver whose secret is not in a file (:func:`~.auth.set_job_secret`,
``MOE_AUTOGRAD_SECRET``) writes it to a private temporary file (mode 600 in
a directory of mode 700) that its actors on this node read, and removes it
once every actor started from it has read it (``wait_ready``) or at exit;
an actor placed on another node needs the file there (as Ray's own token
file does).

Lifecycle of a server (driver's view)::

    state     entered when                                   what happens
    --------  ---------------------------------------------  --------------------------------
    starting  RayExpertServer(...): the actor is created      the actor checks Ray's token
              (named, in ``namespace``)                      auth (refuses without it unless
                                                             allow_unauthenticated), reads the
                                                             secret, builds its experts
    serving   wait_ready(): ``__ray_ready__``, then a sealed  clients call it; a RayFleet
              ``info`` answered                              admits it at its next poll
    draining  leave(): sealed ``drain`` (state draining,     fleets stop choosing it; calls in
              serves until idle, >= linger)                  flight and held states finish
    gone      stop() / leave() end it (``ray.kill``), or     its name is free again
              kill() (as a crash would)
    restart   its process or node died, ``max_restarts``     calls in flight fail; Ray builds it
              left (Ray restarts it, same name and handle)   again (the constructor, with the
                                                             same arguments: its experts resume
                                                             from ``state_dir``, or a peer with
                                                             ``recover``), then it serves again

Durable state and restarts (issue 44): ``state_dir``/``save_every``/
``save_interval`` are the hosted :class:`~.server.ExpertServer`'s (its
experts resume from their newest complete snapshot at start, are saved every
``N`` steps or ``T`` seconds and at a clean leave; the directory is a path
on the actor's node, made absolute by the driver). ``max_restarts`` lets
Ray restart an actor whose process died (kill -9, a crash, an OOM kill) or
re-place it after its node died: Ray runs the actor's constructor again
with the same arguments, so the new incarnation reads the job's secret from
the same file (which therefore stays in place until the server is stopped),
builds its experts again, resumes them from ``state_dir`` (and, with
``recover=True``, takes the state of a live replica of each expert in the
namespace, which is newer), and only then serves: Ray runs no method of
an actor before its constructor returns, so no call reaches a replacement
that has not resumed. Calls in flight when the process died fail
(``max_task_retries`` stays 0: an optimizer step is never applied twice);
clients and fleets reach the new incarnation under the same name. The
actor logs where each expert came from on the ``moe_autograd`` loggers,
which it writes to its stderr (Ray's ``worker-*.err`` log of the actor):
``resumed from snapshot PATH (step N)`` or ``resumed from peer NAME (step
N)`` at INFO, and a WARNING naming each expert that a restart had to start
from its factory's fresh weights.

Invariants:

* The actor refuses to start on a Ray without token authentication unless
  its creator opted out (``allow_unauthenticated=True``, ``serve --insecure``).
* Public Ray API only (``ray.remote``, actor options, ``ray.kill``,
  ``ray.get``, ``__ray_ready__``, ``ray.util.list_named_actors``, the runtime
  context's ``was_current_actor_reconstructed``).
* A restartable actor (``max_restarts`` not 0) finds its secret where its
  first incarnation did for as long as its :class:`RayExpertServer` stands
  for it: a private copy is removed at :meth:`RayExpertServer.stop` /
  ``leave`` / ``kill`` (or at this driver's exit, when the actor, owned by
  it, ends too), not once the first incarnation has read it.
"""
import atexit
import inspect
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..logs import configure_cli
from . import endpoint
from .auth import (ENV_SECRET_FILE, JobSecret, MissingSecretError, encrypt_from_env, job_secret,
                   set_job_secret)
from .channel import request
from .client import RemoteExpert
from .durable import snapshot_paths
from .factory import load_object
from .ray_engine import (NAMESPACE, RayTransport, _ray, forget_everywhere, publish_identity,
                         require_token_auth,
                         serve_frame, set_default_ray_transport, short)
from .server import ExpertServer, set_host_info
from .transport import check_timeout, set_transport

__all__ = ["RayExpertServer", "start_servers", "RECOVER_INFO_S", "RECOVER_TIMEOUT_S"]

Factory = Union[str, Callable[[], Any]]
RECOVER_INFO_S = 5.0  # how long a recovering actor waits for its peers' info(), in all
RECOVER_TIMEOUT_S = 60.0  # a peer's state, when recovering from it
_log = logging.getLogger(__name__)


def _server_parameters() -> List[str]:
    return [p for p in inspect.signature(ExpertServer.__init__).parameters
            if p not in ("self", "experts", "transport", "secret")]


class _ExpertActor:
    """The actor class (wrapped with ``ray.remote`` when started): hosts the
    :class:`~moe_autograd.remote.ExpertServer` (s) that ``experts`` builds."""

    def __init__(self, name: str, namespace: str, experts: Factory,
                 server_options: Dict[str, Any], torch_threads: int,
                 secret_file: Optional[str], allow_unauthenticated: bool,
                 recover: bool = False, consume: bool = False, encrypt: bool = False) -> None:
        import ray
        import torch

        require_token_auth(allow_unauthenticated, f"Ray expert server {name!r}")
        secret = JobSecret.from_file(secret_file) if secret_file else job_secret()
        secret = secret.encrypting(encrypt)  # (the driver's job's setting)
        if consume and secret_file:  # its driver's private copy, this actor's alone: read,
            try:                     # so gone even if the driver is killed with SIGKILL
                os.unlink(secret_file)
            except OSError:
                pass
        if not logging.getLogger("moe_autograd").handlers:  # resumes and refusals in its log
            configure_cli(f"moe_autograd ray server {name}")
        restarted = _was_restarted(ray)
        if restarted:
            _log.info("Ray restarted expert server %r (pid %d): its experts are built again",
                      name, os.getpid())
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        set_job_secret(secret)  # the factory's own ExpertServers serve this job too
        transport = RayTransport(namespace, name=name,
                                 allow_unauthenticated=allow_unauthenticated)
        set_default_ray_transport(transport)
        set_transport(transport)  # ExpertServer's worker name; calls to peers from here
        factory = load_object(experts) if isinstance(experts, str) else experts
        built = factory()
        if isinstance(built, Mapping):
            self.servers = [ExpertServer(built, secret=secret, **server_options)]
        else:
            servers = list(built) if isinstance(built, (list, tuple)) else [built]
            if not all(isinstance(s, ExpertServer) for s in servers):
                raise TypeError(f"the experts factory {experts!r} must return a dict "
                                "name -> nn.Module, or ExpertServer(s); got "
                                f"{type(built).__name__}")
            if server_options:
                raise TypeError(f"server options {sorted(server_options)} apply to a dict of "
                                f"experts; the factory {experts!r} built ExpertServers itself")
            self.servers = servers
        self.name = name
        recovered = _recover(name, namespace, transport, secret, self.servers) if recover else {}
        if restarted:
            _warn_fresh(name, self.servers, recovered)
        publish_identity(namespace, name, str(ray.get_runtime_context().get_actor_id()),
                         [s for server in self.servers for s in server.secrets])
        set_host_info(name=name, state="serving", restarted=restarted,
                      node_id=ray.get_runtime_context().get_node_id())
        endpoint.register("drain", self._drain_op)
        endpoint.register("close", self._close_op)

    def handle(self, head: Any, blob: Any) -> Tuple[bytes, Any]:
        """The actor's one method: a sealed frame in, a sealed frame out."""
        return serve_frame(head, blob, self.name)

    # -- sealed operations (registered in this process's endpoint) ---------------------
    def _drain_op(self, caller: Any, request: Dict[str, Any]) -> List[Any]:
        """Leaves cleanly: marks the server draining (fleets stop choosing it
        within their poll), serves for at least ``linger`` seconds and until
        no request runs and no state is held (at most ``timeout``), then
        closes. Replies what was left when it closed."""
        values = (request.get("linger"), request.get("timeout"))
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                   for v in values):
            return ["error", "TypeError: drain needs linger and timeout, non-negative seconds"]
        linger, timeout = float(values[0]), float(values[1])  # type: ignore[arg-type]
        set_host_info(state="draining")
        start = time.monotonic()
        while True:
            busy = sum(int(s.stats()["in_flight"]) for s in self.servers)
            held = sum(int(s.stats()["live"]) for s in self.servers)
            spent = time.monotonic() - start
            if (spent >= linger and busy == 0 and held == 0) or spent >= timeout:
                break
            time.sleep(0.02)
        self._close(max(0.0, timeout - (time.monotonic() - start)))
        return ["ok", {"in_flight": busy, "live": held}]

    def _close_op(self, caller: Any, request: Dict[str, Any]) -> List[Any]:
        timeout = request.get("timeout")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            return ["error", "TypeError: close needs timeout, non-negative seconds"]
        self._close(float(timeout))
        return ["ok", None]

    def _close(self, timeout: float) -> None:
        """Stops serving: requests in flight get ``timeout`` seconds, states are freed."""
        for server in self.servers:
            server.close(timeout=timeout)


def _was_restarted(ray: Any) -> bool:
    """Whether Ray restarted the actor this process runs (False outside one)."""
    try:
        with warnings.catch_warnings():  # (it reads the deprecated actor_id itself)
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not an actor's process
        return False


def _recover(me: str, namespace: str, transport: RayTransport, secret: JobSecret,
             servers: Sequence[ExpertServer]) -> Dict[str, str]:
    """Each expert of ``servers`` takes the state of a live replica: a
    named actor of ``namespace`` (not ``me``) whose sealed ``info`` answers,
    within :data:`RECOVER_INFO_S` for all of them (a peer still in its own
    constructor cannot), that it serves the expert (the first by name that
    hands its state over);
    logged at INFO with the peer, the step, the bytes and the time (a
    failing peer at WARNING, and the next one is tried). Returns expert ->
    ``"peer NAME"`` for those that took one."""
    ray = _ray()
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == namespace and a.get("name") != me)
    asked = []
    for peer in names:
        try:
            asked.append((peer, request(transport, peer, {"op": "info"}, RECOVER_INFO_S,
                                        secret=secret, label="info")))
        except Exception:  # noqa: BLE001 - not an expert server, or gone meanwhile
            continue
    serving: Dict[str, List[str]] = {}  # expert -> peers serving it
    deadline = time.monotonic() + RECOVER_INFO_S
    for peer, opened in asked:
        try:
            status, info = opened.result(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - dead, starting, another job's: not a source
            continue
        if status == "ok" and isinstance(info, dict) and info.get("state") == "serving":
            for expert in info.get("experts", {}) or {}:
                serving.setdefault(str(expert), []).append(peer)
    recovered: Dict[str, str] = {}
    for server in servers:
        for expert in server.names:
            for peer in serving.get(expert, []):
                started = time.monotonic()
                try:
                    state = RemoteExpert(peer, expert, transport=transport, secret=secret,
                                         forward_timeout=RECOVER_TIMEOUT_S).remote_snapshot()
                    steps = server.restore(expert, state, f"peer {peer}")
                except Exception as error:  # noqa: BLE001 - the next replica, if any
                    _log.warning("expert %r: could not take the state of peer %r: %s: %s",
                                 expert, peer, type(error).__name__, error)
                    continue
                size = sum(t.numel() * t.element_size() for t in state.module.values())
                _log.info("expert %r took the state of peer %r (step %d, %.2f MB of weights "
                          "in %.3f s)", expert, peer, steps, size / 1e6,
                          time.monotonic() - started)
                recovered[expert] = f"peer {peer}"
                break
    return recovered


def _warn_fresh(me: str, servers: Sequence[ExpertServer], recovered: Mapping[str, str]) -> None:
    """A WARNING for each expert that the restart of ``me`` starts from its
    factory's weights: no live replica's state taken, and no snapshot in its
    server's state directory (or no state directory at all)."""
    for server in servers:
        resumed: Optional[Mapping[str, str]] = getattr(server, "resumed", None)
        for expert in server.names:
            if expert in recovered:
                continue
            if server.snapshots is None:
                why = "it has no state_dir"
            elif resumed is not None and not resumed.get(expert):
                why = f"no usable snapshot of it in {server.snapshots.directory}"
            elif resumed is None and not snapshot_paths(server.snapshots.directory, expert):
                why = f"no snapshot of it in {server.snapshots.directory}"
            else:
                continue  # resumed from a snapshot (logged at INFO by its server)
            _log.warning("expert %r starts fresh on %r, restarted by Ray: what it learned died "
                         "with the process (%s; no live replica's state taken)", expert, me, why)


_actor_classes: List[Any] = []


def _actor_class() -> Any:
    """``ray.remote(_ExpertActor)``, made once per process."""
    if not _actor_classes:
        _actor_classes.append(_ray().remote(_ExpertActor))
    return _actor_classes[0]


_private_dirs: List[str] = []
#: private copy -> actors started from it that may not have read it yet
_private_readers: Dict[str, int] = {}
_private_lock = threading.Lock()


def _remove_private_dirs() -> None:
    with _private_lock:
        for path in _private_dirs:
            shutil.rmtree(path, ignore_errors=True)
        _private_dirs.clear()
        _private_readers.clear()


atexit.register(_remove_private_dirs)


def _read_private_copy(path: Optional[str]) -> None:
    """An actor started from the private copy ``path`` has read it (it is
    constructed) or never will (it failed): the copy, and the directory with
    the last copy, are removed once no actor is left to read them. (The
    ``atexit`` hook covers actors nobody waited for; an actor that is not
    restartable removes its own copy as soon as it has read it, so a driver
    killed with SIGKILL leaves none behind once its actors started.)"""
    if path is None:
        return
    with _private_lock:
        left = _private_readers.get(path, 0) - 1
        if left > 0:
            _private_readers[path] = left
            return
        _private_readers.pop(path, None)
        try:
            os.unlink(path)
        except OSError:
            pass
        if not _private_readers:
            for folder in _private_dirs:
                shutil.rmtree(folder, ignore_errors=True)
            _private_dirs.clear()


def _secret_source(secret_file: Optional[str]) -> Tuple[str, JobSecret, Optional[str]]:
    """The file the actor reads the secret from, the secret (see the module
    docstring), and that file again if it is a private copy (then
    :func:`_read_private_copy` once the actor has read it): ``secret_file``,
    else this process's job secret (:func:`~.auth.job_secret`: the default
    set here, else the environment's), through the file
    ``MOE_AUTOGRAD_SECRET_FILE`` names when that file holds it, else through
    a private copy."""
    if secret_file:
        path = os.path.abspath(secret_file)
        return path, JobSecret.from_file(path, encrypt_from_env()), None
    secret = job_secret()
    named = os.environ.get(ENV_SECRET_FILE)
    if named:
        try:
            if JobSecret.from_file(named, secret.encrypt) == secret:
                return os.path.abspath(named), secret, None
        except (OSError, ValueError, MissingSecretError):
            pass
    with _private_lock:
        if not _private_dirs:
            _private_dirs.append(tempfile.mkdtemp(prefix="moe_autograd-secret-"))  # mode 700
        # one copy per actor: each actor removes its own once it has read it
        path = os.path.join(_private_dirs[0],
                            f"{secret.key_id.hex()}-{secrets.token_hex(8)}.secret")
        secret.save(path)
        _private_readers[path] = _private_readers.get(path, 0) + 1
    return path, secret, path


def _check_placement(ray: Any, name: str, num_gpus: float,
                     resources: Optional[Mapping[str, float]], on_node: Optional[str]) -> None:
    """Raises ``ValueError`` naming the resource that no live node (of those
    ``on_node`` allows) has as much of as asked, before Ray is asked: Ray
    would keep the actor pending (RayExpertServer: until ``ready_timeout``)
    or fail a node-affinity placement with its own words (issue 43)."""
    wanted = {k: float(v) for k, v in (resources or {}).items()}
    if num_gpus:
        wanted["GPU"] = float(num_gpus)
    if not wanted:
        return
    alive = [n for n in ray.nodes() if n.get("Alive")]
    node = ray.get_runtime_context().get_node_id() if on_node == "here" else on_node
    allowed = alive if node is None else [n for n in alive if n.get("NodeID") == node]
    where = "any live node of the cluster" if node is None else (
        "this process's node" if on_node == "here" else f"node {node}")
    for key, amount in sorted(wanted.items()):
        if any(n.get("Resources", {}).get(key, 0.0) >= amount for n in allowed):
            continue
        elsewhere = any(n.get("Resources", {}).get(key, 0.0) >= amount for n in alive)
        has = sorted({k for n in allowed for k in n.get("Resources", {})
                      if not k.startswith("node:")})
        hint = ("another node has it: let Ray place the actor there ('serve --engine ray "
                "--anywhere', RayExpertServer(..., on_node=None))" if elsewhere else
                f"start a node that advertises it ('ray start ... --resources='"
                f"{{\"{key}\": N}}'', on one machine the head itself: 'ray start --head "
                f"--resources=...'), or ask for no {key!r}")
        raise ValueError(f"cannot start Ray expert server {name!r}: {where} has no "
                         f"{amount:g} of the resource {key!r} (it has {has}); {hint}")


class RayExpertServer:
    """Starts an expert server as a named Ray actor, and stands for it.

    ``RayExpertServer("srv-a", "my_experts:make", backward="stateful")`` starts
    an actor named ``srv-a`` (in ``namespace``) that builds its experts with
    the factory (``"package.module:function"``, or a picklable callable)
    returning a dict ``name -> nn.Module`` (served by one
    :class:`~moe_autograd.remote.ExpertServer` given ``server_options``:
    ``backward``, ``optimizer``, ``auto_step``, ``state_ttl``, ``max_states``,
    ... exactly its keyword arguments) or ExpertServer(s) built by the
    factory itself. Clients then call ``RemoteExpert("srv-a", expert,
    transport=RayTransport())`` (or rely on the automatic choice in a process
    where only Ray is initialised). Waits until the actor is ready
    (``ready_timeout`` seconds) and raises what went wrong if it is not.

    The job's secret: ``secret_file`` on the actor's node (default: this
    process's ``MOE_AUTOGRAD_SECRET_FILE``, else a private copy of its
    secret, see the module docstring). ``allow_unauthenticated``: start on a
    Ray without token authentication (refused by default).

    Placement: ``num_cpus``/``num_gpus``/``resources`` as for any Ray actor
    (e.g. ``resources={"experts": 1}`` with nodes started by ``ray start
    --resources='{"experts": 4}'``); ``max_concurrency`` is the number of
    requests served at once (RPC's ``num_worker_threads``). ``detached``:
    the actor outlives this driver (by default it ends with it: ``python -m
    moe_autograd serve --engine ray`` relies on that, so that a server
    process killed with its node takes its actor along). ``on_node``: a node
    id to place the actor on, or ``"here"`` (this process's node).
    ``torch_threads``: ``torch.set_num_threads`` in the actor (0 leaves
    torch's default).

    Durable state (see the module docstring): ``state_dir`` (a directory on
    the actor's node; a shared filesystem if Ray may re-place it on another
    node), ``save_every`` steps and/or ``save_interval`` seconds, as
    :class:`~moe_autograd.remote.ExpertServer`'s. ``max_restarts``: how
    many times Ray restarts the actor after its process or node died (0,
    the default: never; -1: always); a restart resumes its experts from
    ``state_dir`` and, with ``recover=True``, from a live replica in
    ``namespace`` (a new server started with ``recover=True`` takes its
    replicas' state too, before its first call). Re-placement after a
    node's death needs ``on_node=None``. A detached restartable actor needs
    a ``secret_file`` that outlives this driver.
    """

    def __init__(self, name: str, experts: Factory, *, namespace: str = NAMESPACE,
                 max_concurrency: int = 16, num_cpus: float = 0.0, num_gpus: float = 0.0,
                 resources: Optional[Mapping[str, float]] = None, detached: bool = False,
                 ready_timeout: float = 120.0, torch_threads: int = 1,
                 runtime_env: Optional[Mapping[str, Any]] = None,
                 on_node: Optional[str] = None, wait: bool = True,
                 secret_file: Optional[str] = None, allow_unauthenticated: bool = False,
                 state_dir: Optional[str] = None, save_every: Optional[int] = None,
                 save_interval: Optional[float] = None, max_restarts: int = 0,
                 recover: bool = False, **server_options: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if not (isinstance(experts, str) or callable(experts)):
            raise TypeError("experts must be a 'package.module:function' str or a callable "
                            f"returning the experts, got {type(experts).__name__}")
        if isinstance(experts, str) and ":" not in experts:
            raise ValueError(f"experts must look like 'package.module:function', got {experts!r}")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) \
                or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be a positive int, got {max_concurrency!r}")
        known = _server_parameters()
        unknown = sorted(set(server_options) - set(known))
        if unknown:
            raise TypeError(f"RayExpertServer got unknown options {unknown}; ExpertServer "
                            f"takes {known}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) \
                or max_restarts < -1:
            raise ValueError(f"max_restarts must be an int >= -1 (-1: always restart), got "
                             f"{max_restarts!r}")
        server_options = dict(server_options, **_durable(state_dir, save_every, save_interval))
        if detached and max_restarts != 0 and not secret_file \
                and not os.environ.get(ENV_SECRET_FILE):
            raise ValueError(f"RayExpertServer {name!r}: a detached actor that Ray may restart "
                             "reads the job's secret again at each restart, after this driver "
                             "(and the private copy of its secret) is gone: give it a "
                             "secret_file (or MOE_AUTOGRAD_SECRET_FILE)")
        self._restartable = max_restarts != 0
        self._ready_timeout = check_timeout("ready_timeout", ready_timeout)
        ray = _ray()
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised in this process: call "
                               "ray.init(address=...) before starting a RayExpertServer")
        require_token_auth(allow_unauthenticated, f"RayExpertServer {name!r}")
        _check_placement(ray, name, num_gpus, resources, on_node)  # (no secret copy made yet)
        secret_path, self.secret, self._private_copy = _secret_source(secret_file)
        self.name, self.namespace = name, namespace
        self._transport = RayTransport(namespace, timeout=self._ready_timeout,
                                       allow_unauthenticated=allow_unauthenticated)
        options: Dict[str, Any] = dict(name=name, namespace=namespace,
                                       max_concurrency=max_concurrency, num_cpus=num_cpus,
                                       num_gpus=num_gpus, max_restarts=max_restarts,
                                       max_task_retries=0)  # at most once: no step twice
        if resources:
            options["resources"] = dict(resources)
        if detached:
            options["lifetime"] = "detached"
        if runtime_env is not None:
            options["runtime_env"] = dict(runtime_env)
        if on_node is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            node = ray.get_runtime_context().get_node_id() if on_node == "here" else on_node
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        actor_class = _actor_class()
        self._info: Dict[str, Any] = {}
        try:
            self.handle = actor_class.options(**options).remote(
                name, namespace, experts, dict(server_options), torch_threads, secret_path,
                bool(allow_unauthenticated), bool(recover),
                self._private_copy is not None and not self._restartable,
                bool(self.secret.encrypt))
        except ValueError as error:
            self._release_secret()
            raise ValueError(f"cannot start Ray expert server {name!r} in namespace "
                             f"{namespace!r}: {short(error)}") from error
        if wait:
            self.wait_ready()

    def _release_secret(self) -> None:
        """The actor no longer needs the private copy of the secret (see
        :func:`_read_private_copy`). Idempotent."""
        copy, self._private_copy = self._private_copy, None
        _read_private_copy(copy)

    def _request(self, message: Dict[str, Any], timeout: Optional[float]) -> Any:
        """A sealed operation of the actor; its value (raises its error)."""
        self._transport.use_handle(self.name, self.handle, started=True)
        status, value = request(self._transport, self.name, message, timeout,
                                secret=self.secret, label=str(message["op"])).result(timeout)
        if status != "ok":
            raise RuntimeError(f"Ray expert server {self.name!r}: {message['op']} failed: "
                               f"{value}")
        return value

    def wait_ready(self) -> "RayExpertServer":
        """Waits until the actor serves (``ready_timeout``); raises
        ``RuntimeError`` with the actor's own error (a failing factory, no
        node with the resources asked for, no token authentication) and ends
        it if it does not."""
        if self._info:
            return self
        ray = _ray()
        try:
            try:  # constructed: the actor has read its secret
                ray.get(self.handle.__ray_ready__.remote(), timeout=self._ready_timeout)
            except BaseException:  # it is killed below and never will
                self._release_secret()
                raise
            if not self._restartable:  # a restart reads it again: kept until kill()
                self._release_secret()
            self._info = self._request({"op": "info"}, self._ready_timeout)
        except Exception as error:  # noqa: BLE001 - the factory failed, or no placement
            try:
                ray.kill(self.handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
            raise RuntimeError(f"Ray expert server {self.name!r} did not start: "
                               f"{_creation_error(error)}") from error
        forget_everywhere(self.name)  # a former actor of that name: look the new one up
        return self

    @classmethod
    def attach(cls, name: str, namespace: str = NAMESPACE, timeout: float = 30.0, *,
               secret: Optional[JobSecret] = None,
               allow_unauthenticated: bool = False) -> "RayExpertServer":
        """Stands for a server already running (e.g. started by ``serve
        --engine ray``); raises ``LookupError`` if there is none."""
        ray = _ray()
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError as error:
            raise LookupError(f"no Ray expert server named {name!r} in namespace "
                              f"{namespace!r}") from error
        self = cls.__new__(cls)
        self.name, self.namespace, self.handle = name, namespace, handle
        self._private_copy, self._restartable = None, False
        self.secret = secret if secret is not None else job_secret()
        self._ready_timeout = timeout
        self._transport = RayTransport(namespace, timeout=timeout,
                                       allow_unauthenticated=allow_unauthenticated)
        self._info = self._request({"op": "info"}, timeout)
        return self

    def refresh(self, timeout: float = 5.0) -> "RayExpertServer":
        """Asks the actor again (a sealed ``info``): :attr:`pid`,
        :attr:`node_id` and :attr:`restarted` are then its current
        incarnation's (after Ray restarted it); raises if it does not answer
        within ``timeout`` seconds (restarting, or dead)."""
        info = self._request({"op": "info"}, timeout)
        if isinstance(info, dict):
            self._info = info
        return self

    @property
    def pid(self) -> int:
        """The actor's process id (on its node), as last asked (:meth:`refresh`)."""
        return int(self._info["pid"])

    @property
    def restarted(self) -> bool:
        """Whether the incarnation last asked (:meth:`refresh`) is one that
        Ray restarted (``max_restarts``)."""
        return bool(self._info.get("restarted", False))

    @property
    def node_id(self) -> str:
        return str(self._info["node_id"])

    @property
    def experts(self) -> Dict[str, str]:
        """Expert name -> backward strategy, as served."""
        return dict(self._info["experts"])

    def served(self, timeout: float = 5.0) -> Dict[str, int]:
        """The calls the actor has served so far (a sealed ``info``):
        ``forward``, ``backward`` and ``failed``, as
        :meth:`~moe_autograd.remote.ExpertServer.served` counts them."""
        info = self._request({"op": "info"}, timeout)
        served = info.get("served") if isinstance(info, dict) else None
        return {str(k): int(v) for k, v in served.items()} if isinstance(served, dict) else {}

    def stop(self, drain_timeout: float = 10.0) -> None:
        """Closes the servers (requests in flight get ``drain_timeout``
        seconds), then ends the actor. Idempotent; a dead actor is fine."""
        try:
            self._request({"op": "close", "timeout": drain_timeout}, drain_timeout + 5.0)
        except Exception:  # noqa: BLE001 - dead already, or stuck: killed below
            pass
        self.kill()

    def leave(self, drain_timeout: float = 10.0, linger: float = 1.0) -> Dict[str, int]:
        """Drains (the sealed ``drain``: unpublished for fleets at once, calls
        in flight and held states served for up to ``drain_timeout`` seconds,
        at least ``linger``), then ends the actor. Returns what was left
        undrained (``in_flight``, ``live``)."""
        left = {"in_flight": -1, "live": -1}
        try:
            left = self._request({"op": "drain", "linger": linger, "timeout": drain_timeout},
                                 drain_timeout + linger + 10.0)
        except Exception:  # noqa: BLE001 - dead already, or stuck: killed below
            pass
        self.kill()
        return dict(left)

    def kill(self) -> None:
        """Ends the actor at once (as a crash would, without draining)."""
        ray = _ray()
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - dead already
            pass
        self._release_secret()
        forget_everywhere(self.name, self._transport)

    def __enter__(self) -> "RayExpertServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RayExpertServer({self.name!r}, namespace={self.namespace!r}, pid={self.pid})"


def _creation_error(error: BaseException) -> str:
    """What an actor's creation raised, in a line or two (Ray's texts span many)."""
    text = str(error)
    for marker in ("RayAuthError", "MissingSecretError", "PermissionError", "TypeError",
                   "ValueError", "ModuleNotFoundError", "ImportError", "AttributeError"):
        at = text.rfind(f"{marker}: ")
        if at >= 0:
            return text[at:].strip().splitlines()[0][:600]
    return short(error)


def _durable(state_dir: Optional[str], save_every: Optional[int],
             save_interval: Optional[float]) -> Dict[str, Any]:
    """The hosted server's ``state_dir``/``save_every``/``save_interval``
    (none when no ``state_dir``), the directory made absolute here: the
    actor's working directory is Ray's, not this process's."""
    if state_dir is None:
        if save_every is not None or save_interval is not None:
            raise ValueError("save_every and save_interval need a state_dir")
        return {}
    if not isinstance(state_dir, (str, os.PathLike)) or not str(state_dir):
        raise TypeError(f"state_dir must be a directory path, got {state_dir!r}")
    if save_every is not None and (isinstance(save_every, bool) or not isinstance(
            save_every, int) or save_every < 1):
        raise ValueError(f"save_every must be a positive number of steps or None, got "
                         f"{save_every!r}")
    if save_interval is not None and not (isinstance(save_interval, (int, float)) and not
                                          isinstance(save_interval, bool) and
                                          0 < save_interval < float("inf")):
        raise ValueError(f"save_interval must be positive seconds or None, got "
                         f"{save_interval!r}")
    return {"state_dir": os.path.abspath(state_dir), "save_every": save_every,
            "save_interval": save_interval}


def start_servers(specs: Sequence[Tuple[str, Factory]], **options: Any) -> List[RayExpertServer]:
    """One :class:`RayExpertServer` per ``(name, experts)``; on a failure the
    ones started are stopped. ``options`` are every server's; a
    ``state_dir`` is each one's own subdirectory named after it (two live
    servers never share an expert's snapshots, and a restart of a server
    finds its own)."""
    started: List[RayExpertServer] = []
    state_dir = options.pop("state_dir", None)
    try:
        for name, experts in specs:  # all start at once...
            mine: Dict[str, Any] = {} if state_dir is None else {
                "state_dir": os.path.join(state_dir, name)}
            started.append(RayExpertServer(name, experts, wait=False, **options, **mine))
        for server in started:  # ...then each is waited for
            server.wait_ready()
    except BaseException:
        for server in started:
            server.kill()
        raise
    return started
