"""Three gaps a mutation run of the MoE tests found (issue 8):

* ``detect_anomalies`` was only tested with NaN: ``inf`` and ``-inf`` outputs
  (and gradients) must be masked the same way;
* a call whose backward misses ``backward_timeout`` must never add its
  parameter gradients when it finishes later;
* a call cancelled before it started (a pool of one worker held by a hung
  expert) is a timeout in ``moe.stats()``, not a failure.

The stragglers wait on Events, and the tests join the pool's workers
(``WorkerPool.shutdown``) instead of sleeping to know they are done.
"""
from typing import Any, Callable

import pytest
import torch
from torch import Tensor

from moe_layer_helpers import (  # noqa: F401 - release and warmed_up are fixtures
    Reference, active_experts, assert_close, assert_grads_match, expert_of,
    make_moe, release, wait_until, warmed_up,
)

pytestmark = pytest.mark.usefixtures("warmed_up")

F_IN, F_OUT = 6, 5



def _x(*shape: int, seed: int = 0, requires_grad: bool = True) -> Tensor:
    torch.manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)


def _poison(expert: Any, value: float, where: str) -> None:
    """Makes ``expert`` put ``value`` into one entry of its output (forward)
    or of the gradient it returns for its input (backward: one infinite
    entry, no NaN anywhere, so only a check for non-finite values sees it)."""
    compute = expert.compute

    class Poison(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: Tensor) -> Tensor:  # type: ignore[override]
            return t.clone()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
            g = g.clone()
            g[0, 0] = value
            return g

    def poisoned(x: Tensor) -> Tensor:
        if where == "backward":
            return compute(Poison.apply(x))
        out = compute(x).clone()
        out[0, 0] = value
        return out

    expert.compute = poisoned


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")],
                         ids=["inf", "-inf", "nan"])
def test_detect_anomalies_masks_non_finite_outputs(value: float) -> None:
    moe = make_moe(num_experts=4, k=2, seed=3, detect_anomalies=True)
    ref = Reference(moe)
    x = _x(20, F_IN, seed=4)
    bad = active_experts(moe, x)[-1]
    _poison(expert_of(moe, bad), value, "forward")
    y, _ = moe(x)
    assert torch.isfinite(y).all(), f"a {value} output reached y"
    xr = x.detach().clone().requires_grad_()
    y_ref, _ = ref(xr, dead={bad})
    assert_close(y.detach(), y_ref.detach(), "y")
    g = torch.randn_like(y_ref)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    assert_close(x.grad, xr.grad, "x.grad")
    assert_grads_match(moe, ref, none_for={bad})
    stats = moe.stats()[bad]
    # as for NaN (test_moe_faults.py): a non-finite answer, never a timeout
    assert (stats["non_finite"], stats["timeouts"]) == (1, 0), stats


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [float("inf"), float("-inf")], ids=["inf", "-inf"])
def test_detect_anomalies_without_it_lets_infinities_through(value: float) -> None:
    moe = make_moe(num_experts=4, k=2, seed=3)
    x = _x(20, F_IN, seed=4)
    bad = active_experts(moe, x)[-1]
    _poison(expert_of(moe, bad), value, "forward")
    y, _ = moe(x)
    assert not torch.isfinite(y).all()
    assert moe.stats()[bad]["non_finite"] == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [float("inf"), float("-inf")], ids=["inf", "-inf"])
def test_detect_anomalies_treats_infinite_gradients_as_a_backward_failure(value: float) -> None:
    moe = make_moe(num_experts=4, k=2, seed=17, detect_anomalies=True)
    ref = Reference(moe)
    x = _x(12, F_IN, seed=18)
    bad = active_experts(moe, x)[0]
    _poison(expert_of(moe, bad), value, "backward")
    y, _ = moe(x)
    xr = x.detach().clone().requires_grad_()
    y_ref, _ = ref(xr, detached={bad})
    g = torch.randn_like(y_ref)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    assert torch.isfinite(x.grad).all(), f"a {value} gradient reached x.grad"
    assert_close(x.grad, xr.grad, "x.grad")
    assert_grads_match(moe, ref, none_for={bad})
    stats = moe.stats()[bad]
    assert (stats["backward_failures"], stats["backward_timeouts"]) == (1, 0), stats


# -- a late backward never commits ---------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["backward", "autograd_grad"])
def test_backward_straggler_never_adds_its_gradients_when_it_finishes_late(
        fresh_pool: Callable[[int], Any], release: Any, how: str) -> None:
    pool = fresh_pool(4)
    moe = make_moe(num_experts=4, k=2, seed=17, backward_timeout=0.3)
    ref = Reference(moe)
    x = _x(2, 6, F_IN, seed=18)
    bad = active_experts(moe, x)[0]
    faults = expert_of(moe, bad).faults
    # waits on the Event (the 30 s delay is only a safety net)
    faults.backward, faults.backward_delay, faults.event = "sleep", 30.0, release
    y, _ = moe(x)
    xr = x.detach().clone().requires_grad_()
    y_ref, _ = ref(xr, detached={bad})
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()
    try:
        if how == "backward":
            (y * g).sum().backward()
            gx = x.grad
        else:
            params = [p for e in moe.experts for p in e.parameters()]
            gx, *_ = torch.autograd.grad((y * g).sum(), [x, *params], allow_unused=True)
        assert faults.backward_finished == 0, "the straggler was waited for"
        assert moe.stats()[bad]["backward_timeouts"] == 1
        assert all(p.grad is None for p in moe.experts[bad].parameters())
    finally:
        release.set()  # the straggler now finishes its backward...
    assert wait_until(lambda: faults.backward_finished == 1)
    pool.shutdown()  # ...and its task completely: shutdown joins every worker
    assert all(p.grad is None for p in moe.experts[bad].parameters()), (
        "the late backward added its parameter gradients")
    assert_close(gx, xr.grad, "x.grad")
    if how == "backward":
        assert_grads_match(moe, ref, none_for={bad})
    else:
        assert all(p.grad is None for p in moe.parameters())
    # A next step is not polluted either.
    faults.backward = None
    moe.zero_grad(set_to_none=True)
    ref.zero_grad()
    x.grad = None
    xr.grad = None
    fresh_pool(4)
    y, _ = moe(x)
    y_ref, _ = ref(xr)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    assert_grads_match(moe, ref)


# -- a cancelled call is a timeout ---------------------------------------------------------

@pytest.mark.timeout(60)
def test_cancelled_forward_call_counts_as_timeout_not_failure(
        fresh_pool: Callable[[int], Any], release: Any) -> None:
    """One worker, two experts that both hang: the worker takes one of them;
    the caller never runs a call itself under a deadline, so the other call is
    still pending at the deadline and is cancelled before it starts. Both are
    timeouts, neither a failure."""
    pool = fresh_pool(1)
    moe = make_moe(num_experts=2, k=2, seed=27, forward_timeout=0.3, k_min=0)
    faults = [expert_of(moe, e).faults for e in range(2)]
    for f in faults:
        f.forward, f.event = "hang", release
    try:
        y, _ = moe(_x(4, F_IN, seed=28))
        assert torch.equal(y, torch.zeros_like(y))
        started = [f.calls for f in faults]
        assert sorted(started) == [0, 1], f"calls started per expert: {started}"
        cancelled = started.index(0)
        s = moe.stats()
        for e in range(2):
            assert (s[e]["calls"], s[e]["timeouts"], s[e]["failures"]) == (1, 1, 0), (e, s[e])
        assert s[cancelled]["p50_ms"] is None  # a cancelled call has no latency
        totals = moe.expert_stats.totals()
        assert totals["timeouts"] == 2 and totals["failures"] == 0
    finally:
        release.set()
    assert wait_until(lambda: sum(f.finished for f in faults) == 1)
    pool.shutdown()
    assert faults[cancelled].calls == 0  # a cancelled call never starts, even later


@pytest.mark.timeout(60)
def test_cancelled_backward_call_counts_as_backward_timeout_not_failure(
        fresh_pool: Callable[[int], Any], release: Any) -> None:
    """The same in backward: the one worker is held by one expert's hung
    backward; the other expert's backward never starts before
    ``backward_timeout``. Both are backward timeouts, neither a failure, and
    neither adds gradients."""
    pool = fresh_pool(1)
    moe = make_moe(num_experts=2, k=2, seed=27, backward_timeout=0.3, backward_k_min=0)
    ref = Reference(moe)
    faults = [expert_of(moe, e).faults for e in range(2)]
    for f in faults:
        f.backward, f.backward_delay, f.event = "sleep", 30.0, release
    x = _x(4, F_IN, seed=28)
    y, _ = moe(x)
    try:
        y.sum().backward()
        started = [f.backward_calls for f in faults]
        assert sorted(started) == [0, 1], f"backwards started per expert: {started}"
        cancelled = started.index(0)
        s = moe.stats()
        for e in range(2):
            assert (s[e]["backward_calls"], s[e]["backward_timeouts"],
                    s[e]["backward_failures"]) == (1, 1, 0), (e, s[e])
        assert all(p.grad is None for e in moe.experts for p in e.parameters())
    finally:
        release.set()
    assert wait_until(lambda: sum(f.backward_finished for f in faults) == 1)
    pool.shutdown()
    assert faults[cancelled].backward_calls == 0
    assert all(p.grad is None for e in moe.experts for p in e.parameters())
    # the gate still learned, exactly as with both experts constant
    xr = x.detach().clone().requires_grad_()
    y_ref, _ = ref(xr, detached={0, 1})
    y_ref.sum().backward()
    assert_close(moe.gate.weight.grad, ref.gate.weight.grad, "gate.weight.grad")
