"""A client's requests: a message sealed, sent, and its reply opened.

Why: every request of a client (an expert's forward and backward, a
coalesced batch, a collect, a release, a control call, a fleet's challenge)
takes the same path down and up: encode (:mod:`.wire`), seal with the job's
session (:mod:`.auth`), hand to the engine (:mod:`.transport`); then verify
the reply (sealed by that server with the same secret, for this very
request), decode it, and note what the server reports refusing. Nothing in
a reply is unpickled, so a hostile server cannot run code here; a reply that
fails authentication is rejected, counted and logged.

A request is a ``dict`` whose ``"op"`` names the server's operation (see
:mod:`.endpoint`); its reply is ``["ok", value]`` or ``["error", text]``.

Invariants:

* :func:`request` raises :class:`~.errors.RemoteAuthError` only before
  anything is sent (no secret configured) or :class:`~.transport.TransportSendError`
  (nothing could be sent); everything else reaches the pending's ``result``:
  :class:`~.transport.TransportError` from the engine, and
  :class:`~.errors.RemoteAuthError` when the server refused the request or
  its reply fails.
* ``result`` opens a reply once (later calls return the same value, or
  raise the same error), on whichever thread asks first: the engine's
  completion thread under :func:`~.transport.when_done`. (An engine may
  hand over a reply whose buffers an encrypted message is decrypted into,
  :attr:`~.frame.Frame.owned`: it cannot be opened twice.)
"""
import threading
from typing import Any, Callable, Dict, List, Optional

from . import wire
from .auth import (JobSecret, Refused, ReplyRejected, boot_of, note_peer_refusals, resolve_secret,
                   session_for, unbind_boot)
from .errors import RemoteAuthError, RemoteExpertError
from .transport import Pending, Transport, TransportError, TransportSendError, get_transport

__all__ = ["request", "Opened", "call_operation"]

Reply = List[Any]


class Opened:
    """A request in flight whose ``result`` is the server's reply pair
    (see the module docstring)."""

    def __init__(self, pending: Pending, worker: str, seq: int, session: Any,
                 transport: Optional[Transport] = None, bound: bool = False) -> None:
        self._pending, self._worker, self._seq, self._session = pending, worker, seq, session
        self._transport, self._bound = transport, bound
        self._lock = threading.Lock()
        self._value: Optional[Reply] = None
        self._failed: Optional[RemoteAuthError] = None
        add = getattr(pending, "add_done_callback", None)
        if add is not None:
            self.add_done_callback: Callable[[Callable[[], None]], None] = add

    def done(self) -> bool:
        return bool(self._pending.done())

    def result(self, timeout: Optional[float]) -> Reply:
        frame = self._pending.result(timeout)
        with self._lock:
            if self._failed is not None:  # (opened once: an owned reply was decrypted in place)
                raise self._failed
            if self._value is None:
                try:
                    self._value = self._open(frame)
                except RemoteAuthError as error:
                    self._failed = error
                    raise
            return self._value

    def _open(self, frame: Any) -> Reply:
        worker = self._worker
        try:
            body, buffers = self._session.open_reply(worker, self._seq, frame)
        except Refused as refused:
            if self._bound and refused.reason == "bad MAC":  # a restarted process? its new
                unbind_boot(worker)                             # boot id is bound by the next
                forget = getattr(self._transport, "forget", None)  # record read (identity)
                if forget is not None:
                    forget(worker)
            raise RemoteAuthError(f"worker {worker!r} refused the request ({refused}); is it "
                                  "serving this job with the same secret?") from None
        except ReplyRejected as rejected:
            raise RemoteAuthError(str(rejected)) from None
        try:
            message = wire.decode(body, buffers)
        except wire.WireError as error:  # counted and logged like a reply that fails
            self._session.reject(worker, f"an unreadable reply ({error})")
            raise RemoteAuthError(f"server {worker!r} sent an unreadable reply: {error}"
                                  ) from None
        reply = message.get("reply") if type(message) is dict else None
        if not (type(reply) is list and len(reply) == 2 and reply[0] in ("ok", "error")):
            raise RemoteAuthError(f"server {worker!r} sent a malformed reply")
        note_peer_refusals(worker, message.get("refused"))
        return reply


def request(transport: Transport, worker: str, message: Dict[str, Any],
            timeout: Optional[float], *, secret: Optional[JobSecret] = None,
            label: str = "") -> Opened:
    """Sends ``message`` to ``worker`` sealed with ``secret`` (default: the
    job's, :func:`~.auth.job_secret`); see the module docstring."""
    try:
        session = session_for(resolve_secret(secret))
    except Exception as error:  # noqa: BLE001 - no secret configured, unreadable file
        raise RemoteAuthError(str(error)) from error
    try:
        body, buffers = wire.encode(message)
    except wire.WireTypeError as error:
        raise TransportSendError(f"the request cannot travel: {error}") from error
    prepare = getattr(transport, "prepare", None)
    if prepare is not None:  # (Ray: identifies the actor, which binds its boot id, first)
        prepare(worker, session.secret.key_id)
    bound = boot_of(worker) is not None
    frame, seq = session.seal(worker, body, buffers, label or str(message.get("op", "")))
    return Opened(transport.call(worker, frame, timeout), worker, seq, session, transport, bound)


def call_operation(worker: str, name: str, *args: Any, timeout: Optional[float] = 30.0,
                   transport: Optional[Transport] = None,
                   secret: Optional[JobSecret] = None) -> Any:
    """Runs the operation ``name`` that server ``worker`` registered
    (:func:`~.endpoint.register_operation`) with ``args`` and returns its
    result; raises :class:`~.errors.RemoteExpertError` with the server's
    error, or the transport's."""
    wire.check_value(list(args), f"the arguments of operation {name!r}")
    try:
        opened = request(transport or get_transport(), worker,
                         {"op": "call", "name": name, "args": list(args)}, timeout,
                         secret=secret, label="call")
        status, value = opened.result(timeout)
    except TransportError as error:
        raise RemoteExpertError(f"operation {name!r} on worker {worker!r} failed: "
                                f"{error}") from error
    if status != "ok":
        raise RemoteExpertError(f"operation {name!r} on worker {worker!r} failed: {value}")
    return value
