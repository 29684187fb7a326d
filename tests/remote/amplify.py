"""Amplifying requests (issue 45, item 4), and the server's peak memory
around each (not a test module: ``test_remote_limits.py`` imports it, and
runs it as a script in a fresh process to measure).

Each request is a member's (sealed with the job's secret), crafted on the
wire as a hostile member would, against an in-process server
(:class:`~moe_autograd.remote.loopback.InProcess`) whose
``max_request_bytes`` is :data:`LIMIT`:

* ``int8``: one compressed tensor (int8 codec) declaring float64 elements:
  :data:`INT8_PAYLOAD` bytes of payload that decode to 8 times as many;
* ``maps``: a 16 MiB body of empty maps (the size the issue measured);
* ``maps_within``: as many empty maps as fit the body's bound for this job;
* ``lists_within``: the same with empty lists;
* ``nested``: lists nested 1,000 deep (msgpack's own stack allows 1,024).

``python amplify.py KIND...`` prints one JSON line per kind: the bytes that
arrived, the growth of the process's peak resident memory (``VmHWM``, reset
through ``/proc/self/clear_refs`` before each request) over what it held
before the request, the reply's text, and whether a step afterwards is
exact against a local copy. It crafts with msgpack and the sealing of
:class:`~moe_autograd.remote.auth.Session` only, so it measures an older
checkout of the package too (``PYTHONPATH=<old checkout>``).
"""
import json
import math
import struct
import sys
from typing import Any, Dict, List, Tuple

import msgpack
import torch
from torch import nn

from moe_autograd.remote import ExpertServer, RemoteExpert, wire
from moe_autograd.remote.auth import Session
from moe_autograd.remote.frame import Frame
from wiring import SECRET, InProcess

HERE = "amp-srv"
EXPERT = "amp_lin"
WIDTH = 8
MiB = 1 << 20
LIMIT = 16 * MiB             # the server's max_request_bytes
INT8_PAYLOAD = 8 * MiB       # int8 elements of the compressed request
BODY_OF_MAPS = 16 * MiB      # the body of empty maps
KINDS = ("int8", "maps", "maps_within", "lists_within", "nested")
_FLOAT64 = list(wire.DTYPES).index("float64")
_INT8_CODEC, _BLOCK = 3, 64


def _call(args: Any) -> Dict[str, Any]:
    return {"op": "forward", "expert": EXPERT, "call": "c" * 32, "seed": 0, "grad": False,
            "flags": [False], "args": args, "answer_by": None}


def _array(n: int, item: bytes) -> bytes:
    """The msgpack of a list of ``n`` copies of the msgpack value ``item``."""
    return b"\xdd" + struct.pack(">I", n) + item * n


def _body_within() -> int:
    """The longest body this server's job may send (``LIMIT // BODY_SHARE``,
    at least 1 MiB: ``wire.Limits.for_budget``)."""
    return max(1 * MiB, LIMIT // 32)


def request(kind: str) -> Tuple[bytes, List[bytes]]:
    """The body and buffers of one amplifying request (see the module docstring)."""
    if kind == "int8":
        n = INT8_PAYLOAD
        descriptor = struct.pack("<IIBBBBIQ", 0, 1, _INT8_CODEC, _FLOAT64, 0, 1, _BLOCK, n)
        body = msgpack.packb(_call([msgpack.ExtType(3, descriptor)]), use_bin_type=True)
        return body, [bytes(n), bytes(4 * math.ceil(n / _BLOCK))]  # zeros: a valid payload
    head = msgpack.packb(_call([None]), use_bin_type=True)
    prefix, suffix = head.split(b"\x91\xc0")  # the args' list, to fill with the crafted value
    prefix += b"\x91"
    room = _body_within() - len(prefix) - len(suffix) - 5
    if kind == "maps":
        value = _array(BODY_OF_MAPS, b"\x80")
    elif kind == "maps_within":
        value = _array(room, b"\x80")
    elif kind == "lists_within":
        value = _array(room, b"\x90")
    elif kind == "nested":
        value = b"\x91" * 1000 + b"\xc0"
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    return prefix + value + suffix, []


def send(kind: str, session: Session) -> str:
    """The reply's text to request ``kind`` (the whole wire, this process's endpoint)."""
    return _answer(kind, session, *session.seal(HERE, *request(kind)))


def _answer(kind: str, session: Session, frame: Frame, seq: int) -> str:
    reply = InProcess("amp-client").call(HERE, frame, 60.0).result(60.0)
    out, out_buffers = session.open_reply(HERE, seq, reply)
    status, text = wire.decode(out, out_buffers)["reply"]
    assert status == "error", (kind, status)
    return str(text)


def serve() -> Tuple[ExpertServer, nn.Linear]:
    module = nn.Linear(WIDTH, WIDTH)
    return ExpertServer({EXPERT: module}, max_request_bytes=LIMIT,
                        transport=InProcess(HERE)), module


def step_is_exact(module: nn.Linear) -> bool:
    """A forward and backward through the server equal a local copy's, bit for bit."""
    expert = RemoteExpert(HERE, EXPERT, transport=InProcess("amp-client"))
    local = nn.Linear(WIDTH, WIDTH)
    local.load_state_dict(module.state_dict())
    module.zero_grad()
    x = torch.randn(3, WIDTH, requires_grad=True)
    lx = x.detach().clone().requires_grad_()
    y, ly = expert(x), local(lx)
    y.square().sum().backward()
    ly.square().sum().backward()
    return bool(torch.equal(y.detach(), ly.detach()) and torch.equal(x.grad, lx.grad)
                and torch.equal(module.weight.grad, local.weight.grad))


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(field)


def measure(kind: str, session: Session) -> Dict[str, Any]:
    """Request ``kind``'s reply and the peak memory it took (see the module docstring)."""
    body, buffers = request(kind)  # made and sealed before: the client's side is not counted
    received = len(body) + sum(len(b) for b in buffers)
    frame, seq = session.seal(HERE, body, buffers)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    text = _answer(kind, session, frame, seq)
    return {"kind": kind, "received": received, "peak": _status("VmHWM") - before,
            "reply": text[:300]}


def main(kinds: List[str]) -> None:
    server, module = serve()
    try:
        session = Session(SECRET)
        assert step_is_exact(module)  # warm: the paths of a call are loaded
        for kind in kinds:
            result = measure(kind, session)
            result["exact_after"] = step_is_exact(module)
            print(json.dumps(result), flush=True)
    finally:
        server.close()


if __name__ == "__main__":
    main(sys.argv[1:] or list(KINDS))
