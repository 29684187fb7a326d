"""The autograd Functions of the oracle's ``map_with_parallel_backward`` cases.

A map case runs ``map_with_parallel_backward(F, *[(x_i, w_i, 0.5, log) ...])``
against ``tuple(F.apply(*args) for args in ...)``. ``w_i`` is the ``gain``
Parameter of call ``i``'s expert module (so sharing and tying work as for
modules); ``log`` is a list each Function appends ``ctx.needs_input_grad``
and which of its backward's incoming gradients were None to (compared as a
multiset: calls may run in any order).

Replay a failure with ``pytest tests/oracle --fuzz-seed=S --fuzz-case=K``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Type

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

Log = List[Tuple[Any, ...]]


class FMul(torch.autograd.Function):
    """Saves its inputs; gradients for both tensors."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, s: float, log: Log) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.s, ctx.log = s, log
        log.append(("forward", "FMul", ctx.needs_input_grad))
        return x * w * s

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        ctx.log.append(("backward", "FMul", ctx.needs_input_grad))
        gx = g * w * ctx.s if ctx.needs_input_grad[0] else None
        gw = (g * x * ctx.s).sum(0) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


class FDirty(torch.autograd.Function):
    """Modifies its input in place and returns it (``mark_dirty``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, s: float, log: Log) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        x.mul_(s)
        ctx.mark_dirty(x)
        ctx.save_for_backward(w)
        ctx.s, ctx.log = s, log
        log.append(("forward", "FDirty", ctx.needs_input_grad))
        return x, x * w

    @staticmethod
    def backward(ctx: Any, gx: Optional[Tensor], gy: Optional[Tensor]) -> Any:  # type: ignore[override]
        (w,) = ctx.saved_tensors
        ctx.log.append(("backward", "FDirty", gx is None, gy is None))
        total = gx * ctx.s + gy * w * ctx.s
        return total, None, None, None


class FNonDiff(torch.autograd.Function):
    """A float output marked non-differentiable, and an integer one."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, s: float, log: Log) -> Tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        y, z = x * w, x * s
        ctx.mark_non_differentiable(z)
        ctx.save_for_backward(x, w)
        ctx.log = log
        log.append(("forward", "FNonDiff", ctx.needs_input_grad))
        return y, z, x.argmax(-1)

    @staticmethod
    def backward(ctx: Any, gy: Tensor, gz: Any, gi: Any) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        ctx.log.append(("backward", "FNonDiff", gz is None, gi is None))
        return gy * w, (gy * x).sum(0), None, None


class FPassThrough(torch.autograd.Function):
    """Returns an input as it is, next to a computed output."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, s: float, log: Log) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.save_for_backward(w)
        ctx.log = log
        log.append(("forward", "FPassThrough", ctx.needs_input_grad))
        return x, x * w

    @staticmethod
    def backward(ctx: Any, gx: Optional[Tensor], gy: Optional[Tensor]) -> Any:  # type: ignore[override]
        (w,) = ctx.saved_tensors
        ctx.log.append(("backward", "FPassThrough", gx is None, gy is None))
        return gx + gy * w, None, None, None


class FNoMaterialize(torch.autograd.Function):
    """``set_materialize_grads(False)``: backward sees None for unused outputs."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, s: float, log: Log) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w)
        ctx.log = log
        log.append(("forward", "FNoMaterialize", ctx.needs_input_grad))
        return x * w, x + s

    @staticmethod
    def backward(ctx: Any, ga: Optional[Tensor], gb: Optional[Tensor]) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        ctx.log.append(("backward", "FNoMaterialize", ga is None, gb is None))
        gx = None
        if ga is not None:
            gx = ga * w
        if gb is not None:
            gx = gb if gx is None else gx + gb
        gw = None if ga is None else (ga * x).sum(0)
        return gx, gw, None, None


class FRandom(torch.autograd.Function):
    """Draws random numbers in forward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, s: float, log: Log) -> Tensor:  # type: ignore[override]
        mask = (torch.rand_like(x) > 0.5).to(x.dtype)
        ctx.save_for_backward(mask, w)
        ctx.log = log
        log.append(("forward", "FRandom", ctx.needs_input_grad))
        return x * mask * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        mask, w = ctx.saved_tensors
        ctx.log.append(("backward", "FRandom"))
        return g * mask * w, None, None, None


class FSetupContext(torch.autograd.Function):
    """New style: ``forward`` without ctx, ``setup_context``, a default argument."""

    @staticmethod
    def forward(x: Tensor, w: Tensor, s: float, log: Log, shift: float = 0.25) -> Tensor:  # type: ignore[override]
        return x * w + shift

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tensor) -> None:
        x, w, s, log, shift = inputs
        ctx.save_for_backward(x, w)
        ctx.log = log
        log.append(("setup_context", "FSetupContext", ctx.needs_input_grad, shift))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        ctx.log.append(("backward", "FSetupContext", ctx.needs_input_grad))
        return g * w, (g * x).sum(0), None, None, None


class FOnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, s: float, log: Log) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.log = log
        log.append(("forward", "FOnceDifferentiable", ctx.needs_input_grad))
        return torch.tanh(x * w)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        ctx.log.append(("backward", "FOnceDifferentiable", ctx.needs_input_grad))
        d = g * (1 - torch.tanh(x * w) ** 2)
        return d * w, (d * x).sum(0), None, None


FUNCTIONS: Dict[str, Type[torch.autograd.Function]] = {
    f.__name__: f for f in (FMul, FDirty, FNonDiff, FPassThrough, FNoMaterialize, FRandom,
                            FSetupContext, FOnceDifferentiable)
}
RANDOM_FUNCTIONS = frozenset({"FRandom"})
