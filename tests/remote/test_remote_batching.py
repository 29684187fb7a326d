"""Coalesced remote calls (issue 11): one request per worker per pass, the same
semantics per call, and no pool thread per waiting call.

Messages are counted through the transport seam (``wiring.Counting``, a
transport that wraps the default one and records each frame's operation).
The tests that count set the servers' linger long (a request then always
answers all its calls at once), so scheduling cannot split a reply into a
reply and a collect.
"""
import gc
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

import remote_experts as rx
from moe_autograd import map_with_parallel_backward, parallel_apply
from moe_autograd.executor import get_pool
from moe_autograd.moe import MixtureOfExperts
from moe_autograd.parallel import start_calls
from moe_autograd.remote import (ExpertServer, RemoteCall, RemoteExpert, RemoteExpertError,
                                 RemoteTimeoutError, call_operation, flush_releases)
from moe_autograd.remote.frame import Frame
from moe_autograd.remote.transport import TransportTimeout
from wiring import InProcess, ask

pytestmark = pytest.mark.timeout(60)


def run(worker: str, name: str, *args: Any) -> Any:
    """The test operation ``name`` (``remote_experts``) on ``worker``."""
    return call_operation(worker, name, *args, timeout=20.0)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def lingering(world: Tuple[str, ...]) -> Iterator[None]:
    """Ready answers wait for all their siblings (no split replies)."""
    old = [run(w, "set_linger", 30.0) for w in world]
    try:
        yield
    finally:
        for w, value in zip(world, old):
            run(w, "set_linger", value)


def local_copy(expert: RemoteExpert, module: nn.Module) -> nn.Module:
    module.load_state_dict(expert.remote_state_dict())
    return module


# -- one request per worker per pass ---------------------------------------------------
@pytest.mark.parametrize("prefix", ["", "sf_"])
def test_parallel_apply_sends_one_request_per_worker_and_pass(world, lingering, prefix: str) -> None:
    t = rx.Counting()
    lin_a, lin_b = (RemoteExpert(w, prefix + "lin", transport=t) for w in ("srv-a", "srv-b"))
    two = RemoteExpert("srv-a", prefix + "two", transport=t)
    experts = [lin_a, lin_b, two, lin_a, lin_b]  # lin_a twice: one module, two calls
    local_a, local_b = local_copy(lin_a, nn.Linear(rx.WIDTH, rx.WIDTH)), local_copy(
        lin_b, nn.Linear(rx.WIDTH, rx.WIDTH))
    local_two = local_copy(two, rx.TwoInTwoOut())
    for e in (lin_a, lin_b, two):
        e.zero_grad()
    t.take()
    xs = [torch.randn(3, rx.WIDTH, requires_grad=True) for _ in range(6)]
    inputs: List[Any] = [xs[0], xs[1], (xs[2], xs[3]), xs[4], xs[5]]
    outs = parallel_apply(experts, inputs)
    assert t.take() == {"srv-a": ["batch"], "srv-b": ["batch"]}
    loss = sum(o.square().sum() for o in [outs[0], outs[1], *outs[2], outs[3], outs[4]])
    loss.backward()
    assert t.take() == {"srv-a": ["batch"], "srv-b": ["batch"]}

    lxs = [x.detach().clone().requires_grad_() for x in xs]
    locals_ = [local_a(lxs[0]), local_b(lxs[1]), local_two(lxs[2], lxs[3]), local_a(lxs[4]),
               local_b(lxs[5])]
    torch.testing.assert_close([outs[0], outs[1], *outs[2], outs[3], outs[4]],
                               [locals_[0], locals_[1], *locals_[2], locals_[3], locals_[4]])
    sum(o.square().sum() for o in [locals_[0], locals_[1], *locals_[2], locals_[3],
                                   locals_[4]]).backward()
    torch.testing.assert_close([x.grad for x in xs], [x.grad for x in lxs])
    for expert, module in ((lin_a, local_a), (lin_b, local_b), (two, local_two)):
        remote = expert.remote_grads()  # both calls of lin_a accumulated on the server
        for name, param in module.named_parameters():
            torch.testing.assert_close(remote[name], param.grad, msg=name)


def test_map_and_moe_send_one_request_per_worker_and_pass(world, lingering) -> None:
    t = rx.Counting()
    experts = [RemoteExpert(w, "sf_lin", transport=t) for w in ("srv-a", "srv-a", "srv-b")]
    locals_ = [local_copy(e, nn.Linear(rx.WIDTH, rx.WIDTH)) for e in experts]
    xs = [torch.randn(2, rx.WIDTH, requires_grad=True) for _ in experts]
    t.take()
    results = map_with_parallel_backward(RemoteCall, *[e.function_args(x) for e, x in zip(experts, xs)])
    assert t.take() == {"srv-a": ["batch"], "srv-b": ["forward"]}
    sum(r[0].sum() for r in results).backward()
    assert t.take() == {"srv-a": ["batch"], "srv-b": ["backward"]}
    lxs = [x.detach().clone().requires_grad_() for x in xs]
    sum(m(x).sum() for m, x in zip(locals_, lxs)).backward()
    torch.testing.assert_close([x.grad for x in xs], [x.grad for x in lxs])

    moe_experts = [RemoteExpert(w, name, transport=t)
                   for w in ("srv-a", "srv-b") for name in ("lin", "sf_lin")]
    moe = MixtureOfExperts(moe_experts, rx.WIDTH, k=4)  # every token visits every expert
    t.take()
    y, aux = moe(torch.randn(6, rx.WIDTH))
    assert t.take() == {"srv-a": ["batch"], "srv-b": ["batch"]}
    (y.sum() + aux).backward()
    assert t.take() == {"srv-a": ["batch"], "srv-b": ["batch"]}
    assert moe.gate.weight.grad is not None


# -- per-call semantics under coalescing -------------------------------------------------
def test_a_failing_or_late_call_fails_only_itself(world) -> None:
    t = rx.Counting()
    experts = [RemoteExpert("srv-b", "lin", transport=t),
               RemoteExpert("srv-b", "failing", transport=t),
               RemoteExpert("srv-b", "slow", forward_timeout=0.5, transport=t),  # sleeps 2 s
               RemoteExpert("srv-b", "lin", forward_timeout=5.0, transport=t)]
    xs = [torch.randn(2, rx.WIDTH, requires_grad=True) for _ in experts]
    started = time.monotonic()
    calls, group = start_calls(experts, xs)
    group.wait()
    elapsed = time.monotonic() - started
    assert t.take()["srv-b"][0] == "batch"  # one request (and collects for the rest)
    assert group.succeeded(0) and group.succeeded(3)
    failed, late = group.errors[1], group.errors[2]
    assert isinstance(failed, RemoteExpertError) and not isinstance(failed, TimeoutError)
    assert "'failing'" in str(failed) and "'srv-b'" in str(failed) and "boom" in str(failed)
    assert isinstance(late, RemoteTimeoutError)
    assert "forward of expert 'slow' on worker 'srv-b' missed its 0.5 s deadline" in str(late)
    assert 0.45 < elapsed < 0.5 + 0.4, elapsed
    # The fast answers were not held back by their slow sibling.
    for i in (0, 3):
        assert group.finished_at[i] - started < 0.4, (i, group.finished_at[i] - started)
    torch.testing.assert_close(calls[0].outputs[0], nn.functional.linear(
        xs[0], *local_copy(experts[0], nn.Linear(rx.WIDTH, rx.WIDTH)).parameters()))
    with pytest.raises(RemoteExpertError, match="'failing' on worker 'srv-b'.*boom"):
        parallel_apply(experts[:2], xs[:2])


def test_moe_masks_only_the_late_call(world) -> None:
    experts = [RemoteExpert("srv-b", "lin"), RemoteExpert("srv-b", "lin"),
               RemoteExpert("srv-b", "slow")]  # one request; "slow" sleeps 2 s
    moe = MixtureOfExperts(experts, rx.WIDTH, k=3, k_min=1, forward_timeout=1.0)
    x = torch.randn(8, rx.WIDTH, requires_grad=True)
    started = time.monotonic()
    y, aux = moe(x)
    assert time.monotonic() - started < 1.0 + 0.4
    stats = moe.stats()
    assert [s["timeouts"] for s in stats] == [0, 0, 1], stats
    assert [s["failures"] for s in stats] == [0, 0, 0], stats
    (y.sum() + aux).backward()
    assert x.grad is not None and bool(torch.isfinite(y).all())


def test_passes_without_grad(world) -> None:
    experts = [RemoteExpert(w, name) for w in ("srv-a", "srv-b") for name in ("sf_lin", "two")]
    before = experts[0].remote_stats()["stored"]
    x, y = torch.randn(3, rx.WIDTH, requires_grad=True), torch.randn(3, rx.WIDTH)
    with torch.no_grad():
        outs = parallel_apply(experts, [x, (x, y), x, (x, y)])
        moe = MixtureOfExperts([RemoteExpert(w, "lin") for w in ("srv-a", "srv-b")], rx.WIDTH, k=2)
        z, _ = moe(x)
    assert not outs[0].requires_grad and isinstance(outs[1], tuple) and len(outs[1]) == 2
    assert z.shape == x.shape and not z.requires_grad
    assert experts[0].remote_stats()["stored"] == before  # no state for a pass without grad
    torch.testing.assert_close(outs[0], local_copy(experts[0], nn.Linear(rx.WIDTH, rx.WIDTH))(x))


@pytest.mark.parametrize("prefix", ["", "sf_"])
def test_seeds_and_strategies_are_those_of_single_calls(world, prefix: str) -> None:
    # y = dropout(x) * w: the coalesced pass draws the masks an uncoalesced
    # loop (mode="inline": one RemoteExpert call after another) draws, and its
    # backward (recomputed or kept) uses them: x.grad == y / x.
    experts = [RemoteExpert(w, prefix + "drop_scale") for w in ("srv-a", "srv-b", "srv-a")]
    xs = [torch.rand(32, rx.WIDTH).add(0.5).requires_grad_() for _ in experts]
    torch.manual_seed(11)
    loop = parallel_apply(experts, xs, mode="inline")
    torch.manual_seed(11)
    outs = parallel_apply(experts, xs)
    torch.testing.assert_close(outs, loop)
    sum(o.sum() for o in outs).backward()
    for x, out in zip(xs, outs):
        assert 0 < int((out == 0).sum()) < out.numel()
        torch.testing.assert_close(x.grad, out.detach() / x.detach())


def test_stateful_states_are_owned_freed_and_released(world) -> None:
    experts = [RemoteExpert("srv-a", "bt_sf_lin") for _ in range(3)]
    flush_releases()
    assert wait_until(lambda: experts[0].remote_stats()["live"] == 0)
    outs = parallel_apply(experts, [torch.randn(2, rx.WIDTH, requires_grad=True) for _ in experts])
    assert experts[0].remote_stats()["live"] == 3
    sum(o.sum() for o in outs).backward()  # one coalesced backward frees all three
    assert experts[0].remote_stats()["live"] == 0
    outs = parallel_apply(experts, [torch.randn(2, rx.WIDTH, requires_grad=True) for _ in experts])
    assert experts[0].remote_stats()["live"] == 3
    del outs  # no backward: the client releases the states
    gc.collect()
    assert wait_until(lambda: experts[0].remote_stats()["live"] == 0), experts[0].remote_stats()
    # A stateful forward that misses its deadline in a coalesced request
    # leaves no state behind once it finishes on the server.
    slow = RemoteExpert("srv-a", "bt_sf_slow", forward_timeout=0.3)  # sleeps 1 s
    calls, group = start_calls([slow, experts[0]], [torch.randn(2, rx.WIDTH, requires_grad=True)
                                                    for _ in range(2)])
    group.wait()
    assert isinstance(group.errors[0], RemoteTimeoutError) and group.succeeded(1)
    del calls, group
    gc.collect()
    time.sleep(1.0)  # the late forward ends on the server
    flush_releases()
    assert wait_until(lambda: experts[0].remote_stats()["live"] == 0), experts[0].remote_stats()


def test_byte_caps_and_bad_jobs_fail_their_call_alone(world) -> None:
    small = RemoteExpert("srv-a", "small_lin")  # max_request_bytes=1 MiB
    huge = torch.zeros(1, rx.WIDTH).expand(2 ** 22, rx.WIDTH)  # 128 MiB once materialised
    calls, group = start_calls([small, small], [huge, torch.randn(4, rx.WIDTH)])
    group.wait()
    assert "max_request_bytes=1048576" in str(group.errors[0]), group.errors[0]
    assert "'small_lin'" in str(group.errors[0]) and group.succeeded(1)

    # Jobs a request carries are single-call requests: each is checked alone.
    t = torch.randn(2, rx.WIDTH)

    def forward(call: str, **change: Any) -> Dict[str, Any]:
        return dict({"op": "forward", "expert": "lin", "call": call, "seed": 0, "grad": True,
                     "flags": [True], "args": [t], "answer_by": None}, **change)
    jobs = [forward("id-1", flags=[True, True]),
            forward("id-2"),
            {"op": "control", "expert": "lin", "what": "stats", "payload": None,
             "answer_by": None},  # a batch carries forward and backward calls only
            {"op": "backward", "expert": "sf_lin", "call": "never-stored", "seed": 0,
             "flags": [True], "args": None, "grads": [t], "answer_by": None}]
    status, (answers, more) = ask("srv-a", {"op": "batch", "batch": "b" * 32, "jobs": jobs})
    assert status == "ok" and not more
    assert answers[0][0] == "error" and "flags" in answers[0][1], answers[0]
    assert answers[1][0] == "ok" and answers[1][1][0][0].shape == t.shape
    assert answers[2][0] == "error" and "a job is a dict whose op is one of" in answers[2][1]
    assert answers[3][0] == "error" and "no state for call" in answers[3][1]
    for bad, match in [({"batch": "b" * 32, "jobs": "nope"}, "jobs must be a list"),
                       ({"batch": "b" * 32, "jobs": []}, "jobs must be a list"),
                       ({"batch": "b" * 32, "jobs": [["forward", [], None]]}, "a job must be"),
                       ({"batch": "b" * 32, "jobs": [forward("id-4", answer_by=-1.0)]},
                        "answer_by"),
                       ({"batch": None, "jobs": jobs}, "batch id must be")]:
        status, text = ask("srv-a", dict(bad, op="batch"))
        assert status == "error" and match in text, (bad, text)
    status, text = ask("srv-a", {"op": "collect", "batch": "c" * 32})
    assert status == "error" and "unknown batch" in text
    assert run("srv-a", "kept_batches") == 0


# -- no thread per waiting call -----------------------------------------------------------
def test_64_waiting_remote_calls_park_no_pool_thread(world) -> None:
    """64 calls held on the servers at once (so all 64 are in flight together,
    more than the client's 32 workers could carry one each) while the
    client's pool runs only the pass's one local call."""
    for w in world:  # earlier tests' stragglers (2 s sleeps) leave the servers' pools
        assert wait_until(lambda w=w: run(w, "pool_busy") == 0), w
        run(w, "close_gate")
    release_local = threading.Event()
    ran_on: List[str] = []

    def local(x: Tensor) -> Tensor:
        ran_on.append(threading.current_thread().name)
        release_local.wait(20.0)
        return x + 1

    remote = [RemoteExpert(world[k % 2], "gate") for k in range(64)]
    xs = [torch.randn(2, rx.WIDTH) for _ in range(65)]
    pool = get_pool()
    threads_before = threading.active_count()
    try:
        calls, group = start_calls([*remote, local], xs)
        assert wait_until(lambda: sum(run(w, "gate_waiting") for w in world) == 64)
        assert wait_until(lambda: len(ran_on) == 1)
        # All 64 remote calls are in flight; one worker runs the local call.
        assert len(pool._running) == 1, len(pool._running)
        assert ran_on[0].startswith("moe_autograd-worker-"), ran_on
        assert threading.active_count() <= threads_before + 3, (
            threads_before, threading.active_count())
    finally:
        release_local.set()
        for w in world:
            run(w, "open_gate")
    group.wait()
    assert all(group.succeeded(i) for i in range(65)), [e for e in group.errors if e]
    torch.testing.assert_close(calls[0].outputs[0], xs[0] * 2)
    torch.testing.assert_close(calls[64].rebuild(calls[64].outputs), xs[64] + 1)


# -- the transport seam, in this process (no RPC world) -----------------------------------
class Recording(InProcess):
    """This process's endpoint as the worker ``here``, recording each frame's
    label; no callbacks needed (its pendings are done at once)."""

    def __init__(self) -> None:
        super().__init__("here")
        self.sent: List[str] = []

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Any:
        self.sent.append(frame.label)
        return super().call(worker, frame, timeout)


class _Never:
    """A reply that never comes; it records its callback."""

    def __init__(self) -> None:
        self.callbacks: List[Callable[[], None]] = []

    def done(self) -> bool:
        return False

    def result(self, timeout: Optional[float]) -> Any:
        raise TransportTimeout("never")

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        self.callbacks.append(fn)


class Silent:
    """A transport whose replies never come (a frozen peer)."""

    name = "silent"

    def __init__(self, default: Optional[float] = None) -> None:
        self.default = default

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> _Never:
        return _Never()

    def local_name(self) -> str:
        return "here"

    def default_timeout(self) -> Optional[float]:
        return self.default


@pytest.mark.parametrize("backward", ["stateless", "stateful"])
def test_in_process_transport_coalesces(backward: str) -> None:
    transport = Recording()
    modules = {f"unit_bt_{backward}_{k}": nn.Linear(3, 3) for k in range(3)}
    with ExpertServer(modules, backward=backward, transport=transport):
        experts = [RemoteExpert("here", name, transport=transport) for name in modules]
        xs = [torch.randn(2, 3, requires_grad=True) for _ in experts]
        outs = parallel_apply(experts, xs)
        sum(o.sum() for o in outs).backward()
        assert transport.sent == ["batch:forward", "batch:backward"]
        lxs = [x.detach().clone().requires_grad_() for x in xs]
        sum(m(x).sum() for m, x in zip(modules.values(), lxs)).backward()
        torch.testing.assert_close([x.grad for x in xs], [x.grad for x in lxs])


def test_deadlines_hold_when_no_reply_comes() -> None:
    transport = Silent(default=0.6)
    experts = [RemoteExpert("w", "a", forward_timeout=0.2, transport=transport),
               RemoteExpert("w", "b", transport=transport)]  # the transport's 0.6 s
    xs = [torch.randn(2, 3, requires_grad=True) for _ in experts]
    start_calls([nn.Identity()], [torch.randn(1)])[1].wait()  # one-time imports, off the clock
    started = time.monotonic()
    calls, group = start_calls(experts, xs)
    gc.collect(0)  # nothing but the deadline watcher keeps the unanswered request
    group.wait()
    assert group.finished_at[0] - started == pytest.approx(0.2, abs=0.15)
    assert group.finished_at[1] - started == pytest.approx(0.6, abs=0.2)
    assert "forward of expert 'a' on worker 'w' missed its 0.2 s deadline" in str(group.errors[0])
    assert isinstance(group.errors[1], RemoteTimeoutError)
    assert "'b' on worker 'w' missed the transport's own timeout" in str(group.errors[1])


def test_a_transport_without_callbacks_gets_a_waiter_per_request() -> None:
    from moe_autograd.remote.transport import when_done

    class Later:
        def __init__(self) -> None:
            self.ready = threading.Event()

        def done(self) -> bool:
            return self.ready.is_set()

        def result(self, timeout: Optional[float]) -> Any:
            if not self.ready.wait(timeout):
                raise TransportTimeout("late")
            return ("ok", 42)

    got: List[Any] = []
    seen = threading.Event()
    pending = Later()
    when_done(pending, lambda reply, error: (got.append((reply, error)), seen.set()), 5.0)
    assert not got
    pending.ready.set()
    assert seen.wait(5.0) and got == [(("ok", 42), None)]
    late = Later()
    when_done(late, lambda reply, error: got.append((reply, type(error))), 0.05)
    assert wait_until(lambda: len(got) == 2, 5.0) and got[1] == (None, TransportTimeout)
