"""Arbitrary ordering edges in the autograd graph.

``fork(x)`` returns ``x`` unchanged and a phony that depends on it; ``join(x,
phony)`` returns ``x`` unchanged but now depending on the phony. In backward the
engine therefore runs whatever hangs off the phony before the gradient of ``x``
passes the fork. Checkpointing uses this to run a :class:`~moe_autograd.
checkpoint.Recompute` node ahead of its :class:`~moe_autograd.checkpoint.
Checkpoint`; skip portals use it to tie hidden tensors to a batch.

Neither function copies data: the returned tensors are views of ``x``.

The spellings follow the pipeline library (torchgpipe): ``fork``/``join`` and
the autograd Functions behind them, :class:`Fork` and :class:`Join`, public so
that code written against those primitives (``Fork.apply(x)``,
``Join.apply(x, phony)``) runs unchanged; ``_Fork``/``_Join`` remain as
aliases.
"""
from typing import Any, Tuple

import torch
from torch import Tensor

from .phony import get_phony

__all__ = ["fork", "join", "Fork", "Join"]


def fork(input: Tensor) -> Tuple[Tensor, Tensor]:
    """Branches ``input`` into itself and a phony that depends on it."""
    if torch.is_grad_enabled() and input.requires_grad:
        input, phony = Fork.apply(input)
    else:
        phony = get_phony(input.device, requires_grad=False)
    return input, phony


def join(input: Tensor, phony: Tensor) -> Tensor:
    """Merges a phony into ``input`` so that ``input`` depends on it."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        input = Join.apply(input, phony)
    return input


class Fork(torch.autograd.Function):
    """Branches: ``input`` unchanged, and a phony that depends on it."""

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor, grad_grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad_input


class Join(torch.autograd.Function):
    """Merges: ``input`` unchanged, now depending on ``phony`` in backward."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, phony: Tensor) -> Tensor:  # type: ignore[override]
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        return grad_input, None


_Fork, _Join = Fork, Join  # the earlier private spellings
