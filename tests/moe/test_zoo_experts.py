"""Every experts class of the installed transformers that the
experts-implementation mechanism can dispatch (tests/moe/zoo_helpers.py finds
them), built tiny: the moe_autograd implementation equals the class's own
eager loop bit for bit, output and every gradient (tokens, routing weights,
parameters), in float32 and bfloat16 (routing weights in bfloat16, as Qwen's
routers give them, or float32, as Mixtral's), top-k 2 and 4; or it raises
NotImplementedError naming the class. Nothing is downloaded."""
import pytest
import torch

from zoo_helpers import (
    assert_same, assert_same_grads, experts_classes, grads, is_new, skip_if_new, tiny_experts,
)

from moe_autograd.moe.hf_experts import (
    EXPERTS_IMPLEMENTATION, eager_loop, register_experts_implementation,
)

pytestmark = pytest.mark.timeout(300)

TOKENS = 24
PRECISIONS = {  # name: (dtype of the tokens and weights, dtype of the routing weights)
    "float32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-f32-routing": (torch.bfloat16, torch.float32),
}


def _top_ks(cls):
    """The top-k of its cases: 1 for a loop that takes one route per row."""
    try:
        return (1,) if eager_loop(cls).single_route else (2, 4)
    except NotImplementedError:  # refused: the test checks the refusal
        return (2, 4)


def _cases():
    for cls in experts_classes():
        for precision in PRECISIONS:
            for k in _top_ks(cls):
                yield pytest.param(cls, precision, k, id=f"{cls.__name__}-{precision}-k{k}")


def _routing(num_experts: int, k: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:k]
                         for _ in range(TOKENS)])
    weights = torch.softmax(torch.randn(TOKENS, k, generator=generator), dim=-1).to(dtype)
    return index, weights.requires_grad_()


def _run(experts, x, index, weights, g):
    x = x.clone().requires_grad_()
    w = weights.detach().clone().requires_grad_()
    y = experts(x, index, w)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad, grads(experts.named_parameters())


@pytest.mark.parametrize("experts_class,precision,k", list(_cases()))
def test_experts_class_equals_its_eager_loop(experts_class, precision, k):
    name = register_experts_implementation()
    dtype, routing_dtype = PRECISIONS[precision]
    stock = tiny_experts(experts_class, "eager", seed=1, dtype=dtype)
    ours = tiny_experts(experts_class, name, seed=1, dtype=dtype)
    num_experts = stock.num_experts
    index, weights = _routing(num_experts, k, routing_dtype, seed=2)
    generator = torch.Generator().manual_seed(3)
    down = stock.down_proj  # [E, H, I], or [E, I, H] transposed
    hidden = down.shape[2] if stock.is_transposed else down.shape[1]
    x = torch.randn(TOKENS, hidden, generator=generator).to(dtype)
    g = torch.randn(TOKENS, hidden, generator=generator).to(dtype)
    try:
        eager_loop(ours)
    except NotImplementedError as error:
        assert experts_class.__name__ in str(error)
        with pytest.raises(NotImplementedError, match=experts_class.__name__):
            ours(x, index, weights)
        skip_if_new(experts_class.__name__, "refused by name", error)
        return
    y, x_grad, w_grad, p_grads = _run(ours, x, index, weights, g)
    y0, x_grad0, w_grad0, p_grads0 = _run(stock, x, index, weights, g)
    what = f"{experts_class.__name__} {precision} k={k}"
    assert_same(y, y0, f"{what}: output")
    assert_same(x_grad, x_grad0, f"{what}: gradient of the tokens")
    if w_grad0 is None:  # a loop that ignores the weights (ErgoExpertProjections)
        assert w_grad is None, f"{what}: the routing weights have a gradient, stock none"
    else:
        assert_same(w_grad, w_grad0, f"{what}: gradient of the routing weights")
    assert_same_grads(p_grads, p_grads0, what)


def test_the_zoo_is_the_whole_zoo():
    """Every dispatchable class is found, and every one the zoo knows has a
    known loop (a newer release's new classes: tests skip them, make latest
    reports them)."""
    classes = experts_classes()
    assert len(classes) >= 60 and any(c.__name__ == "MixtralExperts" for c in classes)
    unknown = []
    for cls in classes:
        if is_new(cls.__name__):
            continue
        try:
            eager_loop(tiny_experts(cls, "eager"))
        except NotImplementedError as error:
            unknown.append(str(error))
    assert not unknown, f"eager loops moe_autograd does not reproduce: {unknown}"


def test_implementation_name_is_stable():
    assert register_experts_implementation() == EXPERTS_IMPLEMENTATION == "moe_autograd"


def test_an_unknown_eager_loop_is_refused_not_run():
    """A class that dispatches, but whose own loop moe_autograd does not
    know: NotImplementedError naming it, never another computation."""
    from transformers import MixtralConfig
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation
    class ScaledExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.randn(4, 4, 4))
            self.act_fn = torch.nn.functional.silu

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * hidden_states  # not the loop of any known class

    config = MixtralConfig()
    config._experts_implementation = register_experts_implementation()
    experts = ScaledExperts(config)
    with pytest.raises(NotImplementedError, match="ScaledExperts's eager expert loop"):
        experts(torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


def test_set_experts_implementation_switches_back_when_it_refuses():
    from transformers import Llama4ForCausalLM
    from zoo_helpers import tiny_model
    from moe_autograd.moe import set_experts_implementation
    model = tiny_model("llama4", Llama4ForCausalLM)
    before = model.get_experts_implementation()
    with pytest.raises(NotImplementedError, match="Llama4TextExperts.*cannot dispatch"):
        set_experts_implementation(model)
    assert model.get_experts_implementation() == before


def test_only_a_family_or_class_a_newer_release_brings_is_skipped():
    """A known family or class that fails still fails (the caller re-raises);
    a new one is skipped with what could not be done and why."""
    error = ValueError("heads\nmore")
    with pytest.raises(pytest.skip.Exception, match=r"new in transformers .*: zeta_moe: "
                       r"the tiny builder cannot make it: ValueError: heads$"):
        skip_if_new("zeta_moe", "the tiny builder cannot make it", error)
    for known in ("mixtral", "MixtralExperts"):
        assert not is_new(known)
        skip_if_new(known, "the tiny builder cannot make it", error)  # returns
