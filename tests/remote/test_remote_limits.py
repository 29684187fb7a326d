"""Server byte limits bound whole requests and see every tensor (issue 18,
items 3 and 4).

* ``max_request_bytes`` bounds a coalesced request, not each call in it: the
  calls to one server are admitted in order while what they materialise fits
  together, the others are refused before they run. Each call counts what IT
  materialises: a tensor that several calls of one request share (it travels
  once) counts once per call, and a stride-0 expanded tensor at its full size.
* Every tensor reachable in a call's arguments is counted, however nested
  (lists, tuples and dicts, the wire's containers), against
  ``max_request_bytes`` and, for a stateful call, against ``max_state_bytes``;
  anything else cannot travel at all (refused before it is sent).

The servers live in this process: either their handlers are called directly
with an authenticated caller (``wiring.caller()``; what the endpoint runs on a
server's thread), or requests go through the whole wire to this process's own
endpoint (``wiring.InProcess``): no RPC world.
"""
import json
import logging
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from torch import Tensor, nn

import amplify
from moe_autograd.remote import ExpertServer, RemoteExpert, RemoteExpertError, sizes, wire
from moe_autograd.remote import auth, batch_server, compression, security_stats
from moe_autograd.remote.auth import Session
from moe_autograd.remote.batch_server import _batch_op, _collect_op, kept_batches
from moe_autograd.remote.server import run_job
from moe_autograd.remote.sizes import Tally, materialised_bytes
from wiring import SECRET, InProcess, ask, caller

pytestmark = pytest.mark.timeout(60)
WIDTH = 8
MiB = 1 << 20
HERE = "here"  # the worker name the in-process transport serves as


class CountingLinear(nn.Module):
    """A linear map that counts its calls and takes an optional extra argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self._lock = threading.Lock()

    def forward(self, x: Tensor, extra: Any = None) -> Tensor:
        with self._lock:
            self.calls += 1
        return self.lin(x[:4])


def stride0(nbytes: int) -> Tensor:
    """A float32 tensor of ``nbytes`` once materialised, 32 bytes on the wire."""
    return torch.zeros(1, WIDTH).expand(nbytes // (4 * WIDTH), WIDTH)


class _Recording(InProcess):
    """The in-process transport, noting each frame it carries in ``sent``."""

    def __init__(self, sent: List[str]) -> None:
        super().__init__(HERE)
        self.sent = sent

    def call(self, worker: str, frame: Any, timeout: Any) -> Any:
        self.sent.append(frame.label)
        return super().call(worker, frame, timeout)


@pytest.fixture
def limited() -> Iterator[Tuple[CountingLinear, CountingLinear]]:
    a, b = CountingLinear(), CountingLinear()
    transport = InProcess(HERE)
    servers = [ExpertServer({"lim_a": a}, max_request_bytes=1 * MiB, transport=transport),
               ExpertServer({"lim_b": b}, max_request_bytes=None, transport=transport)]
    try:
        yield a, b
    finally:
        for server in servers:
            server.close()


def _job(name: str, k: int, x: Tensor) -> Dict[str, Any]:
    return {"op": "forward", "expert": name, "call": f"call-{name}-{k}", "seed": 0,
            "grad": True, "flags": [False], "args": [x], "answer_by": None}


def _batch(batch_id: str, jobs: List[Any]) -> List[Any]:
    """Every answer of a coalesced request (collecting the rest as a client would)."""
    me = caller()
    status, (answers, more) = _batch_op(me, {"op": "batch", "batch": batch_id, "jobs": jobs})
    assert status == "ok", answers
    while more:
        status, (rest, more) = _collect_op(me, {"op": "collect", "batch": batch_id})
        assert status == "ok", rest
        answers = [a if a is not None else r for a, r in zip(answers, rest)]
    return answers


def test_request_limit_bounds_the_whole_coalesced_request(limited: Any) -> None:
    a, b = limited
    # Four calls of 0.75 MiB each (each under the 1 MiB limit; 3 MiB together).
    jobs = [_job("lim_a", k, stride0(3 * MiB // 4)) for k in range(4)]
    answers = _batch("batch-limit-1", jobs)
    assert answers[0][0] == "ok", answers[0]
    for answer in answers[1:]:
        assert answer[0] == "error", answer
        assert "max_request_bytes=1048576" in answer[1] and "whole request" in answer[1], answer
        assert "'lim_a'" in answer[1]
    assert a.calls == 1  # the refused calls never ran

    # Calls to another server of the same request have their own budget; a
    # tensor two calls share counts for both (0.5 MiB together here); a later,
    # smaller call that fits is admitted after one that did not fit.
    a.calls = 0
    shared = stride0(MiB // 4)
    jobs = [_job("lim_a", 10, shared), _job("lim_a", 11, shared), _job("lim_a", 12, stride0(MiB)),
            _job("lim_b", 13, stride0(8 * MiB)), _job("lim_a", 14, torch.randn(4, WIDTH))]
    answers = _batch("batch-limit-2", jobs)
    assert [answer[0] for answer in answers] == ["ok", "ok", "error", "ok", "ok"], answers
    assert f"with the {MiB // 2} bytes of the calls admitted before it" in answers[2][1], answers[2]
    assert a.calls == 3 and b.calls == 1


def test_a_tensor_shared_by_jobs_counts_for_each_job(limited: Any) -> None:
    """One tensor travels once (and arrives as one object) however many jobs
    of a request use it, but every job materialises it: it counts for each."""
    a, _ = limited
    shared = stride0(5 * MiB // 8)  # 0.625 MiB expanded: fits 1 MiB once, not twice
    message = {"op": "batch", "batch": "batch-shared",
               "jobs": [_job("lim_a", 20 + k, shared) for k in range(4)]}
    _, buffers = wire.encode(message)
    assert [wire.tensor_nbytes(t) for t in buffers] == [4 * WIDTH]  # once, 32 bytes on the wire
    status, (answers, more) = ask(HERE, message, InProcess(HERE))  # the whole wire
    assert status == "ok" and not more, answers
    assert answers[0][0] == "ok", answers[0]
    for answer in answers[1:]:
        assert answer[0] == "error", answer
        assert answer[1].startswith("MemoryError: forward request of expert 'lim_a' carries "
                                    f"{5 * MiB // 8} bytes"), answer[1]
        assert "max_request_bytes=1048576" in answer[1], answer[1]
        assert "a tensor several calls share counts for each" in answer[1], answer[1]
    assert a.calls == 1  # nothing ran for the refused jobs
    # The same jobs in requests of their own are each admitted.
    for k in range(2):
        status, value = run_job(caller(), _job("lim_a", 30 + k, shared))
        assert status == "ok", value
    assert a.calls == 3


@dataclass
class Holder:
    payload: Any


class Slotted:
    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner


def _nestings(t: Tensor) -> List[Any]:
    return [
        [[[[[t]]]]],                                   # five levels of lists
        {"a": {"b": {"c": {"d": {"e": (t,)}}}}},       # dicts in dicts, a tuple at the end
        ((((t,),),),),                                 # tuples in tuples
        {"k": [{"inner": [t]}]},                       # lists in dicts in lists
        [{"deep": [[{"t": t}]]}, (None, 1.5, "s")],    # mixed, with other wire values
    ]


NESTINGS = ["lists", "dicts", "tuples", "dict-list", "mixed"]


@pytest.mark.parametrize("k", range(len(NESTINGS)), ids=NESTINGS)
def test_nested_tensors_count_against_the_request_limit(limited: Any, k: int) -> None:
    a, _ = limited
    extra = _nestings(stride0(4 * MiB))[k]
    expert = RemoteExpert(HERE, "lim_a", transport=InProcess(HERE))
    with pytest.raises(RemoteExpertError, match="max_request_bytes=1048576") as info:
        expert(torch.randn(4, WIDTH), extra)  # through the wire: nested as sent
    assert str(4 * MiB + 4 * WIDTH * 4) in str(info.value), info.value  # counted in full, with x
    assert a.calls == 0
    assert expert(torch.randn(4, WIDTH), _nestings(torch.zeros(16))[k]).shape == (4, WIDTH)


@pytest.mark.parametrize("extra", [
    SimpleNamespace(x=SimpleNamespace(y=[torch.zeros(4)])),     # namespaces
    Holder(payload={"k": [Holder(payload=torch.zeros(4))]}),    # dataclasses
    Slotted(Slotted([torch.zeros(4)])),                         # __slots__
    [deque([torch.zeros(4)])],                                  # a deque in a list
    {("key", 1): [torch.zeros(4)]},                             # a dict with a non-str key
], ids=["namespace", "dataclass", "slots", "deque", "tuple-key"])
def test_arguments_that_cannot_travel_are_refused_before_sending(limited: Any,
                                                                 extra: Any) -> None:
    """Where the old pickled arguments could hide a tensor in any object, the
    wire carries only its schema: anything else is refused by the client,
    naming where it is, and never reaches a server."""
    a, _ = limited
    sent: List[str] = []
    expert = RemoteExpert(HERE, "lim_a", transport=_Recording(sent))
    with pytest.raises(TypeError, match="argument list\\[1\\].*(cannot travel|keys must be str)"):
        expert(torch.randn(4, WIDTH), extra)
    assert sent == [] and a.calls == 0


@pytest.mark.parametrize("args,refusal", [
    ((torch.empty(2 ** 40, WIDTH, device="meta"),),             # 2**40 rows: no allocation
     "argument list[0] is a meta tensor: it has no data to send"),
    ((torch.empty(2, WIDTH, device="meta"),),
     "argument list[0] is a meta tensor: it has no data to send"),
    ((torch.randn(4, WIDTH), 2 ** 80),                          # a seed beyond 64 bits
     f"argument list[1] is an int outside 64 bits ({2 ** 80})"),
    ((torch.randn(4, WIDTH), [-(2 ** 63) - 1]),
     f"argument list[1][0] is an int outside 64 bits ({-(2 ** 63) - 1})"),
], ids=["huge-meta", "meta", "int-2**80", "nested-int"])
def test_bad_arguments_are_refused_by_name_before_any_copy_or_send(limited: Any, args: Any,
                                                                   refusal: str) -> None:
    """Issue 43: a meta tensor was copied to the CPU before it was checked (a
    35 TB allocation for 2**40 x 8, NotImplementedError for a small one). A
    TypeError names the call and the argument, and nothing is sent."""
    a, _ = limited
    sent: List[str] = []
    expert = RemoteExpert(HERE, "lim_a", transport=_Recording(sent))
    with pytest.raises(TypeError) as info:
        expert(*args)
    assert str(info.value) == f"the arguments of forward of expert 'lim_a' on worker {HERE!r}: " \
        f"{refusal}"
    assert sent == [] and a.calls == 0


def test_an_int_beyond_64_bits_is_refused_by_its_range_by_the_encoder() -> None:
    """Values that reach the encoder without check_value (a message of our
    own): the range is named, not the type."""
    with pytest.raises(TypeError, match=r"^an int outside 64 bits \(1208925819614629174706176\) "
                       r"cannot travel: the wire carries ints from -9223372036854775808 to "
                       r"9223372036854775807$"):
        wire.encode({"seed": 2 ** 80})


@pytest.mark.parametrize("k", range(len(NESTINGS)), ids=NESTINGS)
def test_nested_tensors_count_against_the_state_limit(k: int) -> None:
    module = CountingLinear()
    server = ExpertServer({f"lim_state_{k}": module}, backward="stateful",
                          max_request_bytes=None, max_state_bytes=2 * MiB,
                          transport=InProcess(HERE))
    me = caller()
    try:
        big = torch.zeros(4 * MiB // 4)  # a real 4 MiB tensor, held by the state
        x = torch.randn(4, WIDTH, requires_grad=True)

        def forward(call: str, extra: Any) -> List[Any]:
            return run_job(me, {"op": "forward", "expert": f"lim_state_{k}", "call": call,
                                "seed": 0, "grad": True, "flags": [True, False],
                                "args": [x, extra]})
        status, text = forward(f"state-{k}", _nestings(big)[k])
        assert status == "error" and "max_state_bytes=2097152" in text, text
        assert server.stats()["live"] == 0 and server.stats()["bytes"] == 0
        status, value = forward(f"state-ok-{k}", _nestings(torch.zeros(16))[k])
        assert status == "ok", value
        stats = server.stats()
        assert stats["live"] == 1
        assert stats["bytes"] == 4 * WIDTH * 4 + 16 * 4 + 4 * WIDTH * 4  # x, nested, output
    finally:
        server.close()


def test_tally_counts_each_tensor_once_and_bounds_its_walk(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    t = torch.zeros(10)
    assert materialised_bytes([t, {"again": t}, (t, t.view(2, 5))]) == 80
    assert materialised_bytes(t.expand(4, 10)) == 160  # stride 0: at full size
    tally = Tally()
    assert tally.add([t]) == 40 and tally.add({"t": t}) == 0 and tally.total == 40
    assert tally.add(torch.zeros(100), limit=100) is None and tally.total == 40  # refused: as was
    assert tally.add(torch.zeros(10), limit=100) == 40 and tally.total == 80
    # One tally per job: the jobs of a request that share t count it each.
    assert [Tally().add([t], [t]) for _ in range(3)] == [40, 40, 40]
    monkeypatch.setattr(sizes, "MAX_OBJECTS", 1000)  # (1 << 20 by default)
    wide = [[] for _ in range(1001)]
    with pytest.raises(ValueError, match="more than 1000 objects"):
        materialised_bytes(wide)
    assert materialised_bytes([[] for _ in range(999)]) == 0
    # A cycle cannot arrive (the wire has no references), and cannot hang the
    # walk either: it ends past MAX_OBJECTS, refused.
    loop: List[Any] = [t]
    loop.append(loop)
    with pytest.raises(ValueError, match="more than 1000 objects"):
        materialised_bytes(loop)


# -- what a batch's request may name, and what a server keeps of it ---------------------------

class Gated(nn.Module):
    """Doubles its input once the test opens gate ``k`` (its second argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.gates = [threading.Event() for _ in range(8)]

    def forward(self, x: Tensor, k: int) -> Tensor:
        assert self.gates[k].wait(20), f"gate {k} never opened"
        return x * 2


@pytest.fixture
def gated() -> Iterator[Gated]:
    expert = Gated()
    server = ExpertServer({"gate": expert}, transport=InProcess(HERE))
    try:
        yield expert
    finally:
        for gate in expert.gates:
            gate.set()
        server.close()


def _gated_job(k: int, answer_by: Any = None) -> Dict[str, Any]:
    return {"op": "forward", "expert": "gate", "call": f"call-gate-{k}", "seed": 0,
            "grad": False, "flags": [False, False], "args": [torch.ones(2), k],
            "answer_by": answer_by}


def _answered(reply: List[Any]) -> Tuple[List[int], bool]:
    """Which jobs a batch or collect reply answers, and its ``more``."""
    status, (answers, more) = reply
    assert status == "ok", answers
    return [k for k, a in enumerate(answers) if a is not None], more


def test_a_batch_id_must_be_a_short_non_empty_string(gated: Gated) -> None:
    """batch and collect refuse, word for word, an id that is not a str of 1
    to 256 characters, and accept both ends of that range."""
    gated.gates[0].set()
    me = caller()
    for bad in [None, 5, "", "x" * 257]:
        want = ["error", "TypeError: batch id must be a non-empty str of at most 256 "
                f"characters, got {bad!r:.80}"]
        assert _batch_op(me, {"op": "batch", "batch": bad, "jobs": [_gated_job(0)]}) == want
        assert _collect_op(me, {"op": "collect", "batch": bad}) == want
    for good in ["a", "x" * 256]:
        assert _answered(_batch_op(me, {"op": "batch", "batch": good,
                                        "jobs": [_gated_job(0)]})) == ([0], False)


def test_a_malformed_batch_request_is_refused_word_for_word_and_the_next_one_served(
        gated: Gated, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs that are not a list of 1 to MAX_JOBS dicts, and a batch id the
    client still uses, are refused as a whole, naming what is wrong; the
    same id from another client is its own."""
    monkeypatch.setattr(batch_server, "MAX_JOBS", 3)
    gated.gates[0].set()
    me, other = caller(), caller(session=b"o" * 16)
    for jobs, got in [(None, "NoneType"), ([], "list"), ([_gated_job(0)] * 4, "list")]:
        assert _batch_op(me, {"op": "batch", "batch": "malformed", "jobs": jobs}) == [
            "error", f"TypeError: jobs must be a list of 1 to 3 jobs, got {got}"]
    assert _batch_op(me, {"op": "batch", "batch": "malformed", "jobs": [_gated_job(0), 5]}) == [
        "error", "TypeError: a job must be a dict, got int"]
    assert _answered(_batch_op(me, {"op": "batch", "batch": "three",
                                    "jobs": [_gated_job(0)] * 3})) == ([0, 1, 2], False)
    assert _answered(_batch_op(me, {"op": "batch", "batch": "in-use",
                                    "jobs": [_gated_job(0), _gated_job(1)]})) == ([0], True)
    assert _batch_op(me, {"op": "batch", "batch": "in-use", "jobs": [_gated_job(0)]}) == [
        "error", "ValueError: batch id 'in-use' is in use: batch ids must be unique"]
    assert _answered(_batch_op(other, {"op": "batch", "batch": "in-use",
                                       "jobs": [_gated_job(0)]})) == ([0], False)
    gated.gates[1].set()
    assert _answered(_collect_op(me, {"op": "collect", "batch": "in-use"})) == ([1], False)


def test_a_jobs_answer_by_must_be_none_or_positive_seconds(gated: Gated) -> None:
    """answer_by: None or a positive finite number of seconds (not a bool,
    not a string), refused word for word otherwise."""
    gated.gates[0].set()
    me = caller()
    for bad in [True, 0, -1.0, float("inf"), float("nan"), "1"]:
        assert _batch_op(me, {"op": "batch", "batch": "bad-by",
                              "jobs": [_gated_job(0, answer_by=bad)]}) == [
            "error", f"TypeError: a job's answer_by must be None or positive seconds, got {bad!r}"]
    for k, good in enumerate([None, 30, 30.5]):
        assert _answered(_batch_op(me, {"op": "batch", "batch": f"good-by-{k}",
                                        "jobs": [_gated_job(0, answer_by=good)]})) == ([0], False)


def test_a_batch_is_kept_until_its_last_answer_is_collected(gated: Gated) -> None:
    """A partly answered batch stays collectable by its owner, one new answer
    per collect, for as long as some job runs (with or without an
    answer_by), and is forgotten once every answer went."""
    me = caller()
    before = kept_batches()  # (other tests' batches, if any)
    for answer_by in [None, 30.0]:
        for gate in gated.gates:
            gate.clear()
        gated.gates[0].set()
        batch = f"kept-{answer_by}"
        jobs = [_gated_job(k, answer_by) for k in range(3)]
        assert _answered(_batch_op(me, {"op": "batch", "batch": batch, "jobs": jobs})) == (
            [0], True)
        gated.gates[1].set()
        assert _answered(_collect_op(me, {"op": "collect", "batch": batch})) == ([1], True)
        assert kept_batches() == before + 1
        gated.gates[2].set()
        assert _answered(_collect_op(me, {"op": "collect", "batch": batch})) == ([2], False)
        assert kept_batches() == before
        assert _collect_op(me, {"op": "collect", "batch": batch}) == [
            "error", f"LookupError: unknown batch {batch!r} of this client (answered already, "
            "or dropped after 60 s without a collect)"]


def test_a_client_keeps_a_bounded_number_of_batches_and_never_drops_anothers(
        gated: Gated, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_KEPT_PER_OWNER kept batches, the owner's oldest is dropped;
    another client's are kept, and collected by that client only."""
    monkeypatch.setattr(batch_server, "MAX_KEPT_PER_OWNER", 2)
    gated.gates[0].set()
    mine, theirs = caller(), caller(session=b"t" * 16)
    before = kept_batches()  # (other tests' batches, if any)
    assert _answered(_batch_op(theirs, {"op": "batch", "batch": "b-0",
                                        "jobs": [_gated_job(0), _gated_job(4)]})) == ([0], True)
    for n in range(3):
        assert _answered(_batch_op(mine, {"op": "batch", "batch": f"b-{n}",
                                          "jobs": [_gated_job(0), _gated_job(1 + n)]})) == (
            [0], True)
    assert kept_batches() == before + 3  # two of mine, one of theirs
    assert _collect_op(mine, {"op": "collect", "batch": "b-0"})[0] == "error"  # my oldest: dropped
    for n in (1, 2):
        gated.gates[1 + n].set()
        assert _answered(_collect_op(mine, {"op": "collect", "batch": f"b-{n}"})) == ([1], False)
    gated.gates[4].set()
    assert _answered(_collect_op(theirs, {"op": "collect", "batch": "b-0"})) == ([1], False)
    assert kept_batches() == before


# -- limits before work (issue 45, item 4): amplifying requests ---------------------------------
@pytest.mark.parametrize("kind, says", [
    ("int8", "compressed tensor 0 (torch.float64, shape [8388608]) takes 67108864 bytes once "
             "decoded; with the 0 bytes of the compressed tensors before it, more than the "
             "16777216 bytes this request may declare"),
    ("maps", "a body of 16777324 bytes, more than the 1048576 bytes this request's body may take"),
    ("maps_within", "a body holding more than 132096 lists, tuples and dicts (at most 1024 and "
                    "one per 8 bytes of body)"),
    ("lists_within", "a body holding more than 132096 lists, tuples and dicts"),
    ("nested", f"lists, tuples and dicts nested more than {wire.MAX_BODY_DEPTH} deep"),
])
def test_amplifying_requests_are_refused_before_decoding_counted_and_logged(
        kind: str, says: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each amplifying request of amplify.py (a member's: sealed with the
    job's secret) is refused before anything of it is decoded, with an
    error naming what was too big and the limit, counted as a "too large"
    refusal and logged; the next step is exact against a local copy."""
    monkeypatch.setattr(auth, "_logged", {})  # (the log's rate limit: each test logs)
    monkeypatch.setattr(compression, "decompress",
                        lambda *a: pytest.fail("a compressed tensor decoded before admitted"))
    server, module = amplify.serve()
    try:
        before = security_stats()["refused"].get("too large", 0)
        with caplog.at_level(logging.WARNING, logger="moe_autograd.remote.auth"):
            text = amplify.send(kind, Session(SECRET))
        assert text.startswith("MemoryError: request too large, refused before it was decoded: "
                               + says), text
        assert security_stats()["refused"]["too large"] == before + 1
        assert any("(too large); nothing of it was used or run" in r.getMessage()
                   and says[:40] in r.getMessage() for r in caplog.records), caplog.text
        monkeypatch.undo()
        assert amplify.step_is_exact(module)
    finally:
        server.close()


@pytest.mark.timeout(240)
def test_amplifying_requests_keep_the_servers_peak_memory_bounded() -> None:
    """The server's peak resident memory (VmHWM, in a fresh process) over
    each amplifying request is at most the bytes that arrived, plus 10 times
    the body's bound for its job (1 MiB here), plus 8 MiB. Before issue 45:
    107 MiB for the int8 request (8.5 MiB arrived), 1.3 GB for the 16 MiB
    body of empty maps, 80 MiB for 1 MiB of them. Each is followed by an
    exact step."""
    script = Path(amplify.__file__)
    out = subprocess.run([sys.executable, str(script), *amplify.KINDS], cwd=script.parent,
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["kind"] for r in results] == list(amplify.KINDS), out.stdout
    for result in results:
        assert "request too large, refused before it was decoded" in result["reply"], result
        bound = result["received"] + 10 * amplify._body_within() + 8 * MiB
        assert result["peak"] <= bound, result
        assert result["exact_after"], result


@pytest.mark.timeout(60)
def test_a_member_that_opens_sessions_without_end_locks_no_client_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(issue 45, item 5, end to end) A member opens far more sessions than
    the server keeps windows for, one real call each: a client that was
    calling before, and a new one, are served at once, and the step after
    is exact against a local copy of the expert."""
    from wiring import SECRET

    monkeypatch.setattr(auth, "MAX_SESSIONS", 32)
    torch.manual_seed(0)
    module = nn.Linear(4, 4)
    server = ExpertServer({"lim_sessions": module}, transport=InProcess(HERE))
    try:
        def client() -> RemoteExpert:
            return RemoteExpert(HERE, "lim_sessions", transport=InProcess(HERE), secret=SECRET)
        x = torch.randn(2, 4)
        before = auth.session_for(SECRET)
        client()(x)  # a client calling before the flood
        for _ in range(200):  # a member opening a session per call
            monkeypatch.setitem(auth._sessions, SECRET.key_id, Session(SECRET))
            client()(x)
        for session in (before, Session(SECRET)):  # the earlier client, and a new one
            monkeypatch.setitem(auth._sessions, SECRET.key_id, session)
            xs = x.clone().requires_grad_()
            out = client()(xs)
            local = x.clone().requires_grad_()
            want = module(local)
            assert torch.equal(out, want.detach())
            out.sum().backward()
            want.sum().backward()
            assert torch.equal(xs.grad, local.grad)
    finally:
        server.close()
