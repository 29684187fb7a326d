"""The one seam between remote experts and the engine that carries messages.

Why a seam: :mod:`torch.distributed.rpc` (TensorPipe) is the transport today,
but nothing else in :mod:`moe_autograd.remote` touches it, so another engine
(Ray actors, a gRPC service) can be added by implementing :class:`Transport`
and passing it to ``RemoteExpert(..., transport=...)`` or :func:`set_transport`.

The interface is deliberately tiny: ``call(worker, fn, args, timeout)`` runs
the module-level function ``fn(*args)`` in the process named ``worker`` and
returns a :class:`Pending` whose ``result(timeout)`` blocks for the reply.

Invariants:

* ``call`` never blocks on the peer; it raises :class:`TransportSendError` only if
  the request cannot be sent at all (unknown worker, unpicklable arguments,
  transport not initialised).
* ``Pending.result`` raises :class:`TransportTimeout` when the reply has not
  come within the ``timeout`` given to ``call`` (enforced by the engine, like
  the RPC agent's own timeout, or by the waiter within ``result(timeout)``), and
  :class:`TransportError` for every other failure (peer dead, connection
  reset). A reply that arrives after its waiter gave up is dropped.
"""
from typing import Any, Callable, Optional, Protocol, Tuple

__all__ = ["Transport", "Pending", "TransportError", "TransportSendError", "TransportTimeout",
           "RpcTransport", "get_transport", "set_transport"]


class TransportError(Exception):
    """The request could not be sent, or its reply never came back."""


class TransportSendError(TransportError):
    """The request could not be sent at all (nothing reached the peer)."""


class TransportTimeout(TransportError):
    """The reply did not arrive within the deadline."""


class Pending(Protocol):
    """A request in flight."""

    def result(self, timeout: Optional[float]) -> Any:
        """Blocks up to ``timeout`` seconds (None: forever) for the reply."""
        ...

    def done(self) -> bool:
        ...


class Transport(Protocol):
    """What remote experts need of a transport."""

    name: str

    def call(self, worker: str, fn: Callable[..., Any], args: Tuple[Any, ...],
             timeout: Optional[float]) -> Pending:
        """Runs ``fn(*args)`` on ``worker``; ``timeout`` bounds the whole call."""
        ...

    def local_name(self) -> str:
        """This process's worker name."""
        ...


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timeout" in text or "timed out" in text


class _RpcPending:
    """An ``rpc_async`` future. The agent itself fails it at the RPC's
    timeout (set to the call's deadline), so waiting needs no Python callback
    on the agent's threads, and a late response is dropped by the agent."""

    __slots__ = ("_future",)

    def __init__(self, future: Any) -> None:
        self._future = future

    def done(self) -> bool:
        return bool(self._future.done())

    def result(self, timeout: Optional[float]) -> Any:
        try:
            return self._future.wait()  # releases the GIL; bounded by the RPC timeout
        except Exception as error:  # noqa: BLE001 - every engine error is mapped
            kind = TransportTimeout if _is_timeout(error) else TransportError
            raise kind(f"{type(error).__name__}: {error}") from error


class RpcTransport:
    """:mod:`torch.distributed.rpc`, initialised by the user with ``init_rpc``.

    ``timeout=None`` uses the agent's default RPC timeout (the ``rpc_timeout``
    of the backend options, 60 s unless configured).
    """

    name = "torch.distributed.rpc"

    def call(self, worker: str, fn: Callable[..., Any], args: Tuple[Any, ...],
             timeout: Optional[float]) -> Pending:
        from torch.distributed import rpc

        rpc_timeout = rpc.constants.UNSET_RPC_TIMEOUT if timeout is None else max(timeout, 1e-3)
        try:
            future = rpc.rpc_async(worker, fn, args=args, timeout=rpc_timeout)
        except Exception as error:  # noqa: BLE001 - unknown worker, pickling, not initialised
            raise TransportSendError(f"{type(error).__name__}: {error}") from error
        return _RpcPending(future)

    def local_name(self) -> str:
        from torch.distributed import rpc

        try:
            return rpc.get_worker_info().name
        except Exception as error:  # noqa: BLE001
            raise TransportError(
                "torch.distributed.rpc is not initialised in this process: call "
                f"rpc.init_rpc(name, rank, world_size, ...) first ({error})") from error


_transport: Transport = RpcTransport()


def get_transport() -> Transport:
    """The transport that remote experts and servers use by default."""
    return _transport


def set_transport(transport: Transport) -> None:
    """Replaces the default transport (for every later RemoteExpert/server)."""
    global _transport
    _transport = transport
