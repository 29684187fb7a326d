"""A forced ``inline`` mode runs the MoE layer's calls on the caller's thread,
forward and backward (it gave them one thread each: ``lanes = n``)."""
import threading
from typing import List

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import MixtureOfExperts


class _Where(nn.Module):
    def __init__(self, seen: List[str]) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen = seen

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(threading.current_thread().name)
        return _Noted.apply(self.fc(x), self.seen)


class _Noted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seen):  # type: ignore[override]
        ctx.seen = seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        ctx.seen.append(threading.current_thread().name)
        return g, None


@pytest.mark.timeout(60)
def test_forced_inline_runs_every_call_on_the_caller() -> None:
    seen: List[str] = []
    torch.manual_seed(0)
    moe = MixtureOfExperts([_Where(seen) for _ in range(8)], 4, k=2, mode="inline")
    y, aux = moe(torch.randn(16, 4))
    (y.sum() + aux).backward()
    here = threading.current_thread().name
    assert seen and all(name == here for name in seen), set(seen)
