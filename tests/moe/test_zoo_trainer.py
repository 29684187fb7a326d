"""``transformers.Trainer`` on a tiny MoE with moe_autograd's experts
implementation: a few training steps whose losses and final weights equal
those of the same run with transformers' ``eager`` experts loop, bit for bit.

Needs the ``test`` extra's ``accelerate`` (Trainer requires it) and
``transformers``; skipped without them. Nothing is downloaded: the model is
a randomly initialised tiny Mixtral and the data random token ids."""
import copy
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra: "
                                   "pip install -e '.[examples]' (make test installs it)")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate: "
                    "pip install -e '.[test]' (make test installs it)")
from transformers import (MixtralConfig, MixtralForCausalLM, Trainer,  # noqa: E402
                          TrainingArguments)

from moe_autograd.moe import set_experts_implementation  # noqa: E402

pytestmark = pytest.mark.timeout(300)
STEPS = 3


class _Recording(Trainer):
    """A Trainer that keeps every step's loss tensor (the logged ones are rounded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: List[torch.Tensor] = []

    def compute_loss(self, model: Any, inputs: Dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        value = loss[0] if isinstance(loss, tuple) else loss
        self.losses.append(value.detach().clone())
        return loss


def _train(model: MixtralForCausalLM, data: List[Dict[str, torch.Tensor]],
           out: Path) -> _Recording:
    args = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=1e-3, seed=0, data_seed=0, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = _Recording(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer


def test_trainer_losses_equal_eager(tmp_path: Path) -> None:
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=32, output_router_logits=True)
    torch.manual_seed(0)
    eager = MixtralForCausalLM(config)
    eager.set_experts_implementation("eager")  # the reference: transformers' expert loop
    ours = copy.deepcopy(eager)
    set_experts_implementation(ours)
    ids = torch.randint(0, config.vocab_size, (8, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]

    reference = _train(eager, data, tmp_path / "eager")
    trained = _train(ours, data, tmp_path / "ours")
    assert len(reference.losses) == len(trained.losses) == STEPS
    for step, (a, b) in enumerate(zip(reference.losses, trained.losses)):
        assert torch.equal(a, b), f"step {step}: loss {b.item()!r} != eager's {a.item()!r}"
    for (name, p), q in zip(eager.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), f"{name} differs after {STEPS} steps"
