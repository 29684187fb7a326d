"""Gradients of the tensors a call computes further from and the caller holds
(``self.keep = h``; ``return h, h * 2``): the loop's, or a clear error
(moe_autograd.kept, issue 30 item 2)."""
from typing import Any, Callable, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import parallel_apply

from helpers import bits_equal

pytestmark = pytest.mark.timeout(60)


class Keeps(nn.Module):
    """Keeps an intermediate the output is computed from."""

    def __init__(self, retain: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.retain = retain
        self.keep: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        self.keep = h
        if self.retain:
            h.retain_grad()
        return self.b(h)


class Chained(nn.Module):
    """Returns an intermediate and what it computes from it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = torch.tanh(self.a(x))
        return h, self.b(h)


SIDES = ["lanes", "parallel", "checkpoint"]


def _world() -> Tuple[List[nn.Module], List[Tensor]]:
    torch.manual_seed(0)
    experts: List[nn.Module] = [Keeps(), Keeps(retain=False), Chained()]
    return experts, [torch.randn(3, 4, requires_grad=True) for _ in experts]


def _both(side: str, then: Callable[[List[nn.Module], List[Tensor], List[Any]], Any]
          ) -> Tuple[Any, Any]:
    results = []
    for runtime in (True, False):
        experts, xs = _world()
        if runtime:
            outs = parallel_apply(experts, xs, mode="parallel" if side == "checkpoint" else side,
                                  checkpoint=side == "checkpoint")
        else:
            outs = [e(x) for e, x in zip(experts, xs)]
        results.append(then(experts, xs, outs))
    return results[0], results[1]


def _loss(outs: List[Any]) -> Tensor:
    return sum((o[1] if isinstance(o, tuple) else o).pow(2).sum() for o in outs)  # type: ignore[return-value]


def _equal(got: List[Optional[Tensor]], want: List[Optional[Tensor]]) -> bool:
    return len(got) == len(want) and all(
        (g is None and w is None) or (g is not None and w is not None and bits_equal(g, w))
        for g, w in zip(got, want))


@pytest.mark.parametrize("side", SIDES)
def test_retained_gradient_of_a_kept_tensor(side: str) -> None:
    """retain_grad() inside the forward: the caller's tensor retains the
    whole gradient (through the call's output too), not None."""
    def then(es: List[Any], xs: List[Tensor], outs: List[Any]) -> List[Any]:
        _loss(outs).backward()
        assert es[0].keep.retains_grad and not es[1].keep.retains_grad
        return [es[0].keep.grad, es[0].a.weight.grad, xs[0].grad]
    got, want = _both(side, then)
    assert got[0] is not None and _equal(got, want)


@pytest.mark.parametrize("side", SIDES)
def test_kept_tensor_used_by_the_caller_too(side: str) -> None:
    def then(es: List[Any], xs: List[Tensor], outs: List[Any]) -> List[Any]:
        (_loss(outs) + es[0].keep.sum() * 3 + es[1].keep.sum()).backward()
        return [es[0].keep.grad, es[0].a.weight.grad, es[1].a.weight.grad, xs[1].grad]
    got, want = _both(side, then)
    assert _equal(got, want)


@pytest.mark.parametrize("side", SIDES)
def test_retained_gradient_accumulates_over_two_backwards(side: str) -> None:
    def then(es: List[Any], xs: List[Tensor], outs: List[Any]) -> List[Any]:
        loss = _loss(outs) + es[0].keep.sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [es[0].keep.grad, es[0].a.weight.grad]
    got, want = _both(side, then)
    assert _equal(got, want)


@pytest.mark.parametrize("side", SIDES)
def test_backward_inputs_naming_a_kept_tensor_and_an_output(side: str) -> None:
    def then(es: List[Any], xs: List[Tensor], outs: List[Any]) -> List[Any]:
        h, _ = outs[2]
        (_loss(outs) + h.sum()).backward(inputs=[es[0].keep, h, xs[0]])
        return [es[0].keep.grad, h.grad, xs[0].grad]
    got, want = _both(side, then)
    assert got[1] is not None and _equal(got, want)


@pytest.mark.parametrize("side", SIDES)
def test_retained_gradient_of_an_output_the_call_computes_further_from(side: str) -> None:
    def then(es: List[Any], xs: List[Tensor], outs: List[Any]) -> List[Any]:
        outs[2][0].retain_grad()
        _loss(outs).backward()
        return [outs[2][0].grad]
    got, want = _both(side, then)
    assert _equal(got, want)


@pytest.mark.parametrize("side", SIDES)
def test_gradient_of_a_kept_tensor_alone_raises_naming_the_call(side: str) -> None:
    """autograd.grad naming only the kept tensor: the node does not run, so
    its part through the call's output is missing: a clear error."""
    experts, xs = _world()
    outs = parallel_apply(experts, xs, mode="parallel" if side == "checkpoint" else side,
                          checkpoint=side == "checkpoint")
    with pytest.raises(RuntimeError, match=r"call 1 of 3: the gradient of the tensor the "
                                           r"expert kept in 'keep'"):
        torch.autograd.grad(_loss(outs) + experts[1].keep.sum(), [experts[1].keep])


class Scaled(nn.Module):
    """Two outputs, the second from the first, neither saved for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = x * self.w
        return h, h * 3


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_output_modified_in_place_after_the_call_is_a_new_tensor(mode: str) -> None:
    """Its .grad is that of its new version (which the call never computed
    further from), as the loop's."""
    results = []
    for runtime in (True, False):
        torch.manual_seed(0)
        expert, x = Scaled(), torch.randn(3, 4, requires_grad=True)
        h, h3 = parallel_apply([expert], [x], mode=mode)[0] if runtime else expert(x)
        h.retain_grad()
        h.mul_(2)
        (h.pow(2).sum() + h3.sum()).backward()
        results.append([h.grad, x.grad, expert.w.grad])
    assert _equal(*results)


@pytest.mark.xfail(strict=True, reason=(
    "D5b: torch.autograd.grad captures the gradient of a tensor the call computes further "
    "from before the node runs: asked for with the call's input, it is the direct part only"))
@pytest.mark.parametrize("side", SIDES)
def test_autograd_grad_of_a_kept_tensor_with_the_calls_input(side: str) -> None:
    def then(es: List[Any], xs: List[Tensor], outs: List[Any]) -> List[Any]:
        return list(torch.autograd.grad(_loss(outs) + es[1].keep.sum(), [es[1].keep, xs[1]]))
    got, want = _both(side, then)
    assert _equal(got, want)


@pytest.mark.xfail(strict=True, reason=(
    "D5c: a kept tensor the loss does not use is an output of the node no pass reaches: "
    "torch.autograd.grad(..., allow_unused=True) gives None where the loop's is reached "
    "through the call's output"))
def test_autograd_grad_of_an_unused_kept_tensor() -> None:
    def then(es: List[Any], xs: List[Tensor], outs: List[Any]) -> List[Any]:
        return list(torch.autograd.grad(_loss(outs), [es[0].keep, xs[0]], allow_unused=True))
    got, want = _both("lanes", then)
    assert _equal(got, want)


class RetainsWhatItReturns(nn.Module):
    """retain_grad() inside the forward on what it returns, and on a tensor it
    keeps but computes nothing further from (it returns its input then)."""

    def __init__(self, returns_input: bool) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.returns_input = returns_input
        self.keep: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x) * 1.5
        h.retain_grad()
        self.keep = h
        return x * 1 if self.returns_input else h


@pytest.mark.parametrize("side", SIDES)
def test_retain_grad_inside_the_forward_on_a_root_nothing_in_the_call_consumes(
        side: str) -> None:
    """The caller's output (or kept tensor) retains its gradient, as the
    loop's does: not retains_grad False and .grad None (found by the oracle's
    keep stage)."""
    def run(runtime: bool) -> List[Any]:
        torch.manual_seed(0)
        experts = [RetainsWhatItReturns(False), RetainsWhatItReturns(True)]
        xs = [torch.randn(3, 4, requires_grad=True) for _ in experts]
        if runtime:
            outs = parallel_apply(experts, xs, mode="parallel" if side == "checkpoint" else side,
                                  checkpoint=side == "checkpoint")
        else:
            outs = [e(x) for e, x in zip(experts, xs)]
        kept = experts[1].keep
        assert kept is not None
        (outs[0].pow(2).sum() + outs[1].sum() + kept.sum() * 0.75).backward()
        return [outs[0].retains_grad, outs[0].grad, kept.retains_grad, kept.grad,
                experts[1].a.weight.grad]
    got, want = run(True), run(False)
    assert got[0] and got[2] and got[1] is not None and got[3] is not None
    assert _equal([got[1], got[3], got[4]], [want[1], want[3], want[4]])


class _ReturnsItsInputFirst(nn.Module):
    """The input itself, then g and h = sin(g): the node's roots are g and h,
    at positions 1 and 2 of the result."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        g = self.fc(x)
        return x, g, g.sin()


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_a_kept_output_is_named_by_its_place_in_the_result(mode: str) -> None:
    x = torch.randn(2, 3, requires_grad=True)
    _, g, h = parallel_apply([_ReturnsItsInputFirst()], [x], mode=mode)[0]
    with pytest.raises(RuntimeError, match=r"^parallel_apply: call 0 of 1: the gradient of "
                                           r"output 1, which the call computes further from"):
        torch.autograd.grad(h.sum() + g.sum(), [g])


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor) -> Tensor:  # type: ignore[override]
        return h * 1

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        raise ValueError("the expert's backward fails")


class _KeepsThenFails(nn.Module):
    """Keeps an intermediate, then computes further from it through a part
    whose backward raises (torch's reentrant checkpoint under backward(inputs=),
    or a Function of the expert's); a parameter after it (the call streams
    its gradients through a node of its own)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.reentrant = reentrant
        self.keep: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        h = x * 1.5
        self.keep = h
        h = torch.tanh(h)
        if self.reentrant:
            h = torch.utils.checkpoint.checkpoint(self.fc, h, use_reentrant=True)
        else:
            h = _FailsInBackward.apply(self.fc(h))
        return h * self.gain


@pytest.mark.parametrize("reentrant", [True, False], ids=["ckpt_reentrant", "function"])
@pytest.mark.parametrize("side", SIDES)
def test_backward_inputs_naming_only_a_kept_tensor_raises_the_calls_failure(
        side: str, reentrant: bool) -> None:
    """backward(inputs=[kept]) runs the call's backward for the kept tensor's
    whole gradient, and the engine takes none of the call's input gradients:
    a failure there is the loop's error too, never lost with the kept tensor's
    .grad left at its outside part (oracle seed 1795850281, case 518)."""
    x = torch.randn(3, 4, requires_grad=True)
    want = (r"call 0 of 1: the expert uses torch.utils.checkpoint\(use_reentrant=True\)"
            if reentrant else "the expert's backward fails")
    for runtime in (False, True):
        torch.manual_seed(0)
        expert = _KeepsThenFails(reentrant)
        if runtime:
            (out,) = parallel_apply([expert], [x], mode="parallel" if side == "checkpoint"
                                    else side, checkpoint=side == "checkpoint")
        else:
            out = expert(x)
        kept = expert.keep
        assert kept is not None
        with pytest.raises((RuntimeError, ValueError),
                           match=want if runtime else "use_reentrant=True|backward fails"):
            (out.sum() + kept.sum() * 0.75).backward(inputs=[kept])
