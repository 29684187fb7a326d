"""How a server runs one expert call: forward, recomputation and backward.

Why a module of its own: this is the part that must agree with local autograd
(gradients, RNG, parameter accumulation), independent of any transport.

Invariants:

* A forward runs under ``CallRng(seed).activate()``; a stateless backward
  recomputes under the same seed with :func:`enable_recomputing`, so random
  ops (dropout masks) are replayed exactly, whatever other threads draw.
* Tensor arguments become detached leaves on the module's device; a leaf
  requires grad iff the client's tensor did, so input gradients come back
  exactly for those (``None`` elsewhere).
* Parameter gradients reach the hosted module's ``.grad`` through the real
  ``AccumulateGrad`` nodes (concurrent backwards are locked by PyTorch).
* Replies carry CPU tensors only (what TensorPipe accepts without device maps).
* Output gradients are checked (count, shape, dtype) before any backward runs.
"""
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from ..checkpoint import enable_checkpointing, enable_recomputing
from ..rng import CallRng

__all__ = ["module_device", "make_leaves", "run_forward", "run_backward", "check_grads", "to_wire",
           "trainable", "warm_up", "batch_grads", "accumulate", "has_grad_hooks"]

Grads = List[Optional[Tensor]]


def warm_up() -> None:
    """Pays one-time costs (the first random-stream activation, and the
    lazy imports of ``autograd.backward`` with explicit gradients, about a
    second) at server start, not inside the first request's deadline."""
    with torch.enable_grad(), CallRng(0).activate():
        y = torch.ones(1, requires_grad=True).mul(2)
    torch.autograd.backward([y], [torch.ones_like(y)])


def module_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")


def trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def to_wire(value: Optional[Tensor]) -> Optional[Tensor]:
    return None if value is None else value.detach().cpu()


def make_leaves(args: Sequence[Any], flags: Sequence[bool], device: torch.device) -> List[Any]:
    """The call's arguments with tensors as fresh leaves on ``device``."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"arguments must be a tuple, got {type(args).__name__}")
    if not isinstance(flags, (tuple, list)) or len(flags) != len(args):
        raise TypeError(f"requires_grad flags must be a list of {len(args)} bools, got {flags!r}")
    leaves: List[Any] = []
    for k, (arg, flag) in enumerate(zip(args, flags)):
        if isinstance(arg, Tensor):
            leaf = arg.detach().to(device)
            if flag is True:
                if not (leaf.is_floating_point() or leaf.is_complex()):
                    raise TypeError(f"argument {k} ({leaf.dtype}) cannot require grad")
                leaf.requires_grad_(True)
            leaves.append(leaf)
        elif flag:
            raise TypeError(f"argument {k} is a {type(arg).__name__}, not a tensor, but is "
                            "flagged as requiring grad")
        else:
            leaves.append(arg)
    return leaves


def _outputs(result: Any) -> Tuple[List[Tensor], bool]:
    if isinstance(result, Tensor):
        return [result], True
    if isinstance(result, (tuple, list)) and result and all(isinstance(r, Tensor) for r in result):
        return list(result), False
    raise TypeError(f"the expert returned {type(result).__name__}; a remote expert must "
                    "return a tensor or a non-empty tuple of tensors")


def run_forward(module: nn.Module, args: Sequence[Any], flags: Sequence[bool], seed: int, *,
                grad: bool, keep_graph: bool, rng: Optional[CallRng] = None
                ) -> Tuple[List[Any], List[Tensor], bool, List[bool]]:
    """Runs the module; returns ``(leaves, outputs, single, differentiable)``.

    With ``keep_graph`` (stateful) the outputs carry the graph. Otherwise,
    with ``grad``, the forward is a checkpointed one: grad on, as the loop's
    (so an output the expert detached, or computed from nothing that needs
    grad, is not differentiable, and an in-place op on a leaf that requires
    grad raises as there), saving no tensor (the graph is dropped with the
    outputs); without ``grad``, no grad at all. ``differentiable`` says which
    outputs the caller may differentiate (a stateless backward recomputes).
    ``rng``: the stream to run under (default ``CallRng(seed)``); its
    ``drew`` says afterwards whether the expert drew random numbers.
    """
    leaves = make_leaves(args, flags, module_device(module))
    rng = CallRng(seed) if rng is None else rng
    if keep_graph:
        with torch.enable_grad(), rng.activate():
            outputs, single = _outputs(module(*leaves))
        return leaves, outputs, single, [o.requires_grad for o in outputs]
    if grad:
        with torch.enable_grad(), saved_tensors_hooks(_drop, _never), enable_checkpointing(), \
                rng.activate():
            outputs, single = _outputs(module(*leaves))
        return leaves, outputs, single, [o.requires_grad for o in outputs]
    with torch.no_grad(), rng.activate():
        outputs, single = _outputs(module(*leaves))
    return leaves, outputs, single, [False] * len(outputs)


def _drop(tensor: Tensor) -> None:
    """A stateless forward's pack hook: nothing is kept for a backward that
    recomputes."""
    return None


def _never(packed: None) -> Tensor:
    raise RuntimeError("a stateless forward's graph cannot be differentiated: its backward "
                       "recomputes")


def recompute(module: nn.Module, args: Sequence[Any], flags: Sequence[bool],
              seed: int, rng: Optional[CallRng] = None) -> Tuple[List[Any], List[Tensor]]:
    """The stateless backward's forward: same seed, grad on, recomputing
    (``rng`` as for :func:`run_forward`)."""
    leaves = make_leaves(args, flags, module_device(module))
    with torch.enable_grad(), enable_recomputing(), \
            (CallRng(seed) if rng is None else rng).activate():
        outputs, _ = _outputs(module(*leaves))
    return leaves, outputs


def check_grads(outputs: Sequence[Tensor], grads: Any) -> None:
    """Raises unless ``grads`` holds one gradient per output: ``None``, or a
    tensor of the output's shape and dtype. Touches nothing."""
    if not isinstance(grads, (tuple, list)) or len(grads) != len(outputs):
        raise TypeError(f"expected {len(outputs)} output gradients, got {grads!r:.200}")
    for k, (out, g) in enumerate(zip(outputs, grads)):
        if g is None:
            continue
        if not isinstance(g, Tensor):
            raise TypeError(f"gradient {k} is a {type(g).__name__}, not a tensor")
        if g.shape != out.shape:
            raise ValueError(f"gradient {k} has shape {list(g.shape)}, but output {k} has "
                             f"shape {list(out.shape)}")
        if g.dtype != out.dtype:
            raise TypeError(f"gradient {k} has dtype {g.dtype}, but output {k} has {out.dtype}")


def run_backward(leaves: Sequence[Any], outputs: Sequence[Tensor], grads: Sequence[Any]) -> Grads:
    """Backpropagates ``grads`` (one per output, or None; see
    :func:`check_grads`); returns one gradient per argument (None for
    arguments that did not require grad)."""
    check_grads(outputs, grads)
    pairs = []
    for out, g in zip(outputs, grads):
        if g is None or not out.requires_grad:
            continue
        pairs.append((out, g.to(out.device)))
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return [to_wire(leaf.grad) if isinstance(leaf, Tensor) and leaf.requires_grad else None
            for leaf in leaves]


def has_grad_hooks(module: nn.Module) -> bool:
    """Whether a parameter of ``module`` has a gradient hook
    (``Tensor.register_hook``): :func:`batch_grads` then :func:`accumulate`
    would run it twice (once computing the gradient, once accumulating it)."""
    return any(getattr(p, "_backward_hooks", None) for p in module.parameters())


def batch_grads(module: nn.Module, leaves: Sequence[Any], outputs: Sequence[Tensor],
                grads: Sequence[Any]) -> Tuple[Grads, List[Tuple[Tensor, Tensor]]]:
    """:func:`run_backward` for a batch of calls (:mod:`.gather`), in two
    halves, so that a batch that fails and is run again one call at a time
    never accumulates a gradient twice: computes (``autograd.grad``, nothing
    accumulated) the gradients of the argument leaves, returned as
    :func:`run_backward` returns them, and of ``module.parameters()``,
    returned as ``(parameter, gradient)`` pairs for :func:`accumulate`. Not
    for a module with gradient hooks on its parameters (see
    :func:`has_grad_hooks`). A leaf outside ``module.parameters()`` that the
    expert reaches gets no gradient (a plain backward would give it one)."""
    check_grads(outputs, grads)
    pairs = [(out, g.to(out.device)) for out, g in zip(outputs, grads)
             if g is not None and out.requires_grad]
    wanted = [leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.requires_grad]
    params: List[Tensor] = [p for p in module.parameters() if p.requires_grad]
    if not pairs or not (wanted or params):
        return [None for _ in leaves], []
    found = torch.autograd.grad([o for o, _ in pairs], wanted + params, [g for _, g in pairs],
                                allow_unused=True)
    reached = [(p, g) for p, g in zip(params, found[len(wanted):]) if g is not None]
    by_leaf = {id(leaf): g for leaf, g in zip(wanted, found[:len(wanted)])}
    return [to_wire(by_leaf.get(id(leaf))) if isinstance(leaf, Tensor) and leaf.requires_grad
            else None for leaf in leaves], reached


def accumulate(reached: Sequence[Tuple[Tensor, Tensor]]) -> None:
    """Adds each gradient to its parameter's ``.grad`` through the
    parameter's real ``AccumulateGrad`` node (``autograd.backward`` on the
    parameters themselves: PyTorch's per-tensor lock, post-accumulate hooks
    as in a plain backward)."""
    if reached:
        torch.autograd.backward([p for p, _ in reached], [g for _, g in reached])
