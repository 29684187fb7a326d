"""The one seam between remote experts and the engine that carries messages.

Why a seam: remote experts need an engine that moves a message to another
process and its reply back. Two engines sit behind it: :mod:`torch.distributed.rpc`
(TensorPipe; :mod:`.rpc_engine`, the default, needing no service) and Ray
(:mod:`.ray_engine`, optional: ``pip install -e '.[ray]'``). An engine
carries :class:`~.frame.Frame` s (bytes and tensor buffers, sealed by
:mod:`.auth`): it never runs a function it was sent, and nothing above it
touches an engine. A third engine (a gRPC service) plugs in by implementing
:class:`Transport`, registering itself (:func:`register_engine`) or being
passed as ``RemoteExpert(..., transport=...)`` / :func:`set_transport`.

What an engine must provide (the :class:`Transport` protocol):

======================  ==================================================================
send a request          ``call(worker, frame, timeout)`` delivers ``frame`` to the server
                        process named ``worker`` and returns a :class:`Pending` at once
                        (never blocks on the peer); its result is the reply frame
serve requests          the process named ``worker`` hands each frame it receives to
                        :func:`moe_autograd.remote.endpoint.serve` and sends back the
                        frame that returns (an RPC worker's ``_receive``, a Ray actor's
                        ``handle``)
complete by callback    ``Pending.add_done_callback(fn)`` (optional, see
                        :class:`CallbackPending`): how :mod:`.batching` completes many
                        calls without a waiting thread each; without it, one daemon
                        thread waits per request
deadlines               ``timeout`` bounds the whole call; ``None`` means the engine's own
                        limit (``default_timeout()``, optional), so every call ends
liveness                a request to a dead or unreachable peer fails with
                        :class:`TransportError` (at once when the engine sees the death,
                        else at its deadline), never hangs
names                   ``local_name()``: this process's name, unique in its world (shown
                        to servers; owners are authenticated sessions, see :mod:`.auth`)
======================  ==================================================================

Choosing the engine: :func:`get_transport` returns, unless
:func:`set_transport` replaced it, an :class:`AutoTransport` that picks per
call among the registered engines by how the world was started: an
initialised RPC agent (``rpc.init_rpc``) means torch RPC, else an
initialised Ray (``ray.init``, or running inside a Ray worker) means Ray;
both initialised: the first registered (torch RPC), name Ray explicitly
(``transport=RayTransport()``) to use it. Engines register themselves when
imported (:mod:`moe_autograd.remote` imports both); this module imports none.

Invariants:

* ``call`` never blocks on the peer; it raises :class:`TransportSendError` only if
  the request cannot be sent at all (unknown worker, engine not initialised).
* ``Pending.result`` raises :class:`TransportTimeout` when the reply has not
  come within the ``timeout`` given to ``call`` (enforced by the engine or by
  the waiter within ``result(timeout)``), and :class:`TransportError` for
  every other failure (peer dead, connection reset). A reply that arrives
  after its waiter gave up is dropped.
* ``call(..., timeout=None)`` still ends: the engine's own timeout bounds it.
  A finite timeout above what the engine can represent is clamped
  (:data:`RPC_MAX_TIMEOUT_S`); one below its resolution is rounded *up*,
  never down to nothing. Callers that need an exact deadline enforce it
  themselves (:mod:`.batching` does: a reply after the deadline is dropped).
* ``Pending.result`` waits in slices of at most :data:`WAIT_SLICE_S`
  seconds in Python, never in one blocking engine call, so a waiting main
  thread gets Ctrl-C (``KeyboardInterrupt``) within a slice, and a waiting
  daemon thread can be stopped at interpreter exit.
"""
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol

from ..executor import check_timeout as _check_timeout
from .frame import Frame

__all__ = ["Transport", "Pending", "TransportError", "TransportSendError", "TransportTimeout",
           "get_transport", "set_transport", "check_timeout", "register_engine", "engines",
           "RPC_MAX_TIMEOUT_S", "WAIT_SLICE_S", "when_done", "CallbackPending", "AutoTransport",
           "choose_backend", "Engine"]

RPC_MAX_TIMEOUT_S = 2_147_483.0  # the RPC agent keeps timeouts as int32 milliseconds
WAIT_SLICE_S = 0.1  # longest a waiter stays in one blocking wait (signals, exit)


def check_timeout(name: str, value: Any, limit: float = RPC_MAX_TIMEOUT_S) -> Optional[float]:
    """:func:`moe_autograd.executor.check_timeout`, clamped to what the RPC
    agent can carry."""
    return _check_timeout(name, value, limit)


class TransportError(Exception):
    """The request could not be sent, or its reply never came back."""


class TransportSendError(TransportError):
    """The request could not be sent at all (nothing reached the peer)."""


class TransportTimeout(TransportError):
    """The reply did not arrive within the deadline."""


class Pending(Protocol):
    """A request in flight; its result is the reply :class:`~.frame.Frame`."""

    def result(self, timeout: Optional[float]) -> Any:
        """Blocks up to ``timeout`` seconds (None: until the ``call``'s own
        timeout or the engine's) for the reply; lets signal handlers run
        (Ctrl-C) while it waits."""
        ...

    def done(self) -> bool:
        ...

    # Optional: ``add_done_callback(fn: Callable[[], None]) -> None`` calls
    # ``fn()`` once the reply or the failure is there (at once if it is
    # already), on whichever thread completes it: see :func:`when_done`.


class CallbackPending(Pending, Protocol):
    """A :class:`Pending` that can tell a caller when it is done."""

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` once the reply or the failure is there (at once if
        it is already), on whichever thread completes it; ``fn`` must not block."""
        ...


class Transport(Protocol):
    """What remote experts need of an engine (see the module docstring's
    table). Optional: ``prepare(worker, key_id)``, called before a request to
    ``worker`` is sealed (Ray identifies the actor there);
    ``default_timeout() -> Optional[float]``, the seconds that bound a call
    given ``timeout=None``; and ``timeout_hint() -> str``, how a user
    changes them (named in timeout errors)."""

    name: str

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Pending:
        """Delivers ``frame`` to ``worker``; ``timeout`` bounds the whole call."""
        ...

    def local_name(self) -> str:
        """This process's worker name."""
        ...


def when_done(pending: Pending, fn: Callable[[Any, Optional[BaseException]], None],
              timeout: Optional[float]) -> None:
    """Calls ``fn(reply, None)`` or ``fn(None, error)`` once ``pending`` is
    done: from its ``add_done_callback`` if it has one (at once if it is done
    already), else from a daemon thread that waits ``result(timeout)`` for it
    (one thread per request, for transports without callbacks)."""

    def outcome() -> None:
        try:
            reply = pending.result(None)  # done: returns or raises at once
        except Exception as error:  # noqa: BLE001 - handed to fn
            fn(None, error)
            return
        fn(reply, None)

    add = getattr(pending, "add_done_callback", None)
    if add is not None:
        add(outcome)
        return
    if pending.done():
        outcome()
        return

    def wait() -> None:
        try:
            reply = pending.result(timeout)
        except Exception as error:  # noqa: BLE001 - handed to fn
            fn(None, error)
            return
        fn(reply, None)
    threading.Thread(target=wait, daemon=True, name="moe_autograd-remote-wait").start()


# -- engines ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Engine:
    """A registered engine: ``running()`` says whether this process is in
    one of its worlds; ``transport()`` is its default transport."""

    name: str
    running: Callable[[], bool]
    transport: Callable[[], Transport]
    hint: str  # how a user starts its world (named when none is running)


_engines: List[Engine] = []
_engines_lock = threading.Lock()


def register_engine(engine: Engine) -> None:
    """Makes ``engine`` one that :class:`AutoTransport` may choose (in
    registration order); registering a name again replaces it in place."""
    with _engines_lock:
        for k, known in enumerate(_engines):
            if known.name == engine.name:
                _engines[k] = engine
                return
        _engines.append(engine)


def engines() -> List[Engine]:
    with _engines_lock:
        return list(_engines)


def choose_backend() -> Transport:
    """The transport of the first registered engine this process runs in;
    raises :class:`TransportSendError` saying how to start one if none."""
    known = engines()
    for engine in known:
        if engine.running():
            return engine.transport()
    hints = " or ".join(e.hint for e in known) or "import moe_autograd.remote"
    raise TransportSendError(f"no remote engine is initialised in this process: call {hints} "
                             "first (or pass transport=... explicitly)")


class AutoTransport:
    """The default transport: each call goes to :func:`choose_backend`'s
    engine, so that remote experts built before ``init_rpc``/``ray.init``
    use the engine started later."""

    name = "auto"

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Pending:
        return choose_backend().call(worker, frame, timeout)

    def local_name(self) -> str:
        try:
            return choose_backend().local_name()
        except TransportSendError as error:
            raise TransportError(str(error)) from None

    def default_timeout(self) -> Optional[float]:
        try:
            get = getattr(choose_backend(), "default_timeout", None)
        except TransportError:
            return None
        return get() if get is not None else None

    def timeout_hint(self) -> str:
        try:
            get = getattr(choose_backend(), "timeout_hint", None)
        except TransportError:
            get = None
        return str(get()) if get is not None else "the transport's own timeout"


_transport: Transport = AutoTransport()


def get_transport() -> Transport:
    """The transport that remote experts and servers use by default: an
    :class:`AutoTransport` unless :func:`set_transport` replaced it."""
    return _transport


def set_transport(transport: Optional[Transport]) -> None:
    """Replaces the default transport (for every later RemoteExpert/server);
    ``None`` restores the automatic choice (:class:`AutoTransport`)."""
    global _transport
    if transport is not None and not callable(getattr(transport, "call", None)):
        raise TypeError(f"set_transport expects a Transport (with call(worker, frame, "
                        f"timeout) and local_name()), got {type(transport).__name__}")
    _transport = transport if transport is not None else AutoTransport()
