"""``ModuleCall``: one expert call on an isolated graph, plain or checkpointed.

Lifecycle::

    plain:        forward (grad on, graph kept) ........ backward(grads) -> release
    checkpointed: forward (no_grad, inputs kept) -> recompute (grad on, same RNG)
                                                     -> backward(grads) -> release

The call's tensor inputs are detached leaves (``requires_grad`` kept), so its
graph ends at them and never reaches into the caller's graph; backward reads
their ``.grad`` as the input gradients.

Invariants:

* Parameter gradients reach ``.grad`` through PyTorch's own ``AccumulateGrad``
  (hooks fire, concurrent accumulation is locked by PyTorch): at once, or, for
  a tolerant caller, only at :meth:`ModuleCall.commit` once the call is accepted.
* Under ``torch.autograd.grad`` / ``backward(inputs=...)`` outside, only input
  gradients are computed; parameters' ``.grad`` are left alone, as plain
  autograd leaves them.
* A checkpointed call recomputes with the same private RNG streams
  (:class:`moe_autograd.rng.CallRng`) and the caller's autocast state, so it
  reproduces its forward exactly, whatever other threads draw meanwhile.
* :meth:`ModuleCall.release` drops every tensor the call holds, the caller's
  inputs included.
"""
import threading
from contextlib import nullcontext
from typing import Any, Callable, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .checkpoint import enable_checkpointing, enable_recomputing
from .executor import TaskGroup, get_pool
from .node import Grads, IsolatedCall, accumulates_into_leaves
from .rng import CallRng
from .skip.tracker import SkipTracker, use_skip_tracker
from .stream import use_device
from .tls import CallerState, bind, capture

__all__ = ["ModuleCall", "Expert"]

Expert = Callable[..., Any]


def _device_of(module: Expert, leaves: Sequence[Any]) -> torch.device:
    if isinstance(module, nn.Module):
        for p in module.parameters():
            return p.device
    for v in leaves:
        if isinstance(v, Tensor):
            return v.device
    return torch.device("cpu")


def _graph_leaves(outputs: Sequence[Tensor]) -> List[Tensor]:
    """Every leaf tensor that requires grad under ``outputs``' graphs."""
    seen: Set[Any] = set()
    leaves: List[Tensor] = []
    stack: List[Any] = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves


class ModuleCall(IsolatedCall):
    """One call of an expert (module or callable) on an isolated graph."""

    def __init__(self, module: Expert, args: Tuple[Any, ...], kwargs: Mapping[str, Any], *,
                 checkpoint: bool = False, hold_param_grads: bool = False,
                 check_finite_grads: bool = False, name: str = "call", index: int = 0,
                 validate: Optional[Callable[["ModuleCall"], None]] = None) -> None:
        self.module, self.name, self.index, self.validate = module, name, index, validate
        self.checkpoint = checkpoint and torch.is_grad_enabled()
        self.hold_param_grads = hold_param_grads
        self.check_finite_grads = check_finite_grads
        leaves, self._in_spec = tree_flatten((args, kwargs))
        self.inputs = [v for v in leaves if isinstance(v, Tensor) and v.requires_grad]
        self._leaves: Optional[List[Any]] = [
            v.detach().requires_grad_(v.requires_grad) if isinstance(v, Tensor) else v
            for v in leaves
        ]
        self._grad_leaves = [v for v in self._leaves if isinstance(v, Tensor) and v.requires_grad]
        self.device = _device_of(module, leaves)
        self.rng = CallRng.fork() if self.checkpoint else None
        self._lock = threading.Lock()
        self._recompute: Optional[TaskGroup[None]] = None
        self._local_outputs: Optional[List[Tensor]] = None
        self._held: List[Tuple[Tensor, Tensor]] = []
        self.outputs: List[Tensor] = []
        self.result: Any = None

    # -- forward ---------------------------------------------------------------
    def _call(self) -> Any:
        assert self._leaves is not None
        args, kwargs = tree_unflatten(self._leaves, self._in_spec)
        with use_device(self.device), use_skip_tracker(SkipTracker()), \
                torch.profiler.record_function(self.name):
            return self.module(*args, **kwargs)

    def forward(self) -> "ModuleCall":
        """Runs the call on this thread (a worker); fills ``outputs``."""
        if self.checkpoint:
            assert self.rng is not None
            with torch.no_grad(), enable_checkpointing(), self.rng.activate():
                result = self._call()
        else:
            result = self._call()
        out_leaves, self._out_spec = tree_flatten(result)
        self._out_leaves = out_leaves
        self.outputs = [v for v in out_leaves if isinstance(v, Tensor)]
        if not self.checkpoint:
            self._local_outputs = self.outputs
            self.non_differentiable = [o for o in self.outputs if not o.requires_grad]
        else:
            self.non_differentiable = [o for o in self.outputs
                                       if not (o.is_floating_point() or o.is_complex())]
        if self.validate is not None:
            self.validate(self)
        return self

    @property
    def needs_grad(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        if self.checkpoint:
            params = self.module.parameters() if isinstance(self.module, nn.Module) else ()
            return bool(self.inputs) or any(p.requires_grad for p in params)
        return any(o.requires_grad for o in self.outputs)

    def rebuild(self, outer_outputs: Sequence[Tensor]) -> Any:
        """The call's result with ``outer_outputs`` in place of its tensors."""
        it = iter(outer_outputs)
        leaves = [next(it) if isinstance(v, Tensor) else v for v in self._out_leaves]
        return tree_unflatten(leaves, self._out_spec)

    # -- recomputation ---------------------------------------------------------
    def _recompute_now(self) -> None:
        rng = self.rng
        assert rng is not None
        # A forward that drew no random number replays without the RNG mode
        # (which costs a Python hop per op): the same ops draw nothing again.
        with torch.enable_grad(), enable_recomputing(), \
                rng.activate() if rng.drew is not False else nullcontext():
            result = self._call()
        self._local_outputs = [v for v in tree_flatten(result)[0] if isinstance(v, Tensor)]

    def start_recompute(self, state: Optional[CallerState] = None) -> None:
        """Queues the recomputation on a worker unless it is queued already;
        ``state`` is the caller's (autocast...) to recompute under."""
        if not self.checkpoint:
            return
        with self._lock:
            if self._recompute is not None or self._leaves is None:
                return
            self._recompute = get_pool().submit([bind(state or capture(), self._recompute_now)])

    def _wait_recompute(self) -> None:
        self.start_recompute()
        group = self._recompute
        assert group is not None
        group.wait()  # runs it here if no worker took it yet
        if group.errors[0] is not None:
            raise group.errors[0]

    # -- backward --------------------------------------------------------------
    def backward(self, grad_outputs: Grads) -> Grads:
        if self._leaves is None:
            raise RuntimeError(f"{self.name}: backward after its graph was freed")
        if self.checkpoint:
            self._wait_recompute()
        outputs = self._local_outputs
        assert outputs is not None
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if g is not None and o.requires_grad]
        if not pairs:
            return [None] * len(self.inputs)
        outs, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        if not accumulates_into_leaves():
            # torch.autograd.grad / backward(inputs=...) outside: the inputs'
            # gradients only, as plain autograd; parameters' .grad untouched.
            return self._backward_held(outs, grads, params=False)
        if self.hold_param_grads:
            return self._backward_held(outs, grads)
        torch.autograd.backward(outs, grads, retain_graph=True)
        input_grads = []
        for leaf in self._grad_leaves:
            input_grads.append(leaf.grad)
            leaf.grad = None  # a retained graph's next backward starts afresh
        return input_grads

    def _backward_held(self, outs: List[Tensor], grads: List[Tensor], params: bool = True) -> Grads:
        """Input gradients; parameter gradients (``params``) held for commit."""
        inputs = set(map(id, self._grad_leaves))
        held = [leaf for leaf in _graph_leaves(outs) if id(leaf) not in inputs] if params else []
        targets = self._grad_leaves + held
        if not targets:
            self._held = []
            return []
        computed = torch.autograd.grad(outs, targets, grads, retain_graph=True, allow_unused=True)
        if self.check_finite_grads:
            for g in computed:
                if g is not None and not bool(torch.isfinite(g).all()):
                    raise FloatingPointError(f"{self.name}: non-finite gradient")
        n = len(self._grad_leaves)
        self._held = [(p, g) for p, g in zip(held, computed[n:]) if g is not None]
        return list(computed[:n])

    def commit(self) -> None:
        held, self._held = self._held, []
        if held:
            # Through PyTorch's own AccumulateGrad: its lock orders concurrent
            # commits into shared parameters, and the parameters' hooks fire.
            torch.autograd.backward([p for p, _ in held], [g for _, g in held])

    def release(self) -> None:
        # A checkpointed call outlives release (its outputs' tag and the
        # Recompute node reference it): drop the caller's input tensors too.
        self.inputs = []
        self._grad_leaves = []
        self._leaves = None
        self._local_outputs = None
        self._held = []
        self._recompute = None
