"""A tiny ``*ForCausalLM`` of every MoE family of the installed transformers
(tests/moe/zoo_helpers.py finds them), in train mode with every dropout and
router jitter on: with its experts switched to moe_autograd
(``set_experts_implementation``), loss, logits, aux loss and every gradient
equal the stock model's bit for bit over 3 AdamW steps, plain and with
gradient checkpointing; or switching raises NotImplementedError naming the
experts class that cannot dispatch (``REFUSED``). Nothing is downloaded.

By default the families of the issue run (Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V3, PhiMoE, Granite-MoE, Jamba, GPT-OSS, Llama4, DBRX) plus one of
every other loop variant or routing and every refused family;
``MOE_AUTOGRAD_ZOO=all`` (``make zoo``) runs all.
"""
import copy
import re
from typing import Any, Dict, List

import pytest
import torch

from zoo_helpers import (
    ZOO_ALL, assert_same, assert_same_grads, causal_lm_families, grads, skip_if_new, tiny_model,
)

from moe_autograd.moe.hf_experts import set_experts_implementation

pytestmark = pytest.mark.timeout(300)

STEPS = 3

# The families whose experts cannot run moe_autograd, and the class named.
REFUSED = {
    "dbrx": "DbrxExperts", "doge": "no experts module", "ergo": "ErgoExperts", "jetmoe": "JetMoe",
    "llama4": "Llama4TextExperts",
}

DEFAULT = {  # the families run by default (the others with MOE_AUTOGRAD_ZOO=all)
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "phimoe", "granitemoe",
    "jamba", "gpt_oss", "llama4", "dbrx",
    # one of each other eager-loop variant, routing or layout, and every refusal
    "aria", "deepseek_v4", "nemotron_h", "inkling2", "glm4_moe", "longcat_flash", *REFUSED,
}


def _cases():
    for package, lm_class in causal_lm_families():
        for checkpointing in (False, True):
            marks = () if ZOO_ALL or package in DEFAULT else (
                pytest.mark.skip(reason="MOE_AUTOGRAD_ZOO=all (make zoo) runs it"),)
            yield pytest.param(package, lm_class, checkpointing, marks=marks,
                               id=f"{package}-{'checkpointing' if checkpointing else 'plain'}")


def _batch(vocab_size: int) -> Dict[str, Any]:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(4, vocab_size, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # some padding
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}


def _checkpointing(model: torch.nn.Module) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable({"use_reentrant": False})


def _train(model: torch.nn.Module, batch: Dict[str, Any]) -> List[Dict[str, Any]]:
    """3 AdamW steps from the same seed; per step: loss, logits, aux loss,
    gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(11)
    steps = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        aux = getattr(out, "aux_loss", None)
        steps.append({"loss": out.loss.detach(), "logits": out.logits.detach(),
                      "aux_loss": None if aux is None else aux.detach(),
                      "grads": grads(model.named_parameters())})
        optimizer.step()
    return steps


@pytest.mark.parametrize("package,lm_class,checkpointing", list(_cases()))
def test_model_equals_stock(package, lm_class, checkpointing):
    stock = tiny_model(package, lm_class)
    ours = copy.deepcopy(stock)
    if package in REFUSED:
        with pytest.raises(NotImplementedError, match=re.escape(REFUSED[package])):
            set_experts_implementation(ours)
        return
    try:
        set_experts_implementation(ours)
    except NotImplementedError as error:
        skip_if_new(package, "refused by name", error)
        raise
    if checkpointing:
        _checkpointing(stock)
        _checkpointing(ours)
    batch = _batch(stock.config.vocab_size)
    expected, got = _train(stock, batch), _train(ours, batch)
    for step, (a, b) in enumerate(zip(expected, got)):
        what = f"{lm_class.__name__} step {step}"
        assert_same(b["loss"], a["loss"], f"{what}: loss")
        assert_same(b["logits"], a["logits"], f"{what}: logits")
        if a["aux_loss"] is not None:
            assert_same(b["aux_loss"], a["aux_loss"], f"{what}: aux loss")
        assert_same_grads(b["grads"], a["grads"], what)
    for (name, p), q in zip(stock.named_parameters(), ours.parameters()):
        assert_same(q.detach(), p.detach(), f"{lm_class.__name__}: {name} after {STEPS} steps")


def test_every_family_builds_with_experts():
    """Every family found builds tiny and holds experts modules, so that no
    family silently tests nothing."""
    families = causal_lm_families()
    assert len(families) >= 40
    assert {"mixtral", "qwen2_moe", "llama4", "dbrx"} <= {p for p, _ in families}
