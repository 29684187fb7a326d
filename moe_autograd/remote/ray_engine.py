"""Ray as an engine: :class:`RayTransport`, and how an actor serves frames.

Why: :mod:`torch.distributed.rpc` is in maintenance mode, and the clusters our
users run already have an engine with membership, failure detection, named
actors, placement by resources and token authentication: Ray. Here it
carries :class:`~.frame.Frame` s between a client and an expert server that
is a named actor (:mod:`.ray_server`), which has ONE method,
``handle(head, blob)``: ``head`` is the frame's header and body (bytes),
``blob`` its buffers back to back (bytes when small, else one NumPy uint8
array that Ray moves out of band); the actor splits the blob by the lengths
the header announces and hands the frame to :func:`.endpoint.serve`. ``ray``
is an optional dependency (``pip install -e '.[ray]'``), imported
only when used.

Mapping::

    RPC world                              Ray
    -------------------------------------  ------------------------------------------------
    worker name ("srv-a")                  the name of a named actor (in NAMESPACE unless
                                           told otherwise), found with ray.get_actor
    rpc_async(worker, _receive, frame)     actor.handle.remote(head, blob)
    the agent's timeout (rpc_timeout)      RayTransport(timeout=...), 60 s by default,
                                           enforced by one watcher thread here
    a worker process dies                  Ray fails its calls (ActorDiedError), seen here
                                           as a TransportError at once

Lifecycle of one call (``_RayPending``)::

    state    event                                  what happens
    -------  -------------------------------------  -----------------------------------------
    sent     the actor's reply arrives              done: result() returns the frame
    sent     the actor raises, dies or is           done: TransportError (the handle is
             unreachable                            forgotten: a restarted or replacing actor
                                                    of the same name is looked up again)
    sent     its timeout passes (watcher thread)    done: TransportTimeout; the reply, if it
                                                    ever comes, is dropped
    done     anything                               ignored (completed exactly once)

Trust: Ray's own layer deserialises every actor call's arguments (and every
reply) with its pickler before our code sees them, so what protects a
server from strangers is the cluster's token authentication: a process
without the cluster's token is refused at connect. :func:`require_token_auth`
refuses to serve or to call over a Ray whose processes do not require the
token (``RAY_AUTH_MODE=token``), unless the user opts out explicitly
(``allow_unauthenticated=True``, ``serve --insecure``). Above that, every
frame is sealed with the job's secret (:mod:`.auth`). But Ray also
deserialises every *reply* before our check of it runs, so calling an actor
is trusting it: :meth:`RayTransport.call` calls a named actor only once it
has identified it, by its identity record (:func:`publish_identity`: the
name bound to the actor's ID, signed with the job's secret, in Ray's
internal KV, read as bytes, so nothing of the actor's is deserialised by
the check). An actor that took a dead server's name has another actor ID
and no such record: it is refused (``unidentified``, counted and logged)
before anything is sent to it, on the first call and after every reconnect.
What this cannot stop: a holder of the cluster's token runs code on every
node anyway (``__ray_call__``, tasks), and can read the job's secret from a
server's memory; the README's trust table says so.

Invariants:

* Everything of :mod:`.transport`'s invariants holds: ``call`` never blocks on
  the peer and raises :class:`~.transport.TransportSendError` only when
  nothing could be sent; ``result`` waits in slices of
  :data:`~.transport.WAIT_SLICE_S`; every call ends, at its own timeout or
  the transport's.
* Callbacks run once, on Ray's completion thread or the watcher's, and must
  not block (:mod:`.batching`'s do not).
* Public Ray API (``ray.get_actor``, ``ActorHandle.method.remote``,
  ``ObjectRef.future()``, ``ray.kill``, ``ray.get_runtime_context()``), and
  three internals: ``ray._raylet.get_authentication_mode`` (what
  ``ray.exceptions`` itself uses) to tell whether token authentication is
  on, ``ActorHandle._actor_id`` and ``ray.experimental.internal_kv`` (bytes
  in, bytes out) for identities.
* A named actor is called only after its identity record verified for the
  frame's job and its handle's actor ID (or through the handle of the actor
  this process started: ``use_handle(..., started=True)``).
"""
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import endpoint
from .auth import JobSecret, bind_boot, refuse, secret_for, unbind_boot
from .deadlines import DeadlineWatch, per_process
from .frame import KEY_ID_BYTES, Frame, FrameError, buffer_lengths, buffer_view
from .transport import (RPC_MAX_TIMEOUT_S, WAIT_SLICE_S, Engine, Pending, TransportError,
                        TransportSendError, TransportTimeout, check_timeout, register_engine)

__all__ = ["RayTransport", "default_ray_transport", "serve_frame", "require_token_auth",
           "token_auth_enabled", "RayAuthError", "NAMESPACE", "DEFAULT_TIMEOUT_S",
           "INLINE_MAX_BYTES", "ray_available", "ray_running", "forget_everywhere", "short",
           "set_default_ray_transport", "TOKEN_HELP", "Unidentified", "publish_identity",
           "IDENTITY_KV_NAMESPACE"]

NAMESPACE = "moe_autograd"  # the Ray namespace of expert servers unless told otherwise
DEFAULT_TIMEOUT_S = 60.0    # what bounds a call given no timeout (as rpc_timeout does)
INLINE_MAX_BYTES = 1 << 20  # buffers up to this many bytes travel as one bytes object
_log = logging.getLogger(__name__)
Blob = Union[bytes, Any]


class RayAuthError(RuntimeError):
    """The Ray cluster does not require token authentication (see
    :func:`require_token_auth`)."""


class Unidentified(TransportSendError):
    """A named actor that has no identity record signed with the job's
    secret for its actor ID (an impostor that took a server's name, or an
    actor that is no expert server of this job): nothing was sent to it."""


IDENTITY_KV_NAMESPACE = "moe_autograd"  # Ray's internal KV: bytes in, bytes out


def _identity_key(namespace: str, name: str) -> str:
    return f"identity/{namespace}/{name}"


def publish_identity(namespace: str, name: str, actor_id: str,
                     secrets_: Sequence[JobSecret]) -> None:
    """An expert server's actor, as it starts: writes its identity record
    (its name bound to its actor ID, signed with each job's secret it
    serves) into Ray's internal KV, where a client reads it before it calls
    the actor (:meth:`RayTransport.call`). No call of the actor is needed to
    read it: nothing an impostor sends is deserialised by the check."""
    from ray.experimental import internal_kv

    boot = endpoint.gate().boot.hex()  # requests bound to it: none replayed after a restart
    record = {"name": name, "namespace": namespace, "actor_id": actor_id, "boot": boot,
              "macs": {s.key_id.hex(): s.sign("ray identity", namespace, name, actor_id, boot)
                       for s in secrets_}}
    internal_kv._internal_kv_put(_identity_key(namespace, name), json.dumps(record),
                                 overwrite=True, namespace=IDENTITY_KV_NAMESPACE)


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
        raise TransportSendError("Ray is not installed: pip install -e '.[ray]' "
                                 f"(or pip install ray) ({error})") from error
    return ray


def short(error: BaseException) -> str:
    """An engine error in one line (Ray's texts span many)."""
    cause = getattr(error, "cause", None)  # RayTaskError: what the function raised
    shown = cause if isinstance(cause, BaseException) else error
    text = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {text[0][:300] if text else ''}"


# -- token authentication -------------------------------------------------------------------
def token_auth_enabled() -> Optional[bool]:
    """Whether this process runs Ray with token authentication (so that its
    Ray servers refuse calls without the cluster's token); ``None`` if this
    Ray cannot tell."""
    try:
        from ray._raylet import (AuthenticationMode,  # type: ignore[attr-defined]
                                 get_authentication_mode)
    except ImportError:
        return None
    return bool(get_authentication_mode() == AuthenticationMode.TOKEN)


TOKEN_HELP = (
    "Turn token authentication on for the whole cluster: put a token in a file only its owner "
    "can read (e.g. 'ray get-auth-token --generate', which writes ~/.ray/auth_token, or any "
    "random string in a file of mode 600), and set RAY_AUTH_MODE=token and "
    "RAY_AUTH_TOKEN_PATH=<that file> in the environment of 'ray start' on every node and of "
    "every driver (the trainer, 'python -m moe_autograd serve --engine ray'); or, on a "
    "network you trust, opt out with allow_unauthenticated=True ('serve --insecure')")


def require_token_auth(allow_unauthenticated: bool, what: str) -> None:
    """Raises :class:`RayAuthError` (saying how to turn it on) unless this
    process runs Ray with token authentication or the caller opted out."""
    if allow_unauthenticated:
        return
    enabled = token_auth_enabled()
    if enabled:
        return
    state = "cannot tell whether" if enabled is None else "does not run with"
    raise RayAuthError(f"{what}: this process {state} Ray token authentication "
                       "(RAY_AUTH_MODE=token), so anyone who reaches the cluster's ports could "
                       f"call into it. {TOKEN_HELP}")


# -- frames over Ray -------------------------------------------------------------------------
def _blob(buffers: Sequence[Any]) -> Blob:
    """The buffers back to back: bytes when small, else one NumPy array."""
    views = [buffer_view(b) for b in buffers]
    total = sum(v.nbytes for v in views)
    if total <= INLINE_MAX_BYTES:
        return b"".join(views)
    import numpy as np

    out = np.empty(total, dtype=np.uint8)
    at = 0
    for view in views:
        out[at:at + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
        at += view.nbytes
    return out


def _split(head: Any, blob: Any) -> List[Any]:
    """The buffers of a frame whose ``blob`` is its buffers back to back (an
    empty list when the header cannot say: the frame is then refused as
    malformed by whoever parses it)."""
    try:
        lengths = buffer_lengths(head)
        view = buffer_view(blob)
    except (FrameError, TypeError, ValueError):
        return []
    if sum(lengths) != view.nbytes:
        return []
    parts, at = [], 0
    for n in lengths:
        parts.append(view[at:at + n])
        at += n
    return parts


def serve_frame(head: Any, blob: Any, me: str) -> Tuple[bytes, Blob]:
    """An actor's ``handle``: the reply to the frame ``(head, blob)``."""
    head = head if isinstance(head, (bytes, bytearray)) else b""
    reply = endpoint.serve(Frame(bytes(head), _split(head, blob)), me)
    return reply.head, _blob(reply.buffers)


class _RayPending:
    """One actor call: see the module's lifecycle table."""

    __slots__ = ("_transport", "_worker", "_ref", "_lock", "_event", "_value", "_error",
                 "_callbacks", "__weakref__")

    def __init__(self, transport: "RayTransport", worker: str, ref: Any) -> None:
        self._transport, self._worker, self._ref = transport, worker, ref
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
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bytes)):
            self._settle(None, TransportError(f"Ray actor {self._worker!r} sent a reply that "
                                              "is not a frame"))
            return
        self._settle(Frame(value[0], _split(value[0], value[1]), "reply"), None)

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
    """Calls expert servers that are named Ray actors (:class:`~.ray_server.RayExpertServer`).

    ``namespace``: where the servers' names live (:data:`NAMESPACE` by
    default, whatever namespace this driver joined). ``timeout``: seconds
    that bound a call given ``timeout=None`` (``None``: no bound at all, so a
    frozen actor holds such a call forever; give experts deadlines).
    ``name``: this process's name as servers see it (default: the actor's
    name inside a named actor, else ``ray-<worker id>``; owners of calls are
    authenticated sessions, not names). ``allow_unauthenticated``: call
    servers over a Ray without token authentication (refused by default:
    see :func:`require_token_auth`).

    Ray must be initialised in the process (``ray.init(address=...)``, or
    running inside a Ray worker) before the first call.
    """

    name = "ray"

    def __init__(self, namespace: str = NAMESPACE, *, timeout: Optional[float] = DEFAULT_TIMEOUT_S,
                 name: Optional[str] = None, allow_unauthenticated: bool = False) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty str or None, got {name!r}")
        self.namespace = namespace
        self.timeout = check_timeout("timeout of RayTransport", timeout)
        self.allow_unauthenticated = bool(allow_unauthenticated)
        self._name = name
        self._handles: Dict[str, Any] = {}
        #: worker -> the job key ids its current handle's identity was
        #: checked for (``None``: the handle of an actor this process started)
        self._identified: Dict[str, Optional[set]] = {}
        self._lock = threading.Lock()
        self._local: Optional[Tuple[int, str]] = None  # (pid, name) once computed
        self._checked = False

    def __repr__(self) -> str:
        return f"RayTransport(namespace={self.namespace!r}, timeout={self.timeout!r})"

    # -- names and handles ------------------------------------------------------------
    def handle(self, worker: str) -> Any:
        """The actor handle of ``worker`` (looked up once, then cached)."""
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
                f"RayExpertServer / 'serve --engine ray' running?): {short(error)}") from error
        except Exception as error:  # noqa: BLE001 - GCS unreachable, not initialised
            raise TransportSendError(f"looking up Ray actor {worker!r} failed: "
                                     f"{short(error)}") from error
        with self._lock:
            self._handles[worker] = handle
        return handle

    def use_handle(self, worker: str, handle: Any, started: bool = False) -> None:
        """Calls ``worker`` through ``handle``: with ``started``, the handle
        of the actor this process started (needs no identity check), else
        one looked up by name elsewhere (checked before its first call)."""
        with self._lock:
            if self._handles.get(worker) is not handle:
                self._identified.pop(worker, None)
            self._handles[worker] = handle
            if started:
                self._identified[worker] = None

    def forget(self, worker: str) -> None:
        """Drops the cached handle of ``worker`` (looked up, and identified,
        again on the next call: its boot id too)."""
        with self._lock:
            self._handles.pop(worker, None)
            self._identified.pop(worker, None)
        unbind_boot(worker)

    def prepare(self, worker: str, key_id: bytes) -> None:
        """Before a request to ``worker`` is sealed: identifies its actor for
        the job ``key_id`` (which binds the request to its process's boot
        id); raises :class:`Unidentified` as :meth:`call` would."""
        ray = _ray()
        if ray.is_initialized():
            self._identify(worker, self.handle(worker), key_id)

    def _identify(self, worker: str, handle: Any, key_id: bytes) -> None:
        """Raises :class:`Unidentified` (refused: counted, logged) unless the
        actor behind ``handle`` has an identity record for ``worker`` signed
        with the secret of ``key_id`` for its actor ID (see
        :func:`publish_identity`); checked once per handle and job."""
        with self._lock:
            checked = self._identified.get(worker, set())
        if checked is None or key_id in checked:
            return
        why = self._identity_problem(worker, handle, key_id)
        if why is not None:
            refuse("unidentified", f"a call of Ray actor {worker!r}: {why}",
                   once=f"unidentified:{worker}:{why}")
            raise Unidentified(f"Ray actor {worker!r} was not called: {why} (an impostor "
                               f"that took the name, or not an expert server of this job)")
        with self._lock:
            if self._handles.get(worker) is handle:
                found = self._identified.setdefault(worker, set())
                if found is not None:
                    found.add(key_id)

    def _identity_problem(self, worker: str, handle: Any, key_id: bytes) -> Optional[str]:
        secret = secret_for(key_id)
        if secret is None:
            return "no secret of this process has the frame's key id"
        actor_id = getattr(getattr(handle, "_actor_id", None), "hex", lambda: None)()
        if not isinstance(actor_id, str):
            return "its handle has no actor ID"
        try:
            from ray.experimental import internal_kv

            raw = internal_kv._internal_kv_get(_identity_key(self.namespace, worker),
                                               namespace=IDENTITY_KV_NAMESPACE)
        except Exception as error:  # noqa: BLE001 - the GCS is unreachable
            return f"its identity record could not be read ({short(error)})"
        if raw is None:
            return "it published no identity record"
        try:
            record = json.loads(raw)
            mac = record["macs"].get(key_id.hex())
            claimed, boot = str(record["actor_id"]), str(record["boot"])
            boot_id = bytes.fromhex(boot)
        except (ValueError, KeyError, TypeError, AttributeError):
            return "its identity record is malformed"
        if not secret.verify(mac, "ray identity", self.namespace, worker, claimed, boot):
            return "its identity record is not signed with this job's secret"
        if claimed != actor_id:
            return (f"the name's signed identity is actor {claimed[:12]}, this actor is "
                    f"{actor_id[:12]}")
        try:
            bind_boot(worker, boot_id)  # its process's requests: none replayable elsewhere
        except ValueError:
            return "its identity record names a malformed boot id"
        return None

    def _failure(self, worker: str, error: BaseException) -> TransportError:
        ray = _ray()
        exceptions = ray.exceptions
        if isinstance(error, exceptions.GetTimeoutError):
            return TransportTimeout(short(error))
        if isinstance(error, exceptions.RayActorError):
            self.forget(worker)  # a restarted or replacing actor is looked up again
            return TransportError(f"Ray actor {worker!r} is dead or unreachable "
                                  f"({short(error)})")
        return TransportError(short(error))

    # -- the protocol -----------------------------------------------------------------
    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Pending:
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
        if not self._checked:
            try:
                require_token_auth(self.allow_unauthenticated, "RayTransport")
            except RayAuthError as error:
                raise TransportSendError(str(error)) from None
            self._checked = True
        handle = self.handle(worker)
        self._identify(worker, handle, bytes(frame.head[8:8 + KEY_ID_BYTES]))
        try:
            ref = handle.handle.remote(frame.head, _blob(frame.buffers))
        except Exception as error:  # noqa: BLE001 - a dead cluster
            raise TransportSendError(short(error)) from error
        pending = _RayPending(self, worker, ref)
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


_default: List[RayTransport] = []
_default_lock = threading.Lock()


def default_ray_transport() -> RayTransport:
    """This process's :class:`RayTransport` for the automatic choice
    (:func:`~.transport.choose_backend`); inside an expert server's actor,
    the one of its namespace (:func:`set_default_ray_transport`)."""
    if not _default:
        with _default_lock:
            if not _default:
                _default.append(RayTransport())
    return _default[0]


def set_default_ray_transport(transport: RayTransport) -> None:
    with _default_lock:
        _default[:] = [transport]


def forget_everywhere(name: str, *transports: Any) -> None:
    """Drops the cached handle of ``name`` in the default Ray transport and
    in ``transports`` (an actor of that name was replaced)."""
    for transport in {id(t): t for t in (*_default, *transports) if t is not None}.values():
        forget = getattr(transport, "forget", None)
        if forget is not None:
            forget(name)


def ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


register_engine(Engine("ray", ray_running, default_ray_transport, "ray.init(address=...)"))
