"""Ray as the engine under remote experts: :class:`RayTransport` and :class:`RayExpertServer`.

Why: :mod:`torch.distributed.rpc` is in maintenance mode, and the clusters our
users run already have an engine with membership, failure detection, named
actors, placement by resources and token authentication: Ray. This module
puts it behind the transport seam (:mod:`.transport`), so that
:class:`~moe_autograd.remote.RemoteExpert`, the coalesced batching (one
request per server per pass), stateful and stateless backward, deadlines,
call-id ownership, server limits, ``optimizer=`` and a ``MixtureOfExperts``'
masking work on Ray exactly as on RPC: the server side runs the very same
``serve_*`` functions (:mod:`.server`, :mod:`.batch_server`), in a Ray actor
instead of an RPC worker. ``ray`` is an optional dependency
(``pip install moe_autograd[ray]``), imported only when used.

Mapping::

    RPC world                              Ray
    -------------------------------------  ------------------------------------------------
    worker name ("srv-a")                  the name of a named actor (in NAMESPACE unless
                                           told otherwise), found with ray.get_actor
    rpc_async(worker, fn, args, timeout)   actor.run_packed.remote(pack((fn, args))): the
                                           actor runs fn(*args) on one of its threads and
                                           replies pack(result); actor.run.remote(fn, args)
                                           for a message pack refuses (see below)
    the agent's timeout (rpc_timeout)      RayTransport(timeout=...), 60 s by default,
                                           enforced by one watcher thread here
    num_worker_threads                     the actor's max_concurrency (16)
    a worker process dies                  Ray fails its calls (ActorDiedError), seen here
                                           as a TransportError at once
    this process's worker name             the actor's name inside an actor, else
                                           "ray-<worker id>" (unique in the cluster)

Lifecycle of one call (``_RayPending``)::

    state    event                                  what happens
    -------  -------------------------------------  -----------------------------------------
    sent     the actor's reply arrives              done: result() returns it, callbacks run
    sent     the actor raises, dies or is           done: TransportError (the handle is
             unreachable                            forgotten: a restarted or replacing actor
                                                    of the same name is looked up again)
    sent     its timeout passes (watcher thread)    done: TransportTimeout; the reply, if it
                                                    ever comes, is dropped
    done     anything                               ignored (completed exactly once)

Invariants:

* Everything of :mod:`.transport`'s invariants holds: ``call`` never blocks on
  the peer and raises :class:`~.transport.TransportSendError` only when
  nothing could be sent (Ray not initialised, no actor of that name,
  arguments that cannot be serialised); ``result`` waits in slices of
  :data:`~.transport.WAIT_SLICE_S` (Ctrl-C gets through); every call ends,
  at its own timeout or the transport's.
* Tensors travel as NumPy arrays where that is exact (:mod:`.ray_wire`:
  Ray pickles those out of band, at a tenth of a tensor's pickling cost).
* A request, and its reply, travels as ONE ``bytes`` object written by the
  C pickler (:func:`~.ray_wire.pack`: Ray passes bytes on without
  cloudpickle) when all it holds pickles alike both ways; otherwise Ray's
  own serialisation carries it (``run``), and a reply that cannot be packed
  comes back as ``(value,)``. What arrives is the same either way.
* Callbacks run once, on Ray's completion thread or the watcher's, and must
  not block (:mod:`.batching`'s do not).
* No private module of Ray or torch is used: ``ray.get_actor``,
  ``ActorHandle.method.remote``, ``ObjectRef.future()``, ``ray.kill``,
  ``ray.get_runtime_context()`` only.
* Trust: like an RPC world, a Ray cluster is one trust domain. A server
  actor runs any importable function it is sent, as an RPC worker does; what
  keeps strangers out is the cluster's token authentication (on by default
  in Ray 2.60) and its network, not this module.
"""
import inspect
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .deadlines import DeadlineWatch, per_process
from .ray_wire import NotPacked, pack, to_wire, unpack
from .transport import (RPC_MAX_TIMEOUT_S, WAIT_SLICE_S, Pending, TransportError,
                        TransportSendError, TransportTimeout, check_timeout, set_transport)

__all__ = ["RayTransport", "RayExpertServer", "default_ray_transport", "start_servers",
           "NAMESPACE", "DEFAULT_TIMEOUT_S", "ray_available"]

NAMESPACE = "moe_autograd"  # the Ray namespace of expert servers unless told otherwise
DEFAULT_TIMEOUT_S = 60.0    # what bounds a call given no timeout (as rpc_timeout does)
_log = logging.getLogger(__name__)


def ray_available() -> bool:
    """Whether ``ray`` can be imported here."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise TransportSendError("Ray is not installed: pip install 'moe_autograd[ray]' "
                                 f"(or pip install ray) ({error})") from error
    return ray


def _short(error: BaseException) -> str:
    """An engine error in one line (Ray's texts span many)."""
    cause = getattr(error, "cause", None)  # RayTaskError: what the function raised
    shown = cause if isinstance(cause, BaseException) else error
    text = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {text[0][:300] if text else ''}"


# -- calls in flight ------------------------------------------------------------------
class _RayPending:
    """One actor call: see the module's lifecycle table."""

    __slots__ = ("_transport", "_worker", "_ref", "_packed", "_lock", "_event", "_value",
                 "_error", "_callbacks", "__weakref__")

    def __init__(self, transport: "RayTransport", worker: str, ref: Any, packed: bool) -> None:
        self._transport, self._worker, self._ref = transport, worker, ref
        self._packed = packed  # sent to run_packed: the reply is bytes or (value,)
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: List[Callable[[], None]] = []

    def _watch_reply(self) -> None:
        self._ref.future().add_done_callback(self._on_reply)

    def _on_reply(self, future: Any) -> None:
        try:
            value = future.result()
        except BaseException as error:  # noqa: BLE001 - every engine error is mapped
            self._settle(None, self._transport._failure(self._worker, error))
            return
        if self._packed:
            try:
                value = unpack(value) if type(value) is bytes else value[0]
            except Exception as error:  # noqa: BLE001 - a malformed reply fails the call
                self._settle(None, TransportError(f"Ray actor {self._worker!r} sent a reply "
                                                  f"that cannot be read: {_short(error)}"))
                return
        self._settle(value, None)

    def _settle(self, value: Any, error: Optional[BaseException]) -> None:
        with self._lock:
            if self._event.is_set():
                return  # completed already (a late reply after the timeout)
            self._value, self._error = value, error
            callbacks, self._callbacks = self._callbacks, []
            self._ref = None  # the reply's object may be freed
            self._event.set()
        for fn in callbacks:
            _run_callback(fn)

    def expire(self, seconds: float) -> None:
        """The watcher: no reply within ``seconds``."""
        self._settle(None, TransportTimeout(
            f"no reply from Ray actor {self._worker!r} within {seconds:g} s"))

    def done(self) -> bool:
        return self._event.is_set()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        _run_callback(fn)

    def result(self, timeout: Optional[float]) -> Any:
        if not self._event.is_set():
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S,
                                                                 deadline - time.monotonic())
                if left <= 0:
                    raise TransportTimeout(f"no reply from Ray actor {self._worker!r} "
                                           f"within {timeout:g} s")
                if self._event.wait(left):  # a signal handler may raise in here (Ctrl-C)
                    break
        if self._error is not None:
            raise self._error
        return self._value


def _run_callback(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a callback must not kill Ray's thread
        _log.exception("a completion callback of a Ray call failed")


def _expire(pending: "_RayPending", seconds: float) -> None:
    pending.expire(seconds)


def _open(pending: "_RayPending", seconds: float) -> bool:
    return not pending.done()


_watch = per_process(lambda: DeadlineWatch("moe_autograd-ray-deadlines", _expire, _open))


# -- the transport ----------------------------------------------------------------------
class RayTransport:
    """Calls expert servers that are named Ray actors (:class:`RayExpertServer`).

    ``namespace``: where the servers' names live (:data:`NAMESPACE` by
    default, whatever namespace this driver joined). ``timeout``: seconds
    that bound a call given ``timeout=None`` (``None``: no bound at all, so a
    frozen actor holds such a call forever; give experts deadlines).
    ``name``: this process's name as an owner of calls (default: the
    actor's name inside a named actor, else ``ray-<worker id>``).

    Ray must be initialised in the process (``ray.init(address=...)``, or
    running inside a Ray worker) before the first call.
    """

    name = "ray"

    def __init__(self, namespace: str = NAMESPACE, *, timeout: Optional[float] = DEFAULT_TIMEOUT_S,
                 name: Optional[str] = None) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty str or None, got {name!r}")
        self.namespace = namespace
        self.timeout = check_timeout("timeout of RayTransport", timeout)
        self._name = name
        self._handles: Dict[str, Any] = {}
        self._lock = threading.Lock()
        self._local: Optional[Tuple[int, str]] = None  # (pid, name) once computed

    def __repr__(self) -> str:
        return f"RayTransport(namespace={self.namespace!r}, timeout={self.timeout!r})"

    # -- names and handles ------------------------------------------------------------
    def _handle(self, worker: str) -> Any:
        handle = self._handles.get(worker)
        if handle is not None:
            return handle
        ray = _ray()
        if not isinstance(worker, str) or not worker:
            raise TransportSendError(f"a Ray server is named by a non-empty str, got {worker!r}")
        try:
            handle = ray.get_actor(worker, namespace=self.namespace)
        except ValueError as error:
            raise TransportSendError(
                f"no Ray actor named {worker!r} in namespace {self.namespace!r} (is its "
                f"RayExpertServer / 'serve --engine ray' running?): {_short(error)}") from error
        except Exception as error:  # noqa: BLE001 - GCS unreachable, not initialised
            raise TransportSendError(f"looking up Ray actor {worker!r} failed: "
                                     f"{_short(error)}") from error
        with self._lock:
            self._handles[worker] = handle
        return handle

    def forget(self, worker: str) -> None:
        """Drops the cached handle of ``worker`` (looked up again on the next call)."""
        with self._lock:
            self._handles.pop(worker, None)

    def _failure(self, worker: str, error: BaseException) -> TransportError:
        ray = _ray()
        exceptions = ray.exceptions
        if isinstance(error, exceptions.GetTimeoutError):
            return TransportTimeout(_short(error))
        if isinstance(error, exceptions.RayActorError):
            self.forget(worker)  # a restarted or replacing actor is looked up again
            return TransportError(f"Ray actor {worker!r} is dead or unreachable "
                                  f"({_short(error)})")
        return TransportError(_short(error))

    # -- the protocol -----------------------------------------------------------------
    def call(self, worker: str, fn: Callable[..., Any], args: Tuple[Any, ...],
             timeout: Optional[float]) -> Pending:
        try:
            limit = check_timeout("timeout", timeout, RPC_MAX_TIMEOUT_S)
        except (TypeError, ValueError) as error:
            raise TransportSendError(str(error)) from error
        if limit is None:
            limit = self.timeout
        ray = _ray()
        if not ray.is_initialized():
            raise TransportSendError("Ray is not initialised in this process: call "
                                     "ray.init(address=...) first")
        handle = self._handle(worker)
        try:
            data: Optional[bytes] = pack((fn, args))
        except NotPacked:
            data = None
        # A server of an older version has no run_packed: Ray's way then.
        packed = None if data is None else getattr(handle, "run_packed", None)
        try:
            if packed is not None:
                ref = packed.remote(data)
            else:
                ref = handle.run.remote(fn, to_wire(args))
        except Exception as error:  # noqa: BLE001 - serialisation, a dead cluster
            raise TransportSendError(_short(error)) from error
        pending = _RayPending(self, worker, ref, packed is not None)
        if limit is not None:
            _watch().add(time.monotonic() + limit, pending, limit)
        pending._watch_reply()
        return pending

    def local_name(self) -> str:
        if self._name is not None:
            return self._name
        pid = os.getpid()
        local = self._local
        if local is not None and local[0] == pid:
            return local[1]
        try:
            ray = _ray()
        except TransportSendError as error:
            raise TransportError(str(error)) from error
        if not ray.is_initialized():
            raise TransportError("Ray is not initialised in this process: call "
                                 "ray.init(address=...) first")
        context = ray.get_runtime_context()
        name = context.get_actor_name() if context.get_actor_id() is not None else None
        name = name or f"ray-{context.get_worker_id()}"
        self._local = (pid, name)
        return name

    def default_timeout(self) -> Optional[float]:
        """Seconds that bound a call given no timeout (``None``: unbounded)."""
        return self.timeout

    def timeout_hint(self) -> str:
        limit = f"{self.timeout:g} s" if self.timeout is not None else "none"
        return (f"the transport's own timeout ({limit}; set it with RayTransport(timeout=...), "
                "or give the expert a forward_timeout/backward_timeout)")

    def alive(self, worker: str) -> bool:
        """Whether a live actor is registered under ``worker`` (a lookup by
        name; a crashed actor that Ray has not yet noticed still counts)."""
        ray = _ray()
        try:
            ray.get_actor(worker, namespace=self.namespace)
        except ValueError:
            return False
        return True


_default: Optional[RayTransport] = None
_default_lock = threading.Lock()


def default_ray_transport() -> RayTransport:
    """This process's :class:`RayTransport` for the automatic choice
    (:func:`~.transport.choose_backend`); inside a :class:`RayExpertServer`,
    the one of its namespace."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = RayTransport()
    return _default


# -- the server side: an actor hosting ExpertServers ------------------------------------
def _server_parameters() -> List[str]:
    from .server import ExpertServer

    return [p for p in inspect.signature(ExpertServer.__init__).parameters
            if p not in ("self", "experts", "transport")]


Factory = Union[str, Callable[[], Any]]


class _ExpertActor:
    """The actor class (wrapped with ``ray.remote`` when started): hosts the
    :class:`~moe_autograd.remote.ExpertServer` (s) that ``experts`` builds
    and runs the server-side functions it is sent."""

    def __init__(self, name: str, namespace: str, experts: Factory,
                 server_options: Dict[str, Any], torch_threads: int) -> None:
        global _default
        import torch

        from .cli import load_object
        from .server import ExpertServer

        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        transport = RayTransport(namespace, name=name)
        _default = transport
        set_transport(transport)  # ExpertServer's worker name; calls to peers from here
        factory = load_object(experts) if isinstance(experts, str) else experts
        built = factory()
        if isinstance(built, Mapping):
            self.servers = [ExpertServer(built, **server_options)]
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
        self.state = "serving"  # "draining" once drain() started: fleets route no new call here

    def run(self, fn: Callable[..., Any], args: Tuple[Any, ...]) -> Any:
        """The server-side entry point: ``fn(*args)`` here (``serve_*``)."""
        return to_wire(fn(*args))

    def run_packed(self, data: bytes) -> Union[bytes, Tuple[Any]]:
        """:meth:`run` for a packed request (``pack((fn, args))``): the reply
        packed, or ``(value,)`` when it cannot be (see :mod:`.ray_wire`)."""
        fn, args = unpack(data)
        value = fn(*args)
        try:
            return pack(value)
        except NotPacked:
            return (to_wire(value),)

    def info(self) -> Dict[str, Any]:
        import ray

        return {"name": self.name, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "experts": {n: s.backward for s in self.servers for n in s.names},
                "state": self.state}

    def drain(self, linger: float, timeout: float) -> Dict[str, int]:
        """Leaves cleanly: marks the server draining (fleets stop choosing it
        within their poll), serves for at least ``linger`` seconds and until
        no request runs and no state is held (at most ``timeout``), then
        closes. Returns what was left when it closed."""
        self.state = "draining"
        start = time.monotonic()
        while True:
            busy = sum(int(s.stats()["in_flight"]) for s in self.servers)
            held = sum(int(s.stats()["live"]) for s in self.servers)
            spent = time.monotonic() - start
            if (spent >= linger and busy == 0 and held == 0) or spent >= timeout:
                break
            time.sleep(0.02)
        self.close(max(0.0, timeout - (time.monotonic() - start)))
        return {"in_flight": busy, "live": held}

    def close(self, timeout: float) -> None:
        """Stops serving: requests in flight get ``timeout`` seconds, states are freed."""
        for server in self.servers:
            server.close(timeout=timeout)


_actor_classes: List[Any] = []


def _actor_class() -> Any:
    """``ray.remote(_ExpertActor)``, made once per process."""
    if not _actor_classes:
        _actor_classes.append(_ray().remote(_ExpertActor))
    return _actor_classes[0]


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

    Placement: ``num_cpus``/``num_gpus``/``resources`` as for any Ray actor
    (e.g. ``resources={"experts": 1}`` with nodes started by ``ray start
    --resources='{"experts": 4}'``); ``max_concurrency`` is the number of
    requests served at once (RPC's ``num_worker_threads``). ``detached``:
    the actor outlives this driver (by default it ends with it: ``python -m
    moe_autograd serve --engine ray`` relies on that, so that a server
    process killed with its node takes its actor along). ``on_node``: a node id to place the actor on, or
    ``"here"`` (this process's node). ``torch_threads``: ``torch.set_num_threads`` in the actor
    (0 leaves torch's default).
    """

    def __init__(self, name: str, experts: Factory, *, namespace: str = NAMESPACE,
                 max_concurrency: int = 16, num_cpus: float = 0.0, num_gpus: float = 0.0,
                 resources: Optional[Mapping[str, float]] = None, detached: bool = False,
                 ready_timeout: float = 120.0, torch_threads: int = 1,
                 runtime_env: Optional[Mapping[str, Any]] = None,
                 on_node: Optional[str] = None, wait: bool = True,
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
        self.name, self.namespace = name, namespace
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
                name, namespace, experts, dict(server_options), torch_threads)
        except ValueError as error:
            raise ValueError(f"cannot start Ray expert server {name!r} in namespace "
                             f"{namespace!r}: {_short(error)}") from error
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "RayExpertServer":
        """Waits until the actor serves (``ready_timeout``); raises
        ``RuntimeError`` with the actor's own error (a failing factory, no
        node with the resources asked for) and ends it if it does not."""
        if self._info:
            return self
        ray = _ray()
        try:
            self._info = ray.get(self.handle.info.remote(), timeout=self._ready_timeout)
        except Exception as error:  # noqa: BLE001 - the factory failed, or no placement
            try:
                ray.kill(self.handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
            raise RuntimeError(f"Ray expert server {self.name!r} did not start: "
                               f"{_short(error)}") from error
        _forget_everywhere(self.name)  # a former actor of that name: look the new one up
        return self

    @classmethod
    def attach(cls, name: str, namespace: str = NAMESPACE,
               timeout: float = 30.0) -> "RayExpertServer":
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
        self._ready_timeout = timeout
        self._info = ray.get(handle.info.remote(), timeout=timeout)
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

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        """``fn(*args)`` in the server's process (tests, diagnostics)."""
        ray = _ray()
        return ray.get(self.handle.run.remote(fn, args), timeout=timeout)

    def stop(self, drain_timeout: float = 10.0) -> None:
        """Closes the servers (requests in flight get ``drain_timeout``
        seconds), then ends the actor. Idempotent; a dead actor is fine."""
        ray = _ray()
        try:
            ray.get(self.handle.close.remote(drain_timeout), timeout=drain_timeout + 5.0)
        except Exception:  # noqa: BLE001 - dead already, or stuck: killed below
            pass
        self.kill()

    def leave(self, drain_timeout: float = 10.0, linger: float = 1.0) -> Dict[str, int]:
        """Drains (see :meth:`_ExpertActor.drain`: unpublished for fleets at
        once, calls in flight and held states served for up to
        ``drain_timeout`` seconds, at least ``linger``), then ends the actor.
        Returns what was left undrained (``in_flight``, ``live``)."""
        ray = _ray()
        left = {"in_flight": -1, "live": -1}
        try:
            left = ray.get(self.handle.drain.remote(linger, drain_timeout),
                           timeout=drain_timeout + linger + 10.0)
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
        _forget_everywhere(self.name)

    def __enter__(self) -> "RayExpertServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RayExpertServer({self.name!r}, namespace={self.namespace!r}, pid={self.pid})"


def _forget_everywhere(name: str) -> None:
    from .transport import get_transport

    for transport in {id(t): t for t in (_default, get_transport()) if t is not None}.values():
        forget = getattr(transport, "forget", None)
        if forget is not None:
            forget(name)


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
