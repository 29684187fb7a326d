"""A tensor a call reads on several paths gets its gradient terms one by one,
in the loop's order (``moe_autograd/terms.py``)."""
import copy
from typing import Any, List

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import is_recomputing, parallel_apply
from moe_autograd.module_call import ModuleCall

pytestmark = pytest.mark.timeout(60)


def _bits(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class TiedTwice(nn.Module):
    """Uses its weight twice and its input three times (once inside a
    multi-input node: ``x * x``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.w) @ self.w.t() + x * x


def _record(module: nn.Module, x: Tensor) -> ModuleCall:
    call = ModuleCall(module, (x,), {})
    call.forward()
    call.prepare()
    return call


def test_one_slot_per_edge_and_none_without_repeats() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    call = _record(TiedTwice(), x)
    # x: x @ w, x * x (two edges from one node) -> 3 slots; w: twice -> 2 slots
    assert sum(t is x for t in call.inputs) == 3
    assert sum(t is call.module.w for t in call.inputs) == 2
    plain = _record(nn.Linear(4, 4), x)
    assert plain._split is None and len(plain.inputs) == 3


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_terms_reach_the_engine_in_the_loops_order(mode: str) -> None:
    torch.manual_seed(0)
    mod = TiedTwice()
    ref = copy.deepcopy(mod)
    for _ in range(3):
        x0 = torch.randn(16, 4, requires_grad=True)
        rx0 = x0.detach().clone().requires_grad_()

        def run(m: nn.Module, leaf: Tensor, outs: Any) -> List[Tensor]:
            h = torch.sin(leaf)
            ys = outs(m, h)
            # the caller uses h and the weight too: its terms come first
            (ys[0].sum() + (2 * ys[1]).sum() + (h * h).sum() + (m.w ** 3).sum()).backward()
            grads = [leaf.grad, m.w.grad]
            leaf.grad = m.w.grad = None
            return grads
        got = run(mod, x0, lambda m, h: parallel_apply([m, m], [h, h], mode=mode))
        want = run(ref, rx0, lambda m, h: [m(h), m(h)])
        assert all(_bits(g, w) for g, w in zip(got, want))


class ThreeReads(nn.Module):
    """Reads ``x`` three times; the second output, ``sin(x)``, may get no gradient."""

    def forward(self, x: Tensor) -> Any:
        return torch.tanh(x) * torch.cos(x), torch.sin(x)


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_a_branch_the_backward_skips_gives_no_term(mode: str) -> None:
    """Three edges into ``x``, one of them (``sin``) never run: the two terms
    that do come must still be added one by one after the caller's."""
    call = _record(ThreeReads(), torch.randn(3, 4, requires_grad=True))
    assert call._split is not None and len(call.inputs) == 3
    torch.manual_seed(0)
    for _ in range(5):  # rounding differs in some inputs only
        x = torch.randn(64, 4, requires_grad=True)
        rx = x.detach().clone().requires_grad_()
        for leaf, run in ((x, lambda h: parallel_apply([ThreeReads()], [h], mode=mode)[0]),
                          (rx, ThreeReads())):
            h = leaf * 1.7
            a, _ = run(h)
            (a.sum() + (h * h).sum()).backward()
        assert _bits(x.grad, rx.grad)


class Moody(nn.Module):
    """Reads its input twice the first time it runs, then ``later`` times (a
    count outside the module's state): its recomputed graph has other edges."""

    def __init__(self, later: int) -> None:
        super().__init__()
        self.runs = [0]
        self.later = later

    def forward(self, x: Tensor) -> Tensor:
        self.runs[0] += 1
        reads = 2 if self.runs[0] == 1 else self.later
        out = x
        for _ in range(reads - 1):
            out = out * x
        return out


def test_checkpointed_call_counts_on_forward_and_records_on_recompute() -> None:
    """A checkpointed call's split is counted on its forward's graph and moved
    onto the recomputation's (the terms go to their slots); where that graph
    reaches a tensor on one edge, or on more edges than it has slots, the
    tensor keeps the per-leaf sum."""
    x = torch.randn(3, 4, requires_grad=True)
    call = ModuleCall(TiedTwice(), (x,), {}, checkpoint=True)
    call.forward()
    call.prepare()
    assert call._split is not None and sum(t is x for t in call.inputs) == 3
    out = call.outputs[0]
    grads = call.backward([torch.ones_like(out)])
    assert sum(g is not None for g in grads[:1] + grads[-3:]) >= 2  # terms in several slots

    for later, want in ((1, torch.ones(3, 4)), (3, 3 * x.detach() ** 2)):
        moody = ModuleCall(Moody(later), (x,), {}, checkpoint=True)
        moody.forward()
        moody.prepare()
        assert moody._split is not None and len(moody.inputs) == 2  # x * x: two edges
        (g, extra) = moody.backward([torch.ones(3, 4)])
        assert extra is None and torch.equal(g, want)  # the recomputation's one term, or sum


class NestedByMode(nn.Module):
    """A nested batch on its input, fanned out in forward and inline in its
    recomputation (as ``auto`` may pick: a site's first batch fans out), with
    the input also returned; the loop's twin runs the nested calls itself."""

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.loop = False

    def forward(self, x: Tensor) -> Any:
        subs = list(self.subs)
        if self.loop:
            a, b = subs[0](x), subs[1](x)
        else:
            a, b = parallel_apply(subs, [x, x], mode="inline" if is_recomputing() else "parallel")
        return a + b, x


def test_checkpointed_call_whose_nested_batch_changes_mode() -> None:
    """fuzz seed 1795671768 case 5599: the forward's graph reaches the input
    through the nested node and its calls' gradient nodes (four edges), the
    recomputation's through two Linear nodes: the two terms still go to the
    first two slots, in the loop's order (they were summed first: last bits)."""
    for seed in range(5):
        torch.manual_seed(seed)
        mod = NestedByMode()
        ref = copy.deepcopy(mod)
        ref.loop = True
        x = torch.randn(3, 4, requires_grad=True)
        rx = x.detach().clone().requires_grad_()
        w1, w2 = torch.randn(3, 4), torch.randn(3, 4)
        h, same = parallel_apply([mod], [x], checkpoint=True, mode="lanes")[0]
        ((h * w1).sum() + (same * w2).sum()).backward()
        rh, rsame = ref(rx)
        ((rh * w1).sum() + (rsame * w2).sum()).backward()
        assert _bits(x.grad, rx.grad)
