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
"""
import logging
import threading
import traceback
from typing import Any, Callable, Dict, List

from . import wire
from .auth import Caller, Gate, Refused, refusal_frame
from .frame import Frame

__all__ = ["serve", "gate", "register", "register_operation", "unregister_operation",
           "operations", "error_text", "Handler", "Reply"]

Reply = List[Any]  # ["ok", value] or ["error", text]
Handler = Callable[[Caller, Dict[str, Any]], Reply]
_log = logging.getLogger(__name__)
_handlers: Dict[str, Handler] = {}
_operations: Dict[str, Callable[..., Any]] = {}
_lock = threading.Lock()
_gate = Gate()


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
        request = wire.decode(body, buffers)
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
    return _gate.seal_reply(secret, caller, me, out, out_buffers)

