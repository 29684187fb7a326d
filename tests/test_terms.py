"""A tensor a call reads on several paths gets its gradient terms one by one,
in the loop's order (``moe_autograd/terms.py``)."""
import copy
from typing import Any, List

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import parallel_apply
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


def test_a_branch_the_backward_skips_falls_back_to_the_sums() -> None:
    """A call whose second output gets no gradient: one edge never runs, so
    the recorded terms are fewer than the edges; the per-leaf sums go."""
    class TwoHeads(nn.Module):
        def forward(self, x: Tensor) -> Any:
            return torch.tanh(x), torch.sin(x)
    x = torch.randn(3, 4, requires_grad=True)
    rx = x.detach().clone().requires_grad_()
    a, _ = parallel_apply([TwoHeads()], [x], mode="parallel")[0]
    (a.sum() + x.sum()).backward()
    ra, _ = TwoHeads()(rx)
    (ra.sum() + rx.sum()).backward()
    assert _bits(x.grad, rx.grad)
