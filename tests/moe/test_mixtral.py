"""transformers' Mixtral (5.x) and moe_autograd: MixtureOfExperts.from_mixtral
gives a block's outputs and loads its weights; the registered experts
implementation gives the stock model's loss and gradients bit for bit; the aux
loss matches transformers' load_balancing_loss_func. Tiny random models only,
nothing downloaded; skipped when transformers is not installed."""
import copy
from typing import Any, Dict

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is an optional extra: "
                    "pip install -e '.[examples]' (make test installs it)")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import (  # noqa: E402
    MixtralSparseMoeBlock, load_balancing_loss_func,
)

from moe_autograd import MixtureOfExperts  # noqa: E402
from moe_autograd.moe import (  # noqa: E402
    from_mixtral, mixtral_load_balancing_loss, register_experts_implementation,
)

pytestmark = pytest.mark.timeout(120)


def _config(**overrides: Any) -> MixtralConfig:
    values: Dict[str, Any] = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, experts_implementation="eager")
    values.update(overrides)
    return MixtralConfig(**values)


def _block(seed: int = 0) -> MixtralSparseMoeBlock:
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(_config())
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


def test_from_mixtral_gives_the_blocks_outputs_and_gradients():
    block = _block()
    moe = MixtureOfExperts.from_mixtral(block)
    assert moe.k == 2 and moe.router_dtype == torch.float32 and moe.aux_loss == "mixtral"
    assert type(moe.gate).__name__ == "MixtralTopKRouter" and moe.gate is not block.gate
    x = torch.randn(3, 5, 16)
    xb, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_block, y = block(xb), moe(xm)  # a bare y, as the block returns
    torch.testing.assert_close(y, y_block, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    (y_block * g).sum().backward()
    (y * g).sum().backward()
    torch.testing.assert_close(xm.grad, xb.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.gate.weight.grad, block.gate.weight.grad,
                               rtol=1e-5, atol=1e-6)
    for e, expert in enumerate(moe.experts):
        torch.testing.assert_close(expert.gate_up_proj.grad,
                                   block.experts.gate_up_proj.grad[e], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(expert.down_proj.grad,
                                   block.experts.down_proj.grad[e], rtol=1e-5, atol=1e-6)


def test_a_blocks_state_dict_loads_as_it_is():
    block, other = _block(1), _block(2)
    moe = from_mixtral(other)
    result = moe.load_state_dict(block.state_dict())  # strict: raises on any mismatch
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(9, 16)
    assert torch.equal(moe(x), from_mixtral(block)(x))


def test_aux_loss_and_router_logits_follow_transformers():
    block = _block(3)
    moe = from_mixtral(block, return_aux_loss=True, return_router_logits=True)
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    y, aux, logits = moe(x, mask)
    router_logits, _, _ = block.gate(x)
    assert torch.equal(logits, router_logits.float())
    assert torch.equal(aux, load_balancing_loss_func((router_logits,), 4, 2, mask))


@pytest.mark.parametrize("masked", [False, True])
def test_mixtral_load_balancing_loss_equals_transformers(masked):
    torch.manual_seed(4)
    layers = [torch.randn(12, 6) for _ in range(3)]
    mask = torch.randint(0, 2, (3, 4)) if masked else None
    expected = load_balancing_loss_func(tuple(layers), 6, 2, mask)
    assert torch.equal(mixtral_load_balancing_loss(layers, 6, 2, mask), expected)


def test_jitter_and_other_layouts_are_refused():
    block = _block()
    block.jitter_noise = 0.1
    with pytest.raises(NotImplementedError, match="jitter"):
        from_mixtral(block)
    block = _block()
    block.experts.has_bias = True
    with pytest.raises(NotImplementedError, match="has_bias"):
        from_mixtral(block)


def _train_step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, output_router_logits=True)
    out.loss.backward()
    return out


def test_registered_experts_implementation_equals_the_stock_loop_bit_for_bit():
    torch.manual_seed(5)
    stock = MixtralForCausalLM(_config(hidden_size=32, intermediate_size=64)).train()
    ours = copy.deepcopy(stock)
    ours.set_experts_implementation(register_experts_implementation())
    ids = torch.randint(0, 64, (2, 12))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
             "use_cache": False}
    a, b = _train_step(stock, batch), _train_step(ours, batch)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.logits, b.logits)
    for (name, p), q in zip(stock.named_parameters(), ours.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_from_mixtral_blocks_replace_a_models_blocks():
    """The layer in place of every block: router logits are still recorded
    (its gate is a MixtralTopKRouter), so the model's aux loss still works."""
    torch.manual_seed(6)
    stock = MixtralForCausalLM(_config()).train()
    model = copy.deepcopy(stock)
    for layer in model.model.layers:
        layer.mlp = MixtureOfExperts.from_mixtral(layer.mlp)
    ids = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    a, b = _train_step(stock, batch), _train_step(model, batch)
    assert len(b.router_logits) == 2
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.aux_loss, a.aux_loss, rtol=1e-5, atol=1e-6)
    model.load_state_dict(stock.state_dict())  # the stock checkpoint loads as it is
