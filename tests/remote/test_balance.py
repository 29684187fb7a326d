"""Replica choice (issue 32): :class:`ReplicaBalancer` on a fake clock and fake
latencies (each invariant of moe_autograd/remote/balance.py by number), and
a :class:`FleetExpert` over in-process replicas: backward to the forward's
replica, every call ended once, a failing replica penalised and re-probed.

The integration tests with real servers (three replicas, one slowed by a
server-side sleep) are in test_elastic.py (torch RPC, ``Fleet``) and
test_ray_fleet.py (Ray, ``RayFleet``)."""
import random
import threading
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

from moe_autograd.remote import (BALANCE_POLICIES, ExpertServer, FleetExpert, ReplicaBalancer,
                                  flush_releases)
from moe_autograd.remote.balance import MAX_BACKOFF, check_balance
from moe_autograd.remote.frame import Frame
from moe_autograd.remote.transport import TransportSendError
from wiring import SECRET, InProcess

pytestmark = pytest.mark.timeout(30)


class Clock:
    """A fake clock: time moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _balancer(seed: int = 0, **options: Any) -> Tuple[ReplicaBalancer, Clock]:
    clock = Clock()
    return ReplicaBalancer(rng=random.Random(seed), clock=clock, **options), clock


def _run(balancer: ReplicaBalancer, clock: Clock, latency: Dict[str, float], calls: int,
         expert: str = "e", fail: Tuple[str, ...] = ()) -> List[str]:
    """``calls`` calls one after another: choose, then end after the
    replica's latency (forward and backward), the clock moving by it."""
    chosen = []
    for _ in range(calls):
        worker = balancer.choose(expert, sorted(latency))
        chosen.append(worker)
        clock.now += latency[worker]
        balancer.end(expert, worker, "forward", latency[worker], worker not in fail)
        if worker not in fail:
            balancer.begin(expert, worker)
            clock.now += latency[worker]
            balancer.end(expert, worker, "backward", latency[worker], True)
    return chosen


def _until(balancer: ReplicaBalancer, clock: Clock, latency: Dict[str, float], until: float,
           fail: Tuple[str, ...] = (), stop: str = "") -> List[str]:
    """Calls one after another until the clock reads ``until`` (or right
    after a call on ``stop``)."""
    chosen: List[str] = []
    while clock.now < until and stop not in chosen:
        chosen += _run(balancer, clock, latency, 1, fail=fail)
    return chosen


def test_slow_replica_gets_only_probes() -> None:
    """Three replicas, one 5x slower: after one exploration each, the slow
    one is chosen only when it is re-probed (once per ``probe_after``)."""
    balancer, clock = _balancer(probe_after=5.0)
    latency = {"a": 0.010, "b": 0.010, "c": 0.050}
    chosen = _run(balancer, clock, latency, 300)
    assert chosen[:3] == ["a", "b", "c"]  # unmeasured replicas are explored first, in order
    probes = [k for k, w in enumerate(chosen) if w == "c"]
    # 300 calls of ~20 ms on a and b: 6 s, so one re-probe after 5 s without a call on c
    assert len(probes) == 2, probes
    assert {"a", "b"} == set(chosen[3:]) - {"c"}
    stats = balancer.stats()["e"]
    assert stats["c"]["calls"] == 2 and stats["c"]["probes"] == 2  # both were explorations
    assert stats["c"]["forward_ms"] == pytest.approx(50.0)
    assert stats["a"]["forward_ms"] == pytest.approx(10.0)
    assert stats["a"]["backward_ms"] == pytest.approx(10.0)
    assert all(s["in_flight"] == 0 for s in stats.values())
    assert sum(s["calls"] for s in stats.values()) == 300


def test_invariant_1_same_seed_same_choices() -> None:
    """Invariant 1: same candidates, outcomes, clock and seed: same choices."""
    latency = {"a": 0.010, "b": 0.011, "c": 0.012, "d": 0.030}
    runs = [_run(*_balancer(seed=7), latency, 200) for _ in range(2)]
    assert runs[0] == runs[1]
    other = _run(*_balancer(seed=8), latency, 200)
    assert other != runs[0]  # the draw does depend on the seed


def test_invariant_2_concurrent_choices_see_each_other() -> None:
    """Invariant 2: choices made at once (a barrier) are counted in flight
    under the lock: 3 unmeasured replicas, 3 calls at once: one each; then
    30 more at once on measured, equal replicas: spread by calls in flight."""
    balancer, clock = _balancer()
    workers = ["a", "b", "c"]
    barrier = threading.Barrier(3)
    chosen: List[str] = []
    lock = threading.Lock()

    def choose() -> None:
        barrier.wait(10.0)
        worker = balancer.choose("e", workers)
        with lock:
            chosen.append(worker)
    threads = [threading.Thread(target=choose) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert sorted(chosen) == workers
    assert [balancer.in_flight("e", w) for w in workers] == [1, 1, 1]
    for w in workers:
        balancer.end("e", w, "forward", 0.01, True)

    barrier = threading.Barrier(30)
    chosen.clear()
    threads = [threading.Thread(target=choose) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    counts = [chosen.count(w) for w in workers]
    assert sum(counts) == 30 and [balancer.in_flight("e", w) for w in workers] == counts
    # two choices on equal latencies, by calls in flight: none gets more than
    # twice the others' (one replica would take all 30 without the counts)
    assert max(counts) <= 2 * min(counts) + 2, counts


def test_invariant_3_every_call_ends_once_and_counts_stay_positive() -> None:
    """Invariant 3: each choose/begin is ended by one end; an end without a
    begin does not drive the count below zero; ``ok=None`` records nothing."""
    balancer, clock = _balancer()
    worker = balancer.choose("e", ["a"])
    balancer.begin("e", "a")
    balancer.begin("other", "a")
    assert balancer.in_flight("e", "a") == 2 and balancer.in_flight("other", "a") == 1
    balancer.end("e", worker, "forward", 0.0, None)  # never reached the replica
    assert balancer.in_flight("e", "a") == 1 and balancer.stats()["e"]["a"]["calls"] == 0
    balancer.end("e", "a", "backward", 0.02, True)
    balancer.end("e", "a", "backward", 0.02, True)  # one too many
    assert balancer.in_flight("e", "a") == 0 and balancer.in_flight("other", "a") == 1
    assert balancer.stats()["e"]["a"]["in_flight"] == 0


def test_invariant_4_failed_replica_is_penalised_then_reprobed() -> None:
    """Invariant 4: a failure leaves the replica out of the draw; it is
    re-probed after ``probe_after`` (doubling with each failure in a row, at
    most MAX_BACKOFF times), and once it answers well it gets calls again,
    its stale estimate replaced by the new sample."""
    balancer, clock = _balancer(probe_after=1.0)
    latency = {"a": 0.010, "b": 0.010, "c": 0.005}
    _run(balancer, clock, latency, 3)  # each explored once: c is the fastest
    assert _run(balancer, clock, latency, 20).count("c") >= 10
    chosen = _run(balancer, clock, latency, 1, fail=("c",))  # c fails (a draw picks it)
    while chosen[-1] != "c":
        chosen = _run(balancer, clock, latency, 1, fail=("c",))
    assert balancer.stats()["e"]["c"]["penalised"] == 1
    failed_at = clock.now
    chosen = _until(balancer, clock, latency, failed_at + 0.99, fail=("c",))
    assert "c" not in chosen  # within its wait (1 s): left out of every draw
    chosen = _until(balancer, clock, latency, failed_at + 1.02, fail=("c",), stop="c")
    assert chosen[-1:] == ["c"]  # its wait passed: re-probed (and it fails again)
    assert balancer.stats()["e"]["c"]["penalised"] == 2
    failed_at = clock.now
    chosen = _until(balancer, clock, latency, failed_at + 1.99)
    assert "c" not in chosen  # the second wait is 2 s
    chosen = _until(balancer, clock, latency, failed_at + 2.02, stop="c")
    assert chosen[-1:] == ["c"]  # re-probed; recovered: it answered well
    stats = balancer.stats()["e"]["c"]
    assert stats["penalised"] == 0 and stats["forward_ms"] == pytest.approx(5.0)
    assert _run(balancer, clock, latency, 20).count("c") >= 10  # traffic again

    flaky, clock = _balancer(probe_after=1.0)
    for _ in range(10):
        _run(flaky, clock, {"x": 0.01}, 1, fail=("x",))
        clock.now += 1.0 * MAX_BACKOFF  # the longest wait: always re-probed
    assert flaky.stats()["e"]["x"]["penalised"] == 10


def test_invariant_4_stale_estimate_is_replaced() -> None:
    """Invariant 4: a replica that lost every draw for ``probe_after`` is
    probed again, and its next sample replaces (not averages) its estimate:
    a replica that was slow and recovered is used again at once."""
    balancer, clock = _balancer(probe_after=2.0)
    latency = {"a": 0.010, "b": 0.050}
    _run(balancer, clock, latency, 2)
    assert set(_run(balancer, clock, latency, 50)) == {"a"}  # two candidates: a wins every draw
    latency["b"] = 0.002  # b recovered; nobody knows yet
    chosen = _until(balancer, clock, latency, clock.now + 3.0, stop="b")
    assert chosen[-1] == "b" and len(chosen) > 50  # re-probed after 2 s (the 52nd call)
    assert balancer.stats()["e"]["b"]["forward_ms"] == pytest.approx(2.0)
    assert set(_run(balancer, clock, latency, 20)) == {"b"}


def test_queue_length_weighs_in() -> None:
    """The score is latency x (1 + calls of the expert in flight there): a
    replica twice as fast with three calls in flight loses to an idle one;
    calls of other experts on the same server do not count."""
    balancer, clock = _balancer()
    _run(balancer, clock, {"a": 0.005, "b": 0.010}, 2)
    for _ in range(3):
        balancer.begin("other", "a")  # another expert's calls on the same server
    assert balancer.choose("e", ["a", "b"]) == "a"
    for _ in range(2):
        balancer.begin("e", "a")  # e.g. other threads' calls of the same expert
    assert balancer.choose("e", ["a", "b"]) == "b"
    balancer.end("e", "b", "forward", 0.01, True)
    for _ in range(3):
        balancer.end("e", "a", "forward", 0.005, True)
    assert balancer.choose("e", ["a", "b"]) == "a"


def test_invariant_5_choose_returns_a_candidate_and_checks_its_options() -> None:
    """Invariant 5, and the options' errors."""
    balancer, clock = _balancer()
    for k in range(50):
        candidates = [w for w in "abcd" if (k >> "abcd".index(w)) & 1] or ["a"]
        worker = balancer.choose("e", candidates)
        assert worker in candidates
        balancer.end("e", worker, "forward", 0.01 * (1 + "abcd".index(worker)), True)
    with pytest.raises(ValueError, match="no candidate replica of expert 'e'"):
        balancer.choose("e", [])
    with pytest.raises(ValueError, match="alpha"):
        ReplicaBalancer(alpha=0.0)
    with pytest.raises(ValueError, match="probe_after"):
        ReplicaBalancer(probe_after=0.0)
    assert BALANCE_POLICIES == ("latency", "order") and check_balance("order") == "order"
    with pytest.raises(ValueError, match="balance of FleetExpert 'x' must be one of"):
        FleetExpert(_Fleet([], InProcess()), "x", balance="fastest")  # type: ignore[arg-type]
    balancer.forget("a")
    assert "a" not in balancer.stats()["e"]


# -- FleetExpert over in-process replicas ---------------------------------------------------
class _Transport(InProcess):
    """Serves frames with this process's endpoint as the named worker;
    ``dead`` workers fail at once; records every worker called."""

    name = "balance-unit"

    def __init__(self) -> None:
        super().__init__("balance-client")
        self.dead: List[str] = []
        self.calls: List[Tuple[str, str]] = []

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Any:
        self.calls.append((worker, frame.label))
        if worker in self.dead:
            raise TransportSendError(f"RuntimeError: could not find destination name {worker}")
        return super().call(worker, frame, timeout)


class _Fleet:
    secret = SECRET

    def __init__(self, replicas: List[str], transport: Any,
                 balancer: Optional[ReplicaBalancer] = None) -> None:
        self._replicas, self.transport = replicas, transport
        self.balancer = balancer
        self.suspected: List[str] = []

    def replicas(self, name: str) -> List[str]:
        return list(self._replicas)

    def servers(self) -> Dict[str, Any]:
        return {w: ("bal_unit",) for w in self._replicas}

    def suspect(self, worker: str, why: str = "") -> None:
        self.suspected.append(worker)

    def _served(self, worker: str) -> None:
        pass

    def refresh_on_miss(self) -> None:
        pass


@pytest.mark.parametrize("backward", ["stateless", "stateful"])
def test_fleet_expert_balances_and_keeps_backward_on_its_replica(backward: str) -> None:
    transport = _Transport()
    module = nn.Linear(3, 3)
    server = ExpertServer({"bal_unit": module}, backward=backward, transport=transport)
    try:
        balancer = ReplicaBalancer(rng=random.Random(0))
        fleet = _Fleet(["r0", "r1", "r2"], transport, balancer)
        expert = FleetExpert(fleet, "bal_unit", forward_timeout=5.0)  # type: ignore[arg-type]
        assert expert.balancer is balancer and expert.balance == "latency"
        pending = []
        for _ in range(9):  # forwards first, backwards later: each to its forward's replica
            x = torch.randn(2, 3, requires_grad=True)
            pending.append((x, expert(x), expert.last_worker))
        assert [w for _, _, w in pending[:3]] == ["r0", "r1", "r2"]  # explored in order
        assert sum(balancer.in_flight("bal_unit", w) for w in fleet._replicas) == 0
        for x, y, worker in reversed(pending):
            del transport.calls[:]
            y.sum().backward()
            assert [w for w, _ in transport.calls] == [worker], transport.calls
            torch.testing.assert_close(x.grad, module.weight.sum(0).expand(2, 3))
        stats = expert.replica_stats()
        assert sum(s["calls"] for s in stats.values()) == 9
        assert sum(s["backwards"] for s in stats.values()) == 9
        assert all(s["in_flight"] == 0 and s["backward_ms"] is not None for s in stats.values())

        # a replica that fails is penalised: retried elsewhere now, left out after
        transport.dead.append("r1")
        balancer.forget("r1")  # as if it rejoined: explored by the next call, which fails
        for _ in range(6):
            expert(torch.randn(2, 3)).sum()
        assert [w for w, _ in transport.calls].count("r1") == 1, transport.calls
        stats = expert.replica_stats()
        assert stats["r1"]["failures"] == 1 and stats["r1"]["penalised"] == 1, stats
        assert fleet.suspected == ["r1"] and expert.retries == 1
        assert all(s["in_flight"] == 0 for s in stats.values())
        flush_releases()
        assert server.stats()["live"] == 0  # dropped outputs released
    finally:
        flush_releases()
        server.close()


def test_fleet_expert_without_a_fleet_balancer_keeps_its_own() -> None:
    """A resolver without ``balancer`` (a stand-in fleet): each expert
    measures on its own; ``balance="order"`` sticks to the oldest replica."""
    transport = _Transport()
    server = ExpertServer({"bal_unit": nn.Linear(3, 3)}, transport=transport)
    try:
        fleet = _Fleet(["r0", "r1"], transport)
        latency = FleetExpert(fleet, "bal_unit")  # type: ignore[arg-type]
        order = FleetExpert(fleet, "bal_unit", balance="order")  # type: ignore[arg-type]
        assert latency.balancer is not order.balancer
        served = []
        for _ in range(3):
            latency(torch.randn(1, 3))
            order(torch.randn(1, 3))
            served.append((latency.last_worker, order.last_worker))
        assert served[:2] == [("r0", "r0"), ("r1", "r0")] and served[2][1] == "r0"
        assert order.replica_stats()["r0"]["calls"] == 3  # measured under "order" too
        assert "balance='order'" in repr(order)
    finally:
        server.close()
