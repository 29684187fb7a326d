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

Invariants:

* The actor refuses to start on a Ray without token authentication unless
  its creator opted out (``allow_unauthenticated=True``, ``serve --insecure``).
* Public Ray API only (``ray.remote``, actor options, ``ray.kill``,
  ``ray.get``, ``__ray_ready__``).
"""
import atexit
import inspect
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import endpoint
from .auth import ENV_SECRET_FILE, JobSecret, MissingSecretError, job_secret, set_job_secret
from .channel import request
from .factory import load_object
from .ray_engine import (NAMESPACE, RayTransport, _ray, forget_everywhere, require_token_auth,
                         serve_frame, set_default_ray_transport, short)
from .server import ExpertServer, set_host_info
from .transport import check_timeout, set_transport

__all__ = ["RayExpertServer", "start_servers"]

Factory = Union[str, Callable[[], Any]]


def _server_parameters() -> List[str]:
    return [p for p in inspect.signature(ExpertServer.__init__).parameters
            if p not in ("self", "experts", "transport", "secret")]


class _ExpertActor:
    """The actor class (wrapped with ``ray.remote`` when started): hosts the
    :class:`~moe_autograd.remote.ExpertServer` (s) that ``experts`` builds."""

    def __init__(self, name: str, namespace: str, experts: Factory,
                 server_options: Dict[str, Any], torch_threads: int,
                 secret_file: Optional[str], allow_unauthenticated: bool) -> None:
        import ray
        import torch

        require_token_auth(allow_unauthenticated, f"Ray expert server {name!r}")
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        secret = JobSecret.from_file(secret_file) if secret_file else job_secret()
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
        set_host_info(name=name, state="serving",
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
    ``atexit`` hook covers actors nobody waited for; a process killed before
    either leaves the copy, mode 600, behind.)"""
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
        return path, JobSecret.from_file(path), None
    secret = job_secret()
    named = os.environ.get(ENV_SECRET_FILE)
    if named:
        try:
            if JobSecret.from_file(named) == secret:
                return os.path.abspath(named), secret, None
        except (OSError, ValueError, MissingSecretError):
            pass
    with _private_lock:
        if not _private_dirs:
            _private_dirs.append(tempfile.mkdtemp(prefix="moe_autograd-secret-"))  # mode 700
        path = os.path.join(_private_dirs[0], f"{secret.key_id.hex()}.secret")
        if not os.path.exists(path):
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
    """

    def __init__(self, name: str, experts: Factory, *, namespace: str = NAMESPACE,
                 max_concurrency: int = 16, num_cpus: float = 0.0, num_gpus: float = 0.0,
                 resources: Optional[Mapping[str, float]] = None, detached: bool = False,
                 ready_timeout: float = 120.0, torch_threads: int = 1,
                 runtime_env: Optional[Mapping[str, Any]] = None,
                 on_node: Optional[str] = None, wait: bool = True,
                 secret_file: Optional[str] = None, allow_unauthenticated: bool = False,
                 **server_options: Any) -> None:
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
                                       num_gpus=num_gpus, max_restarts=0)
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
                bool(allow_unauthenticated))
        except ValueError as error:
            _read_private_copy(self._private_copy)
            raise ValueError(f"cannot start Ray expert server {name!r} in namespace "
                             f"{namespace!r}: {short(error)}") from error
        if wait:
            self.wait_ready()

    def _request(self, message: Dict[str, Any], timeout: Optional[float]) -> Any:
        """A sealed operation of the actor; its value (raises its error)."""
        self._transport.use_handle(self.name, self.handle)
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
            finally:  # or it is killed below and never will
                _read_private_copy(self._private_copy)
                self._private_copy = None
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
        self._private_copy = None
        self.secret = secret if secret is not None else job_secret()
        self._ready_timeout = timeout
        self._transport = RayTransport(namespace, timeout=timeout,
                                       allow_unauthenticated=allow_unauthenticated)
        self._info = self._request({"op": "info"}, timeout)
        return self

    @property
    def pid(self) -> int:
        """The actor's process id (on its node)."""
        return int(self._info["pid"])

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


def start_servers(specs: Sequence[Tuple[str, Factory]], **options: Any) -> List[RayExpertServer]:
    """One :class:`RayExpertServer` per ``(name, experts)``; on a failure the
    ones started are stopped."""
    started: List[RayExpertServer] = []
    try:
        for name, experts in specs:  # all start at once...
            started.append(RayExpertServer(name, experts, wait=False, **options))
        for server in started:  # ...then each is waited for
            server.wait_ready()
    except BaseException:
        for server in started:
            server.kill()
        raise
    return started
