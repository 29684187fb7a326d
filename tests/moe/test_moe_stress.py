"""Many user threads training MixtureOfExperts layers at once, with random
forward/backward failures, hangs and NaNs: no deadlock, gradients of the
surviving experts equal the dense reference, no thread outlives the pool."""
import random
import sys
import threading
import time

import pytest
import torch

from moe_autograd.executor import get_pool
from moe_autograd.moe import NotEnoughExperts
from moe_layer_helpers import (  # noqa: F401 - release is a fixture
    Reference, active_experts, assert_close, assert_grads_match, expert_of, make_moe, release,
    tag, wait_until, warm_up,
)

F_IN = 6
THREADS = 3
ITERATIONS = 8
FORWARD_TIMEOUT = 0.4
BACKWARD_TIMEOUT = 0.4
HANG = 1.0  # longer than the deadlines, but bounded
OWN_FAULTS = [None, None, "raise", "nan", "sleep", "b:raise", "b:nan", "b:sleep"]
SHARED_FAULTS = [None, "raise", "nan", "b:raise", "b:nan"]
FORWARD_COUNTERS = ("failures", "timeouts", "non_finite")
BACKWARD_COUNTERS = ("backward_failures", "backward_timeouts")


def _changed(before, after, keys):
    return {e for e, (b, a) in enumerate(zip(before, after)) if any(a[k] != b[k] for k in keys)}


def _timeouts_only(before, after, experts, key):
    return all(after[e][key] > before[e][key] for e in experts)


def _split(fault):
    if fault is None:
        return None, None
    if fault.startswith("b:"):
        return None, fault[2:]
    return fault, None


def _own_iteration(moe, ref, rng, iteration, counts):
    """One training step of a thread's own layer with one injected fault;
    checks the result against the reference over the experts that survived."""
    fault = rng.choice(OWN_FAULTS)
    victim = rng.randrange(len(moe.experts))
    forward_fault, backward_fault = _split(fault)
    for e in range(len(moe.experts)):
        faults = expert_of(moe, e).faults
        faults.forward = forward_fault if e == victim else None
        faults.backward = backward_fault if e == victim else None
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(2, 5, F_IN, dtype=torch.float64, generator=gen, requires_grad=True)
    active = active_experts(moe, x)
    if fault is not None and victim in active:
        counts[fault] += 1  # injected (counted even if load costs the step)
    for p in moe.parameters():
        p.grad = None
    ref.zero_grad()

    before = moe.stats()
    try:
        y, _ = moe(x)
    except NotEnoughExperts:
        # only a load-induced timeout of a healthy expert may cost the quorum
        after = moe.stats()
        extra = _changed(before, after, FORWARD_COUNTERS) - {victim}
        assert extra and _timeouts_only(before, after, extra, "timeouts"), (fault, victim, after)
        counts["skipped"] += 1
        print(f"{threading.current_thread().name}: forward lost its quorum to load: "
              f"fault {fault} on {victim}, also late {sorted(extra)}")
        return
    after = moe.stats()
    dead = _changed(before, after, FORWARD_COUNTERS)
    if forward_fault is not None and victim in active:
        assert victim in dead, (fault, victim, after)
    extra = dead - {victim}
    assert _timeouts_only(before, after, extra, "timeouts"), (fault, victim, after)
    counts["unplanned"] += len(extra)

    g = torch.randn(y.shape, dtype=y.dtype, generator=gen)
    try:
        (y * g).sum().backward()
    except NotEnoughExperts:
        after_backward = moe.stats()
        extra = _changed(after, after_backward, BACKWARD_COUNTERS) - {victim}
        assert extra and _timeouts_only(after, after_backward, extra, "backward_timeouts")
        counts["skipped"] += 1
        print(f"{threading.current_thread().name}: backward lost its quorum to load: "
              f"fault {fault} on {victim}, also late {sorted(extra)}")
        return
    after_backward = moe.stats()
    broken = _changed(after, after_backward, BACKWARD_COUNTERS)
    if backward_fault is not None and victim in active and victim not in dead:
        assert victim in broken, (fault, victim, after_backward)
    extra = broken - {victim}
    assert _timeouts_only(after, after_backward, extra, "backward_timeouts")
    counts["unplanned"] += len(extra)

    xr = x.detach().clone().requires_grad_()
    y_ref, _ = ref(xr, dead=dead, detached=broken)
    (y_ref * g).sum().backward()
    assert_close(y.detach(), y_ref.detach(), f"iteration {iteration} y")
    assert_close(x.grad, xr.grad, f"iteration {iteration} x.grad")
    assert_grads_match(moe, ref, none_for=dead | broken)
    counts["checked"] += 1


def _shared_iteration(shared, rng, ident, records):
    """One step of the shared layer; its faults are keyed by the input's tag,
    so they do not depend on which thread runs what when."""
    fault = rng.choice(SHARED_FAULTS)
    victim = rng.randrange(len(shared.experts))
    plan = _split(fault)
    if fault is not None:
        expert_of(shared, victim).faults.plan[ident] = plan
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    x = tag(torch.randn(8, F_IN, dtype=torch.float64, generator=gen), ident).requires_grad_()
    y, _ = shared(x)
    g = torch.randn(y.shape, dtype=y.dtype, generator=gen)
    (y * g).sum().backward()
    dead = {victim} if plan[0] is not None else set()
    broken = {victim} if plan[1] is not None else set()
    records.append((x.detach(), g, dead, broken, x.grad))


@pytest.mark.timeout(120)
def test_many_threads_with_random_faults(release):
    warm_up()
    threads_before = set(threading.enumerate())
    shared = make_moe(num_experts=4, k=2, seed=1000, detect_anomalies=True)
    for e in range(4):
        expert_of(shared, e).faults.plan = {}
    shared_ref = Reference(shared)
    records = []
    errors = []
    counts_lock = threading.Lock()
    all_counts = []
    own_layers = []

    def user(t):
        try:
            rng = random.Random(1234 + t)
            moe = make_moe(num_experts=4, k=2, seed=t, detect_anomalies=True,
                           forward_timeout=FORWARD_TIMEOUT, backward_timeout=BACKWARD_TIMEOUT,
                           checkpoint=(t == 0))
            for e in range(4):
                faults = expert_of(moe, e).faults
                faults.event, faults.delay, faults.backward_delay = release, HANG, HANG
            ref = Reference(moe)
            with counts_lock:
                own_layers.append(moe)
            counts = {k: 0 for k in ("checked", "skipped", "unplanned", "raise", "nan", "sleep",
                                     "b:raise", "b:nan", "b:sleep")}
            for i in range(ITERATIONS):
                _own_iteration(moe, ref, rng, i, counts)
                _shared_iteration(shared, rng, t * ITERATIONS + i + 1, records)
            with counts_lock:
                all_counts.append(counts)
        except BaseException as error:  # noqa: B902 - reported by the main thread
            errors.append((t, error))

    users = [threading.Thread(target=user, args=(t,), name=f"moe-stress-user-{t}")
             for t in range(THREADS)]
    started = time.monotonic()
    for thread in users:
        thread.start()
    for thread in users:
        thread.join(timeout=90)
    hung = [thread.name for thread in users if thread.is_alive()]
    assert not hung, f"deadlock: {hung} still running after {time.monotonic() - started:.0f}s"
    if errors:
        t, error = errors[0]
        raise AssertionError(f"user thread {t} failed: {error!r}") from error

    # every own layer was checked against its reference most of the time
    checked = sum(c["checked"] for c in all_counts)
    assert checked >= THREADS * ITERATIONS // 2, all_counts
    print("stress counts per thread:", all_counts)
    for kind in ("raise", "nan", "sleep", "b:raise", "b:nan", "b:sleep"):
        assert sum(c[kind] for c in all_counts) >= 1, (kind, all_counts)

    # the shared layer: per-call input gradients, and the parameter gradients
    # accumulated by all threads, equal the reference's
    assert len(records) == THREADS * ITERATIONS
    for n, (x, g, dead, broken, x_grad) in enumerate(records):
        xr = x.clone().requires_grad_()
        y_ref, _ = shared_ref(xr, dead=dead, detached=broken)
        (y_ref * g).sum().backward()
        assert_close(x_grad, xr.grad, f"shared record {n} x.grad")
    assert_grads_match(shared, shared_ref)

    # no thread outlives the pool once the stragglers are let go
    release.set()
    for moe in own_layers + [shared]:
        for e in range(4):
            faults = expert_of(moe, e).faults
            assert wait_until(lambda: faults.finished == faults.calls, timeout=10)
            assert wait_until(lambda: faults.backward_finished == faults.backward_calls,
                              timeout=10)
    pool = get_pool()
    workers = set(pool.threads)
    assert len(workers) <= pool.max_workers
    leaked = [t.name for t in threading.enumerate()
              if t not in threads_before and t not in workers and t.is_alive()]
    assert not leaked, leaked
    assert all(t.name.startswith("moe_autograd-worker-") for t in workers)


@pytest.mark.timeout(60)
def test_concurrent_backward_of_a_shared_layer_accumulates_every_gradient():
    """Threads that backward through one layer at the same moment must not lose
    each other's parameter gradients (plain autograd locks the accumulation)."""
    threads, rounds = 4, 20
    moe = make_moe(num_experts=2, k=2, seed=77)
    ref = Reference(moe)
    barrier = threading.Barrier(threads, timeout=20)
    for e in range(2):
        faults = expert_of(moe, e).faults
        faults.backward = "none"  # installs the backward hook, which does nothing wrong
        faults.backward_barrier = barrier  # every thread's backward of expert e meets here
    inputs = [[torch.randn(3, F_IN, dtype=torch.float64) for _ in range(threads)]
              for _ in range(rounds)]
    errors = []
    start_round = threading.Barrier(threads + 1, timeout=30)
    end_round = threading.Barrier(threads + 1, timeout=30)
    # expert 1's backward must not meet expert 0's at the same barrier: give
    # expert 1 its own
    expert_of(moe, 1).faults.backward_barrier = threading.Barrier(threads, timeout=20)

    def user(t):
        try:
            for r in range(rounds):
                start_round.wait()
                y, _ = moe(inputs[r][t])
                y.sum().backward()
                end_round.wait()
        except BaseException as error:  # noqa: B902
            errors.append(error)
            start_round.abort()
            end_round.abort()

    users = [threading.Thread(target=user, args=(t,)) for t in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # many thread switches: races show up more often
    for thread in users:
        thread.start()
    lost = []
    try:
        for r in range(rounds):
            for p in moe.parameters():
                p.grad = None
            ref.zero_grad()
            start_round.wait()
            end_round.wait()
            for t in range(threads):
                y_ref, _ = ref(inputs[r][t])
                y_ref.sum().backward()
            for e in range(2):
                for p, q in zip(moe.experts[e].parameters(), ref.experts[e].parameters()):
                    if p.grad is None or not torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-11):
                        lost.append((r, e))
                        break
            assert_close(moe.gate.weight.grad, ref.gate.weight.grad, "gate grad")
    finally:
        for thread in users:
            thread.join(timeout=30)
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert not lost, f"parameter gradients lost in (round, expert): {lost}"
