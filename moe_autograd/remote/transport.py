"""The one seam between remote experts and the engine that carries messages.

Why a seam: remote experts need an engine that moves a request to another
process and its reply back. Two engines sit behind it: :mod:`torch.distributed.rpc`
(TensorPipe; :class:`RpcTransport`, the default, needing no service) and Ray
(:class:`~moe_autograd.remote.ray_backend.RayTransport`, optional:
``pip install moe_autograd[ray]``). Nothing else in :mod:`moe_autograd.remote`
touches an engine, so a third one (a gRPC service) plugs in by implementing
:class:`Transport` and passing it to ``RemoteExpert(..., transport=...)`` or
:func:`set_transport`.

What a backend must provide (the :class:`Transport` protocol):

======================  ==================================================================
send a request          ``call(worker, fn, args, timeout)`` runs the module-level function
                        ``fn(*args)`` in the server process named ``worker`` and returns a
                        :class:`Pending` at once (never blocks on the peer)
complete by callback    ``Pending.add_done_callback(fn)`` (optional, see
                        :class:`CallbackPending`): how :mod:`.batching` completes many
                        calls without a waiting thread each; without it, one daemon
                        thread waits per request
deadlines               ``timeout`` bounds the whole call; ``None`` means the engine's own
                        limit (``default_timeout()``, optional), so every call ends
server-side entry point the process named ``worker`` runs ``fn(*args)`` for any
                        importable ``fn`` (:mod:`.server`'s ``serve_*`` functions, the
                        coalesced :mod:`.batch_server` ones): an RPC worker does so by
                        itself; a Ray server is an actor whose ``run(fn, args)`` does it
                        (:class:`~moe_autograd.remote.ray_backend.RayExpertServer`)
liveness                a request to a dead or unreachable peer fails with
                        :class:`TransportError` (at once when the engine sees the death,
                        else at its deadline), never hangs
names                   ``local_name()``: this process's name, unique in its world (the
                        owner of its stateful calls and coalesced batches)
======================  ==================================================================

Choosing the backend: :func:`get_transport` returns, unless
:func:`set_transport` replaced it, an :class:`AutoTransport` that picks per
call by how the world was started: an initialised RPC agent (``rpc.init_rpc``)
means torch RPC, else an initialised Ray (``ray.init``, or running inside a
Ray worker) means Ray; both initialised: RPC (the default), name Ray
explicitly (``transport=RayTransport()``) to use it.

The interface is deliberately tiny: ``call`` returns a :class:`Pending`
whose ``result(timeout)`` blocks for the reply.

Invariants:

* ``call`` never blocks on the peer; it raises :class:`TransportSendError` only if
  the request cannot be sent at all (unknown worker, unpicklable arguments,
  transport not initialised).
* ``Pending.result`` raises :class:`TransportTimeout` when the reply has not
  come within the ``timeout`` given to ``call`` (enforced by the engine, like
  the RPC agent's own timeout, or by the waiter within ``result(timeout)``), and
  :class:`TransportError` for every other failure (peer dead, connection
  reset). A reply that arrives after its waiter gave up is dropped.
* ``call(..., timeout=None)`` still ends: the engine's own timeout bounds it
  (for :class:`RpcTransport`, the ``rpc_timeout`` of the backend options,
  60 s unless set in ``TensorPipeRpcBackendOptions(rpc_timeout=...)``). A
  finite timeout above what the engine can represent is clamped
  (:data:`RPC_MAX_TIMEOUT_S`); one below its resolution is rounded *up*
  (:data:`RPC_RESOLUTION_S`: the RPC agent keeps whole milliseconds, and
  reads 0 as "no limit"), never down to nothing. Callers that need an exact
  deadline enforce it themselves (:mod:`.batching` does: a reply after the
  deadline is dropped).
* ``Pending.result`` waits in slices of at most :data:`WAIT_SLICE_S`
  seconds in Python, never in one blocking engine call, so a waiting main
  thread gets Ctrl-C (``KeyboardInterrupt``) within a slice, and a waiting
  daemon thread can be stopped at interpreter exit.
* No reply of :class:`RpcTransport` arrives while the interpreter finalises.
  A reply (or the agent's timeout) completes its future on a TensorPipe
  thread, which must take the GIL to unpickle it; past the start of
  finalisation that thread is killed inside C++ and torch aborts the process
  ("terminate called ...", status -6), whatever the script's own exit
  status. So at exit (an ``atexit`` hook, which runs before finalisation)
  no new request is sent any more (``call`` raises
  :class:`TransportSendError`: a masked call still running on a worker may
  try again), requests still in flight, typically calls a deadline masked,
  get up to :data:`EXIT_SETTLE_S` to end, and if some have not, the local
  RPC agent is shut down without waiting for them
  (``rpc.shutdown(graceful=False)``: the process is leaving anyway). The
  agent is left alone when none is in flight, or when the script shut RPC
  down itself.
"""
import atexit
import itertools
import math
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

from ..executor import check_timeout as _check_timeout

__all__ = ["Transport", "Pending", "TransportError", "TransportSendError", "TransportTimeout",
           "RpcTransport", "get_transport", "set_transport", "check_timeout",
           "RPC_MAX_TIMEOUT_S", "RPC_RESOLUTION_S", "WAIT_SLICE_S", "EXIT_SETTLE_S",
           "when_done", "in_flight", "CallbackPending", "AutoTransport", "choose_backend"]

RPC_MAX_TIMEOUT_S = 2_147_483.0  # the RPC agent keeps timeouts as int32 milliseconds
RPC_RESOLUTION_S = 0.001  # ...whole ones, truncated, and 0 means no limit at all
WAIT_SLICE_S = 0.1  # longest a waiter stays in one blocking wait (signals, exit)
EXIT_SETTLE_S = 0.5  # at exit, how long requests in flight get to end by themselves


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
    """A request in flight."""

    def result(self, timeout: Optional[float]) -> Any:
        """Blocks up to ``timeout`` seconds (None: until the ``call``'s own
        timeout or the engine's) for the reply; lets signal handlers run
        (Ctrl-C) while it waits."""
        ...

    def done(self) -> bool:
        ...

    # Optional: ``add_done_callback(fn: Callable[[], None]) -> None`` calls
    # ``fn()`` once the reply or the failure is there (at once if it is
    # already), on whichever thread completes it; ``result`` then returns or
    # raises without blocking. Not part of the protocol, so that a transport
    # written before it still type-checks: see :func:`when_done`.


class CallbackPending(Pending, Protocol):
    """A :class:`Pending` that can tell a caller when it is done (what
    :func:`when_done` uses when a pending has it)."""

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` once the reply or the failure is there (at once if
        it is already), on whichever thread completes it; ``fn`` must not block."""
        ...


class Transport(Protocol):
    """What remote experts need of a transport (see the module docstring's
    table). Optional: ``default_timeout() -> Optional[float]``, the seconds
    that bound a call given ``timeout=None``, and ``timeout_hint() -> str``,
    how a user changes them (named in timeout errors)."""

    name: str

    def call(self, worker: str, fn: Callable[..., Any], args: Tuple[Any, ...],
             timeout: Optional[float]) -> Pending:
        """Runs ``fn(*args)`` on ``worker``; ``timeout`` bounds the whole call."""
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


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timeout" in text or "timed out" in text


class _RpcPending:
    """An ``rpc_async`` future. The agent itself fails it at the RPC's
    timeout (set to the call's deadline), and drops a late response.

    ``future.wait()`` would block in C++ where no signal handler runs (Ctrl-C
    would wait for the reply) and where a daemon thread cannot be stopped at
    exit; so the waiter sleeps on a :class:`threading.Lock` (released by a
    done callback on the agent's thread) in slices of :data:`WAIT_SLICE_S`,
    and calls ``wait()`` only once the future is done."""

    __slots__ = ("_future",)

    def __init__(self, future: Any) -> None:
        self._future = future

    def done(self) -> bool:
        return bool(self._future.done())

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        # Runs on the agent's thread that completes the future (or here, if
        # done): ``fn`` must not block.
        self._future.add_done_callback(lambda _: fn())

    def result(self, timeout: Optional[float]) -> Any:
        future = self._future
        if not future.done():
            ready = threading.Lock()  # held until the done callback releases it
            ready.acquire()
            future.add_done_callback(lambda _: ready.release())
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S,
                                                                 deadline - time.monotonic())
                if left <= 0:
                    raise TransportTimeout(f"no reply within {timeout:g} s")
                if ready.acquire(timeout=left):  # a signal handler may raise in here (Ctrl-C)
                    break
        try:
            return future.wait()  # done: returns (or raises) at once
        except Exception as error:  # noqa: BLE001 - every engine error is mapped
            kind = TransportTimeout if _is_timeout(error) else TransportError
            raise kind(f"{type(error).__name__}: {error}") from error


def _agent_seconds(limit: float) -> float:
    """``limit`` as the RPC agent will keep it: whole milliseconds (it
    truncates ``seconds * 1000`` to an int, 0 meaning no limit), rounded up
    so that the agent never fires before the deadline nor drops it."""
    ms = max(1, math.ceil(limit / RPC_RESOLUTION_S - 1e-6))
    return (ms + 0.5) * RPC_RESOLUTION_S  # truncates back to ms, even in float32


# -- requests in flight, and a clean exit ----------------------------------------------
_in_flight: Dict[int, Any] = {}  # futures of RpcTransport not done yet (dict ops: GIL-atomic)
_keys = itertools.count()
_exiting = threading.Event()  # set by the exit hook: no new request from then on


def _track(future: Any) -> None:
    key = next(_keys)
    _in_flight[key] = future
    future.add_done_callback(lambda _: _in_flight.pop(key, None))


def in_flight() -> int:
    """Requests of :class:`RpcTransport` whose reply has not come (tests, exit)."""
    return len(_in_flight)


def _settle_at_exit(settle: float = EXIT_SETTLE_S) -> None:
    """The exit hook: see the module docstring's last invariant."""
    _exiting.set()
    if not _in_flight:
        return
    deadline = time.monotonic() + settle
    while _in_flight and time.monotonic() < deadline:
        time.sleep(0.005)
    if not _in_flight:
        return
    from torch.distributed import rpc

    try:
        rpc.shutdown(graceful=False)  # fails the rest locally; no thread runs them later
    except Exception:  # noqa: BLE001 - not initialised, or shut down meanwhile
        pass
    _in_flight.clear()


atexit.register(_settle_at_exit)


def _after_fork_in_child() -> None:  # the parent's requests are not this process's
    global _exiting
    _in_flight.clear()
    _exiting = threading.Event()


os.register_at_fork(after_in_child=_after_fork_in_child)


class RpcTransport:
    """:mod:`torch.distributed.rpc`, initialised by the user with ``init_rpc``.

    ``timeout=None`` (or ``math.inf``) uses the agent's default RPC timeout
    (the ``rpc_timeout`` of the backend options, 60 s unless configured; note
    that ``rpc_timeout=0`` there means no limit at all). Finite timeouts are
    clamped to :data:`RPC_MAX_TIMEOUT_S` and rounded up to whole milliseconds
    (at least one: the agent would read a smaller value as no limit).
    """

    name = "torch.distributed.rpc"

    def call(self, worker: str, fn: Callable[..., Any], args: Tuple[Any, ...],
             timeout: Optional[float]) -> Pending:
        from torch.distributed import rpc

        if _exiting.is_set():
            raise TransportSendError("the interpreter is exiting: no new request is sent")
        try:
            limit = check_timeout("timeout", timeout)
        except (TypeError, ValueError) as error:
            raise TransportSendError(str(error)) from error
        rpc_timeout = rpc.constants.UNSET_RPC_TIMEOUT if limit is None else _agent_seconds(limit)
        try:
            future = rpc.rpc_async(worker, fn, args=args, timeout=rpc_timeout)
        except Exception as error:  # noqa: BLE001 - unknown worker, pickling, not initialised
            raise TransportSendError(f"{type(error).__name__}: {error}") from error
        _track(future)
        return _RpcPending(future)

    def timeout_hint(self) -> str:
        seconds = self.default_timeout()
        limit = f"rpc_timeout={seconds:g} s" if seconds is not None else "its default"
        return (f"the transport's own timeout ({limit}; set it with "
                "rpc.TensorPipeRpcBackendOptions(rpc_timeout=...), or give the expert a "
                "forward_timeout/backward_timeout)")

    def default_timeout(self) -> Optional[float]:
        """The agent's own timeout in seconds (``None`` if unknown or unlimited)."""
        from torch.distributed import rpc

        try:
            value = float(rpc.get_rpc_timeout())
        except Exception:  # noqa: BLE001 - not initialised
            return None
        return value if value > 0 else None

    def local_name(self) -> str:
        from torch.distributed import rpc

        try:
            return rpc.get_worker_info().name
        except Exception as error:  # noqa: BLE001
            raise TransportError(
                "torch.distributed.rpc is not initialised in this process: call "
                f"rpc.init_rpc(name, rank, world_size, ...) first ({error})") from error


_rpc_transport = RpcTransport()


def _rpc_running() -> bool:
    """Whether this process has an initialised RPC agent (without importing
    RPC if nobody did: then nobody initialised it)."""
    rpc = sys.modules.get("torch.distributed.rpc")
    if rpc is None:
        return False
    try:
        rpc.get_worker_info()
    except Exception:  # noqa: BLE001 - not initialised (or shut down)
        return False
    return True


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


def choose_backend() -> Transport:
    """The backend of the world this process is in: torch RPC if its agent is
    initialised, else Ray if it is initialised, else torch RPC (whose calls
    then fail with an error saying how to start either)."""
    if _rpc_running():
        return _rpc_transport
    if _ray_running():
        from .ray_backend import default_ray_transport

        return default_ray_transport()
    return _rpc_transport


class AutoTransport:
    """The default transport: each call goes to :func:`choose_backend`'s
    backend, so that remote experts built before ``init_rpc``/``ray.init``
    use the engine started later."""

    name = "auto"

    def call(self, worker: str, fn: Callable[..., Any], args: Tuple[Any, ...],
             timeout: Optional[float]) -> Pending:
        return choose_backend().call(worker, fn, args, timeout)

    def local_name(self) -> str:
        if not _rpc_running() and not _ray_running():
            raise TransportError(
                "no remote engine is initialised in this process: call "
                "torch.distributed.rpc.init_rpc(name, rank, world_size, ...) or ray.init(...) "
                "first (or pass transport=... explicitly)")
        return choose_backend().local_name()

    def default_timeout(self) -> Optional[float]:
        get = getattr(choose_backend(), "default_timeout", None)
        return get() if get is not None else None

    def timeout_hint(self) -> str:
        get = getattr(choose_backend(), "timeout_hint", None)
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
        raise TypeError(f"set_transport expects a Transport (with call(worker, fn, args, "
                        f"timeout) and local_name()), got {type(transport).__name__}")
    _transport = transport if transport is not None else AutoTransport()
