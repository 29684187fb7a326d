"""The execution modes (moe_autograd.policy): same results in every mode,
forcing works, and auto mode puts a site in its mode by its second batch:
inline for tiny calls, within the cores for calls that compute, fanned out
for calls that wait; time queued for a core never counts as waiting, and a
site that changes kind changes mode.

The rule's own tests feed it measurements (``policy.record``); the others run
real experts and check only decisions and concurrency, never a speed."""
import functools
import threading
import time
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Sequence

import pytest
import torch
from torch import Tensor, nn

from helpers import BackwardBarrier, Square
from moe_autograd import map_with_parallel_backward, parallel_apply, policy

MODES = ["inline", "lanes", "parallel", "auto"]
DT = torch.float64


class Noisy(nn.Module):
    """Linear -> dropout -> tanh: draws random numbers, saves activations."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(6, 6, dtype=DT)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(6, 6, generator=g, dtype=DT))
        self.drop = nn.Dropout(0.3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.drop(self.fc(x)))


def _run(mode: str, checkpoint: Any = False, nested: bool = False) -> List[Tensor]:
    """Outputs, then gradients of every input and parameter, for one seed."""
    torch.manual_seed(0)
    experts: List[Any] = [Noisy(k) for k in range(3)]
    experts.append(experts[0])  # a shared module
    if nested:
        inner = [Noisy(10), Noisy(11)]

        def fan_out(x: Tensor) -> Tensor:
            a, b = parallel_apply(inner, [x, x * 2], mode=mode)
            return a * b
        experts.append(fan_out)
    xs = [torch.randn(5, 6, dtype=DT, requires_grad=True) for _ in experts]
    outs = parallel_apply(experts, xs, checkpoint=checkpoint, mode=mode)
    sum((o * (k + 1)).sum() for k, o in enumerate(outs)).backward()
    params = [p for e in experts if isinstance(e, nn.Module) for p in e.parameters()]
    if nested:
        params += [p for e in inner for p in e.parameters()]
    return [o.detach() for o in outs] + [t.grad for t in xs + params]  # type: ignore[misc]


def _same(a: Sequence[Optional[Tensor]], b: Sequence[Optional[Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y), (x - y).abs().max()  # type: ignore[operator]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", [False, True, [True, False, True, False]],
                         ids=["plain", "checkpoint", "mixed"])
def test_every_mode_gives_the_same_bits(checkpoint: Any) -> None:
    want = _run("parallel", checkpoint)
    for mode in MODES:
        for _ in range(policy.EVIDENCE + 1):  # auto: past the new-site batches
            _same(_run(mode, checkpoint), want)


@pytest.mark.timeout(60)
def test_nested_calls_give_the_same_bits_in_every_mode() -> None:
    want = _run("parallel", nested=True)
    for mode in MODES:
        _same(_run(mode, nested=True), want)


@pytest.mark.timeout(60)
def test_map_gives_the_same_bits_in_every_mode() -> None:
    def run(mode: str) -> List[Tensor]:
        xs = [torch.randn(4, dtype=DT, generator=torch.Generator().manual_seed(k),
                          requires_grad=True) for k in range(6)]
        outs = map_with_parallel_backward(Square, *[(x,) for x in xs], mode=mode)
        shared = torch.ones(4, dtype=DT, requires_grad=True)
        outs2 = map_with_parallel_backward(Square, *[(shared * k,) for k in range(3)], mode=mode)
        (sum(o[0].sum() for o in outs) + sum(o[0].sum() for o in outs2)).backward()
        return [o[0].detach() for o in outs] + [x.grad for x in xs] + [shared.grad]  # type: ignore[misc]
    want = run("parallel")
    for mode in MODES:
        _same(run(mode), want)


class Boom(RuntimeError):
    pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_a_failing_call_raises_its_own_error_in_every_mode(mode: str) -> None:
    def bad(x: Tensor) -> Tensor:
        raise Boom("expert 1 failed")
    with pytest.raises(Boom, match="expert 1 failed") as info:
        parallel_apply([nn.Identity(), bad, nn.Identity()], [torch.ones(2)] * 3, mode=mode)
    assert any("call 1 of 3" in note for note in getattr(info.value, "__notes__", []))


def test_bad_mode_names_the_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        parallel_apply([nn.Identity()], [torch.ones(1)], mode="fast")
    monkeypatch.setenv("MOE_AUTOGRAD_MODE", "sometimes")
    with pytest.raises(ValueError, match="MOE_AUTOGRAD_MODE"):
        parallel_apply([nn.Identity()], [torch.ones(1)])


def _site_stats(name: str) -> dict:
    return next(s for s in policy.execution_stats() if name in s["site"])


@pytest.mark.timeout(60)
def test_auto_runs_tiny_calls_inline_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_AUTOGRAD_MODE", raising=False)
    xs = [torch.randn(4, requires_grad=True) for _ in range(16)]
    threads: List[str] = []

    class Tiny(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
            threads.append(threading.current_thread().name)
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
            return g * 2

    for _ in range(policy.EVIDENCE + 3):
        threads.clear()
        outs = map_with_parallel_backward(Tiny, *[(x,) for x in xs])
        sum(o[0].sum() for o in outs).backward()
    stats = _site_stats("Tiny")
    assert stats["mode"] == "inline", stats
    assert set(threads) == {threading.current_thread().name}
    assert stats["batches"]["parallel"] == policy.EVIDENCE


@pytest.mark.timeout(60)
def test_lanes_run_on_at_most_their_count_of_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "cores", lambda: 2)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # two lanes of one intra-op thread fit two cores
    try:
        names: List[str] = []
        barrier = threading.Barrier(2, timeout=10)

        def call(x: Tensor) -> Tensor:
            names.append(threading.current_thread().name)
            if len(names) <= 2:
                barrier.wait()  # the first two calls run at once: two lanes
            return x + 1
        parallel_apply([call] * 6, [torch.ones(1)] * 6, mode="lanes")
        assert len(set(names)) <= 2
    finally:
        torch.set_num_threads(previous)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_moe_layer_gives_the_same_bits_in_every_mode(checkpoint: bool) -> None:
    from moe_autograd import MixtureOfExperts

    def run(mode: str) -> List[Optional[Tensor]]:
        torch.manual_seed(0)
        moe = MixtureOfExperts([Noisy(k) for k in range(4)], 6, k=2, checkpoint=checkpoint,
                               mode=mode).double()
        x = torch.randn(3, 5, 6, dtype=DT, requires_grad=True)
        y, aux = moe(x)
        (y.square().sum() + aux).backward()
        return [y.detach(), x.grad] + [p.grad for p in moe.parameters()]
    want = run("parallel")
    for mode in MODES:
        for _ in range(policy.EVIDENCE + 1):
            _same(run(mode), want)


def test_moe_layer_with_deadlines_always_fans_out() -> None:
    from moe_autograd import MixtureOfExperts
    moe = MixtureOfExperts([nn.Linear(2, 2) for _ in range(2)], 2, k=1, forward_timeout=5.0,
                           mode="inline")
    assert moe._decide(list(moe.experts))[0].mode == "parallel"
    with pytest.raises(ValueError, match="mode must be one of"):
        MixtureOfExperts([nn.Linear(2, 2)], 2, k=1, mode="fastest")


# -- the rule, fed measurements -----------------------------------------------------

@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A 2-core machine with 2 intra-op threads: one lane fits."""
    monkeypatch.setattr(policy, "cores", lambda: 2)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _feed(site: Hashable, wall: float, cpu: float, queued: Optional[float],
          n: int = 16, process: Optional[float] = None) -> policy.Decision:
    """Runs one batch of ``n`` calls as auto mode picks it, each call taking
    ``wall`` seconds of which ``cpu`` on a CPU and ``queued`` queued for a core
    (None: run queue not read); returns the decision the batch ran under."""
    decision = policy.choose(site, n)
    batch = wall if decision.mode == "parallel" else wall * n
    policy.record(site, n, batch, cpu * n if process is None else process, wall * n, cpu * n,
                  decision, None if queued is None else queued * n)
    return decision


def _stats(site: Hashable) -> Dict[str, Any]:
    return next(s for s in policy.execution_stats() if s["site"] == policy._name(site))


def test_time_queued_for_a_core_is_not_waiting(two_cores: None) -> None:
    """The issue's case: 16 compute-bound calls fanned out on 2 cores are on a
    CPU ~5% of their time because they queue for a core. The old rule read
    that as "calls wait"; the batch is crowded, so the second batch runs
    within the cores (a probe), which shows them CPU-bound."""
    site = frozenset(("compute",))
    first = _feed(site, wall=0.060, cpu=0.003, queued=0.036)  # blocked 35%, queued 60%
    assert (first.mode, first.reason) == ("parallel", policy.NEW_SITE)
    second = policy.choose(site, 16)
    assert second.mode == "inline" and second.probe
    assert "queued for a core 60% of their time" in second.reason, second.reason
    _feed(site, wall=0.0025, cpu=0.002, queued=0.0003)  # inline: blocked 8%
    third = policy.choose(site, 16)
    assert third.mode == "inline" and not third.probe
    assert third.reason == ("CPU-bound: blocked 8% of their time (on a CPU 80%, queued for "
                            "one 12%); one lane fits the cores"), third.reason
    stats = _stats(site)
    assert stats["batches"] == {"parallel": 1, "inline": 1}
    assert stats["clear_batches"] == 1 and stats["crowded"] == 0.6
    assert (stats["blocked"], stats["queued"], stats["on_cpu"]) == (0.08, 0.12, 0.8)


def test_calls_that_block_each_other_are_not_waiting(two_cores: None) -> None:
    """Fanned out, tiny calls that take turns at the GIL are blocked half their
    time on average, but the first hardly at all; calls that wait all wait.
    The least-blocked call bounds the share."""
    site = frozenset(("gil",))
    decision = policy.choose(site, 16)
    policy.record(site, 16, 0.003, 0.0036, 16 * 0.0006, 16 * 0.00013, decision,
                  16 * 0.0001, least_blocked=0.05)  # blocked 62% on average, 5% least
    assert policy.choose(site, 16).reason.startswith("CPU-bound: blocked 5% of their time")
    waiting = frozenset(("sleepers",))
    decision = policy.choose(waiting, 16)
    policy.record(waiting, 16, 0.006, 0.002, 16 * 0.0055, 16 * 0.0001, decision,
                  16 * 0.0002, least_blocked=0.95)
    assert policy.choose(waiting, 16).reason.startswith("calls wait: blocked 95%")


class _Clock:
    """A fake ``time`` for :mod:`moe_autograd.policy`: wall and CPU clocks
    that move only when a call says so, so a test measures the rule and not
    how busy the machine is."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu

    process_time = thread_time

    def sleep(self, seconds: float) -> None:  # blocked: the wall clock alone moves
        self.wall += seconds

    def compute(self, seconds: float) -> None:  # on a CPU: both move
        self.wall += seconds
        self.cpu += seconds


def test_measure_counts_only_what_every_call_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    """One call sleeps, the other computes: the batch did not wait, whatever
    the average says. Both sleep: it waited. One sleeps half its time: the
    share is that of the least-blocked call (n times its blocked time over
    the calls' total)."""
    clock = _Clock()
    monkeypatch.setattr(policy, "time", clock)
    monkeypatch.setattr(policy, "_queued_s", lambda: 0.0)
    for site, calls, blocked in (
            (frozenset(("one sleeps",)), (clock.sleep, clock.compute), 0.0),
            (frozenset(("both sleep",)), (clock.sleep, clock.sleep), 1.0),
            (frozenset(("two of three sleep",)), (clock.sleep, clock.sleep, clock.compute), 0.0),
            (frozenset(("partly",)), ((lambda s: (clock.sleep(s / 2), clock.compute(s / 2))),
                                      clock.sleep), 2 * 0.025 / 0.1)):
        decision = policy.Decision("parallel", 2, "measured")
        with policy.Measure(site, len(calls), decision) as measure:
            for i, call in enumerate(calls):
                measure.timed(i, functools.partial(call, 0.05))()
        assert _stats(site)["blocked"] == pytest.approx(blocked, abs=1e-3), site


def test_a_busy_machine_teaches_nothing_within_the_cores(two_cores: None) -> None:
    """Run within the cores on a machine other processes keep busy, calls queue
    and, in an intra-op team, block while a teammate queues: such batches are
    crowded too, move no average, and the site stays within the cores."""
    site = frozenset(("busy machine",))
    _feed(site, wall=0.060, cpu=0.003, queued=0.036)  # fanned out, crowded
    for _ in range(5):
        decision = _feed(site, wall=0.015, cpu=0.002, queued=0.006)  # blocked 47%, queued 40%
        assert decision.mode == "inline" and decision.probe, decision
    assert policy.choose(site, 16).reason.startswith(
        "inline, calls queued for a core 40% of their time; no clear batch yet")
    assert _stats(site)["clear_batches"] == 0
    _feed(site, wall=0.0025, cpu=0.002, queued=0.0003)  # the machine is quiet again
    assert policy.choose(site, 16).reason.startswith("CPU-bound: blocked 8%")


def test_waiting_calls_fan_out_from_the_second_batch(two_cores: None) -> None:
    site = frozenset(("waiting",))
    _feed(site, wall=0.006, cpu=0.0002, queued=0.0003)  # blocked 92%
    decision = policy.choose(site, 16)
    assert decision.mode == "parallel" and not decision.probe
    assert decision.reason == ("calls wait: blocked 92% of their time "
                               "(neither on a CPU nor queued for one)")


def test_calls_under_300_us_run_inline(two_cores: None) -> None:
    site = frozenset(("tiny",))
    _feed(site, wall=0.0008, cpu=0.0001, queued=0.0006)  # own time 200 us, crowded
    assert (policy.choose(site, 16).mode, policy.choose(site, 16).reason) == \
        ("inline", "calls take 200 us")


def test_a_site_that_changes_kind_changes_mode_with_hysteresis(two_cores: None) -> None:
    site = frozenset(("drifting",))
    _feed(site, wall=0.006, cpu=0.0002, queued=0.0003)  # waits: blocked 92%
    modes = [_feed(site, wall=0.010, cpu=0.0045, queued=0.0).mode for _ in range(12)]
    assert set(modes) == {"parallel"}  # blocked 55%, still >= 50% - 10%
    modes = [_feed(site, wall=0.010, cpu=0.0065, queued=0.0005).mode for _ in range(12)]
    assert modes[0] == "parallel" and modes[-1] == "inline"  # blocked 30%: CPU-bound
    assert _stats(site)["reason"].startswith("CPU-bound"), _stats(site)
    modes = [_feed(site, wall=0.010, cpu=0.0045, queued=0.0).mode for _ in range(12)]
    assert set(modes) == {"inline"}  # blocked 55%: not past 50% + 10%
    modes = [_feed(site, wall=0.010, cpu=0.0005, queued=0.0).mode for _ in range(12)]
    assert modes[0] == "inline" and modes[-1] == "parallel"  # blocked 95%: waits again


def test_a_waiting_site_whose_fan_out_crowds_is_rechecked_with_backoff(two_cores: None) -> None:
    """Crowded fanned-out batches teach nothing; after RECHECK of them the site
    runs one batch within the cores. If it still waits, the next recheck comes
    twice as late; if it now computes, it stays within the cores."""
    site = frozenset(("rechecked",))
    _feed(site, wall=0.006, cpu=0.0002, queued=0.0003)  # waits

    def crowded() -> str:  # fanned out, queued 50%
        return _feed(site, wall=0.030, cpu=0.002, queued=0.015).mode
    for interval in (policy.RECHECK, 2 * policy.RECHECK):
        assert [crowded() for _ in range(interval)] == ["parallel"] * interval
        probe = policy.choose(site, 16)
        assert probe.mode == "inline" and probe.probe, probe
        assert f"({interval} crowded batches): measured within the cores again" in probe.reason
        _feed(site, wall=0.006, cpu=0.0002, queued=0.0003)  # the probe: still waits
        assert policy.choose(site, 16).mode == "parallel"
    for _ in range(4 * policy.RECHECK):
        crowded()
    _feed(site, wall=0.010, cpu=0.002, queued=0.005)  # the probe, crowded: inconclusive
    assert [crowded() for _ in range(8 * policy.RECHECK)][-1] == "parallel"  # backed off
    _feed(site, wall=0.003, cpu=0.0025, queued=0.0003)  # the probe: now CPU-bound
    assert policy.choose(site, 16).mode == "inline"
    assert _stats(site)["crowded"] == 0.5


def test_without_a_run_queue_a_batch_that_fills_the_cores_is_crowded(two_cores: None) -> None:
    site = frozenset(("no-schedstat",))
    # Fanned out on 2 cores, the process kept them 90% busy, the calls' threads
    # a fair share of it: crowded, whatever the calls' time off a CPU.
    _feed(site, wall=0.060, cpu=0.005, queued=None, process=0.108)
    decision = policy.choose(site, 16)
    assert decision.mode == "inline" and decision.probe
    assert "the process kept 90% of the cores busy" in decision.reason
    waiting = frozenset(("no-schedstat-waiting",))
    _feed(waiting, wall=0.006, cpu=0.0002, queued=None, process=0.004)  # 33% busy
    assert policy.choose(waiting, 16).mode == "parallel"


def test_forced_batches_teach_auto_nothing(two_cores: None) -> None:
    site = frozenset(("forced",))
    for _ in range(3):
        decision = policy.choose(site, 16, "inline")
        policy.record(site, 16, 0.05, 0.05, 0.05, 0.0001, decision, 0.0)
    assert policy.choose(site, 16).reason == policy.NEW_SITE
    assert _stats(site)["batches"] == {"inline (forced)": 3}


def test_the_run_queue_is_read_per_thread() -> None:
    if not policy._SCHED_OK:
        pytest.skip("no /proc/thread-self/schedstat here")
    here = policy._queued_s()
    assert isinstance(here, float) and here >= 0
    seen: List[Optional[float]] = []
    thread = threading.Thread(target=lambda: seen.append(policy._queued_s()))
    thread.start()
    thread.join()
    assert isinstance(seen[0], float) and seen[0] >= 0
    policy._after_fork()  # a forked child reopens its own thread's file
    assert isinstance(policy._queued_s(), float)


# -- real experts -------------------------------------------------------------------

def _mlp(d: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """Calls without an intra-op team: on a machine that other processes load
    several times over, every fanned-out call of a team blocks while its
    teammate queues, and the first batch can look like waiting (a known
    limit, see moe_autograd.policy); without a team the calls queue."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.mark.timeout(120)
def test_a_compute_site_runs_within_the_cores_from_its_second_batch(
        monkeypatch: pytest.MonkeyPatch, one_intra_op_thread: None) -> None:
    """16 compute-bound experts: the first batch fans out, every later one
    runs on at most as many threads as lanes fit the cores (two lanes on 2
    cores), and the stats never say they wait."""
    monkeypatch.delenv("MOE_AUTOGRAD_MODE", raising=False)
    torch.manual_seed(0)
    experts = [_mlp(256, 1024) for _ in range(16)]
    xs = [torch.randn(64, 256, requires_grad=True) for _ in experts]
    threads: List[str] = []
    hooks = [e.register_forward_pre_hook(
        lambda m, a: threads.append(threading.current_thread().name)) for e in experts]
    try:
        for batch in range(1, 4):
            threads.clear()
            outs = parallel_apply(experts, xs)
            sum(o.sum() for o in outs).backward()
            stats = _site_stats("Sequential")
            if batch == 1:
                assert stats["mode"] == "parallel" and stats["reason"] == policy.NEW_SITE
                continue
            lanes = policy._lanes_for(16)
            assert stats["mode"] == ("inline" if lanes == 1 else "lanes"), stats
            assert not stats["reason"].startswith("calls wait"), stats
            assert len(set(threads)) <= lanes, threads
        assert stats["batches"] == {"parallel": 1, stats["mode"]: 2}, stats
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.timeout(120)
def test_a_waiting_site_fans_out_from_its_second_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts that sleep 30 ms (as on a network): every batch fans out, in
    forward and in backward, which a Barrier of all calls in each pass proves
    (it breaks unless all calls run at once), and the stats say they wait."""
    monkeypatch.delenv("MOE_AUTOGRAD_MODE", raising=False)
    n = 4
    for batch in range(1, 5):
        fwd, bwd = threading.Barrier(n, timeout=10), threading.Barrier(n, timeout=10)

        def meet(x: Tensor, fwd: threading.Barrier = fwd, bwd: threading.Barrier = bwd) -> Tensor:
            time.sleep(0.030)
            fwd.wait()
            return BackwardBarrier.apply(x * 2, bwd)
        outs = parallel_apply([meet] * n, [torch.ones(2, requires_grad=True) for _ in range(n)])
        sum(o.sum() for o in outs).backward()
        stats = _site_stats("meet")
        assert stats["mode"] == "parallel", stats
        if batch > 1:
            assert stats["reason"].startswith("calls wait: blocked"), stats
    assert stats["batches"] == {"parallel": 4} and stats["crowded"] is None, stats


@pytest.mark.timeout(120)
def test_a_site_whose_calls_start_waiting_fans_out(monkeypatch: pytest.MonkeyPatch,
                                                   one_intra_op_thread: None) -> None:
    """Drift, for real: experts that compute run within the cores; once they
    sleep 30 ms a call, the site fans out within a few batches (the moving
    average must pass WAIT_SHARE + HYSTERESIS: four or five batches)."""
    monkeypatch.delenv("MOE_AUTOGRAD_MODE", raising=False)
    monkeypatch.setattr(policy, "cores", lambda: 1)  # one lane: inline
    torch.manual_seed(0)
    sleep = [0.0]

    class Sometimes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = _mlp(128, 512)

        def forward(self, x: Tensor) -> Tensor:
            if sleep[0]:
                time.sleep(sleep[0])
            return self.mlp(x)

    experts = [Sometimes() for _ in range(8)]
    xs = [torch.randn(64, 128, requires_grad=True) for _ in experts]

    def step() -> str:
        sum(o.sum() for o in parallel_apply(experts, xs)).backward()
        return str(_site_stats("Sometimes")["mode"])
    assert [step() for _ in range(3)][1:] == ["inline"] * 2, _site_stats("Sometimes")
    sleep[0] = 0.030  # blocked ~90% of each call inline: the average rises past 60%
    modes = [step() for _ in range(10)]
    assert modes[-1] == "parallel", (modes, _site_stats("Sometimes"))


class _Custom(nn.Module):
    """A module of the user's: its forward may wait, or meet another call's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


def test_a_new_site_of_torch_nn_modules_on_the_cpu_starts_within_the_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.nn's own modules run no user code, so their calls cannot wait:
    a new site of them runs its first batch within the cores (a probe), not
    fanned out over every worker; a user module, a hook or a non-module
    keeps the first fan-out (experts that meet each other meet in it)."""
    monkeypatch.delenv("MOE_AUTOGRAD_MODE", raising=False)
    plain = [nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(4)]
    assert policy.computes(plain) and policy.computes([nn.Linear(2, 2), nn.LayerNorm(2)])
    hooked = nn.Linear(8, 8)
    hooked.register_forward_hook(lambda m, a, o: None)
    for other in ([_Custom()], [nn.Sequential(_Custom())], [hooked], [lambda x: x]):
        assert not policy.computes(other)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in plain]
    outs = parallel_apply(plain, xs)
    sum(o.sum() for o in outs).backward()
    stats = _site_stats("Sequential")
    assert stats["reason"].startswith(policy.COMPUTES) and stats["mode"] in ("inline", "lanes")
    parallel_apply([_Custom() for _ in range(4)], xs)
    assert _site_stats("_Custom")["reason"] == policy.NEW_SITE


@pytest.mark.timeout(60)
@pytest.mark.skipif(not policy._SCHED_OK, reason="the kernel keeps no run-queue statistics")
def test_run_queue_descriptors_close_with_their_threads() -> None:
    """Each thread reads its run queue through a descriptor of its own: it is
    closed when the thread ends (no ResourceWarning, no descriptor left)."""
    import gc
    import os
    import threading
    import warnings

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    gc.collect()
    before = fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(8):
            thread = threading.Thread(target=policy._queued_s)
            thread.start()
            thread.join()
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert fds() <= before
