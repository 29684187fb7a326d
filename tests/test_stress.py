"""Stress: many user threads, random shapes, random failures in forward and
backward, through parallel_apply and map_with_parallel_backward.

Successful iterations must give the gradients of sequential autograd; failing
ones the injected exception (of the lowest failing call, named in a note);
nothing may hang, and no thread, ctx or graph may outlive the test.
"""
import copy
import random
import sys
import threading
import weakref

import pytest
import torch
from torch import nn
from torch.autograd import Function

from moe_autograd import map_with_parallel_backward, parallel_apply
from moe_autograd.node import BackwardPolicy
from moe_autograd.parallel import finish_calls, start_calls
from helpers import BackwardBarrier

DT = torch.float64
D = 4


class Injected(Exception):
    def __init__(self, phase, index):
        super().__init__(f"injected {phase} failure in call {index}")
        self.phase, self.index = phase, index


class FailInBackward(Function):
    @staticmethod
    def forward(ctx, x, index):
        ctx.index = index
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Injected("backward", ctx.index)



def make_flaky_function(ctx_refs, lock):
    class Flaky(Function):
        """y = x * w + sin(x) (x, w tensors), with injectable failures."""

        @staticmethod
        def forward(ctx, x, w, index, fail_forward, fail_backward):
            with lock:
                ctx_refs.append(weakref.ref(ctx))
            if fail_forward:
                raise Injected("forward", index)
            ctx.index, ctx.fail_backward = index, fail_backward
            ctx.save_for_backward(x, w)
            return x * w + x.sin()

        @staticmethod
        def backward(ctx, g):
            if ctx.fail_backward:
                raise Injected("backward", ctx.index)
            x, w = ctx.saved_tensors
            return g * (w + x.cos()), g * x, None, None, None

    return Flaky


def make_expert(seed):
    g = torch.Generator().manual_seed(seed)
    expert = nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, D)).to(DT)
    with torch.no_grad():
        for p in expert.parameters():
            p.copy_(torch.randn(p.shape, dtype=DT, generator=g) * 0.5)
    return expert


def close(a, b):
    if a is None or b is None:
        assert a is None and b is None, (a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def expected_failure(fail_forward, fail_backward):
    """The call the runtime must report: the lowest one failing in the first
    failing phase."""
    if any(fail_forward):
        return "forward", fail_forward.index(True)
    if any(fail_backward):
        return "backward", fail_backward.index(True)
    return None


def check_error(error, phase, index, n, api):
    assert isinstance(error, Injected), repr(error)
    assert (error.phase, error.index) == (phase, index), (error.phase, error.index, phase, index)
    notes = getattr(error, "__notes__", [])
    assert any(f"call {index} of {n}" in note for note in notes), notes
    if phase == "backward" and api == "parallel_apply":
        assert any("backward" in note for note in notes), notes


def run_parallel_apply(rng, experts, refs, local_refs, stats):
    n = rng.randint(1, 6)
    which = [rng.randrange(len(experts)) for _ in range(n)]
    rows = [rng.randint(1, 5) for _ in range(n)]
    fail_forward = [rng.random() < 0.06 for _ in range(n)]
    fail_backward = [rng.random() < 0.06 for _ in range(n)]
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    xs = [torch.randn(r, D, dtype=DT, generator=g).requires_grad_(rng.random() < 0.8)
          for r in rows]
    upstream = [torch.randn(r, D, dtype=DT, generator=g) for r in rows]

    def call(i, module):
        def run(x):
            if fail_forward[i]:
                raise Injected("forward", i)
            y = module(x)
            local_refs.append(weakref.ref(y))
            if fail_backward[i]:
                y = FailInBackward.apply(y, i)
            return y
        return run

    for m in experts + refs:
        m.zero_grad(set_to_none=True)
    failure = expected_failure(fail_forward, fail_backward)
    wanted = [x for x in xs if x.requires_grad]
    # sometimes only the inputs' gradients, as a gradient penalty asks them
    inputs_only = bool(wanted) and rng.random() < 0.3
    try:
        outs = parallel_apply([call(i, experts[w]) for i, w in enumerate(which)], xs)
        loss = sum((o * u).sum() for o, u in zip(outs, upstream))
        if inputs_only:
            for x, g in zip(wanted, torch.autograd.grad(loss, wanted)):
                x.grad = g
        else:
            loss.backward()
    except Injected as error:
        assert failure is not None, f"unexpected {error!r}"
        check_error(error, *failure, n, "parallel_apply")
        stats["failed"] += 1
        return
    assert failure is None, f"expected a {failure} failure"

    ref_xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]
    ref_outs = [refs[w](x) for w, x in zip(which, ref_xs)]
    for o, r in zip(outs, ref_outs):
        close(o, r)
    ref_loss = sum((o * u).sum() for o, u in zip(ref_outs, upstream))
    if inputs_only:
        ref_wanted = [x for x in ref_xs if x.requires_grad]
        for x, g in zip(ref_wanted, torch.autograd.grad(ref_loss, ref_wanted)):
            x.grad = g
    else:
        ref_loss.backward()
    for x, rx in zip(xs, ref_xs):
        close(x.grad, rx.grad)
    for m, r in zip(experts, refs):
        for p, q in zip(m.parameters(), r.parameters()):
            close(p.grad, q.grad)  # None for both under torch.autograd.grad
    stats["ok"] += 1


def run_map(rng, Flaky, stats):
    n = rng.randint(1, 6)
    fail_forward = [rng.random() < 0.06 for _ in range(n)]
    fail_backward = [rng.random() < 0.06 for _ in range(n)]
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    shapes = [tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3))) for _ in range(n)]
    xs = [torch.randn(s, dtype=DT, generator=g).requires_grad_() for s in shapes]
    ws = [torch.randn(s, dtype=DT, generator=g).requires_grad_(rng.random() < 0.5)
          for s in shapes]
    upstream = [torch.randn(s, dtype=DT, generator=g) for s in shapes]
    failure = expected_failure(fail_forward, fail_backward)
    try:
        results = map_with_parallel_backward(
            Flaky, *[(x, w, i, ff, fb) for i, (x, w, ff, fb)
                     in enumerate(zip(xs, ws, fail_forward, fail_backward))])
        leaves = xs + [w for w in ws if w.requires_grad]
        got = torch.autograd.grad(sum((r[0] * u).sum() for r, u in zip(results, upstream)),
                                  leaves)
    except Injected as error:
        assert failure is not None, f"unexpected {error!r}"
        check_error(error, *failure, n, "map")
        stats["failed"] += 1
        return
    assert failure is None, f"expected a {failure} failure"
    want_outs = [Flaky.apply(x, w, i, False, False) for i, (x, w) in enumerate(zip(xs, ws))]
    for r, o in zip(results, want_outs):
        close(r[0], o)
    want = torch.autograd.grad(sum((o * u).sum() for o, u in zip(want_outs, upstream)), leaves)
    for a, b in zip(got, want):
        close(a, b)
    stats["ok"] += 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool_size", [None, 2])
def test_random_calls_and_failures_from_many_threads(fresh_pool, thread_guard, wait_dead,
                                                     pool_size, monkeypatch):
    # The parallel path under stress (tiny calls would run inline in auto mode,
    # where a failing backward is the loop's own, without a "call i of n" note).
    monkeypatch.setenv("MOE_AUTOGRAD_MODE", "parallel")
    if pool_size is not None:
        pool = fresh_pool(pool_size)
    threads, iterations = 6, 15
    lock = threading.Lock()
    ctx_refs, local_refs, errors = [], [], []
    Flaky = make_flaky_function(ctx_refs, lock)
    stats = {"ok": 0, "failed": 0}

    def user(u):
        rng = random.Random(1234 + u)
        experts = [make_expert(100 * u + k) for k in range(3)]
        refs = copy.deepcopy(experts)
        mine = {"ok": 0, "failed": 0}
        try:
            for _ in range(iterations):
                if rng.random() < 0.5:
                    run_parallel_apply(rng, experts, refs, local_refs, mine)
                else:
                    run_map(rng, Flaky, mine)
        except BaseException as error:  # noqa: B902 - reported by the main thread
            errors.append(error)
        with lock:
            for key in stats:
                stats[key] += mine[key]

    users = [threading.Thread(target=user, args=(u,), name=f"stress-user-{u}")
             for u in range(threads)]
    for t in users:
        t.start()
    for t in users:
        t.join(100)
    assert not any(t.is_alive() for t in users), "a user thread hung"
    assert not errors, errors[0]
    assert stats["ok"] + stats["failed"] == threads * iterations
    assert stats["ok"] > 0 and stats["failed"] > 0, stats  # both paths were exercised
    # every call's state died with its iteration
    assert not any(wait_dead(ctx_refs)), "a ctx outlived its graph"
    assert not any(wait_dead(local_refs)), "a call's local graph outlived its backward"
    if pool_size is not None:
        assert len(pool.threads) <= pool_size


@pytest.mark.timeout(120)
def test_concurrent_tolerant_backwards_into_shared_parameters(thread_guard):
    """Tolerant policies: several user threads' backward deliver gradients of
    the same parameters at once (the engine accumulates them); none may be lost."""
    threads, rounds = 4, 20
    expert = make_expert(7)
    ref = copy.deepcopy(expert)
    inputs = [[torch.randn(3, D, dtype=DT, generator=torch.Generator().manual_seed(100 * r + t))
               for t in range(threads)] for r in range(rounds)]
    start, end = threading.Barrier(threads + 1, timeout=30), threading.Barrier(threads + 1, timeout=30)
    # every thread's backward of call k meets here, so their accumulations collide
    meet = [threading.Barrier(threads, timeout=30) for _ in range(2)]
    errors = []

    def expert_call(k):
        return lambda x: BackwardBarrier.apply(expert(x), meet[k])

    def user(t):
        try:
            for r in range(rounds):
                start.wait()
                calls, group = start_calls([expert_call(0), expert_call(1)],
                                           [inputs[r][t], inputs[r][t] * 2])
                group.wait()
                group.raise_first_error()
                outs = finish_calls(calls, BackwardPolicy(tolerate_failures=True))
                sum(o.sum() for o in outs).backward()
                end.wait()
        except BaseException as error:  # noqa: B902
            errors.append(error)
            for barrier in [start, end] + meet:
                barrier.abort()

    users = [threading.Thread(target=user, args=(t,)) for t in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # frequent switches make lost updates likely
    lost = []
    try:
        for t in users:
            t.start()
        for r in range(rounds):
            expert.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            start.wait()
            end.wait()
            for t in range(threads):
                (ref(inputs[r][t]).sum() + ref(inputs[r][t] * 2).sum()).backward()
            for p, q in zip(expert.parameters(), ref.parameters()):
                if p.grad is None or not torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-11):
                    lost.append(r)
                    break
    except threading.BrokenBarrierError:
        pass
    finally:
        sys.setswitchinterval(interval)
        for t in users:
            t.join(30)
    assert not errors, errors[0]
    assert not lost, f"parameter gradients lost in rounds {lost}"
