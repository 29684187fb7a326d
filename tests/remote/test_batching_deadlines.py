"""Deadlines and failures of coalesced calls (:mod:`moe_autograd.remote.batching`): calls
with different deadlines in ONE message each keep their own, a pass's
deadline (a ``MixtureOfExperts``' ``forward_timeout``) ends a call sooner,
and a call whose deadline passed ends its job, its message and its state
(issue 34: survivors of a mutation run; the straggler tests only checked
that the layer masks). A message that fails, or a reply that is malformed or
an error, fails each of its calls with an error naming it; a map of
``RemoteCall`` coalesces as module calls do.

No timing: the client's clock is a fake (``batching.time`` replaced in that
module only) and the transport a recorder whose reply the test hands in;
the deadline watcher's own entries are far in the future (tens of seconds).
"""
import heapq
import logging
import threading
import time
import types
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import map_with_parallel_backward, parallel_apply
from moe_autograd.autograd import _FunctionCall
from moe_autograd.parallel import finish_calls, start_calls
from moe_autograd.remote import (ExpertServer, RemoteAuthError, RemoteCall, RemoteExpert,
                                 RemoteExpertError, RemoteTimeoutError, batch_server, batching,
                                 flush_releases)
from moe_autograd.remote.batch_server import _Batch
from moe_autograd.remote.batching import COLLECTOR, GRACE_S, Job, RemoteModuleCall, send
from moe_autograd.remote.frame import Frame
from moe_autograd.remote.transport import TransportError, TransportSendError, TransportTimeout
from wiring import InProcess

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


class Held:
    """A pending reply that the test completes."""

    def __init__(self) -> None:
        self.callbacks: List[Any] = []
        self.reply: Any = None

    def done(self) -> bool:
        return self.reply is not None

    def result(self, timeout: Optional[float]) -> Any:
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply

    def add_done_callback(self, fn: Any) -> None:
        self.callbacks.append(fn)

    def answer(self, reply: Any) -> None:
        self.reply = reply
        for fn in self.callbacks:
            fn()


class Recorder:
    """Stands in for the channel: records each message and its timeout."""

    def __init__(self) -> None:
        self.sent: List[Tuple[Dict[str, Any], Optional[float], Held]] = []

    def __call__(self, transport: Any, worker: str, message: Dict[str, Any],
                 timeout: Optional[float], *, secret: Any = None, label: str = "") -> Held:
        held = Held()
        self.sent.append((message, timeout, held))
        return held


class Peer:
    name = "peer"

    def __init__(self, default: Optional[float]) -> None:
        self.default = default

    def default_timeout(self) -> Optional[float]:
        return self.default


@pytest.fixture
def wired(monkeypatch: pytest.MonkeyPatch) -> Tuple[Clock, Recorder]:
    clock, recorder = Clock(), Recorder()
    monkeypatch.setattr(batching, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(batching, "send_request", recorder)
    return clock, recorder


def _jobs(peer: Peer, timeouts: List[Optional[float]], abandoned: List[str]) -> List[Job]:
    def job(name: str, timeout: Optional[float]) -> Job:
        return Job(peer, "w", {"op": "forward", "expert": name}, timeout,
                   where=lambda: f"forward of expert {name!r} on worker 'w'",
                   limit=lambda: "the transport's own timeout",
                   decode=lambda value: value, abandon=lambda: abandoned.append(name))
    return [job(f"e{k}", t) for k, t in enumerate(timeouts)]


def _send(jobs: List[Job], deadline: Optional[float]) -> Dict[int, Tuple[Any, Any]]:
    results: Dict[int, Tuple[Any, Any]] = {}
    send(jobs, lambda i, value, error: results.__setitem__(i, (value, error)), deadline)
    return results


def test_calls_with_different_deadlines_in_one_message_each_keep_their_own(wired) -> None:
    clock, recorder = wired
    abandoned: List[str] = []
    jobs = _jobs(Peer(default=70.0), [30.0, 50.0, None], abandoned)
    results = _send(jobs, None)
    [(message, timeout, held)] = recorder.sent  # one message for the three calls
    assert message["op"] == "batch" and [j["expert"] for j in message["jobs"]] == ["e0", "e1", "e2"]
    assert [j["answer_by"] for j in message["jobs"]] == [30.0, 50.0, None]
    # The message lives until its last call's deadline (the transport's 70 s
    # for the call without one), plus the grace; never less.
    assert timeout == pytest.approx(70.0 + GRACE_S)
    clock.now += 40.0  # e0's deadline passed: its answer, arriving now, is dropped
    held.answer(["ok", [[["ok", "a0"], ["ok", "a1"], None], True]])
    assert results[1] == ("a1", None)
    value, error = results[0]
    assert value is None and isinstance(error, RemoteTimeoutError)
    assert str(error) == ("forward of expert 'e0' on worker 'w' missed its 30 s deadline (no reply "
                          "within 30 s)")
    assert abandoned == ["e0"]
    # e2 still open: one collect, whose own timeout reaches e2's deadline only
    assert [m["op"] for m, _, _ in recorder.sent] == ["batch", "collect"]
    _, collect_timeout, collect = recorder.sent[1]
    assert collect_timeout == pytest.approx(70.0 - 40.0 + GRACE_S)
    collect.answer(["ok", [[None, None, ["ok", "a2"]], False]])
    assert results[2] == ("a2", None) and abandoned == ["e0"] and len(results) == 3


def test_a_pass_deadline_ends_the_calls_it_precedes_sooner(wired) -> None:
    clock, recorder = wired
    abandoned: List[str] = []
    jobs = _jobs(Peer(default=70.0), [30.0, 50.0, None], abandoned)
    results = _send(jobs, 40.0)  # the layer's forward_timeout
    [(message, timeout, held)] = recorder.sent
    assert [j["answer_by"] for j in message["jobs"]] == [30.0, 40.0, 40.0]
    assert timeout == pytest.approx(40.0 + GRACE_S)  # not the 50 s or the transport's 70 s
    clock.now += 45.0
    held.answer(["ok", [[None, None, None], False]])  # the server gave up on all three
    assert sorted(abandoned) == ["e0", "e1", "e2"]
    errors = [str(results[k][1]) for k in range(3)]
    assert all(isinstance(results[k][1], RemoteTimeoutError) for k in range(3))
    assert errors[0] == ("forward of expert 'e0' on worker 'w' missed its 30 s deadline (no "
                         "reply within 30 s)")
    for k in (1, 2):
        assert errors[k] == (f"forward of expert 'e{k}' on worker 'w' was given up after 40 s: "
                             "its pass (e.g. a MixtureOfExperts' forward_timeout or "
                             "backward_timeout) stopped waiting before the call's own deadline")


def test_a_pass_deadline_later_than_a_calls_own_leaves_the_own(wired) -> None:
    clock, recorder = wired
    jobs = _jobs(Peer(default=None), [30.0, 50.0], [])
    results = _send(jobs, 60.0)
    [(message, timeout, held)] = recorder.sent
    assert [j["answer_by"] for j in message["jobs"]] == [30.0, 50.0]
    assert timeout == pytest.approx(50.0 + GRACE_S)
    held.answer(["ok", [[["ok", 0], ["ok", 1]], False]])
    assert results == {0: (0, None), 1: (1, None)}


def test_a_call_without_any_deadline_keeps_its_message_open(wired) -> None:
    clock, recorder = wired
    jobs = _jobs(Peer(default=None), [30.0, None], [])
    results = _send(jobs, None)
    [(message, timeout, held)] = recorder.sent
    assert [j["answer_by"] for j in message["jobs"]] == [30.0, None] and timeout is None
    held.answer(["ok", [[["ok", 0], ["ok", 1]], False]])
    assert results == {0: (0, None), 1: (1, None)}


def test_a_lone_call_sends_its_own_message_with_its_own_deadline(wired) -> None:
    clock, recorder = wired
    jobs = _jobs(Peer(default=70.0), [30.0], [])
    results = _send(jobs, 20.0)
    [(message, timeout, held)] = recorder.sent
    assert message == {"op": "forward", "expert": "e0"}  # not wrapped in a batch
    assert timeout == pytest.approx(20.0 + GRACE_S)
    clock.now += 25.0
    held.answer(["ok", "late"])
    assert isinstance(results[0][1], RemoteTimeoutError)
    assert "was given up after 20 s: its pass" in str(results[0][1])


# -- the layer's pass deadline, end to end in this process -------------------------------
class Recording(InProcess):
    """This process's endpoint as the worker ``here``; records each frame's
    label and timeout."""

    def __init__(self) -> None:
        super().__init__("here")
        self.sent: List[Tuple[str, Optional[float]]] = []

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Any:
        self.sent.append((frame.label, timeout))
        return super().call(worker, frame, timeout)


class Gated(nn.Module):
    """Answers only once the test opens its gate."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.gate = threading.Event()

    def forward(self, x: Tensor) -> Tensor:
        assert self.gate.wait(30.0)
        return self.lin(x)


def test_the_layers_pass_deadline_ends_a_masked_calls_job_message_and_state() -> None:
    from moe_autograd.moe import MixtureOfExperts

    width, forward_timeout = 4, 0.3
    gated = Gated(width)
    modules = {"dl_lin0": nn.Linear(width, width), "dl_lin1": nn.Linear(width, width),
               "dl_gated": gated}
    transport = Recording()
    server = ExpertServer(modules, backward="stateful", transport=transport)
    store = server.store
    assert store is not None
    put_done = threading.Event()
    real_put = store.put

    def put(call_id: str, state: Any) -> None:
        try:
            real_put(call_id, state)
        finally:
            if state.expert == "dl_gated":
                put_done.set()
    store.put = put  # type: ignore[method-assign]
    try:
        experts = [RemoteExpert("here", name, forward_timeout=30.0, transport=transport)
                   for name in modules]
        moe = MixtureOfExperts(experts, width, k=3, k_min=1, forward_timeout=forward_timeout)
        x = torch.randn(5, width, requires_grad=True)
        y, aux = moe(x)  # returns at the pass deadline: the gated call masked
        assert [s["timeouts"] for s in moe.stats()] == [0, 0, 1]
        # job: the call's answer_by was the pass's; message: every frame of
        # the pass ends by the pass deadline plus the grace, not at the call's 30 s
        forward_frames = [(label, t) for label, t in transport.sent if "forward" in label]
        assert forward_frames and forward_frames[0][0] == "batch:forward"
        assert all(t is not None and t <= forward_timeout + GRACE_S for _, t in forward_frames)
        # state: the server's forward finishes later; the client has let it go
        gated.gate.set()
        assert put_done.wait(30.0)
        flush_releases()  # (the releaser's thread may be sending it already: wait for it)
        for _ in range(1000):
            if store.stats()["live"] == 2:
                break
            time.sleep(0.01)
        assert store.stats()["live"] == 2  # the two answered calls' states, for their backward
        gone = [reason for _, reason in store._gone.values()]
        assert any("released by the client" in reason for reason in gone)
        (y.sum() + aux).backward()
        assert store.stats()["live"] == 0 and x.grad is not None
    finally:
        gated.gate.set()
        server.close()


# -- a message that fails, a reply that is no answer ----------------------------------------
@pytest.mark.parametrize("error, kind, text", [
    (TransportSendError("peer gone"), RemoteExpertError, "could not be sent: peer gone"),
    (TransportTimeout("no reply"), RemoteTimeoutError, "missed its 30 s deadline (no reply)"),
    (RemoteAuthError("bad seal"), RemoteAuthError, "was refused: bad seal"),
    (TransportError("reset"), RemoteExpertError,
     "failed (is the worker alive and reachable?): reset"),
])
def test_a_failed_message_fails_each_of_its_calls_naming_it(wired, error, kind, text) -> None:
    clock, recorder = wired
    abandoned: List[str] = []
    results = _send(_jobs(Peer(default=None), [30.0, 30.0], abandoned), None)
    recorder.sent[0][2].answer(error)
    for k in range(2):
        value, failure = results[k]
        assert value is None and type(failure) is kind
        assert str(failure) == f"forward of expert 'e{k}' on worker 'w' {text}"
    # a timeout gives the calls up (their states released); other failures do not
    assert abandoned == (["e0", "e1"] if kind is RemoteTimeoutError else [])


def test_a_message_that_cannot_be_sent_fails_each_call(wired, monkeypatch) -> None:
    clock, recorder = wired

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("not a wire value")
    monkeypatch.setattr(batching, "send_request", refuse)
    results = _send(_jobs(Peer(default=None), [30.0, None], []), None)
    for k in range(2):
        assert isinstance(results[k][1], RemoteExpertError)
        assert str(results[k][1]) == (f"forward of expert 'e{k}' on worker 'w' could not be "
                                      "sent: TypeError: not a wire value")


@pytest.mark.parametrize("reply, text", [
    ("garbage", "got a malformed reply: 'garbage'"),
    (["ok", "x", "y"], "got a malformed reply: ['ok', 'x', 'y']"),
    (["error", "server stopping"], "failed on the server: server stopping"),
    (["ok", [[None], False]], "got a malformed reply: [[None], False]"),  # one answer for two
    (["ok", [None, False]], "got a malformed reply: [None, False]"),
    (["ok", [[None, None]]], "got a malformed reply: [[None, None]]"),
])
def test_a_batch_reply_that_is_no_answer_fails_each_call(wired, reply, text) -> None:
    clock, recorder = wired
    results = _send(_jobs(Peer(default=None), [30.0, 30.0], []), None)
    recorder.sent[0][2].answer(reply)
    assert [str(results[k][1]) for k in range(2)] == [
        f"forward of expert 'e{k}' on worker 'w' {text}" for k in range(2)]
    assert all(type(results[k][1]) is RemoteExpertError for k in range(2))


def test_an_answer_is_the_calls_own_result_or_error(wired) -> None:
    clock, recorder = wired
    results = _send(_jobs(Peer(default=None), [30.0, 30.0, 30.0, 30.0], []), None)
    recorder.sent[0][2].answer(["ok", [[["ok", 1], ["error", "boom"], "bad", "ab"], False]])
    assert results[0] == (1, None)
    assert str(results[1][1]) == "forward of expert 'e1' on worker 'w' failed on the server: boom"
    assert str(results[2][1]) == "forward of expert 'e2' on worker 'w' got a malformed reply: 'bad'"
    assert str(results[3][1]) == "forward of expert 'e3' on worker 'w' got a malformed reply: 'ab'"
    assert len(recorder.sent) == 1  # nothing left open: no collect


# -- a map of RemoteCall, in this process -----------------------------------------------------
@pytest.mark.parametrize("backward", ["stateless", "stateful"])
def test_a_map_of_remote_calls_coalesces_and_gets_the_loops_gradients(backward: str) -> None:
    transport = Recording()
    modules = {f"map_{backward}_{k}": nn.Linear(3, 3) for k in range(3)}
    with ExpertServer(modules, backward=backward, transport=transport):
        experts = [RemoteExpert("here", name, transport=transport) for name in modules]
        xs = [torch.randn(2, 3, requires_grad=True) for _ in experts]
        results = map_with_parallel_backward(
            RemoteCall, *[e.function_args(x) for e, x in zip(experts, xs)])
        assert [label for label, _ in transport.sent] == ["batch:forward"]
        sum((r[0] * (k + 1)).sum() for k, r in enumerate(results)).backward()
        assert [label for label, _ in transport.sent][-1] == "batch:backward"
        lxs = [x.detach().clone().requires_grad_() for x in xs]
        sum((m(x) * (k + 1)).sum() for k, (m, x) in enumerate(zip(modules.values(), lxs))).backward()
        torch.testing.assert_close([x.grad for x in xs], [x.grad for x in lxs])
        for k, (r, m, x) in enumerate(zip(results, modules.values(), lxs)):
            torch.testing.assert_close(r[0], m(x))


# -- collected calls in this process: outputs, gradients, the backward's deadline -----------
class TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        h = torch.tanh(self.lin(x))
        return h + y, h * y


class Blows(nn.Module):
    """An infinite gradient for its input."""

    def forward(self, x: Tensor) -> Tensor:
        return x.sqrt()  # at 0


@pytest.mark.parametrize("backward", ["stateless", "stateful"])
def test_collected_calls_return_what_the_expert_returns_and_the_loops_gradients(
        backward: str) -> None:
    transport = Recording()
    modules: Dict[str, nn.Module] = {f"col_{backward}_one": nn.Linear(3, 3),
                                     f"col_{backward}_two": TwoOut()}
    with ExpertServer(modules, backward=backward, transport=transport):
        one, two = (RemoteExpert("here", name, transport=transport) for name in modules)
        x, y, z = (torch.randn(2, 3, requires_grad=True) for _ in range(3))
        outs = parallel_apply([one, two], [x, (y, z)])
        assert isinstance(outs[0], Tensor) and isinstance(outs[1], tuple) and len(outs[1]) == 2
        (outs[0].square().sum() + (outs[1][0] * outs[1][1]).sum()).backward()
        assert [label for label, _ in transport.sent] == ["batch:forward", "batch:backward"]
        lx, ly, lz = (t.detach().clone().requires_grad_() for t in (x, y, z))
        m1, m2 = modules.values()
        want = (m1(lx), m2(ly, lz))
        (want[0].square().sum() + (want[1][0] * want[1][1]).sum()).backward()
        torch.testing.assert_close(outs[0], want[0])
        torch.testing.assert_close(outs[1], want[1])
        torch.testing.assert_close([x.grad, y.grad, z.grad], [lx.grad, ly.grad, lz.grad])


def test_a_non_finite_gradient_from_a_collected_call_is_refused_naming_it() -> None:
    transport = Recording()
    with ExpertServer({"col_blows": Blows(), "col_lin": nn.Linear(3, 3)}, transport=transport):
        experts = [RemoteExpert("here", name, transport=transport)
                   for name in ("col_lin", "col_blows")]
        xs = [torch.randn(2, 3, requires_grad=True), torch.zeros(2, 3, requires_grad=True)]

        def run(n: int) -> List[Any]:
            calls, group = start_calls(experts[:n], xs[:n], check_finite_grads=True)
            group.wait()
            return finish_calls(calls)
        outs = run(2)
        with pytest.raises(FloatingPointError, match=r"call 1 of 2: non-finite gradient"):
            sum(o.sum() for o in outs).backward()
        run(1)[0].sum().backward()  # finite: no error
        assert xs[0].grad is not None


def test_the_layers_backward_deadline_bounds_its_backward_message() -> None:
    from moe_autograd.moe import MixtureOfExperts

    transport = Recording()
    modules = {f"bd_lin{k}": nn.Linear(3, 3) for k in range(3)}
    with ExpertServer(modules, backward="stateful", transport=transport):
        experts = [RemoteExpert("here", name, backward_timeout=30.0, transport=transport)
                   for name in modules]
        moe = MixtureOfExperts(experts, 3, k=3, backward_timeout=5.0)
        y, aux = moe(torch.randn(4, 3, requires_grad=True))
        (y.sum() + aux).backward()
        backward = [t for label, t in transport.sent if label == "batch:backward"]
        assert backward and all(t is not None and t <= 5.0 + GRACE_S for t in backward)


# -- a call alone (run_sync) ---------------------------------------------------------------
class Timed(Held):
    """A reply that arrives ``after`` seconds of the fake clock; records the
    wait the caller asked for."""

    def __init__(self, clock: Clock, after: float, reply: Any) -> None:
        super().__init__()
        self.clock, self.after, self.reply = clock, after, reply
        self.waits: List[Optional[float]] = []

    def result(self, timeout: Optional[float]) -> Any:
        self.waits.append(timeout)
        self.clock.now += self.after
        return super().result(timeout)


def _alone(monkeypatch: pytest.MonkeyPatch, clock: Clock, timeout: Optional[float], after: float,
           reply: Any, abandoned: List[str]) -> Tuple[Job, Timed, List[Tuple[Any, ...]]]:
    pending = Timed(clock, after, reply)
    sent: List[Tuple[Any, ...]] = []

    def request(transport: Any, worker: str, message: Dict[str, Any],
                t: Optional[float], *, secret: Any = None, label: str = "") -> Timed:
        sent.append((transport, worker, message, t, secret, label))
        return pending
    monkeypatch.setattr(batching, "send_request", request)
    [job] = _jobs(Peer(default=None), [timeout], abandoned)
    job.secret = "the job's secret"  # type: ignore[assignment]
    return job, pending, sent


def test_a_lone_call_waits_until_its_deadline_and_no_longer(wired, monkeypatch) -> None:
    from moe_autograd.remote.batching import run_sync
    clock, _ = wired
    abandoned: List[str] = []
    job, pending, sent = _alone(monkeypatch, clock, 30.0, 12.0, ["ok", "v"], abandoned)
    assert run_sync(job) == "v"
    assert sent == [(job.transport, "w", {"op": "forward", "expert": "e0"}, 30.0,
                     "the job's secret", "forward")]
    assert pending.waits == [30.0] and abandoned == []
    job, pending, _ = _alone(monkeypatch, clock, 30.0, 30.0, ["ok", "on time"], abandoned)
    assert run_sync(job) == "on time"  # exactly at the deadline: in time
    job, pending, _ = _alone(monkeypatch, clock, None, 1e6, ["ok", "whenever"], abandoned)
    assert run_sync(job) == "whenever" and pending.waits == [None]
    job, pending, _ = _alone(monkeypatch, clock, 0.5, 0.0, ["ok", "soon"], abandoned)
    assert run_sync(job) == "soon" and pending.waits == [0.5]  # never longer than the deadline


def test_a_lone_calls_late_reply_is_dropped_and_the_call_given_up(wired, monkeypatch) -> None:
    from moe_autograd.remote.batching import run_sync
    clock, _ = wired
    abandoned: List[str] = []
    job, pending, _ = _alone(monkeypatch, clock, 30.0, 31.0, ["ok", "late"], abandoned)
    with pytest.raises(RemoteTimeoutError) as info:
        run_sync(job)
    assert str(info.value) == ("forward of expert 'e0' on worker 'w' missed its 30 s deadline "
                               "(the reply came after 31.000000 s and was dropped)")
    assert abandoned == ["e0"]


@pytest.mark.parametrize("error, gives_up", [
    (TransportTimeout("t"), True), (TransportSendError("s"), False),
    (RemoteAuthError("a"), False), (TransportError("e"), False)])
def test_a_lone_call_that_fails_gives_up_its_state_only_on_a_timeout(
        wired, monkeypatch, error: BaseException, gives_up: bool) -> None:
    from moe_autograd.remote.batching import run_sync
    clock, _ = wired
    abandoned: List[str] = []
    job, pending, _ = _alone(monkeypatch, clock, 30.0, 0.0, error, abandoned)
    with pytest.raises(RemoteExpertError, match="forward of expert 'e0' on worker 'w'"):
        run_sync(job)
    assert abandoned == (["e0"] if gives_up else [])


def test_an_interrupted_lone_call_gives_up_its_state(wired, monkeypatch) -> None:
    from moe_autograd.remote.batching import run_sync
    clock, _ = wired
    abandoned: List[str] = []
    job, pending, _ = _alone(monkeypatch, clock, None, 0.0, KeyboardInterrupt(), abandoned)
    with pytest.raises(KeyboardInterrupt):
        run_sync(job)
    assert abandoned == ["e0"]


def test_an_answer_at_its_deadline_is_in_time(wired) -> None:
    clock, recorder = wired
    results = _send(_jobs(Peer(default=None), [30.0, 30.0], []), None)
    clock.now += 30.0  # exactly the deadline: not after it
    recorder.sent[0][2].answer(["ok", [[["ok", 0], ["ok", 1]], False]])
    assert results == {0: (0, None), 1: (1, None)}
    results = _send(_jobs(Peer(default=None), [30.0], []), None)  # a lone call's message
    clock.now += 30.0
    recorder.sent[1][2].answer(["ok", "alone"])
    assert results == {0: ("alone", None)}


class HalfDetached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = self.lin(x)
        return h, h.detach() * 2


@pytest.mark.parametrize("backward", [
    "stateless",  # was a strict xfail: the stateless forward ran without grad (issue 34)
    "stateful"])
def test_a_collected_calls_output_the_expert_detached_needs_no_gradient(backward: str) -> None:
    transport = Recording()
    modules = {f"col_half_{backward}": HalfDetached(), f"col_l_{backward}": nn.Linear(3, 3)}
    with ExpertServer(modules, backward=backward, transport=transport):
        experts = [RemoteExpert("here", name, transport=transport) for name in modules]
        x = torch.randn(2, 3, requires_grad=True)
        (h, d), y = parallel_apply(experts, [x, x])
        assert h.requires_grad and y.requires_grad and not d.requires_grad


@pytest.mark.parametrize("default, text", [
    (70.0, "missed the transport's own timeout (no reply within 70 s)"),
    (None, "missed the transport's own timeout (no reply)")])
def test_a_call_without_its_own_deadline_says_whose_timeout_it_missed(
        wired, default: Optional[float], text: str) -> None:
    clock, recorder = wired
    results = _send(_jobs(Peer(default=default), [30.0, None], []), None)
    clock.now += 80.0
    recorder.sent[0][2].answer(["ok", [[None, None], False]])  # the server gave up on both
    assert str(results[1][1]) == f"forward of expert 'e1' on worker 'w' {text}"


def test_a_failing_collect_fails_the_calls_still_open(wired) -> None:
    clock, recorder = wired
    results = _send(_jobs(Peer(default=None), [30.0, 30.0, 30.0], []), None)
    recorder.sent[0][2].answer(["ok", [[["ok", 0], None, None], True]])
    assert results == {0: (0, None)} and recorder.sent[1][0]["op"] == "collect"
    recorder.sent[1][2].answer(TransportSendError("peer gone"))
    assert results[0] == (0, None)  # already answered: kept
    for k in (1, 2):
        assert str(results[k][1]) == f"forward of expert 'e{k}' on worker 'w' could not be sent: " \
                                     "peer gone"


@pytest.mark.parametrize("backward", ["stateless", "stateful"])
def test_a_remote_call_the_collector_cannot_carry_runs_on_a_worker_with_the_loops_gradients(
        backward: str) -> None:
    # checkpoint=True (and keyword arguments) are not collected: the record
    # runs as a plain ModuleCall on a worker, through its own graph

    transport = Recording()
    modules = {f"wk_{backward}_{k}": nn.Linear(3, 3) for k in range(2)}
    with ExpertServer(modules, backward=backward, transport=transport):
        experts = [RemoteExpert("here", name, transport=transport) for name in modules]
        xs = [torch.randn(2, 3, requires_grad=True) for _ in experts]
        outs = parallel_apply(experts, xs, checkpoint=True)
        assert all(isinstance(o, Tensor) for o in outs)
        sum(o.square().sum() for o in outs).backward()
        assert not any(label.startswith("batch") for label, _ in transport.sent)
        lxs = [x.detach().clone().requires_grad_() for x in xs]
        want = [m(x) for m, x in zip(modules.values(), lxs)]
        sum(o.square().sum() for o in want).backward()
        torch.testing.assert_close(outs, want)
        torch.testing.assert_close([x.grad for x in xs], [x.grad for x in lxs])


# -- the collector's own paths, in this process (issue 34: survivors that only the shared
# RPC world's tests reached) ---------------------------------------------------------------
class Logged(InProcess):
    """This process's endpoint as the worker ``here``; writes ``send <label>``
    to the shared ``log`` for each frame."""

    def __init__(self, log: List[str]) -> None:
        super().__init__("here")
        self.log = log

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Any:
        self.log.append(f"send {frame.label}")
        return super().call(worker, frame, timeout)


class LoggedExpert(RemoteExpert):
    """A remote expert that writes ``build <name>`` to its transport's log when
    a call's forward job is built."""

    def _forward_job(self, call: Any, args: Any, grad: bool) -> Job:
        self.transport.log.append(f"build {self.name}")  # type: ignore[attr-defined]
        return super()._forward_job(call, args, grad)


def test_a_requests_deadline_entries_stay_live_while_one_of_their_calls_is_open(wired) -> None:
    """The watcher holds a request, and keeps (when it compacts its heap) an
    entry of it, while one of the entry's calls is open; it lets the request
    go, and drops the entry, once they all ended."""
    clock, recorder = wired
    results: Dict[int, Tuple[Any, Any]] = {}
    request = batching._Request(_jobs(Peer(default=None), [30.0, 30.0], []), [0, 1],
                                lambda i, value, error: results.__setitem__(i, (value, error)))
    request.send()
    held = batching._watch()._held
    assert batching._jobs_open(request, (0, 1)) and batching._jobs_open(request, (1,))
    assert request in held  # (its deadlines fire whatever the transport keeps of it)
    recorder.sent[0][2].answer(["ok", [[["ok", 0], None], True]])
    assert results == {0: (0, None)}
    assert not batching._jobs_open(request, (0,)) and batching._jobs_open(request, (0, 1))
    assert request in held
    recorder.sent[1][2].answer(["ok", [[None, ["ok", 1]], False]])
    assert results == {0: (0, None), 1: (1, None)}
    assert not batching._jobs_open(request, (0, 1)) and request not in held


@pytest.mark.timeout(30)
def test_collected_calls_leave_one_server_at_a_time_each_request_before_the_next_is_built() -> None:
    """A pass's calls are grouped by server, and a server's request leaves as
    soon as its calls are built, before the next server's calls are built
    (two transports: two servers for the client); results as the loop's."""
    log: List[str] = []
    near, far = Logged(log), Logged(log)
    modules = {f"pipe_{k}": nn.Linear(3, 3) for k in range(4)}
    with ExpertServer(modules, transport=near):
        experts = [LoggedExpert("here", name, transport=near if k % 2 == 0 else far)
                   for k, name in enumerate(modules)]
        xs = [torch.randn(2, 3, requires_grad=True) for _ in experts]
        outs = parallel_apply(experts, xs)
        assert log == ["build pipe_0", "build pipe_2", "send batch:forward",
                       "build pipe_1", "build pipe_3", "send batch:forward"]
        with torch.no_grad():
            torch.testing.assert_close(outs, [m(x) for m, x in zip(modules.values(), xs)])


@pytest.mark.timeout(30)
def test_a_collected_call_whose_job_cannot_be_built_fails_alone_naming_itself() -> None:
    """A call whose arguments cannot travel fails with its own error, naming
    it; the calls after it to the same server are still sent and answered."""
    modules = {f"unbuilt_{k}": nn.Linear(3, 3) for k in range(3)}
    transport = Recording()
    with ExpertServer(modules, transport=transport):
        experts = [RemoteExpert("here", name, transport=transport) for name in modules]
        xs = [torch.randn(2, 3, requires_grad=True) for _ in experts]
        calls, group = start_calls(experts, [(xs[0], object()), xs[1], xs[2]])
        assert group.wait(20.0)
        error = group.errors[0]
        assert isinstance(error, TypeError) and group.results[0] is None
        assert "the arguments of forward of expert 'unbuilt_0' on worker 'here'" in str(error)
        assert group.errors[1:] == [None, None] and group.results[1:] == calls[1:]
        assert [label for label, _ in transport.sent] == ["batch:forward"]  # the two others
        with torch.no_grad():
            torch.testing.assert_close(finish_calls(calls[1:]),
                                       [m(x) for m, x in zip(list(modules.values())[1:], xs[1:])])


@pytest.mark.timeout(30)
def test_a_collected_call_that_the_callers_validate_refuses_fails_alone_with_its_error() -> None:
    """``validate`` runs on each collected call's answer: the call it refuses
    fails with the validator's error and no result, the others succeed."""
    modules = {f"valid_{k}": nn.Linear(3, 3) for k in range(3)}
    transport = Recording()

    def validate(call: Any) -> None:
        if call.index == 1:
            raise ValueError(f"{call.name}: refused by the caller")
    with ExpertServer(modules, transport=transport):
        experts = [RemoteExpert("here", name, transport=transport) for name in modules]
        xs = [torch.randn(2, 3, requires_grad=True) for _ in experts]
        calls, group = start_calls(experts, xs, validate=validate)
        assert group.wait(20.0)
        assert [label for label, _ in transport.sent] == ["batch:forward"]
        assert type(group.errors[1]) is ValueError and group.results[1] is None
        assert str(group.errors[1]) == "parallel_apply: call 1 of 3: refused by the caller"
        assert group.errors[0] is None and group.errors[2] is None
        assert group.results[0] is calls[0] and group.results[2] is calls[2]


class Detached(nn.Module):
    """An output that needs no gradient (the server keeps nothing: mode none)."""

    def forward(self, x: Tensor) -> Tensor:
        return (x * 2).detach()


class Raises(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise ValueError("no such input")


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor, scale: float) -> Tensor:
        return self.lin(x) * scale


class Unfillable(RemoteCall):
    """A ``RemoteCall`` whose context cannot keep what a forward answered."""

    @staticmethod
    def _fill_ctx(ctx: Any, call: Any, args: Any, outputs: Any, diff: Any) -> None:
        raise LookupError("nowhere to keep it")


def _applies(func: Any, args: List[Tuple[Any, ...]]) -> Dict[Any, Tuple[Any, Any]]:
    """The completions of a collected map's forwards (all in by the return:
    the in-process transport answers at once)."""
    done: Dict[Any, Tuple[Any, Any]] = {}
    COLLECTOR.start_applies(func, args, lambda k, value, error: done.__setitem__(k, (value, error)))
    return done


@pytest.mark.timeout(30)
def test_a_collected_map_leaves_on_each_context_what_a_map_on_workers_leaves() -> None:
    """Each collected call of a map of ``RemoteCall`` completes with the
    emulated context that ``run_isolated_forward`` leaves (needs_input_grad,
    the inputs detached, the stateless inputs saved detached) and its
    outputs; a call that fails on the server, or whose context cannot be
    filled, fails alone with its own error."""
    transport = Recording()
    modules = {"ctx_scaled": Scaled(), "ctx_raises": Raises(), "ctx_lin": nn.Linear(3, 3)}
    with ExpertServer(modules, backward="stateless", transport=transport):
        scaled, raises, lin = (RemoteExpert("here", name, transport=transport) for name in modules)
        base = torch.randn(2, 3, requires_grad=True)
        x = base * 2  # not a leaf: its detached copy is one
        args = [scaled.function_args(x, 3), raises.function_args(x)]
        done = _applies(RemoteCall, args)
        assert set(done) == {0, 1}
        (ctx, outputs), error = done[0]
        assert error is None
        with torch.no_grad():
            torch.testing.assert_close(list(outputs), [modules["ctx_scaled"](x, 3)])
        assert ctx.needs_input_grad == (False, True, True, False)
        inputs = ctx._inputs
        assert inputs[0] is args[0][0] and inputs[3] == 3
        assert inputs[2] is not x and inputs[2].grad_fn is None and inputs[2].requires_grad
        assert torch.equal(inputs[2], x)
        [saved] = ctx.saved_tensors
        assert saved is inputs[2]
        value, error = done[1]
        assert value is None and type(error) is RemoteExpertError
        assert str(error).startswith("forward of expert 'ctx_raises' on worker 'here' failed on "
                                     "the server: ")
        assert "no such input" in str(error)
        done = _applies(Unfillable, [lin.function_args(x)])
        assert list(done) == [0] and done[0][0] is None
        assert type(done[0][1]) is LookupError and str(done[0][1]) == "nowhere to keep it"


@pytest.mark.timeout(30)
def test_a_map_calls_collected_backward_after_its_state_was_freed_is_refused_naming_it() -> None:
    """A map call whose state was freed refuses a backward with the error a
    map on workers gives, naming the Function."""
    transport = Recording()
    with ExpertServer({"freed_lin": nn.Linear(3, 3)}, transport=transport):
        expert = RemoteExpert("here", "freed_lin", transport=transport)
        args = expert.function_args(torch.randn(2, 3, requires_grad=True))
        (ctx, outputs), error = _applies(RemoteCall, [args])[0]
        assert error is None
        record = _FunctionCall(RemoteCall, args, 0, 1, ctx, outputs)
        record.release()
        done: Dict[Any, Tuple[Any, Any]] = {}
        COLLECTOR.start_backwards([record], [[torch.ones(2, 3)]],
                                  lambda k, value, error: done.__setitem__(k, (value, error)))
        assert list(done) == [0] and done[0][0] is None
        assert type(done[0][1]) is RuntimeError
        assert str(done[0][1]) == "RemoteCall: backward after its state was freed"


@pytest.mark.timeout(30)
def test_a_collected_map_call_with_nothing_to_send_in_backward_ends_with_its_result() -> None:
    """The collector's backward of a map call whose outputs need no gradient
    (the server kept nothing) sends nothing and ends the call with None
    gradients; its sibling's backward is sent, with the loop's gradients."""
    transport = Recording()
    modules: Dict[str, nn.Module] = {"none_det": Detached(), "none_lin": nn.Linear(3, 3)}
    with ExpertServer(modules, transport=transport):
        experts = [RemoteExpert("here", name, transport=transport) for name in modules]
        xs = [torch.randn(2, 3, requires_grad=True) for _ in experts]
        args = [e.function_args(x) for e, x in zip(experts, xs)]
        done = _applies(RemoteCall, args)
        records = [_FunctionCall(RemoteCall, a, k, 2, *done[k][0]) for k, a in enumerate(args)]
        transport.sent.clear()
        grad = torch.randn(2, 3)
        ended: Dict[Any, Tuple[Any, Any]] = {}
        COLLECTOR.start_backwards(records, [[None], [grad]],
                                  lambda k, value, error: ended.__setitem__(k, (value, error)))
        assert [label for label, _ in transport.sent] == ["backward"]  # the linear's alone
        assert ended[0] == ((None, None, None), None)
        grads, error = ended[1]
        assert error is None and grads[:2] == (None, None)
        x = xs[1].detach().clone().requires_grad_()
        modules["none_lin"](x).backward(grad)
        torch.testing.assert_close(grads[2], x.grad)
        assert sorted(ended) == [0, 1]


# -- the record of a RemoteExpert call (RemoteModuleCall), in this process ------------------
class Pair(nn.Module):
    """Takes a scalar, a tensor that needs no gradient and a list of two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor, scale: float, shift: Tensor, pair: List[Tensor]) -> Tensor:
        return self.lin(x) * scale + shift + pair[0] * pair[1]


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, y: Tensor, zs: List[Tensor]) -> Tuple[Tensor, Tensor]:
        return self.lin(y) * zs[0], y + 1


class Ignores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.lin(x)


@pytest.mark.timeout(30)
def test_collected_calls_carry_arguments_that_need_no_gradient_and_nested_ones() -> None:
    """Scalars, tensors that need no gradient and lists of tensors travel in
    a collected call as the expert takes them: outputs and gradients are the
    loop's."""
    transport = Recording()
    modules = {"args_pair": Pair(), "args_lin": nn.Linear(3, 3)}
    with ExpertServer(modules, transport=transport):
        pair, lin = (RemoteExpert("here", name, transport=transport) for name in modules)
        x = torch.randn(2, 3, requires_grad=True)
        shift, a, b = (torch.randn(2, 3) for _ in range(3))
        outs = parallel_apply([pair, lin], [(x, 2.5, shift, [a, b]), x])
        (outs[0].square().sum() + outs[1].sum()).backward()
        assert [label for label, _ in transport.sent] == ["batch:forward", "batch:backward"]
        lx = x.detach().clone().requires_grad_()
        want = [modules["args_pair"](lx, 2.5, shift, [a, b]), modules["args_lin"](lx)]
        (want[0].square().sum() + want[1].sum()).backward()
        torch.testing.assert_close(outs, want)
        torch.testing.assert_close(x.grad, lx.grad)


class FirstDoubled(nn.Module):
    def forward(self, xs: List[Tensor]) -> Tensor:
        return xs[0] * 2


class SumAndCount(nn.Module):
    def forward(self, xs: List[Tensor], ys: List[Tensor]) -> Tensor:
        return xs[0] + xs[1] + len(ys)


@pytest.mark.timeout(30)
def test_a_collected_calls_list_arguments_stay_lists_whatever_their_leaves_count() -> None:
    """A list holding one tensor is one argument of one leaf, and a list of
    two beside an empty one two arguments of two leaves: each still reaches
    the expert as the list it is (they once arrived as the bare tensors,
    silently: the expert indexed a tensor)."""
    transport = Recording()
    modules = {"lists_first": FirstDoubled(), "lists_sum": SumAndCount()}
    with ExpertServer(modules, transport=transport):
        first, both = (RemoteExpert("here", name, transport=transport) for name in modules)
        x, y = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3)
        outs = parallel_apply([first, both], [([x],), ([x, y], [])])
        assert [label for label, _ in transport.sent] == ["batch:forward"]
        torch.testing.assert_close(outs, [x * 2, x + y])


@pytest.mark.timeout(30)
def test_a_collected_calls_input_that_the_expert_ignores_gets_no_gradient() -> None:
    """An input the expert does not use gets no gradient (None, as in the
    loop), its other inputs theirs."""
    transport = Recording()
    modules = {"ign_ignores": Ignores(), "ign_lin": nn.Linear(3, 3)}
    with ExpertServer(modules, transport=transport):
        experts = [RemoteExpert("here", name, transport=transport) for name in modules]
        x, y = (torch.randn(2, 3, requires_grad=True) for _ in range(2))
        outs = parallel_apply(experts, [(x, y), x])
        sum(o.sum() for o in outs).backward()
        assert [label for label, _ in transport.sent] == ["batch:forward", "batch:backward"]
        lx = x.detach().clone().requires_grad_()
        (modules["ign_ignores"](lx, y).sum() + modules["ign_lin"](lx).sum()).backward()
        assert y.grad is None
        torch.testing.assert_close(x.grad, lx.grad)


@pytest.mark.timeout(30)
def test_a_remote_call_with_keyword_arguments_fails_as_the_experts_own_call() -> None:
    """A ``RemoteExpert`` takes no keyword arguments: such a call is not
    collected (its keywords would be lost): it fails as calling the expert
    does, naming the call, and only the other call is sent."""
    transport = Recording()
    modules = {f"kw_{k}": nn.Linear(3, 3) for k in range(2)}
    with ExpertServer(modules, transport=transport):
        experts = [RemoteExpert("here", name, transport=transport) for name in modules]
        x = torch.randn(2, 3, requires_grad=True)
        with pytest.raises(TypeError) as alone:
            experts[0](x, scale=2)
        with pytest.raises(TypeError) as info:
            parallel_apply(experts, [x, x], kwargs=[{"scale": 2}, None])
        assert str(info.value) == str(alone.value)
        assert "unexpected keyword argument 'scale'" in str(info.value)
        assert "parallel_apply: call 0 of 2" in info.value.__notes__
        assert [label for label, _ in transport.sent] == ["forward"]


@pytest.mark.timeout(30)
def test_a_remote_call_with_a_nested_tensor_that_requires_grad_runs_as_the_expert_alone() -> None:
    """A call whose argument nests a tensor that requires grad is not
    collected: it runs on a worker as a call of the expert itself, with the
    same outputs and gradients as calling the expert in a loop."""
    transport = Recording()
    modules = {"nest_nested": Nested(), "nest_lin": nn.Linear(3, 3)}
    with ExpertServer(modules, transport=transport):
        nested, lin = (RemoteExpert("here", name, transport=transport) for name in modules)
        y, z = (torch.randn(2, 3, requires_grad=True) for _ in range(2))
        outs = parallel_apply([nested, lin], [(y, [z]), y])
        assert isinstance(outs[0], tuple) and len(outs[0]) == 2 and isinstance(outs[1], Tensor)
        (outs[0][0].square().sum() + outs[0][1].sum() + outs[1].sum()).backward()
        assert [label for label, _ in transport.sent] == ["forward", "forward", "backward",
                                                          "backward"]
        ly, lz = (t.detach().clone().requires_grad_() for t in (y, z))
        want = [nested(ly, [lz]), lin(ly)]  # the loop of the remote experts themselves
        (want[0][0].square().sum() + want[0][1].sum() + want[1].sum()).backward()
        torch.testing.assert_close(outs, want)
        torch.testing.assert_close([y.grad, z.grad], [ly.grad, lz.grad])


def test_a_record_that_checkpoints_or_takes_keywords_is_not_collected() -> None:
    """Only what the collector carries exactly is collected: flat positional
    arguments whose tensors needing grad are arguments themselves, no
    checkpoint, no keywords."""
    expert = RemoteExpert("here", "unused", transport=Recording())
    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(2, 3)
    assert RemoteModuleCall(expert, (x, 2, w), {}).collector is COLLECTOR
    assert RemoteModuleCall(expert, (x,), {}, checkpoint=True).collector is None
    assert RemoteModuleCall(expert, (x,), {"scale": 2}).collector is None
    assert RemoteModuleCall(expert, ([x],), {}).collector is None
    with torch.no_grad():  # (no checkpoint without grad)
        assert RemoteModuleCall(expert, (x,), {}, checkpoint=True).collector is COLLECTOR


@pytest.mark.timeout(30)
def test_a_collected_records_own_backward_gives_the_loops_gradients_until_released() -> None:
    """The record's ``backward`` (one gradient per argument) and
    ``input_grads`` (one per input that requires grad; None for any the
    server did not answer) give the loop's gradients; before its forward or
    after its release it refuses, naming the call."""
    transport = Recording()
    module = Scaled()
    with ExpertServer({"own_scaled": module}, transport=transport):
        expert = RemoteExpert("here", "own_scaled", transport=transport)
        x = torch.randn(2, 3, requires_grad=True)
        unsent = RemoteModuleCall(expert, (x, 2.0), {}, name="own: call 0 of 1")
        with pytest.raises(RuntimeError) as info:
            unsent.backward([torch.ones(2, 3)])
        assert str(info.value) == "own: call 0 of 1: backward after its graph was freed"
        [call], group = start_calls([expert], [(x, 2.0)])
        assert group.wait(20.0) and group.errors == [None]
        [out] = finish_calls([call])
        grad = torch.randn(2, 3)
        raw = call.backward([grad])
        lx = x.detach().clone().requires_grad_()
        torch.testing.assert_close(out, module(lx, 2.0))
        module(lx, 2.0).backward(grad)
        assert len(raw) == 2 and raw[1] is None
        torch.testing.assert_close(raw[0], lx.grad)
        [g] = call.input_grads(raw)
        torch.testing.assert_close(g, lx.grad)
        assert call.input_grads([]) == [None]
        call.release()
        with pytest.raises(RuntimeError) as info:
            call.backward([grad])
        assert str(info.value) == "parallel_apply: call 0 of 1: backward after its graph was freed"


def test_a_collected_calls_input_gradients_land_on_their_inputs_device() -> None:
    """Gradients come back on the CPU (off the wire); each goes to its
    input's device (a meta tensor stands for another device)."""
    expert = RemoteExpert("here", "unused", transport=Recording())
    x = torch.empty(2, 3, device="meta", requires_grad=True)
    record = RemoteModuleCall(expert, (x,), {})
    assert record.collector is COLLECTOR
    [g] = record.input_grads([torch.ones(2, 3)])
    assert g is not None and g.device == x.device and g.shape == x.shape


# -- the server's side: when a batch's reply leaves (batch_server._Batch) ---------------------

class Scheduled:
    """A fake clock for ``batch_server`` and a condition on it: ``wait(pause)``
    runs the jobs' finishes due by then, in time order, and returns at the
    first that notifies, else at the end of the pause (as a real waiter would
    wake). Single-threaded: the "jobs" are the finishes it runs."""

    def __init__(self) -> None:
        self.now = 0.0
        self.due: List[Tuple[float, int, Any]] = []
        self.notified = False

    def monotonic(self) -> float:
        return self.now

    def at(self, when: float, finish: Any) -> None:
        heapq.heappush(self.due, (when, len(self.due), finish))

    def __enter__(self) -> "Scheduled":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def notify_all(self) -> None:
        self.notified = True

    def wait(self, pause: float) -> bool:
        end, self.notified = self.now + pause, False
        while self.due and self.due[0][0] <= end:
            self.now, _, finish = heapq.heappop(self.due)
            finish()
            if self.notified:
                return True
        self.now = end
        return False


def _scheduled_batch(monkeypatch: pytest.MonkeyPatch, answer_by: List[Optional[float]],
                     finishes: Dict[int, float]) -> Tuple[_Batch, Scheduled]:
    """A batch started at 0 whose job ``i`` finishes at ``finishes[i]``."""
    clock = Scheduled()
    monkeypatch.setattr(batch_server, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    batch = _Batch(answer_by)
    batch.cond = clock  # type: ignore[assignment]
    for i, when in finishes.items():
        clock.at(when, lambda i=i: batch.finish(i, ["ok", i]))
    return batch, clock


def _reply(batch: _Batch, clock: Scheduled) -> Tuple[float, List[int], bool]:
    answers, more = batch.reply()
    return clock.now, [i for i, a in enumerate(answers) if a is not None], more


def test_a_batch_replies_a_linger_after_its_first_answer_or_at_its_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first answer of a round wakes the request, which then waits as
    long again as that answer took (at least LINGER_MIN_S) for its siblings;
    the last answer sends the reply at once."""
    batch, clock = _scheduled_batch(monkeypatch, [None, None, None], {0: 0.3, 1: 1.0, 2: 1.2})
    assert _reply(batch, clock) == (pytest.approx(0.6), [0], True)  # 0.3 + 0.3
    assert _reply(batch, clock) == (pytest.approx(1.2), [1, 2], False)  # the last: at once


def test_a_ready_answer_leaves_before_its_calls_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ready answer whose answer_by comes before the end of the linger
    wakes the request, which replies MARGIN_S before that deadline."""
    margin = batch_server.MARGIN_S
    # Job 0 ready at 0.5 lingers to 1.0; job 1 (answer_by 1.0) ready at 0.6
    # must leave by 1.0 - MARGIN_S: the request replies then with both.
    batch, clock = _scheduled_batch(monkeypatch, [None, 1.0, None], {0: 0.5, 1: 0.6, 2: 5.0})
    assert _reply(batch, clock) == (pytest.approx(1.0 - margin), [0, 1], True)
    assert _reply(batch, clock) == (pytest.approx(5.0), [2], False)


def test_answers_ready_before_the_request_waits_leave_after_the_shortest_linger(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Answers ready at once (refused jobs, say), one with an answer_by: the
    request replies LINGER_MIN_S later with them, the rest to collect."""
    batch, clock = _scheduled_batch(monkeypatch, [None, 1.0, None], {2: 3.0})
    batch.finish(0, ["error", "refused"])
    batch.finish(1, ["error", "refused"])
    assert _reply(batch, clock) == (pytest.approx(batch_server.LINGER_MIN_S), [0, 1], True)


class Full:
    """Stands in for the channel: records each message with everything it is
    sent with; the test answers it."""

    def __init__(self) -> None:
        self.sent: List[Dict[str, Any]] = []

    def __call__(self, transport: Any, worker: str, message: Dict[str, Any],
                 timeout: Optional[float], *, secret: Any = None, label: str = "") -> Held:
        held = Held()
        self.sent.append({"transport": transport, "worker": worker, "message": message,
                          "timeout": timeout, "secret": secret, "label": label, "held": held})
        return held


def test_each_request_goes_to_its_own_peer_sealed_with_its_jobs_secret(wired, monkeypatch) -> None:
    """Jobs are grouped by (transport, worker, secret): one message each, sent
    to that worker through that transport, sealed with that secret, labelled
    with the operation (``batch:forward`` for several calls); a batch has a
    128-bit id of its own."""
    full = Full()
    monkeypatch.setattr(batching, "send_request", full)
    near, far = Peer(default=None), Peer(default=None)
    jobs = _jobs(near, [30.0] * 5, [])
    jobs[2].transport = far  # type: ignore[assignment]
    jobs[3].worker = "v"
    jobs[4].secret = "another secret"  # type: ignore[assignment]
    for job in jobs[:4]:
        job.secret = "the secret"  # type: ignore[assignment]
    jobs.append(_jobs(near, [30.0], [])[0])
    jobs[5].secret = "the secret"  # type: ignore[assignment]
    results = _send(jobs, None)
    sent = [(m["transport"], m["worker"], m["secret"], m["label"],
             [j["expert"] for j in m["message"].get("jobs", [m["message"]])]) for m in full.sent]
    assert sent == [(near, "w", "the secret", "batch:forward", ["e0", "e1", "e0"]),
                    (far, "w", "the secret", "forward", ["e2"]),
                    (near, "v", "the secret", "forward", ["e3"]),
                    (near, "w", "another secret", "forward", ["e4"])]
    batch = full.sent[0]["message"]["batch"]
    assert len(batch) == 32 and int(batch, 16) >= 0
    for m in full.sent[1:]:
        m["held"].answer(["ok", "alone"])
    assert results == {2: ("alone", None), 3: ("alone", None), 4: ("alone", None)}


def test_calls_without_deadlines_get_the_transports_and_their_reply_its_grace(
        wired, monkeypatch) -> None:
    """Calls with no deadline of their own end at the transport's timeout:
    the message's timeout is it plus the grace, and the wait for its reply
    one grace more."""
    clock, recorder = wired
    waits: List[Optional[float]] = []
    real = batching.when_done

    def when_done(pending: Any, fn: Any, timeout: Optional[float]) -> None:
        waits.append(timeout)
        real(pending, fn, timeout)
    monkeypatch.setattr(batching, "when_done", when_done)
    results = _send(_jobs(Peer(default=70.0), [None, None], []), None)
    [(message, timeout, held)] = recorder.sent
    assert [j["answer_by"] for j in message["jobs"]] == [None, None]
    assert timeout == pytest.approx(70.0 + GRACE_S)
    assert waits == [pytest.approx(70.0 + 2 * GRACE_S)]
    clock.now += 80.0
    held.answer(["ok", [[None, None], False]])
    assert [str(results[k][1]) for k in range(2)] == [
        f"forward of expert 'e{k}' on worker 'w' missed the transport's own timeout (no reply "
        "within 70 s)" for k in range(2)]


def test_a_transport_error_while_sending_keeps_its_kind(wired, monkeypatch) -> None:
    """A transport error raised as a message is sent fails its calls as the
    same error arriving later would (a timeout: RemoteTimeoutError)."""
    def late(*args: Any, **kwargs: Any) -> Any:
        raise TransportTimeout("no slot in time")
    monkeypatch.setattr(batching, "send_request", late)
    results = _send(_jobs(Peer(default=None), [30.0, 30.0], []), None)
    for k in range(2):
        assert type(results[k][1]) is RemoteTimeoutError
        assert str(results[k][1]) == (f"forward of expert 'e{k}' on worker 'w' missed its 30 s "
                                      "deadline (no slot in time)")


def test_a_completion_that_raises_is_logged_and_the_others_still_run(
        wired, caplog: pytest.LogCaptureFixture) -> None:
    """A completion that raises (on the transport's thread) is logged, and
    does not keep the request's other calls from completing."""
    clock, recorder = wired
    done: List[int] = []

    def complete(i: int, value: Any, error: Optional[BaseException]) -> None:
        if i == 0:
            raise RuntimeError("caller gone")
        done.append(i)
    send(_jobs(Peer(default=None), [30.0, 30.0], []), complete)
    with caplog.at_level(logging.ERROR, logger=batching.__name__):
        recorder.sent[0][2].answer(["ok", [[["ok", 0], ["ok", 1]], False]])
    assert done == [1]
    [record] = [r for r in caplog.records if r.name == batching.__name__]
    assert record.getMessage() == "completing a remote call failed"
    assert record.exc_info is not None and "caller gone" in str(record.exc_info[1])


def test_each_round_of_a_batch_lingers_from_its_own_first_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a reply, the next answer starts a new round: the collect waits
    from it, as long again as it took (not from an earlier round's)."""
    batch, clock = _scheduled_batch(monkeypatch, [None] * 4, {0: 0.3, 1: 0.65, 2: 1.0, 3: 9.0})
    assert _reply(batch, clock) == (pytest.approx(0.6), [0], True)
    assert _reply(batch, clock) == (pytest.approx(1.3), [1, 2], True)  # 0.65 + 0.65
    assert _reply(batch, clock) == (pytest.approx(9.0), [3], False)


def test_answers_finishing_between_a_reply_and_the_collect_wait_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs may finish while no request waits (before the client's collect
    comes), one of them with an answer_by: the collect then lingers from
    them and replies with both."""
    batch, clock = _scheduled_batch(monkeypatch, [None, None, 3.0, None], {0: 0.3, 3: 9.0})
    assert _reply(batch, clock) == (pytest.approx(0.6), [0], True)
    batch.finish(1, ["ok", 1])
    batch.finish(2, ["ok", 2])
    assert _reply(batch, clock) == (pytest.approx(1.2), [1, 2], True)  # 0.6 + 0.6
