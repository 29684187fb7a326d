"""What the wire and its authentication cost per pass, against pickle.

Why: every message of remote experts is now encoded as a schema (msgpack and
raw tensor buffers, :mod:`moe_autograd.remote.wire`) and sealed with
GMAC (:mod:`moe_autograd.remote.auth`; AES-256-GCM
where the job encrypts), where it used to be pickled
(with torch's tensor reducers on Ray; TensorPipe on RPC). These rows time
the CPU both ends spend on that, without any engine, so the engines' own
costs (TensorPipe's, Ray's) do not hide it:

* ``wire/pass-vs-pickle``: the messages of one ``MixtureOfExperts`` training
  step with 16 remote experts on 2 servers (per server: a forward request of
  8 calls, its reply, a backward request, its reply; 32 x 64 float32 per
  tensor), encoded and sealed on the sending side and opened and decoded on
  the receiving side, against ``pickle.dumps`` + ``pickle.loads`` of the same
  messages in the old format (tuples, tensors pickled by torch).
* ``wire/pass-auth-share``: the same pass, ours against the codec alone (no
  MAC, no replay window): what authentication adds.
* ``wire/32MiB-vs-pickle``: one request carrying a 32 MiB float32 tensor
  (an activation of 4,096 x 2,048): GMAC over it (about 21 GB/s here),
  twice (seal, open). HMAC-SHA256 (1.5 GB/s) dominated it before issue 47.
* ``wire/32MiB-encrypted-vs-plain``: the same request sealed and opened by a
  job that encrypts (AES-256-GCM into a new buffer of huge pages at seal,
  and in place at open: the receiver's buffers are its own, as torch RPC
  hands them over; Ray's arrive read-only and are decrypted into a new
  buffer) against one that does not (GMAC, the tensor's own buffer):
  what encryption costs.
"""
import pickle
import secrets
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from ..remote import wire
from ..remote.auth import Gate, JobSecret, Session
from .measure import Plan, Row, compare, measure

__all__ = ["run", "bench_wire"]

SERVERS, CALLS, TOKENS, WIDTH = 2, 8, 32, 64


def _messages() -> List[Tuple[str, Any, Any]]:
    """``(kind, new message, old message)`` of one pass, per server."""
    out = []
    for _ in range(SERVERS):
        xs = [torch.randn(TOKENS, WIDTH) for _ in range(CALLS)]
        ids = [secrets.token_hex(16) for _ in range(CALLS)]
        forward = {"op": "batch", "batch": secrets.token_hex(16), "jobs": [
            {"op": "forward", "expert": f"e{k}", "call": ids[k], "seed": 12345 + k, "grad": True,
             "flags": [True], "args": [xs[k]], "answer_by": 5.0} for k in range(CALLS)]}
        old_forward = ("owner", secrets.token_hex(16), [
            ("forward", (f"e{k}", "owner", ids[k], 12345 + k, True, [True], (xs[k],)), 5.0)
            for k in range(CALLS)])
        ys = [torch.randn(TOKENS, WIDTH) for _ in range(CALLS)]
        reply = {"reply": ["ok", [[["ok", [[y], True, [True], "stateless"]] for y in ys], False]],
                 "refused": 0}
        old_reply = ("ok", ([("ok", ([y], True, [True], "stateless")) for y in ys], False))
        gs = [torch.randn(TOKENS, WIDTH) for _ in range(CALLS)]
        backward = {"op": "batch", "batch": secrets.token_hex(16), "jobs": [
            {"op": "backward", "expert": f"e{k}", "call": ids[k], "seed": 12345 + k,
             "flags": [True], "args": [xs[k]], "grads": [gs[k]], "answer_by": 5.0}
            for k in range(CALLS)]}
        old_backward = ("owner", secrets.token_hex(16), [
            ("backward", (f"e{k}", "owner", ids[k], 12345 + k, (xs[k],), [True], [gs[k]]), 5.0)
            for k in range(CALLS)])
        dxs = [torch.randn(TOKENS, WIDTH) for _ in range(CALLS)]
        back_reply = {"reply": ["ok", [[["ok", [[dx], None]] for dx in dxs], False]], "refused": 0}
        old_back_reply = ("ok", ([("ok", ([dx], None)) for dx in dxs], False))
        out += [("request", forward, old_forward), ("reply", reply, old_reply),
                ("request", backward, old_backward), ("reply", back_reply, old_back_reply)]
    return out


def _sealed_pass(messages: List[Tuple[str, Any, Any]], authenticate: bool,
                 encrypt: bool = False) -> Callable[[], None]:
    secret = JobSecret.generate(encrypt=encrypt)
    session = Session(secret)
    gate = Gate(started=time.time() - 1.0)  # (a request of its first ms is newer)
    gate.admit([secret])

    def step() -> None:
        for kind, message, _ in messages:
            body, buffers = wire.encode(message)
            if not authenticate:
                wire.decode(body, buffers)
                continue
            if kind == "request":
                frame, _ = session.seal("srv", body, buffers)
                frame.owned = True  # (as torch RPC hands a receiver its own buffers)
                caller, got, got_buffers, used = gate.open(frame, "srv")
                wire.decode(got, got_buffers)
                last = (caller, used)
            else:
                caller, used = last
                frame = Gate.seal_reply(used, caller, "srv", body, buffers)
                frame.owned = True
                got, got_buffers = session.open_reply("srv", caller.seq, frame)
                wire.decode(got, got_buffers)
    return step


def _pickled(messages: List[Any]) -> Callable[[], None]:
    def step() -> None:
        for message in messages:
            pickle.loads(pickle.dumps(message, protocol=5))
    return step


def bench_wire(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=5, reps=30, inner=5), Plan(warmup=2, reps=5, inner=2))
    big_plan = Plan.pick(quick, Plan(warmup=2, reps=15), Plan(warmup=1, reps=3))
    torch.manual_seed(0)
    messages = _messages()
    shape = (f"{SERVERS} servers x {CALLS} calls, fwd + bwd requests and replies, "
             f"{TOKENS}x{WIDTH} float32 tensors")
    samples = measure({"ours": _sealed_pass(messages, True),
                       "codec": _sealed_pass(messages, False),
                       "pickle": _pickled([old for _, _, old in messages])},
                      plan.reps, plan.warmup, plan.inner)
    rows = [compare("wire/pass-vs-pickle", samples, "pickle", "ours", 1.0,
                    f"encode + seal + open + decode of one pass ({shape}) vs pickle dumps + "
                    "loads of the old messages (torch's tensor reducers)"),
            compare("wire/pass-auth-share", samples, "codec", "ours", 1.3,
                    "the same pass, ours vs the codec alone: GMAC over "
                    "header, body and buffers, the replay window, the reply's binding")]
    big = torch.randn(4096, 2048)
    message = {"op": "forward", "expert": "e", "call": "c" * 32, "seed": 1, "grad": True,
               "flags": [True], "args": [big]}
    old = ("e", "owner", "c" * 32, 1, True, [True], (big,))
    big_request = [("request", message, old)]
    samples = measure({"ours": _sealed_pass(big_request, True),
                       "encrypted": _sealed_pass(big_request, True, encrypt=True),
                       "pickle": _pickled([old])}, big_plan.reps, big_plan.warmup)
    rows.append(compare("wire/32MiB-vs-pickle", samples, "pickle", "ours", 0.15,
                        "one request with a 4096x2048 float32 tensor (32 MiB): GMAC over "
                        "it at seal and open; pickle copies the bytes once each way"))
    rows.append(compare("wire/32MiB-encrypted-vs-plain", samples, "ours", "encrypted", 2.0,
                        "the same request, its job encrypting (AES-256-GCM into a new buffer "
                        "of huge pages at seal, in place into the receiver's own at open) vs not "
                        "(GMAC over the tensor's own bytes)"))
    return rows


def run(quick: bool) -> List[Dict[str, Any]]:
    return [{"name": r.name, "baseline_ms": r.baseline, "ours_ms": r.ours, "ratio": r.ratio,
             "goal": r.goal, "note": r.note} for r in bench_wire(quick)]
