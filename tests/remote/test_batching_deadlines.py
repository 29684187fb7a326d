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
import threading
import time
import types
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

from moe_autograd.remote import (ExpertServer, RemoteAuthError, RemoteExpert, RemoteExpertError,
                                 RemoteTimeoutError, batching, flush_releases)
from moe_autograd.remote.batching import GRACE_S, Job, send
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
    from moe_autograd import map_with_parallel_backward
    from moe_autograd.remote import RemoteCall

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
    from moe_autograd import parallel_apply

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
    from moe_autograd.parallel import finish_calls, start_calls

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
    from moe_autograd import parallel_apply

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
    from moe_autograd import parallel_apply

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
