"""Portals: hand a skip tensor from one partition to another off the graph.

Why: a stashed tensor must reach the layer that pops it, possibly on another
device and stream, without the autograd engine tracking it as an input of
every partition in between. A :class:`Portal` holds the tensor outside the
graph. Three autograd Functions tie it back to the graph with phonies (size-0
tensors, :mod:`moe_autograd.phony`):

* :class:`PortalBlue` -- at the stash. Its phony is joined into the stashing
  micro-batch; in backward it hands the portal's gradient to the stashed
  tensor.
* :class:`PortalCopy` -- between partitions. Moves the tensor to the next
  device on ``next_stream`` and, in backward, the gradient back.
* :class:`PortalOrange` -- at the pop. Takes a phony forked from the popping
  micro-batch and returns the tensor; in backward it parks the gradient in the
  portal for :class:`PortalBlue`.

Tensor life
-----------

``put_tensor(tensor, tensor_life)`` lets :meth:`Portal.use_tensor` hand the
tensor out ``tensor_life`` times; each :meth:`Portal.blue` and each
:class:`PortalOrange` forward spends one life (marked ``[use]``). At life 0 the
portal drops its reference so the memory is freed as early as possible; a
further use raises :class:`RuntimeError`.

The tracker (:mod:`moe_autograd.skip.tracker`) chooses the life: 2 without
checkpointing, 3 when the stash runs in a checkpointed forward, and 1 again on
the recomputed stash, as the table shows (``-`` = the event does not happen)::

    +----+---------------------------------------------+----------+----------+
    |  # | event (stash in partition j, pop in k > j)  | life     | life     |
    |    |                                             | plain    | ckpt     |
    +----+---------------------------------------------+----------+----------+
    |    | FORWARD                                     |          |          |
    |  1 | save(): Portal(t, life); blue()       [use] | 2 -> 1   | 3 -> 2   |
    |  2 | PortalBlue.forward (phony joined into j)    | 1        | 2        |
    |  3 | copy() (j -> k, once per hop)               | 1        | 2        |
    |  4 | PortalCopy.forward (t moved to k's device)  | 1        | 2        |
    |  5 | orange() (phony forked from k's batch)      | 1        | 2        |
    |  6 | PortalOrange.forward                  [use] | 1 -> 0 X | 2 -> 1   |
    +----+---------------------------------------------+----------+----------+
    |    | BACKWARD (partition k first, then j)        |          |          |
    |  7 | orange() (recomputed)                       | -        | 1        |
    |  8 | PortalOrange.forward (recomputed)     [use] | -        | 1 -> 0 X |
    |  9 | PortalOrange.backward: put_grad(g)          | 0        | 0        |
    | 10 | PortalCopy.backward (g moved k -> j)        | 0        | 0        |
    | 11 | save() (recomputed): put_tensor(t', 1);     | -        | 1 -> 0 X |
    |    | blue() (recomputed)                   [use] |          |          |
    | 12 | PortalBlue.backward: use_grad() -> t'       | 0        | 0        |
    +----+---------------------------------------------+----------+----------+
    X = the portal drops the tensor here (life reached 0).

Invariants:

* Within one micro-batch, the stashing and popping partitions are either both
  checkpointed or neither; mixing them breaks the counts above (a recomputed
  pop would find the tensor already dropped and raise).
* A portal serves one route of one micro-batch for one iteration. It holds at
  most one tensor and one gradient; :meth:`Portal.use_grad` clears the
  gradient, so after backward the portal references no tensor memory.
* Events happen in the order above (the pipeline schedule and the phony edges
  guarantee it), so a portal needs no lock.
"""
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..phony import get_phony
from ..stream import AbstractStream, current_stream, get_device, record_stream, use_stream

__all__ = ["Portal", "PortalBlue", "PortalOrange", "PortalCopy"]


class Portal:
    """Holds one skip tensor (and later its gradient) outside the graph."""

    def __init__(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        self.tensor: Optional[Tensor] = None
        self.tensor_life: int = 0
        self.put_tensor(tensor, tensor_life)
        self.grad: Optional[Tensor] = None

    def __repr__(self) -> str:
        held = "None" if self.tensor is None else f"Tensor{tuple(self.tensor.shape)}"
        return f"Portal(tensor={held}, tensor_life={self.tensor_life})"

    def blue(self) -> Tensor:
        """Spends one life; returns a phony to join into the stashing batch.

        The phony depends on the tensor, so the gradient that
        :class:`PortalOrange` parks in this portal flows back into the tensor.
        """
        tensor = self.use_tensor()
        if tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalBlue.apply(self, tensor)

    def orange(self, phony: Tensor) -> Optional[Tensor]:
        """Returns the tensor, ordered after ``phony`` (forked from the popping batch).

        The life is spent inside :class:`PortalOrange`'s forward.
        """
        self.check_tensor_life()
        if self.tensor is None:
            # A stashed None needs no graph: spend the life here.
            return self.use_tensor()
        return PortalOrange.apply(self, phony)

    def copy(self, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor) -> Tensor:
        """Moves the tensor to ``next_stream``'s device; returns a phony to join.

        ``phony`` is forked from the micro-batch being copied along the same
        hop, so the copy is ordered with it in both directions.
        """
        if self.tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalCopy.apply(self, prev_stream, next_stream, phony)

    def check_tensor_life(self) -> None:
        if self.tensor_life <= 0:
            raise RuntimeError(
                "the skip tensor in this portal has been dropped: all of its lives "
                "were spent (see the tensor-life table in moe_autograd.skip.portal). "
                "It was used more times than its route allows, e.g. a pop recomputed "
                "without its stash being checkpointed."
            )

    def put_tensor(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        """Stores ``tensor`` for ``tensor_life`` uses (see the module's table)."""
        self.tensor_life = tensor_life
        self.tensor = tensor if tensor_life > 0 else None

    def use_tensor(self) -> Optional[Tensor]:
        """Hands out the tensor, spending one life; drops it at life 0."""
        self.check_tensor_life()
        tensor = self.tensor
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        return tensor

    def put_grad(self, grad: Optional[Tensor]) -> None:
        self.grad = grad

    def use_grad(self) -> Optional[Tensor]:
        """Takes the parked gradient (None if the popped tensor got none)."""
        grad, self.grad = self.grad, None
        return grad


def _move(tensor: Tensor, src_stream: AbstractStream, dst_stream: AbstractStream) -> Tensor:
    """Copies ``tensor`` to ``dst_stream``'s device, guarding both allocations."""
    dst_device = get_device(dst_stream)
    out_stream = current_stream(dst_device)
    with use_stream(src_stream), use_stream(dst_stream):
        # Only a copy into device memory may run ahead of the host; a copy
        # into host memory must be complete when it is handed out.
        moved = tensor.to(dst_device, non_blocking=dst_device.type == "cuda")
        # The source is read on dst_stream, not the stream it was made on.
        record_stream(tensor, dst_stream)
        # The copy was allocated on dst_stream but is used on the current one.
        record_stream(moved, out_stream)
    return moved


class PortalBlue(torch.autograd.Function):
    """The stash end: phony out in forward, the portal's gradient out in backward."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, tensor: Tensor) -> Tensor:  # type: ignore[override]
        # The tensor is an input (an edge), never saved: the portal owns it.
        ctx.portal = portal
        return get_phony(tensor.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> Tuple[None, Optional[Tensor]]:  # type: ignore[override]
        return None, ctx.portal.use_grad()


class PortalOrange(torch.autograd.Function):
    """The pop end: the tensor out in forward, its gradient parked in backward."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, phony: Tensor) -> Tensor:  # type: ignore[override]
        ctx.portal = portal
        tensor = portal.use_tensor()
        assert tensor is not None
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[None, None]:  # type: ignore[override]
        ctx.portal.put_grad(grad)
        return None, None


class PortalCopy(torch.autograd.Function):
    """Moves the tensor one hop forward and its gradient one hop back.

    The copy runs on ``next_stream`` (the gradient's on it too). Like the copy
    of the micro-batch it travels with, it adds no stream waits of its own:
    the runtime makes the consumer wait on ``next_stream`` in forward, and
    ``next_stream`` wait on the gradient's producer in backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        portal: Portal,
        prev_stream: AbstractStream,
        next_stream: AbstractStream,
        phony: Tensor,
    ) -> Tensor:
        ctx.portal = portal
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        assert portal.tensor is not None
        portal.tensor = _move(portal.tensor, prev_stream, next_stream)
        return get_phony(get_device(next_stream), requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> Tuple[None, None, None, None]:  # type: ignore[override]
        portal: Portal = ctx.portal
        if portal.grad is not None:
            portal.grad = _move(portal.grad, ctx.next_stream, ctx.prev_stream)
        return None, None, None, None
