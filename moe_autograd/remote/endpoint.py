"""A server process's one entry point: a sealed frame in, a sealed frame out.

Why: whatever the engine (an RPC worker's ``_receive``, a Ray actor's
``handle``), a request reaches the server as a :class:`~.frame.Frame`, and
the same three things must happen, in this order: authenticate it
(:class:`~.auth.Gate`: a request that fails is refused before its body is
decoded), decode it (:mod:`.wire`: schema values and tensors, no code), and
run the *operation it names* among those registered in this process. An
operation is code the server already has (:mod:`.server` registers
``forward``, ``backward``, ``control``, ``release`` and ``info``;
:mod:`.batch_server` ``batch`` and ``collect``; a server's own code may add
more with :func:`register_operation`): nothing reachable from the network
runs a function it was sent.

Lifecycle of a request here (:func:`serve`)::

    step                      outcome
    ------------------------  ----------------------------------------------------------
    Gate.open                 refused -> an unsealed refusal frame (its reason's code
                              only); counted and logged; nothing decoded or run
    wire.decode, within the   past them (a body longer than its job's bound; more lists,
    job's wire.Limits         tuples and dicts than its length allows, or nested deeper;
                              compressed tensors declaring more decoded bytes than the
                              job's budget) -> a sealed error reply naming what was too
                              big; counted and logged as a "too large" refusal; refused
                              while the body is read, before any tensor is decoded
                              (what it cost so far: :mod:`.wire`'s table)
    wire.decode               malformed (a compressed payload that does not match its
                              descriptor included) -> a sealed error reply; counted and
                              logged as a "malformed" refusal
    the operation's handler   its reply ``["ok", value]`` or ``["error", text]`` (a
                              handler that raises becomes an error reply)
    wire.encode, Gate.seal    the reply, with ``refused``: how many requests this
                              process has refused so far (the trainer warns when it grows)

Invariants:

* :func:`serve` never raises: an engine's thread always gets a frame back.
* Handlers receive the authenticated :class:`~.auth.Caller` (job and session:
  the owner of states and batches) and the decoded request (a ``dict``);
  they check its fields themselves.
* A request is decoded within the limits of its job
  (:func:`request_limits`: ``wire.Limits.for_budget`` of the budget that
  :func:`set_request_budget`'s function gives for the caller; the server
  module's is the sum of ``max_request_bytes`` of the servers of that job in
  this process). Decoding it allocates at most about
  ``wire.BODY_AMPLIFICATION`` times its body's bytes, one copy of its buffers
  (where they arrived read-only) and the declared decoded bytes of its
  compressed tensors, which that budget admitted first.
"""
import logging
import os
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional

from . import wire
from .auth import Caller, Gate, Refused, refusal_frame
from .frame import Frame

__all__ = ["serve", "gate", "register", "register_operation", "unregister_operation",
           "operations", "error_text", "set_request_budget", "request_limits", "Handler",
           "Reply", "Budget"]

Reply = List[Any]  # ["ok", value] or ["error", text]
Handler = Callable[[Caller, Dict[str, Any]], Reply]
#: The bytes of tensors one request of a caller's job may take here (``None``: unbounded).
Budget = Callable[[Caller], Optional[int]]
_log = logging.getLogger(__name__)
_handlers: Dict[str, Handler] = {}
_operations: Dict[str, Callable[..., Any]] = {}
_lock = threading.Lock()
_gate = Gate()
_budget: List[Budget] = []  # set_request_budget's function (none: unbounded)
if hasattr(os, "register_at_fork"):  # a forked server is a process of its own: its boot id
    os.register_at_fork(after_in_child=_gate.restart)


def gate() -> Gate:
    """This process's gate (servers admit their job secrets to it)."""
    return _gate


def register(op: str, handler: Handler) -> None:
    """Makes the built-in operation ``op`` run ``handler`` (server modules)."""
    with _lock:
        _handlers[op] = handler


def register_operation(name: str, fn: Callable[..., Any]) -> None:
    """Lets members of a job this process serves call ``fn(*args)`` by
    ``name`` (:func:`moe_autograd.remote.call_operation`): diagnostics, test
    hooks, server-side tools. ``fn`` is this process's own code; its
    arguments and result travel as wire values (tensors, numbers, strings,
    containers of them)."""
    if not isinstance(name, str) or not name or not callable(fn):
        raise TypeError("register_operation(name: str, fn: callable)")
    with _lock:
        _operations[name] = fn


def unregister_operation(name: str) -> None:
    with _lock:
        _operations.pop(name, None)


def operations() -> List[str]:
    with _lock:
        return sorted(_operations)


def set_request_budget(budget: Budget) -> None:
    """Makes ``budget(caller)`` the bytes one request of the caller's job may
    take in this process (:func:`request_limits`; :mod:`.server` sets it)."""
    with _lock:
        _budget[:] = [budget]


def request_limits(caller: Caller) -> wire.Limits:
    """The limits a request of ``caller``'s job is decoded within (see the
    module docstring)."""
    with _lock:
        budget = _budget[0] if _budget else None
    return wire.Limits.for_budget(budget(caller) if budget is not None else None)


def error_text(error: BaseException, tail: bool = False) -> str:
    """An error as a reply carries it (with the server's traceback tail)."""
    text = f"{type(error).__name__}: {error}"
    if tail:
        where = "".join(traceback.format_exception(error)[-6:])
        text += f"\n-- server traceback (tail) --\n{where}"
    return text


def _call_operation(caller: Caller, request: Dict[str, Any]) -> Reply:
    name, args = request.get("name"), request.get("args")
    with _lock:
        fn = _operations.get(name) if isinstance(name, str) else None
    if fn is None:
        return ["error", f"LookupError: no operation {name!r} here; this server has "
                         f"{operations() or 'none'}"]
    if not isinstance(args, list):
        return ["error", "TypeError: an operation's args must be a list"]
    try:
        result = fn(*args)
        wire.check_value(result, f"the result of operation {name!r}")
    except Exception as error:  # noqa: BLE001 - the caller's error
        return ["error", error_text(error, tail=True)]
    return ["ok", result]


register("call", _call_operation)


def _run(caller: Caller, body: bytes, buffers: Any) -> Reply:
    try:
        request = wire.decode(body, buffers, request_limits(caller))
    except wire.TooLarge as error:
        _gate.refuse("too large", f"a request of job {caller.job} past its limits ({error})")
        return ["error", f"MemoryError: request too large, refused before it was decoded: "
                         f"{error}"]
    except wire.WireError as error:
        _gate.refuse("malformed", f"a request whose body does not decode ({error})")
        return ["error", f"malformed request: {error}"]
    if type(request) is not dict:
        return ["error", "malformed request: not a dict"]
    op = request.get("op")
    with _lock:
        handler = _handlers.get(op) if isinstance(op, str) else None
    if handler is None:
        return ["error", f"LookupError: unknown operation {op!r:.60}"]
    try:
        reply = handler(caller, request)
    except Exception as error:  # noqa: BLE001 - a request must never harm the server
        return ["error", error_text(error, tail=True)]
    return reply


def serve(frame: Frame, me: str) -> Frame:
    """The reply to ``frame``, a request to the server named ``me`` (see the
    module docstring)."""
    try:
        caller, body, buffers, secret = _gate.open(frame, me)
    except Refused as refused:
        return refusal_frame(refused.reason)
    except Exception:  # noqa: BLE001 - never: but an engine thread must get a frame
        _log.exception("authenticating a request failed")
        return refusal_frame("malformed")
    reply = _run(caller, body, buffers)
    message: Dict[str, Any] = {"reply": reply, "refused": _gate.refused_total()}
    try:
        out, out_buffers = wire.encode(message)
    except wire.WireTypeError as error:
        message["reply"] = ["error", f"the reply cannot travel: {error}"]
        out, out_buffers = wire.encode(message)
    return _gate.seal_reply(secret, caller, me, out, out_buffers, boot=_gate.boot)

