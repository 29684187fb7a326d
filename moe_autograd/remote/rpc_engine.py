"""torch RPC as an engine: :class:`RpcTransport` and the one function it runs.

Why: :mod:`torch.distributed.rpc` (TensorPipe) needs no service and moves
tensors without copying them into a message. Here it carries
:class:`~.frame.Frame` s only: a request is ``rpc_async(worker, _receive,
args=(head, carried))``, where ``head`` is bytes and ``carried`` the
frame's buffers as 1-D uint8 tensors: ONE tensor holding them back to back
when they are small (:data:`BLOB_MAX_BYTES` in all: TensorPipe then handles
one tensor per message instead of one per buffer), else a list of them
(large tensors are not copied); the receiver splits a blob by the lengths
the header announces. ``_receive`` hands the frame to
:func:`.endpoint.serve` and returns the reply's ``(head, carried)``. No
other function of ours is ever called by RPC, and ``_receive`` runs nothing
its frame names but a registered operation.

Trust: TensorPipe unpickles every RPC (the function's reference and its
arguments) before ``_receive`` runs, so a member of the world can run any
function in any other, whatever this module does. The world must stay
closed: :mod:`.rpc_bind` keeps it on the address it was given (loopback by
default), and the README says what that leaves.

Invariants:

* ``call`` never blocks on the peer; ``Pending.result`` waits in slices of
  :data:`~.transport.WAIT_SLICE_S` (Ctrl-C gets through).
* ``call(..., timeout=None)`` ends at the agent's ``rpc_timeout`` (60 s
  unless set in ``TensorPipeRpcBackendOptions``); a finite timeout is
  clamped to :data:`~.transport.RPC_MAX_TIMEOUT_S` and rounded *up* to whole
  milliseconds (the agent truncates to milliseconds and reads 0 as no limit).
* No reply arrives while the interpreter finalises. A reply (or the
  agent's timeout) completes its future on a TensorPipe thread, which must
  take the GIL; past the start of finalisation torch aborts the process
  ("terminate called ...", status -6). So at exit (an ``atexit`` hook) no new
  request is sent, requests in flight get up to :data:`EXIT_SETTLE_S` to
  end, and if some have not, the local agent is shut down without waiting
  (``rpc.shutdown(graceful=False)``). The agent is left alone when nothing
  is in flight, or when the script shut RPC down itself.
* A request counts as in flight until the agent's thread has run every
  Python callback of its future: each future has ONE done callback
  (:class:`_RpcPending`), which runs the callbacks added to it and leaves
  ``_in_flight`` last. (With one torch callback per Python callback, the
  first one left ``_in_flight``, the exit hook saw nothing in flight and
  the interpreter began to finalise while the agent's thread waited for the
  GIL to run the next: status -6 in about 1 exit in 30, issue 43.)
"""
import atexit
import itertools
import math
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import endpoint
from .frame import Frame, FrameError, buffer_lengths
from .transport import (WAIT_SLICE_S, Engine, Pending, TransportError, TransportSendError,
                        TransportTimeout, check_timeout, register_engine)

__all__ = ["RpcTransport", "rpc_running", "in_flight", "EXIT_SETTLE_S", "RPC_RESOLUTION_S",
           "BLOB_MAX_BYTES"]

RPC_RESOLUTION_S = 0.001  # the agent keeps whole milliseconds, and 0 means no limit at all
EXIT_SETTLE_S = 0.5  # at exit, how long requests in flight get to end by themselves
BLOB_MAX_BYTES = 1 << 20  # buffers up to this many bytes in all travel as one tensor


def _carry(buffers: Sequence[Any]) -> Union[Tensor, List[Any]]:
    """What RPC carries of a frame's buffers (see the module docstring)."""
    if len(buffers) > 1 and sum(int(b.numel()) for b in buffers) <= BLOB_MAX_BYTES:
        return torch.cat([b.reshape(-1) for b in buffers])
    return list(buffers)


def _uncarry(head: Any, carried: Any) -> List[Any]:
    """The buffers of a frame as carried (a blob is split by the lengths its
    header announces; what does not add up arrives as it is, to be refused
    as malformed by whoever parses the frame)."""
    if not isinstance(carried, Tensor):
        return carried if isinstance(carried, list) else []
    try:
        lengths = buffer_lengths(head)
    except FrameError:
        return [carried]
    if carried.dim() != 1 or sum(lengths) != carried.numel():
        return [carried]
    parts, at = [], 0
    for n in lengths:
        parts.append(carried.narrow(0, at, n))
        at += n
    return parts


# -- the server's side ---------------------------------------------------------------------
_me: List[Any] = [None, ""]  # (agent, its worker name): looked up once per agent


def _my_name() -> str:
    from torch.distributed.rpc import api

    agent = api._get_current_rpc_agent()
    if _me[0] is not agent:
        _me[1] = agent.get_worker_info().name
        _me[0] = agent
    return str(_me[1])


def _receive(head: bytes, carried: Any) -> Tuple[bytes, Union[Tensor, List[Any]]]:
    """What RPC runs on a server: one frame in, one out (see the module docstring)."""
    try:
        me = _my_name()
    except Exception:  # noqa: BLE001 - shutting down
        me = ""
    # (the tensors TensorPipe received are this process's own: owned)
    reply = endpoint.serve(Frame(head, _uncarry(head, carried), owned=True), me)
    return reply.head, _carry(reply.buffers)


# -- the client's side ---------------------------------------------------------------------
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
    and calls ``wait()`` only once the future is done.

    The future has one done callback, :meth:`_fire`: it runs every callback
    added here, in order, then takes the request out of ``_in_flight`` (see
    the module docstring's last invariant)."""

    __slots__ = ("_future", "_key", "_lock", "_callbacks", "_fired")

    def __init__(self, future: Any) -> None:
        self._future = future
        self._key = next(_keys)
        self._lock = threading.Lock()
        self._callbacks: List[Callable[[], None]] = []
        self._fired = False
        _in_flight[self._key] = future
        future.add_done_callback(self._fire)  # runs here at once if already done

    def _fire(self, _: Any = None) -> None:
        try:
            with self._lock:
                self._fired = True
                callbacks, self._callbacks = self._callbacks, []
            for fn in callbacks:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - one callback's error must not skip the rest
                    pass
        finally:
            _in_flight.pop(self._key, None)

    def done(self) -> bool:
        return bool(self._future.done())

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        # Runs on the agent's thread that completes the future (or here, if
        # done): ``fn`` must not block.
        with self._lock:
            if not self._fired:
                self._callbacks.append(fn)
                return
        fn()

    def result(self, timeout: Optional[float]) -> Frame:
        future = self._future
        if not future.done():
            ready = threading.Lock()  # held until the done callback releases it
            ready.acquire()
            self.add_done_callback(ready.release)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S,
                                                                 deadline - time.monotonic())
                if left <= 0:
                    raise TransportTimeout(f"no reply within {timeout:g} s")
                if ready.acquire(timeout=left):  # a signal handler may raise in here (Ctrl-C)
                    break
        try:
            value = future.wait()  # done: returns (or raises) at once
        except Exception as error:  # noqa: BLE001 - every engine error is mapped
            kind = TransportTimeout if _is_timeout(error) else TransportError
            raise kind(f"{type(error).__name__}: {error}") from error
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bytes)):
            raise TransportError("a reply that is not a frame (is the peer a moe_autograd "
                                 "server of this version?)")
        return Frame(value[0], _uncarry(value[0], value[1]), "reply", owned=True)


def _agent_seconds(limit: float) -> float:
    """``limit`` as the RPC agent will keep it: whole milliseconds (it
    truncates ``seconds * 1000`` to an int, 0 meaning no limit), rounded up
    so that the agent never fires before the deadline nor drops it."""
    ms = max(1, math.ceil(limit / RPC_RESOLUTION_S - 1e-6))
    return (ms + 0.5) * RPC_RESOLUTION_S  # truncates back to ms, even in float32


# -- requests in flight, and a clean exit ----------------------------------------------
_in_flight: Dict[int, Any] = {}  # futures not done yet (dict ops: GIL-atomic)
_keys = itertools.count()
_exiting = threading.Event()  # set by the exit hook: no new request from then on


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
    """:mod:`torch.distributed.rpc`, initialised with ``init_rpc`` (or
    :func:`moe_autograd.remote.start_rpc`, which keeps the world on its
    address).

    ``timeout=None`` (or ``math.inf``) uses the agent's default RPC timeout
    (the ``rpc_timeout`` of the backend options, 60 s unless configured; note
    that ``rpc_timeout=0`` there means no limit at all). Finite timeouts are
    clamped to :data:`~.transport.RPC_MAX_TIMEOUT_S` and rounded up to whole
    milliseconds (at least one: the agent would read a smaller value as no
    limit).
    """

    name = "torch.distributed.rpc"

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Pending:
        from torch.distributed import rpc

        if _exiting.is_set():
            raise TransportSendError("the interpreter is exiting: no new request is sent")
        try:
            limit = check_timeout("timeout", timeout)
        except (TypeError, ValueError) as error:
            raise TransportSendError(str(error)) from error
        rpc_timeout = rpc.constants.UNSET_RPC_TIMEOUT if limit is None else _agent_seconds(limit)
        try:
            future = rpc.rpc_async(worker, _receive, args=(frame.head, _carry(frame.buffers)),
                                   timeout=rpc_timeout)
        except Exception as error:  # noqa: BLE001 - unknown worker, not initialised
            raise TransportSendError(f"{type(error).__name__}: {error}") from error
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
            return str(rpc.get_worker_info().name)
        except Exception as error:  # noqa: BLE001
            raise TransportError(
                "torch.distributed.rpc is not initialised in this process: call "
                f"rpc.init_rpc(name, rank, world_size, ...) first ({error})") from error


_rpc_transport = RpcTransport()


def rpc_running() -> bool:
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


register_engine(Engine("torch.distributed.rpc", rpc_running, lambda: _rpc_transport,
                       "torch.distributed.rpc.init_rpc(name, rank, world_size, ...)"))
