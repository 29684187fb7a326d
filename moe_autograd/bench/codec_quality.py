"""Training quality under wire compression: the demo task's accuracy per codec.

Why: the codecs' error bounds (:mod:`moe_autograd.remote.compression`) say
what one tensor loses; whether training minds is a separate question. This
trains the demo's model (:mod:`moe_autograd.demo_task`: embed ->
``MixtureOfExperts`` of 6 linear experts, k = 2 -> head, the 4-region task)
once per codec, same seeds, same batches, and reports the final accuracy
against no compression.

How the codec is applied: each expert is wrapped so that exactly what a
remote call compresses is compressed, through the real wire
(:func:`moe_autograd.remote.wire.encode` / ``decode`` of a
:class:`~moe_autograd.remote.compression.Compressed` tensor): the input on
its way to the expert, the output on its way back, and in backward the
output gradient (to the server) and the input gradient (back). In-process:
the numbers are what the codec does to training, without the minutes a
world of processes per codec would cost; the engines carry the same bytes
(``tests/remote/test_compression.py`` checks remote calls against this very
round trip, bit for bit).
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..demo_task import Expert, Model, RegionTask, evaluate, train_step

__all__ = ["run", "train_accuracy", "CodecExpert", "CODECS"]

CODECS = ("fp16", "bf16", "int8")
DIM, WIDTH, CLASSES, EXPERTS, LR = 8, 32, 4, 6, 3e-3


def _round_trip(t: Tensor, codec: str) -> Tensor:
    from ..remote import wire
    from ..remote.compression import Compressed

    return wire.decode(*wire.encode([Compressed(t.detach(), codec)]))[0]  # type: ignore[no-any-return]


class _Wire(torch.autograd.Function):
    """Identity whose forward value and backward gradient cross the wire under a codec."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, codec: str) -> Tensor:  # type: ignore[override]
        ctx.codec = codec
        return _round_trip(x, codec)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        return _round_trip(grad, ctx.codec), None


class CodecExpert(nn.Module):
    """``inner`` as a remote call under ``codec`` would see it (``None``: raw)."""

    def __init__(self, inner: nn.Module, codec: Optional[str]) -> None:
        super().__init__()
        self.inner, self.codec = inner, codec

    def forward(self, x: Tensor) -> Tensor:
        if self.codec is None:
            return self.inner(x)  # type: ignore[no-any-return]
        return _Wire.apply(self.inner(_Wire.apply(x, self.codec)), self.codec)  # type: ignore[no-any-return]


def train_accuracy(codec: Optional[str], steps: int, batch: int = 256, seed: int = 0
                   ) -> Tuple[float, float]:
    """``(accuracy, loss)`` after ``steps`` steps under ``codec`` (one
    intra-op thread, as the demo: the experts' calls overlap on threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        task = RegionTask(DIM, CLASSES, seed)
        experts = [CodecExpert(Expert(WIDTH), codec) for _ in range(EXPERTS)]
        model = Model(DIM, WIDTH, CLASSES, experts, k=2)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        for _ in range(steps):
            train_step(model, opt, task, batch)
        loss, acc = evaluate(model, task)
    finally:
        torch.set_num_threads(threads)
    return acc, loss


def run(quick: bool = False) -> List[Dict[str, Any]]:
    """One row per codec: accuracy with it against none (percent, not ms)."""
    steps = 50 if quick else 300
    base, base_loss = train_accuracy(None, steps)
    rows = []
    for codec in CODECS:
        acc, loss = train_accuracy(codec, steps)
        rows.append({"name": f"remote/codec-{codec}-accuracy", "baseline_ms": 100 * base,
                     "ours_ms": 100 * acc, "ratio": acc / base, "goal": ">= 0.98",
                     "unit": "%",
                     "note": f"demo task accuracy (%, not ms) after {steps} steps, same seeds: "
                             f"compression={codec!r} (loss {loss:.3f}) vs none (loss "
                             f"{base_loss:.3f}); codec applied in-process through the wire"})
    return rows


if __name__ == "__main__":
    from moe_autograd.bench.remote import format_rows

    print(format_rows(run()))
