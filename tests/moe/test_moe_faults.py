"""MixtureOfExperts under faults: failing, slow and NaN experts, forward and
backward, checked against the dense float64 reference computed over the
surviving experts; quorum errors; deadlines; stats."""
import time

import pytest
import torch

import moe_autograd.moe.layer as layer_module
from moe_autograd.moe import NotEnoughExperts
from moe_layer_helpers import (  # noqa: F401 - release is a fixture
    Reference, active_experts, assert_close, assert_grads_match, expert_of, force_routing,
    make_moe, release, wait_until, warmed_up,
)

# Deadline tests must not trip over the process's one-time lazy imports.
pytestmark = pytest.mark.usefixtures("warmed_up")

F_IN, F_OUT = 6, 5
# "Returns within the deadline + a small margin": the stragglers sleep 3 s, so
# this bound still proves the cut-off while leaving room for a loaded machine.
FAST = 2.0


def _x(*shape, seed=0, requires_grad=True):
    torch.manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)


def _backward_both(moe, ref, x, y, ref_kwargs):
    """Backward of ``y`` (the layer's output on ``x``) and of the reference
    with the same upstream gradient; returns (x.grad, reference x.grad)."""
    xr = x.detach().clone().requires_grad_()
    y_ref, _ = ref(xr, **ref_kwargs)
    g = torch.randn_like(y_ref)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    return x.grad, xr.grad, y_ref


def _check_against_reference(moe, ref, x, y, *, dead=(), detached=(), none_for=(), **ref_kwargs):
    gx, gx_ref, y_ref = _backward_both(moe, ref, x, y, dict(dead=dead, detached=detached,
                                                             **ref_kwargs))
    assert_close(y.detach(), y_ref.detach(), "y")
    assert_close(gx, gx_ref, "x.grad")
    assert_grads_match(moe, ref, none_for=none_for)
    for p in moe.parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all()


# -- forward failures --------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("shape", [(24, F_IN), (2, 3, F_IN)], ids=["2d", "leading-dims"])
def test_failing_expert_is_masked_with_renormalised_weights(checkpoint, shape):
    moe = make_moe(num_experts=4, k=2, seed=1, checkpoint=checkpoint)
    ref = Reference(moe)
    x = _x(*shape, seed=2)
    active = active_experts(moe, x)
    bad = active[0]
    expert_of(moe, bad).faults.forward = "raise"
    y, aux = moe(x)
    assert y.shape == (*shape[:-1], F_OUT)
    _check_against_reference(moe, ref, x, y, dead={bad}, none_for={bad})
    assert moe.gate.weight.grad.abs().sum() > 0
    stats = moe.stats()
    assert stats[bad]["failures"] == 1 and stats[bad]["calls"] == 1
    assert stats[bad]["backward_calls"] == 0
    for e in active:
        if e != bad:
            assert stats[e]["failures"] == 0 and stats[e]["backward_calls"] == 1


@pytest.mark.timeout(30)
def test_non_finite_output_is_masked_with_detect_anomalies():
    moe = make_moe(num_experts=4, k=2, seed=3, detect_anomalies=True)
    ref = Reference(moe)
    x = _x(20, F_IN, seed=4)
    bad = active_experts(moe, x)[-1]
    expert_of(moe, bad).faults.forward = "nan"
    y, _ = moe(x)
    assert torch.isfinite(y).all()
    _check_against_reference(moe, ref, x, y, dead={bad}, none_for={bad})
    stats = moe.stats()
    assert stats[bad]["non_finite"] == 1 and stats[bad]["timeouts"] == 0


@pytest.mark.timeout(30)
def test_non_finite_output_is_not_masked_without_detect_anomalies():
    moe = make_moe(num_experts=4, k=2, seed=3)
    x = _x(20, F_IN, seed=4)
    bad = active_experts(moe, x)[-1]
    expert_of(moe, bad).faults.forward = "nan"
    y, _ = moe(x)
    assert not torch.isfinite(y).all()
    assert moe.stats()[bad]["non_finite"] == 0


# -- deadlines ---------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_forward_timeout_cuts_straggler_and_discards_late_answer(release, checkpoint):
    moe = make_moe(num_experts=4, k=2, seed=5, forward_timeout=0.3, checkpoint=checkpoint)
    ref = Reference(moe)
    x = _x(2, 8, F_IN, seed=6)
    slow = active_experts(moe, x)[0]
    faults = expert_of(moe, slow).faults
    faults.forward, faults.delay, faults.event = "sleep", 3.0, release

    started = time.monotonic()
    y, _ = moe(x)
    elapsed = time.monotonic() - started
    assert elapsed < FAST, f"forward took {elapsed:.2f}s with forward_timeout=0.3"
    assert faults.finished == 0  # still sleeping: the layer did not wait for it

    # the straggler answers late: nothing of it may leak into results
    release.set()
    assert wait_until(lambda: faults.finished == 1)
    _check_against_reference(moe, ref, x, y, dead={slow}, none_for={slow})
    stats = moe.stats()
    assert stats[slow]["timeouts"] == 1 and stats[slow]["failures"] == 0
    assert faults.calls == 1  # never recomputed, even with checkpoint


@pytest.mark.timeout(30)
def test_timeout_after_k_min_cuts_straggler(release):
    moe = make_moe(num_experts=4, k=2, seed=7, timeout_after_k_min=0.3)
    ref = Reference(moe)
    x = _x(16, F_IN, seed=8)
    slow = active_experts(moe, x)[0]
    faults = expert_of(moe, slow).faults
    faults.forward, faults.delay, faults.event = "sleep", 3.0, release
    started = time.monotonic()
    y, _ = moe(x)
    elapsed = time.monotonic() - started
    assert elapsed < FAST, f"forward took {elapsed:.2f}s with timeout_after_k_min=0.3"
    _check_against_reference(moe, ref, x, y, dead={slow}, none_for={slow})
    assert moe.stats()[slow]["timeouts"] == 1


@pytest.mark.timeout(30)
def test_timeout_after_k_min_still_waits_for_a_slightly_slow_expert(release):
    """Within the grace period a slow expert is waited for and counts."""
    moe = make_moe(num_experts=4, k=2, seed=7, timeout_after_k_min=5.0, forward_timeout=10.0)
    ref = Reference(moe)
    x = _x(16, F_IN, seed=8)
    slow = active_experts(moe, x)[0]
    faults = expert_of(moe, slow).faults
    faults.forward, faults.delay, faults.event = "sleep", 0.1, release
    y, _ = moe(x)
    _check_against_reference(moe, ref, x, y)
    assert moe.stats()[slow]["timeouts"] == 0


@pytest.mark.timeout(30)
def test_timeout_after_k_min_does_not_start_before_the_quorum(release):
    """With k_min=2 the straggler is needed: the grace period only starts once
    every token has 2 answers, so the layer waits for the (short) straggler."""
    moe = make_moe(num_experts=3, k=2, seed=7, k_min=2, timeout_after_k_min=0.05)
    ref = Reference(moe)
    x = _x(16, F_IN, seed=8)
    slow = active_experts(moe, x)[0]
    faults = expert_of(moe, slow).faults
    faults.forward, faults.delay, faults.event = "sleep", 0.4, release
    y, _ = moe(x)
    assert faults.finished == 1
    _check_against_reference(moe, ref, x, y)


# -- quorum ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_no_quorum_raises_not_enough_experts_naming_the_expert():
    moe = make_moe(num_experts=4, k=2, seed=9, k_min=2)
    x = _x(16, F_IN, seed=10)
    bad = active_experts(moe, x)[1]
    expert_of(moe, bad).faults.forward = "raise"
    with pytest.raises(NotEnoughExperts) as info:
        moe(x)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert f"expert {bad}" in message and "injected forward failure" in message
    assert "k_min=2" in message


@pytest.mark.timeout(30)
def test_no_quorum_by_deadline_raises_in_time(release):
    moe = make_moe(num_experts=4, k=2, seed=9, k_min=2, forward_timeout=0.3)
    x = _x(16, F_IN, seed=10)
    slow = active_experts(moe, x)[1]
    faults = expert_of(moe, slow).faults
    faults.forward, faults.delay, faults.event = "sleep", 3.0, release
    started = time.monotonic()
    with pytest.raises(NotEnoughExperts, match=f"expert {slow}"):
        moe(x)
    elapsed = time.monotonic() - started
    assert elapsed < FAST, f"forward took {elapsed:.2f}s with forward_timeout=0.3"
    assert moe.stats()[slow]["timeouts"] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_allow_zero_outputs_gives_exact_zeros_and_finite_grads(checkpoint):
    moe = make_moe(num_experts=4, k=2, seed=11, k_min=2, allow_zero_outputs=True,
                   checkpoint=checkpoint)
    ref = Reference(moe)
    x = _x(3, 8, F_IN, seed=12)
    bad = active_experts(moe, x)[0]
    expert_of(moe, bad).faults.forward = "raise"
    with torch.no_grad():
        top = moe.gate(x.reshape(-1, F_IN)).topk(2, dim=-1).indices
    lost = (top == bad).any(dim=-1).reshape(3, 8)
    assert lost.any() and not lost.all()
    y, _ = moe(x)
    assert torch.equal(y[lost], torch.zeros_like(y[lost]))
    assert (y[~lost] != 0).all()
    _check_against_reference(moe, ref, x, y, dead={bad}, none_for={bad}, k_min=2,
                             allow_zero_outputs=True)
    assert torch.isfinite(x.grad).all()


@pytest.mark.timeout(30)
def test_allow_zero_outputs_when_every_expert_fails():
    """Even when no expert answers at all, the output is zeros, a training step
    (loss.backward()) still works and every gradient is finite."""
    moe = make_moe(num_experts=3, k=1, seed=13, allow_zero_outputs=True,
                   declare_out_features=True)
    for e in range(3):
        expert_of(moe, e).faults.forward = "raise"
    x = _x(2, 5, F_IN, seed=14)
    y, aux = moe(x)
    assert y.shape == (2, 5, F_OUT)
    assert torch.equal(y, torch.zeros_like(y))
    assert y.requires_grad, "the output left the autograd graph: loss.backward() would fail"
    ((y - 1.0) ** 2).mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for p in moe.gate.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()
    assert all(p.grad is None for e in moe.experts for p in e.parameters())


@pytest.mark.timeout(30)
def test_all_fail_output_shape_without_out_features_is_learnt_from_earlier_calls():
    """Without ``out_features`` the layer can only know the experts' output
    shape once one has answered; after that, an all-failed call keeps it."""
    moe = make_moe(num_experts=3, k=1, seed=13, allow_zero_outputs=True)
    x = _x(4, F_IN, seed=14)
    y, _ = moe(x)
    assert y.shape == (4, F_OUT)
    for e in range(3):
        expert_of(moe, e).faults.forward = "raise"
    y, _ = moe(x)
    assert y.shape == (4, F_OUT) and torch.equal(y, torch.zeros_like(y))


@pytest.mark.timeout(30)
def test_k_min_zero_with_deadline_never_raises(release):
    moe = make_moe(num_experts=2, k=1, seed=15, k_min=0, forward_timeout=0.3)
    force_routing(moe, [1.0, 0.0])
    faults = expert_of(moe, 0).faults
    faults.forward, faults.delay, faults.event = "sleep", 3.0, release
    x = _x(4, F_IN, seed=16)
    started = time.monotonic()
    y, aux = moe(x)
    elapsed = time.monotonic() - started
    assert elapsed < FAST, f"forward took {elapsed:.2f}s with forward_timeout=0.3"
    assert torch.equal(y, torch.zeros_like(y))


# -- backward failures -------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["raise", "nan", "sleep"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_backward_failure_treats_expert_as_constant(release, mode, checkpoint):
    moe = make_moe(num_experts=4, k=2, seed=17, checkpoint=checkpoint,
                   detect_anomalies=(mode == "nan"),
                   backward_timeout=(0.5 if mode == "sleep" else None))
    ref = Reference(moe)
    x = _x(2, 6, F_IN, seed=18)
    bad = active_experts(moe, x)[0]
    faults = expert_of(moe, bad).faults
    faults.backward, faults.backward_delay, faults.event = mode, 3.0, release
    y, _ = moe(x)
    assert_close(y.detach(), ref(x.detach())[0], "y")  # forward unaffected

    xr = x.detach().clone().requires_grad_()
    y_ref, _ = ref(xr, detached={bad})
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()  # first: a process's first backward has a warm-up cost
    started = time.monotonic()
    (y * g).sum().backward()
    elapsed = time.monotonic() - started
    if mode == "sleep":
        assert elapsed < FAST, f"backward took {elapsed:.2f}s with backward_timeout=0.5"
    assert all(p.grad is None for p in moe.experts[bad].parameters())
    assert_close(x.grad, xr.grad, "x.grad")
    assert_grads_match(moe, ref, none_for={bad})
    assert moe.gate.weight.grad.abs().sum() > 0
    assert torch.isfinite(x.grad).all()
    stats = moe.stats()[bad]
    assert stats["backward_calls"] == 1
    if mode == "sleep":
        assert stats["backward_timeouts"] == 1 and stats["backward_failures"] == 0
    else:
        assert stats["backward_failures"] == 1 and stats["backward_timeouts"] == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["raise", "nan"])
def test_backward_failure_under_autograd_grad_treats_expert_as_constant(mode):
    """The same masking when the gradient is asked for with torch.autograd.grad
    (e.g. a gradient penalty) instead of .backward(): a non-finite input
    gradient (detect_anomalies) is a failure too, and no .grad is written."""
    moe = make_moe(num_experts=4, k=2, seed=17, detect_anomalies=True)
    ref = Reference(moe)
    x = _x(12, F_IN, seed=18)
    bad = active_experts(moe, x)[0]
    expert_of(moe, bad).faults.backward = mode
    y, _ = moe(x)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad((y * g).sum(), x)
    xr = x.detach().clone().requires_grad_()
    (gx_ref,) = torch.autograd.grad((ref(xr, detached={bad})[0] * g).sum(), xr)
    assert torch.isfinite(gx).all()
    assert_close(gx, gx_ref, "dy/dx")
    assert moe.stats()[bad]["backward_failures"] == 1
    assert all(p.grad is None for p in moe.parameters())


@pytest.mark.timeout(30)
def test_backward_nan_without_detect_anomalies_propagates():
    moe = make_moe(num_experts=4, k=2, seed=17)
    x = _x(12, F_IN, seed=18)
    bad = active_experts(moe, x)[0]
    expert_of(moe, bad).faults.backward = "nan"
    y, _ = moe(x)
    y.sum().backward()
    assert not torch.isfinite(x.grad).all()
    assert moe.stats()[bad]["backward_failures"] == 0


@pytest.mark.timeout(30)
def test_backward_k_min_raises_when_too_few_backwards_survive():
    moe = make_moe(num_experts=4, k=2, seed=19, backward_k_min=2)
    x = _x(12, F_IN, seed=20)
    bad = active_experts(moe, x)[0]
    expert_of(moe, bad).faults.backward = "raise"
    y, _ = moe(x)
    with pytest.raises(NotEnoughExperts) as info:
        y.sum().backward()
    assert f"expert {bad}" in str(info.value) and "backward_k_min=2" in str(info.value)
    # The check needs every call's outcome, so it raises at the end of the
    # engine's pass: the survivors' gradients streamed in already (as in a
    # loop whose backward fails), the failed expert's never.
    assert all(p.grad is None for p in moe.experts[bad].parameters())


@pytest.mark.timeout(30)
def test_backward_k_min_default_raises_when_a_token_loses_every_backward():
    moe = make_moe(num_experts=2, k=1, seed=21)
    force_routing(moe, [1.0, 0.0])
    expert_of(moe, 0).faults.backward = "raise"
    x = _x(6, F_IN, seed=22)
    y, _ = moe(x)
    with pytest.raises(NotEnoughExperts):
        y.sum().backward()


@pytest.mark.timeout(30)
def test_backward_k_min_zero_tolerates_losing_every_backward():
    moe = make_moe(num_experts=2, k=1, seed=21, backward_k_min=0)
    force_routing(moe, [1.0, 0.0])
    expert_of(moe, 0).faults.backward = "raise"
    x = _x(6, F_IN, seed=22)
    y, _ = moe(x)
    y.sum().backward()
    assert all(p.grad is None for p in moe.experts[0].parameters())
    assert x.grad is None or torch.isfinite(x.grad).all()


# -- stats -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_stats_count_forward_outcomes(release):
    """Three pairs of experts; each token goes to one pair, whose first expert
    is healthy, so the quorum (k_min=1) holds quickly and timeout_after_k_min
    cuts the straggler; the hard deadline is only a safety net for a loaded
    machine."""
    moe = make_moe(num_experts=6, k=2, seed=23, detect_anomalies=True, forward_timeout=10.0,
                   timeout_after_k_min=0.2)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.bias.zero_()
        for pair in range(3):
            moe.gate.weight[2 * pair, pair] = 10.0
            moe.gate.weight[2 * pair + 1, pair] = 9.0
    torch.manual_seed(24)
    x = (torch.eye(3, F_IN, dtype=torch.float64).repeat(4, 1)
         + 0.01 * torch.randn(12, F_IN, dtype=torch.float64)).requires_grad_()
    assert active_experts(moe, x) == [0, 1, 2, 3, 4, 5]
    expert_of(moe, 1).faults.forward = "raise"
    expert_of(moe, 3).faults.forward = "nan"
    slow = expert_of(moe, 5).faults
    slow.forward, slow.delay, slow.event = "sleep", 10.0, release
    for _ in range(2):
        x.grad = None
        y, _ = moe(x)
        y.sum().backward()
    s = moe.stats()
    assert [e["calls"] for e in s] == [2] * 6, s
    for e in (0, 2, 4):
        assert (s[e]["failures"], s[e]["timeouts"], s[e]["non_finite"]) == (0, 0, 0), s[e]
        assert s[e]["backward_calls"] == 2 and s[e]["backward_failures"] == 0, s[e]
        p50, p90, p99 = s[e]["p50_ms"], s[e]["p90_ms"], s[e]["p99_ms"]
        assert p50 is not None and 0 <= p50 <= p90 <= p99, s[e]
    assert (s[1]["failures"], s[1]["timeouts"], s[1]["non_finite"]) == (2, 0, 0), s[1]
    assert (s[3]["non_finite"], s[3]["timeouts"]) == (2, 0), s[3]
    assert (s[5]["timeouts"], s[5]["failures"], s[5]["non_finite"]) == (2, 0, 0), s[5]
    for e in (1, 3, 5):
        assert s[e]["backward_calls"] == 0, s[e]
    assert s[5]["p50_ms"] is None  # never finished while it was looked at
    totals = moe.expert_stats.totals()
    assert totals["calls"] == 12 and totals["timeouts"] == 2 and totals["non_finite"] == 2


@pytest.mark.timeout(30)
def test_stats_count_backward_outcomes(release):
    moe = make_moe(num_experts=3, k=3, seed=25, backward_timeout=0.5, backward_k_min=1)
    expert_of(moe, 0).faults.backward = "raise"
    slow = expert_of(moe, 1).faults
    slow.backward, slow.backward_delay, slow.event = "sleep", 3.0, release
    x = _x(8, F_IN, seed=26)
    y, _ = moe(x)
    y.sum().backward()
    s = moe.stats()
    assert [e["backward_calls"] for e in s] == [1, 1, 1]
    assert (s[0]["backward_failures"], s[0]["backward_timeouts"]) == (1, 0)
    assert (s[1]["backward_failures"], s[1]["backward_timeouts"]) == (0, 1)
    assert (s[2]["backward_failures"], s[2]["backward_timeouts"]) == (0, 0)
    totals = moe.expert_stats.totals()
    assert totals["backward_failures"] == 1 and totals["backward_timeouts"] == 1


@pytest.mark.timeout(30)
def test_straggler_that_answers_just_after_the_deadline_counts_as_timeout(release, monkeypatch):
    """A straggler that finishes between the end of the wait and the stats
    update was still a timeout (its answer was discarded), not a failure."""
    moe = make_moe(num_experts=2, k=1, seed=27, forward_timeout=0.2, k_min=0)
    force_routing(moe, [1.0, 0.0])
    slow = expert_of(moe, 0).faults
    slow.forward, slow.delay, slow.event = "sleep", 3.0, release
    real_gather = layer_module.gather

    def gather_then_let_straggler_finish(*args, **kwargs):
        ok = real_gather(*args, **kwargs)
        release.set()
        assert wait_until(lambda: slow.finished == 1)
        time.sleep(0.05)  # let the worker mark the call done
        return ok

    monkeypatch.setattr(layer_module, "gather", gather_then_let_straggler_finish)
    y, _ = moe(_x(4, F_IN, seed=28))
    assert torch.equal(y, torch.zeros_like(y))  # the late answer was discarded
    s = moe.stats()[0]
    assert (s["timeouts"], s["failures"]) == (1, 0), s


# -- interruptions and transforms (issue 30) --------------------------------------------


class _Interrupt(BaseException):
    """Not an Exception, as KeyboardInterrupt and SystemExit."""


class _InterruptInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        raise _Interrupt()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("deadline", [None, 5.0], ids=["no-deadline", "deadline"])
def test_an_interruption_in_an_expert_is_never_masked(deadline):
    """A BaseException that is not an Exception stops the layer, forward or
    backward, as it stops a loop: never masked as a failed expert."""
    moe = make_moe(num_experts=4, k=2, seed=1, forward_timeout=deadline,
                   backward_timeout=deadline)
    x = _x(24, F_IN, seed=2)
    bad = active_experts(moe, x)[0]
    expert = expert_of(moe, bad)
    compute = expert.compute
    expert.compute = lambda t: (_ for _ in ()).throw(_Interrupt())  # type: ignore[method-assign]
    with pytest.raises(_Interrupt):
        moe(x)
    expert.compute = lambda t: _InterruptInBackward.apply(compute(t))  # type: ignore[method-assign]
    y, _ = moe(x)
    with pytest.raises(_Interrupt):
        y.sum().backward()
    assert moe.stats()[bad]["failures"] == 0  # not counted as a masked failure


@pytest.mark.timeout(30)
def test_jvp_through_the_layer_raises():
    """torch.autograd.functional.jvp differentiates the layer's gradients
    with respect to the incoming ones: an error, never zeros."""
    from torch.autograd.functional import jvp
    moe = make_moe(num_experts=4, k=2, seed=1)
    x = _x(8, F_IN, seed=2, requires_grad=False)
    with pytest.raises(RuntimeError, match="MixtureOfExperts: trying to differentiate twice"):
        jvp(lambda t: moe(t)[0], x, torch.ones_like(x))
