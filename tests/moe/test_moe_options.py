"""MixtureOfExperts options for real models (gate_bias, router_dtype, aux_loss
forms and token mask, returned values, custom gate, stacked state dicts) and
the one-pass combine. transformers is not needed here (see test_mixtral.py)."""
import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from moe_autograd.moe import (
    MixtureOfExperts, load_balancing_loss, mixtral_load_balancing_loss,
)
from moe_layer_helpers import assert_close, dense_reference, make_moe

F_IN, F_OUT = 6, 5
pytestmark = pytest.mark.timeout(60)


def test_gate_bias_false_has_no_bias_and_matches_reference():
    moe = make_moe(k=2, seed=1, gate_bias=False)
    assert moe.gate.bias is None
    assert [name for name, _ in moe.gate.named_parameters()] == ["weight"]
    x = torch.randn(12, F_IN, dtype=torch.float64)
    xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, aux = moe(xm)
    gate_ref = nn.Linear(F_IN, 4, bias=False).double()
    gate_ref.load_state_dict(moe.gate.state_dict())
    y_ref, aux_ref = dense_reference(gate_ref, list(moe.experts), xr, 2)
    assert_close(y, y_ref, "y")
    assert_close(aux, aux_ref, "aux")
    (y.sum() + aux).backward()
    (y_ref.sum() + aux_ref).backward()
    assert_close(xm.grad, xr.grad, "x.grad")
    assert_close(moe.gate.weight.grad, gate_ref.weight.grad, "gate.weight.grad")


def test_defaults_unchanged():
    moe = make_moe(seed=2)
    assert isinstance(moe.gate, nn.Linear) and moe.gate.bias is not None
    assert moe.router_dtype is None and moe.aux_loss == "switch"
    out = moe(torch.randn(4, F_IN, dtype=torch.float64))
    assert isinstance(out, tuple) and len(out) == 2


def test_router_dtype_routes_in_that_dtype():
    torch.manual_seed(3)
    experts = [nn.Linear(F_IN, F_OUT) for _ in range(4)]
    moe = MixtureOfExperts(experts, F_IN, k=2, router_dtype=torch.float64,
                           return_router_logits=True)
    x = torch.randn(10, F_IN)
    y, aux, logits = moe(x)
    assert logits.dtype == torch.float64 and aux.dtype == torch.float64
    assert y.dtype == torch.float32  # the experts' dtype
    assert torch.equal(logits, moe.gate(x).double())
    # the weights are float64 softmaxes; each product is cast to float32 once
    top, idx = logits.topk(2, dim=-1)
    w = torch.softmax(top, dim=-1)
    with torch.no_grad():
        rows = torch.zeros(10, F_OUT)
        for t in range(10):
            for j in range(2):
                rows[t] += (experts[int(idx[t, j])](x[t]) * w[t, j]).float()
    torch.testing.assert_close(y.detach(), rows, rtol=1e-6, atol=1e-6)


def test_router_dtype_float32_with_bfloat16_model_and_float32_gate():
    """Switch-style: the model in bfloat16, the gate kept in float32 (the
    input is cast to the gate's dtype), routing in float32."""
    torch.manual_seed(4)
    moe = MixtureOfExperts([nn.Linear(F_IN, F_IN) for _ in range(4)], F_IN, k=2,
                           router_dtype=torch.float32, return_router_logits=True).bfloat16()
    moe.gate.float()
    x = torch.randn(8, F_IN, dtype=torch.bfloat16, requires_grad=True)
    y, aux, logits = moe(x)
    assert y.dtype == torch.bfloat16 and logits.dtype == torch.float32
    torch.testing.assert_close(logits, moe.gate(x.float()))
    (y.float().sum() + aux).backward()
    assert moe.gate.weight.grad.dtype == torch.float32
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


def test_mixtral_aux_loss_is_k_times_switch():
    moe_s = make_moe(num_experts=5, k=3, seed=5)
    moe_m = make_moe(num_experts=5, k=3, seed=5, aux_loss="mixtral")
    x = torch.randn(20, F_IN, dtype=torch.float64)
    _, aux_s = moe_s(x)
    _, aux_m = moe_m(x)
    assert_close(aux_m, 3 * aux_s, "mixtral aux = k * switch aux")


@pytest.mark.parametrize("form", ["switch", "mixtral"])
def test_token_mask_drops_tokens_from_the_aux_loss_only(form):
    moe = make_moe(k=2, seed=6, aux_loss=form)
    x = torch.randn(3, 5, F_IN, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    y_masked, aux_masked = moe(x, mask)
    y, _ = moe(x)
    _, aux_kept = moe(x[mask.bool()])
    assert torch.equal(y_masked, y)  # routing and outputs untouched
    assert_close(aux_masked, aux_kept, f"{form} aux with mask")
    aux_masked.backward()
    assert moe.gate.weight.grad.abs().sum() > 0


def test_aux_loss_functions_on_logits():
    torch.manual_seed(7)
    logits = torch.randn(12, 4, dtype=torch.float64)
    top = logits.topk(2, dim=-1).indices
    switch = load_balancing_loss(logits, top)
    assert_close(mixtral_load_balancing_loss(logits, 4, 2), 2 * switch, "one layer")
    # several layers pool counts and probabilities (not the mean of losses)
    other = torch.randn(12, 4, dtype=torch.float64)
    pooled = mixtral_load_balancing_loss([logits, other], 4, 2)
    both = torch.cat([logits, other])
    assert_close(pooled, mixtral_load_balancing_loss(both, 4, 2), "pooled = concatenated")
    # a uniform load gives 1 (switch) / k (mixtral)
    even = torch.zeros(8, 4)
    even_top = torch.tensor([[0, 1], [2, 3]] * 4)
    assert float(load_balancing_loss(even, even_top)) == pytest.approx(1.0)


def test_return_options():
    x = torch.randn(2, 3, F_IN, dtype=torch.float64)
    y_only = make_moe(seed=8, return_aux_loss=False)(x)
    assert isinstance(y_only, Tensor) and y_only.shape == (2, 3, F_OUT)
    y, logits = make_moe(seed=8, return_aux_loss=False, return_router_logits=True)(x)
    moe = make_moe(seed=8, return_router_logits=True)
    y3, aux, logits3 = moe(x)
    assert torch.equal(y, y_only) and torch.equal(y3, y_only)
    assert logits.shape == (6, 4) and torch.equal(logits, logits3)
    assert_close(logits3, moe.gate(x.reshape(-1, F_IN)), "router logits")


def test_custom_gate_returning_a_tuple():
    class Router(nn.Module):  # transformers' convention: (logits, scores, indices)
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, F_IN, dtype=torch.float64))

        def forward(self, h: Tensor):
            logits = h @ self.weight.t()
            return logits, None, None

    router = Router()
    moe = make_moe(seed=9, gate=router)
    assert moe.gate is router
    x = torch.randn(7, F_IN, dtype=torch.float64)
    reference = make_moe(seed=9, gate_bias=False)
    with torch.no_grad():
        reference.gate.weight.copy_(router.weight)
    y, aux = moe(x)
    y_ref, aux_ref = reference(x)
    assert torch.equal(y, y_ref) and torch.equal(aux, aux_ref)
    (y.sum() + aux).backward()
    assert router.weight.grad is not None

    bad = make_moe(seed=9, gate=nn.Linear(F_IN, 3).double())
    with pytest.raises(ValueError, match="the gate must return"):
        bad(x)


def test_invalid_options():
    with pytest.raises(ValueError, match="aux_loss"):
        make_moe(aux_loss="gshard")
    with pytest.raises(ValueError, match="router_dtype"):
        make_moe(router_dtype=torch.int32)
    with pytest.raises(ValueError, match="token_mask"):
        make_moe(seed=0)(torch.randn(4, F_IN, dtype=torch.float64), torch.ones(5))


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(F_OUT, F_IN))
        self.lin = nn.Linear(F_IN, F_OUT)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w.t() + self.lin(x)


def test_stacked_expert_weights_load_into_per_expert_modules():
    moe = MixtureOfExperts([_Expert() for _ in range(3)], F_IN, k=2)
    stacked = torch.randn(3, F_OUT, F_IN)
    state = {k: v.clone() for k, v in moe.state_dict().items() if not k.endswith(".w")}
    state["experts.w"] = stacked
    moe.load_state_dict(state)
    for e in range(3):
        assert torch.equal(moe.experts[e].w, stacked[e])
    # per-expert keys still load; a stacked tensor of the wrong length does not
    moe.load_state_dict(moe.state_dict())
    state = {k: v for k, v in moe.state_dict().items() if not k.endswith(".w")}
    state["experts.w"] = torch.randn(2, F_OUT, F_IN)
    with pytest.raises(RuntimeError, match="experts.w"):
        moe.load_state_dict(state)


class _CountIndexAdd(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.index_add, torch.ops.aten.index_add_):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("num_experts", [2, 8])
def test_combine_is_one_index_add_whatever_the_number_of_experts(num_experts):
    moe = make_moe(num_experts=num_experts, k=2, seed=10)
    x = torch.randn(32, F_IN, dtype=torch.float64)
    with _CountIndexAdd() as mode, torch.no_grad():
        moe(x)
    assert mode.count == 1


def test_one_pass_combine_equals_a_per_expert_loop_bit_for_bit():
    """float32: the same sums, in the same order, as one index_add per expert."""
    torch.manual_seed(11)
    experts = [nn.Linear(16, 16) for _ in range(6)]
    moe = MixtureOfExperts(experts, 16, k=3)
    x = torch.randn(40, 16)
    y, _ = moe(x)
    with torch.no_grad():
        logits = moe.gate(x)
        top, idx = logits.topk(3, dim=-1)
        w = torch.softmax(top, dim=-1)
        loop = torch.zeros(40, 16)
        for e, expert in enumerate(experts):
            tokens, slots = (idx == e).nonzero(as_tuple=True)
            if len(tokens):
                loop = loop.index_add(0, tokens, expert(x[tokens]) * w[tokens, slots, None])
    assert torch.equal(y.detach(), loop)
