"""Autograd modes the parallel node cannot carry, and what the runtime does then.

The parallel node is a backward-mode construct: it records each call's own
graph on a worker and replays its backward there. Four modes of PyTorch work
differently and would be lost silently on that path:

* forward-mode AD (``torch.autograd.forward_ad`` dual tensors): a worker runs
  the call on detached inputs, so tangents would come back as ``None``;
* ``torch.func`` transforms (``grad``, ``vjp``, ``jvp``, ``vmap``...): their
  wrapped tensors and interpreter stack live on the caller's thread;
* ``torch.autograd.graph.allow_mutation_on_saved_tensors()``: its
  clone-before-mutate dispatch mode lives on the caller's thread, and a
  checkpointed call's recomputation runs outside it (issue 46);
* ``torch.autograd.graph.disable_saved_tensors_hooks()``: the runtime's calls
  register saved-tensor hooks of their own, which the loop does not;
* tensor subclasses among the calls' arguments (a ``__torch_function__``
  subclass, say): a call's inputs are detached leaves and its outputs the
  node's plain tensors, so the subclass, and a view of such an input
  returned as is, would come back plain and detached (issue 46).

In any of these modes (or with such arguments) the entry points (:func:`moe_autograd.parallel_apply`,
:func:`moe_autograd.map_with_parallel_backward`) run the calls sequentially on
the caller, exactly as a loop would (so results, tangents and errors are the
loop's); layers that cannot run sequentially (the MoE layer's deadlines)
raise a :class:`RuntimeError` naming the mode instead.

The entry points are also opaque to ``torch.compile``
(:func:`opaque_to_dynamo`): dynamo would otherwise trace into the pool's
threads and finalizers; it breaks the graph around them instead.

Invariants: :func:`sequential_mode` costs four cheap reads and one walk
over the arguments' containers (the type of each tensor; never the
experts' parameters); :func:`opaque_to_dynamo` never imports
dynamo itself (seconds of import time), it only uses it once something else
has.
"""
import functools
import sys
from typing import Any, Callable, Dict, Optional, TypeVar

import torch
from torch.autograd import forward_ad
from torch.autograd import graph as _graph

__all__ = ["sequential_mode", "check_parallel_mode", "functorch_active", "opaque_to_dynamo"]

F = TypeVar("F", bound=Callable[..., Any])
#: Whether saved-tensor hooks may be registered on this thread (False inside
#: ``disable_saved_tensors_hooks``); not in torch's type stubs.
_hooks_enabled: Callable[[], bool] = getattr(torch._C._autograd,
                                             "_saved_tensors_hooks_is_enabled", lambda: True)
_disabled: Dict[Callable[..., Any], Callable[..., Any]] = {}


def opaque_to_dynamo(fn: F) -> F:
    """``fn`` that ``torch.compile`` calls as an opaque function (a graph
    break), like ``torch._dynamo.disable(fn)``, without importing dynamo until
    it is loaded anyway: while ``torch._dynamo`` is not imported nothing can
    be compiling, and ``fn`` runs as it is."""
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        disabled = _disabled.get(fn)
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            import torch._dynamo
            disabled = _disabled[fn] = torch._dynamo.disable(fn, recursive=True)
        return disabled(*args, **kwargs)
    return inner  # type: ignore[return-value]


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform is running on this thread (random
    ops then follow the transform's own randomness rules, not per-call streams)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def sequential_mode(tree: Any) -> Optional[str]:
    """The name of the mode that forces sequential calls, or None. ``tree``
    (the calls' arguments and experts) is kept for modes that would depend on
    them; the current ones do not."""
    if functorch_active():
        return "torch.func transforms (grad, vjp, jvp, vmap)"
    if forward_ad._current_level >= 0:
        # Inside a dual level, whatever the arguments: an expert may close
        # over a dual tensor that no argument shows.
        return "forward-mode AD (torch.autograd.forward_ad, torch.func.jvp)"
    if _graph._allow_mutation_on_saved_tensors_enabled:
        # Its clone-before-mutate dispatch mode and its hooks are this
        # thread's: calls on workers, or recomputed in backward, would mutate
        # the tensors their backward reads (issue 46).
        return "torch.autograd.graph.allow_mutation_on_saved_tensors()"
    if not _hooks_enabled():
        # The runtime's calls pack what they save through hooks of their own
        # (and a checkpointed call's forward keeps nothing through them): the
        # loop registers none, so it runs here (issue 46).
        return "torch.autograd.graph.disable_saved_tensors_hooks()"
    subclass = _subclass_in(tree, 0)
    if subclass is not None:
        return f"a tensor subclass argument ({subclass.__module__}.{subclass.__qualname__})"
    return None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _subclass_in(tree: Any, depth: int) -> Optional[type]:
    """The type of the first tensor of a subclass in ``tree`` (lists, tuples
    and dicts of the calls' arguments; modules and other objects are not
    looked into), or None."""
    kind = type(tree)
    if kind in _PLAIN:
        return None
    if isinstance(tree, torch.Tensor):
        return kind
    if depth > 8:
        return None
    if kind in (list, tuple) or isinstance(tree, (list, tuple)):
        for item in tree:
            found = _subclass_in(item, depth + 1)
            if found is not None:
                return found
    elif isinstance(tree, dict):
        for item in tree.values():
            found = _subclass_in(item, depth + 1)
            if found is not None:
                return found
    return None


def check_parallel_mode(what: str, tree: Any) -> None:
    """Raises a clear error if ``tree`` is in a mode ``what`` cannot run in."""
    mode = sequential_mode(tree)
    if mode is not None:
        raise RuntimeError(f"{what} does not support {mode}: run the experts in a "
                           "loop (or through moe_autograd.parallel_apply) in this mode")
