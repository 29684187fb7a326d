"""The gradients of a call's tensors that the call itself goes on from.

Why
---
The node carries a call's *roots*: the tensors of its result and those it
left in plain attributes of its module (``self.keep = h``, see
:mod:`moe_autograd.module_state`), each the caller's tensor now. In a loop
such a tensor is the call's own: when the call computes further from it
(``return h, h * 2``; ``self.keep = h; return f(h)``), its gradient sums
what reaches it from the caller's uses AND what reaches it through the
call's other outputs. The caller's tensor is an output of the node, so the
engine gives it the first part only; the second exists only inside the
call's backward. So for these roots (and only these: found as the call's
graph is walked, see :meth:`moe_autograd.module_call.ModuleCall.prepare`)
the call's backward also computes their whole gradient (more inputs of its
``torch.autograd.grad``), and this module hands it to the caller's tensors:
``.grad`` where they retain it (``h.retain_grad()`` inside the forward, or
the caller's), and what ``torch.autograd.grad`` / ``backward(inputs=...)``
return for them. Where it cannot, it raises, naming the call: never a
partial gradient, never a None where the loop has a tensor. (A hook the
caller registers on such a tensor runs before the node, with the first
part: see the README's semantics table.)

Lifecycle of one followed tensor ``t`` in one backward pass::

    hook       the engine has t's outside part (the caller used t): t.grad
               noted (before retain_grad adds the part to it); the part,
               cloned, is what the engine passes on (and captures, where it
               captures t alone); an end-of-pass check queued
    started    the call's backward starts (the node runs): t.grad noted if
               no hook fired
    computed   the call's backward: the whole gradient of its root
    handed     as the call's backward ends (on its worker): the part
               overwritten in place by the whole gradient; if t retains its
               gradient, t.grad = noted + whole (as retain_grad
               accumulates), or a copy of the whole
    checked    the end of the pass: a hook that fired in a pass where the
               call's backward did not start (the caller asked for t's
               gradient alone, e.g. torch.autograd.grad(loss, [t])) raises,
               naming the call: the part inside the call is not computed

Invariants:

* Only roots the call's graph consumes are followed (one dict lookup per
  edge of the walk a call makes anyway, for calls with several roots);
  every other call pays nothing.
* ``t.retains_grad`` is the loop's (``retain_grad()`` on the root inside
  the forward makes the caller's tensor retain its gradient).
* A tensor the caller modified in place after the call is left to the
  engine: its ``.grad`` is that of its new version, which the call never
  computed further from.

Known limit: ``torch.autograd.grad`` captures such a tensor's gradient
before the node runs, as it was, and hands that (its direct part only) back
when the pass also runs the call's backward (asking for it together with the
call's inputs or parameters); ``.grad`` and ``backward(inputs=...)`` are the
loop's. See the README's semantics table (D5b).
* Nothing here keeps a tensor alive: the caller's tensors are held weakly,
  a pass's notes are dropped once handed.
"""
import weakref
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["KeptTensors"]

_NOT_NOTED = object()


class _Kept:
    """One kept tensor: the caller's (weakly), its root's position, and what
    the pass under way noted."""

    __slots__ = ("outer", "version", "root", "name", "prior", "part", "hooked_in")

    def __init__(self, outer: Tensor, root: int, name: str) -> None:
        self.outer = weakref.ref(outer)
        #: Its version as the call returned it: modified in place since, it is
        #: another tensor for autograd (whose .grad the engine fills itself).
        self.version = outer._version
        self.root = root
        self.name = name
        self.prior: Any = _NOT_NOTED  # keep.grad before this pass added to it
        self.part: Optional[Tensor] = None  # the outside part the engine captures
        self.hooked_in: Optional[int] = None  # the pass (of the call) the hook fired in


def _retained(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t.grad`` where ``t`` retains its gradient (reading it elsewhere warns)."""
    return t.grad if t is not None and t.retains_grad else None


class KeptTensors:
    """The kept tensors of one call (see the module docstring)."""

    def __init__(self, call_name: str) -> None:
        self.call_name = call_name
        self.items: List[_Kept] = []
        #: Backward passes of the call started so far.
        self.passes = 0

    def add(self, outer: Tensor, root: int, name: str, retains: bool) -> None:
        """Follows ``outer`` (the caller's tensor for the call's root
        ``root``, named ``name`` in errors)."""
        item = _Kept(outer, root, name)
        self.items.append(item)
        if retains:
            outer.retain_grad()
        ref = weakref.ref(self)

        def hook(grad: Optional[Tensor]) -> Optional[Tensor]:
            owner = ref()
            # (None: the engine runs the node's hooks for an output with no gradient too)
            return grad if owner is None or grad is None else owner._hook(item, grad)
        outer.register_hook(hook)

    @property
    def roots(self) -> List[int]:
        return [item.root for item in self.items]

    def _hook(self, item: _Kept, grad: Tensor) -> Tensor:
        outer = item.outer()
        item.prior = _retained(outer)
        item.part = grad.clone()
        item.hooked_in = self.passes
        ref = weakref.ref(self)

        def check() -> None:
            owner = ref()
            if owner is not None:
                owner._check(item)
        torch.autograd.Variable._execution_engine.queue_callback(check)
        return item.part

    def started(self) -> None:
        """The call's backward starts (on the engine's thread)."""
        self.passes += 1
        for item in self.items:
            if item.hooked_in != self.passes - 1:
                outer = item.outer()
                item.prior = _retained(outer)
                item.part = None

    def hand(self, grads: List[Optional[Tensor]]) -> None:
        """The whole gradients of the kept roots (in :attr:`roots` order),
        to the caller's tensors."""
        for item, grad in zip(self.items, grads):
            outer = item.outer()
            if grad is not None and item.part is not None:
                item.part.copy_(grad)  # what autograd.grad / backward(inputs) captured
            if (outer is not None and outer.retains_grad and item.prior is not _NOT_NOTED
                    and outer._version == item.version):
                prior = item.prior
                if grad is not None:
                    outer.grad = (grad.clone(memory_format=torch.contiguous_format)
                                  if prior is None else prior + grad)
                else:
                    outer.grad = prior
            item.prior, item.part = _NOT_NOTED, None

    def _check(self, item: _Kept) -> None:
        if item.hooked_in is not None and item.hooked_in == self.passes:
            item.hooked_in = None
            raise RuntimeError(
                f"{self.call_name}: the gradient of {item.name}, which the call computes "
                "further from, was asked for in a backward that does not run the call's own "
                "backward (torch.autograd.grad or backward(inputs=...) naming that tensor "
                "without the call's inputs or parameters): its part through the call's other "
                "outputs is computed only there. Ask for it together with one of the call's "
                "inputs or parameters, or run the batch inline (mode='inline')")
        item.hooked_in = None
