"""``MixtureOfExperts.from_mixtral`` on the sparse-MoE block of every MoE
family of the installed transformers (tests/moe/zoo_helpers.py): it rebuilds
the block (output and gradients equal up to float rounding, the block's state
dict loads as it is) or raises NotImplementedError naming the block class and
what it would compute differently, never a layer computing something else.
``REBUILT`` pins which families are rebuilt. Nothing is downloaded."""
import copy

import pytest
import torch
from torch import nn

from zoo_helpers import causal_lm_families, init_weights, is_new, skip_if_new, tiny_model

from moe_autograd import MixtureOfExperts

pytestmark = pytest.mark.timeout(300)

# The families whose block from_mixtral rebuilds; every other one is refused.
REBUILT = {
    "mixtral", "minimax",                                   # Mixtral's block and router
    "qwen3_moe", "mellum", "olmoe", "flex_olmo",            # plain, norm_topk_prob
    "qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen4_exp",  # + sigmoid-gated shared expert
    "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",  # softmax of top-k
    "jamba",                                                 # unnormalised top-k
}


def _block(package, lm_class, seed=0):
    """The first module of the tiny model holding ``.experts`` (else the
    first of a class named ``*MoE*``), weights redrawn (a larger scale than
    the model's init, so that routing matters)."""
    model = tiny_model(package, lm_class, seed=seed)
    modules = list(model.modules())
    holders = [m for m in modules if isinstance(getattr(m, "experts", None), nn.Module)]
    holders += [m for m in modules if "moe" in type(m).__name__.lower()]
    for module in holders[:1]:
            for attr in ("jitter_noise", "input_jitter_noise"):
                if getattr(module, attr, None):
                    setattr(module, attr, 0.0)
            init_weights(module, seed, std=0.3)
            return module.train()
    error = AssertionError(f"{lm_class.__name__} has no MoE module")
    skip_if_new(package, "the tiny builder makes no MoE module", error)
    raise error


def _forward_backward(module, x, g):
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("package,lm_class", list(causal_lm_families()),
                         ids=[p for p, _ in causal_lm_families()])
def test_from_mixtral_rebuilds_the_block_or_refuses(package, lm_class):
    block = _block(package, lm_class)
    try:
        layer = MixtureOfExperts.from_mixtral(block)
    except (NotImplementedError, TypeError) as error:
        assert package not in REBUILT, f"{type(block).__name__}: {error}"
        assert type(block).__name__ in str(error)
        return
    assert package in REBUILT or is_new(package), \
        f"{type(block).__name__} is rebuilt: add it to REBUILT"
    hidden = layer.in_features
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, hidden, generator=generator)
    g = torch.randn(2, 6, hidden, generator=generator)
    y0, x_grad0, grads0 = _forward_backward(block, x, g)
    y, x_grad, grads = _forward_backward(layer, x, g)
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y0, **close)
    torch.testing.assert_close(x_grad, x_grad0, **close)
    # every parameter of the block has its counterpart, and the same gradient
    for name, grad0 in grads0.items():
        if name.startswith("experts."):
            param = name[len("experts."):]
            for e in range(len(layer.experts)):
                torch.testing.assert_close(grads[f"experts.{e}.{param}"], grad0[e], **close)
        else:
            name = "gate." + name[len("router."):] if name.startswith("router.") else name
            torch.testing.assert_close(grads[name], grad0, **close, msg=name)
    # the block's state dict loads as it is into a layer built from another block
    other = MixtureOfExperts.from_mixtral(_block(package, lm_class, seed=1))
    result = other.load_state_dict(block.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(other(x), layer(x))


def test_refusals_name_the_block_and_the_feature():
    families = dict(causal_lm_families())
    if "deepseek_v3" not in families:
        pytest.skip("no DeepSeek-V3 in this transformers")
    block = _block("deepseek_v3", families["deepseek_v3"])
    with pytest.raises(NotImplementedError, match=r"DeepseekV3MoE.*shared experts"):
        MixtureOfExperts.from_mixtral(block)
    mixtral = _block("mixtral", families["mixtral"])
    mixtral.jitter_noise = 0.1
    with pytest.raises(NotImplementedError, match="MixtralSparseMoeBlock.*jitter"):
        MixtureOfExperts.from_mixtral(mixtral)
    qwen2 = copy.deepcopy(_block("qwen2_moe", families["qwen2_moe"]))
    layer = MixtureOfExperts.from_mixtral(qwen2)
    assert layer.shared_expert is not None and layer.shared_expert_gate is not None
    assert layer.norm_topk_prob == qwen2.gate.norm_topk_prob
