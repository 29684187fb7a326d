"""A Mixtral from ``transformers`` whose sparse-MoE blocks run their experts
through moe_autograd: the same loss, logits and gradients as the stock model.

A tiny Mixtral is randomly initialised (nothing is downloaded) and copied:

* ``stock`` runs transformers' own eager expert loop;
* ``ours`` is the same model after ``set_experts_implementation("moe_autograd")``
  (registered by ``register_experts_implementation()``): each block still
  routes with its own router, but calls its experts through
  ``moe_autograd.run_experts``, so their forwards and backwards overlap.

We check that loss, logits, aux loss and every parameter's gradient are
bit-for-bit equal, also with ``gradient_checkpointing_enable()`` (called
``activation_checkpointing_enable()`` since transformers 5.x: a
non-reentrant checkpoint around each decoder layer), then time a training
step of each. Finally every block is replaced by a ``MixtureOfExperts`` built
from it (``MixtureOfExperts.from_mixtral``: deadlines, quorum and failure
masking on top), which gives the same loss up to float rounding.

Needs the optional extra: ``pip install -e '.[examples]'``.

    python examples/mixtral.py           # 4 layers, 8 experts, 512 tokens
    python examples/mixtral.py --small   # what the tests run
"""
import argparse
import copy
import statistics
import time
from typing import Any, Dict, List

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from moe_autograd import MixtureOfExperts
from moe_autograd.moe import register_experts_implementation


def train_step(model: MixtralForCausalLM, batch: Dict[str, Any]) -> Any:
    model.zero_grad(set_to_none=True)
    out = model(**batch, output_router_logits=True)  # loss includes the aux loss
    out.loss.backward()
    return out


def assert_same(stock: MixtralForCausalLM, ours: MixtralForCausalLM,
                batch: Dict[str, Any], what: str) -> None:
    a, b = train_step(stock, batch), train_step(ours, batch)
    for name in ("loss", "logits", "aux_loss"):
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{what}: {name} differs"
    for (name, p), q in zip(stock.named_parameters(), ours.parameters()):
        assert p.grad is not None and q.grad is not None, f"{what}: {name} has no gradient"
        assert torch.equal(p.grad, q.grad), f"{what}: gradient of {name} differs"
    print(f"{what}: loss {a.loss.item():.6f}; loss, logits, aux loss and all "
          f"{len(list(stock.parameters()))} gradients bit-for-bit equal")


def median_ms(model: MixtralForCausalLM, batch: Dict[str, Any], repeats: int) -> float:
    train_step(model, batch)  # warm-up
    times: List[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        train_step(model, batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2 layers, 4 experts, 32 tokens")
    args = parser.parse_args()
    hidden, ffn, experts, layers, batch_size, seq = (
        (32, 64, 4, 2, 2, 16) if args.small else (256, 512, 8, 4, 4, 128))
    config = MixtralConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, max_position_embeddings=2 * seq)
    torch.manual_seed(0)
    stock = MixtralForCausalLM(config).train()  # random weights: nothing downloaded
    stock.set_experts_implementation("eager")  # the reference: transformers' expert loop
    ours = copy.deepcopy(stock)
    ours.set_experts_implementation(register_experts_implementation())

    ids = torch.randint(0, config.vocab_size, (batch_size, seq))
    mask = torch.ones_like(ids)
    mask[0, seq // 2:] = 0  # some padding: the aux loss leaves it out
    batch: Dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "labels": ids,
                             "use_cache": False}

    assert_same(stock, ours, batch, "plain")
    for model in (stock, ours):
        # gradient_checkpointing_enable(), renamed in transformers 5.x: a
        # non-reentrant torch.utils.checkpoint around every decoder layer.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    assert_same(stock, ours, batch, "gradient checkpointing")
    for model in (stock, ours):
        getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()

    repeats = 2 if args.small else 5
    grouped = copy.deepcopy(stock)
    grouped.set_experts_implementation("grouped_mm")  # transformers' default kernel
    print(f"training step, {batch_size}x{seq} tokens, {layers} layers of {experts} experts: "
          f"stock loop {median_ms(stock, batch, repeats):.1f} ms, "
          f"stock grouped_mm {median_ms(grouped, batch, repeats):.1f} ms, "
          f"moe_autograd {median_ms(ours, batch, repeats):.1f} ms")

    # The fault-tolerant layer in place of every block: same outputs (up to
    # rounding), router logits still recorded, so the aux loss still works.
    layered = copy.deepcopy(stock)
    for layer in layered.model.layers:
        layer.mlp = MixtureOfExperts.from_mixtral(layer.mlp, forward_timeout=30.0)
    a, b = train_step(stock, batch), train_step(layered, batch)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.aux_loss, a.aux_loss, rtol=1e-5, atol=1e-6)
    print(f"MixtureOfExperts.from_mixtral blocks: loss {b.loss.item():.6f} "
          f"(stock {a.loss.item():.6f}), aux loss {b.aux_loss.item():.6f}")


if __name__ == "__main__":
    main()
