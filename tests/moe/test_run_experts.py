"""run_experts (a list of experts on their routed tokens, one dispatch, one
combine) and group_by_expert: results and gradients equal a plain loop."""
import pytest
import torch
from torch import Tensor, nn

from moe_autograd.moe import run_experts
from moe_autograd.moe.dispatch import group_by_expert

pytestmark = pytest.mark.timeout(60)


def _loop(experts, x, index, weights, expert_args=None):
    """transformers' eager expert loop, written out."""
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        slots, tokens = torch.where((index == e).t())
        if len(tokens):
            extra = expert_args[e] if expert_args else ()
            out = expert(x[tokens], *extra) * weights[tokens, slots, None]
            y = y.index_add(0, tokens, out.to(y.dtype))
    return y


def _routing(num_tokens, num_experts, k, seed):
    torch.manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts)
    top, index = torch.softmax(logits, -1).topk(k, dim=-1)
    return index, (top / top.sum(-1, keepdim=True)).requires_grad_()


def test_group_by_expert_orders():
    index = torch.tensor([[1, 0], [0, 2], [2, 1]])
    tokens, slots = group_by_expert(index, 3)
    assert [t.tolist() for t in tokens] == [[0, 1], [0, 2], [1, 2]]
    assert [s.tolist() for s in slots] == [[1, 0], [0, 1], [1, 0]]
    tokens, slots = group_by_expert(index, 3, slot_major=True)
    assert [t.tolist() for t in tokens] == [[1, 0], [0, 2], [2, 1]]
    assert [s.tolist() for s in slots] == [[0, 1], [0, 1], [0, 1]]
    # num_experts is the empty-slot sentinel; beyond it is an error
    tokens, _ = group_by_expert(torch.tensor([[0, 3], [3, 1]]), 3)
    assert [t.tolist() for t in tokens] == [[0], [1], []]
    with pytest.raises(ValueError, match="expert 4"):
        group_by_expert(torch.tensor([[0, 4]]), 3)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_equals_the_loop_with_gradients(checkpoint):
    torch.manual_seed(0)
    experts = [nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(5)]
    index, weights = _routing(24, 5, 2, seed=1)
    x = torch.randn(24, 8, requires_grad=True)
    y = run_experts(experts, x, index, weights, checkpoint=checkpoint)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    ours = [x.grad, weights.grad] + [p.grad for e in experts for p in e.parameters()]
    x.grad = weights.grad = None
    for e in experts:
        e.zero_grad(set_to_none=True)
    y_loop = _loop(experts, x, index, weights)
    (y_loop * g).sum().backward()
    loop = [x.grad, weights.grad] + [p.grad for e in experts for p in e.parameters()]
    assert torch.equal(y, y_loop)
    for a, b in zip(ours, loop):
        assert torch.equal(a, b)


def test_expert_args_carry_stacked_weights_and_their_gradients():
    torch.manual_seed(2)
    stacked = torch.randn(4, 6, 6, requires_grad=True)

    def expert(x: Tensor, w: Tensor) -> Tensor:
        return torch.relu(x @ w.t())

    index, weights = _routing(10, 4, 2, seed=3)
    x = torch.randn(10, 6)
    y = run_experts([expert] * 4, x, index, weights.detach(),
                    expert_args=[(w,) for w in stacked.unbind(0)])
    y.square().sum().backward()
    ours = stacked.grad
    stacked.grad = None
    y_loop = _loop([expert] * 4, x, index, weights.detach(),
                   expert_args=[(stacked[e],) for e in range(4)])
    y_loop.square().sum().backward()
    assert torch.equal(y, y_loop)
    assert torch.equal(ours, stacked.grad)


def test_empty_slots_and_unrouted_experts():
    calls = []

    def expert(x: Tensor) -> Tensor:
        calls.append(x.shape[0])
        return x * 2

    x = torch.randn(3, 4)
    index = torch.tensor([[0, 3], [3, 3], [0, 3]])  # 3 == len(experts): empty
    weights = torch.full((3, 2), 0.5, requires_grad=True)
    y = run_experts([expert] * 3, x, index, weights)
    assert calls == [2]
    assert torch.equal(y[1], torch.zeros(4)) and torch.equal(y[0], x[0])
    y = run_experts([expert] * 3, x, torch.full((3, 2), 3), weights)
    assert torch.equal(y, torch.zeros(3, 4))
    y.sum().backward()  # no expert ran, the graph still reaches the weights
    assert torch.equal(weights.grad, torch.zeros(3, 2))


def test_bad_arguments():
    x = torch.randn(3, 4)
    index = torch.zeros(3, 1, dtype=torch.long)
    weights = torch.ones(3, 1)
    with pytest.raises(ValueError, match="expert 0 must return one tensor with 3 rows"):
        run_experts([lambda t: t[:1]], x, index, weights)
    with pytest.raises(ValueError, match="expert_args"):
        run_experts([lambda t: t], x, index, weights, expert_args=[(), ()])
    with pytest.raises(ValueError, match="differ"):
        run_experts([lambda t: t], x, index, torch.ones(3, 2))
