"""Autograd Functions run outside the graph, and many of them as one node.

``run_isolated_forward`` / ``run_isolated_backward`` call a Function's own
``forward``/``backward`` with an :class:`EmulatedAutogradContext` instead of
autograd's ctx, on detached inputs, so the calls can run on any thread.
:func:`map_with_parallel_backward` runs a batch of such calls on workers and
hangs them off the one parallel node of :mod:`moe_autograd.node`, so that
their backwards run concurrently too.

Invariants: a Function sees the same ctx API as under autograd (saved
tensors, packed through the saved-tensor hooks in force, ``needs_input_grad``,
dirty / non-differentiable outputs, grad materialization, default arguments
bound before ``setup_context``), and its results are checked as autograd
checks them (number of gradients, gradients for non-tensor inputs), with the
call named. Each call of a map draws randomness from its own
:class:`~moe_autograd.rng.CallRng`, forked in call order. Under forward-mode
AD or a ``torch.func`` transform the map runs its calls with ``func.apply`` in
a loop (see :mod:`moe_autograd.transforms`).
"""
import inspect
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Type

import torch
from torch import Tensor
from torch.autograd.function import _is_setup_context_defined  # type: ignore[attr-defined]

from .collect import function_collector, run_applies
from .executor import run_all
from .node import Grads, IsolatedCall, attach, replayable_view
from .policy import INLINE, LANES, Decision, Measure, choose
from .rng import CallRng, mark_concurrent, rewind_unrun_draws
from .tls import bind, capture
from .transforms import functorch_active, opaque_to_dynamo, sequential_mode

__all__ = [
    "EmulatedAutogradContext", "run_isolated_forward", "run_isolated_backward",
    "map_with_parallel_backward",
]



class EmulatedAutogradContext:
    """Stands in for the ``ctx`` that autograd passes to a Function, so that the
    Function's ``forward``/``backward`` can run outside the autograd graph."""

    def __init__(self, needs_input_grad: Tuple[bool, ...] = ()) -> None:
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self.to_save: Tuple[Any, ...] = ()
        #: Versions of ``to_save`` when the forward returned (no hooks in force).
        self._versions: Optional[List[int]] = None
        self._unpack: Optional[Callable[[Any], Tensor]] = None
        self.non_differentiable: Tuple[Tensor, ...] = ()
        self.dirty_tensors: Tuple[Tensor, ...] = ()

    def save_for_backward(self, *tensors: Optional[Tensor]) -> None:
        # As autograd's ctx: through the saved-tensor hooks in force, if any.
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is None:
            self.to_save, self._unpack = tensors, None
            return
        pack, self._unpack = hooks
        self.to_save = tuple(None if t is None else pack(t) for t in tensors)

    def save_for_forward(self, *tensors: Optional[Tensor]) -> None:
        self.saved_for_forward = tensors

    def _seal(self) -> None:
        """Records the versions of the tensors saved without hooks, once the
        forward has returned: autograd's saved variables do the same, and
        refuse to unpack a tensor modified in place since."""
        if self._unpack is None and self.to_save:
            # ``apply`` bumps the version of every dirty tensor once more
            # after the forward (an in-place op outside torch, numpy's, say,
            # bumps nothing); so do the node and the map (see ``_map``).
            dirty = {id(t) for t in self.dirty_tensors}
            self._versions = [
                -1 if t is None or t.is_inference() else t._version + (
                    id(t) in dirty or (t._base is not None and id(t._base) in dirty))
                for t in self.to_save]

    @property
    def saved_tensors(self) -> Tuple[Optional[Tensor], ...]:
        unpack = self._unpack
        if unpack is None:
            versions = self._versions
            if versions is not None:
                for k, (t, v) in enumerate(zip(self.to_save, versions)):
                    if v >= 0 and t._version != v:
                        raise RuntimeError(
                            "one of the variables needed for gradient computation has been "
                            f"modified by an inplace operation: saved tensor {k} "
                            f"[{t.type()} {list(t.shape)}] is at version {t._version}; "
                            f"expected version {v} instead")
            return tuple(self.to_save)
        return tuple(None if p is None else unpack(p) for p in self.to_save)

    def mark_non_differentiable(self, *tensors: Tensor) -> None:
        self.non_differentiable = self.non_differentiable + tensors

    def mark_dirty(self, *tensors: Tensor) -> None:
        self.dirty_tensors = self.dirty_tensors + tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


FunctionType = Type[torch.autograd.Function]


def _detach_args(args: Sequence[Any]) -> Tuple[Any, ...]:
    return tuple([
        a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a for a in args
    ])


_uses_setup_context: Dict[FunctionType, bool] = {}


def _has_setup_context(func: FunctionType) -> bool:
    """Whether ``func`` is a new-style Function (forward without ctx)."""
    try:
        return _uses_setup_context[func]
    except KeyError:
        value = _uses_setup_context[func] = _is_setup_context_defined(func.setup_context)
        return value


_signatures: Dict[FunctionType, inspect.Signature] = {}


def _bind_defaults(func: FunctionType, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """``args`` completed with ``forward``'s defaults, as ``Function.apply``
    does for a Function with ``setup_context``."""
    signature = _signatures.get(func)
    if signature is None:
        signature = _signatures[func] = inspect.signature(func.forward)
    if len(args) >= len(signature.parameters):
        return args
    bound = signature.bind(*args)
    bound.apply_defaults()
    return tuple(bound.args)


def run_isolated_forward(func: FunctionType, *args: Any) -> Tuple[EmulatedAutogradContext, Any]:
    """Runs ``func.forward`` under no_grad on detached copies of the tensor
    arguments (``requires_grad`` preserved); returns ``(ctx, outputs)``."""
    if _has_setup_context(func):
        args = _bind_defaults(func, args)
    ctx = EmulatedAutogradContext(
        tuple([isinstance(a, Tensor) and a.requires_grad for a in args])
    )
    detached = _detach_args(args)
    grad_was_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # torch.no_grad() costs more than the call
    try:
        if _has_setup_context(func):
            outputs = func.forward(*detached)
            func.setup_context(ctx, detached, outputs)
        else:
            outputs = func.forward(ctx, *detached)
    finally:
        torch._C._set_grad_enabled(grad_was_enabled)
    ctx._inputs = detached  # type: ignore[attr-defined]
    ctx._seal()
    return ctx, outputs


def run_isolated_backward(
    func: FunctionType, ctx: EmulatedAutogradContext, *grad_outputs: Optional[Tensor]
) -> Tuple[Optional[Tensor], ...]:
    """Runs ``func.backward(ctx, *grad_outputs)`` under no_grad; always returns a
    tuple of gradients."""
    grad_was_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        grads = func.backward(ctx, *grad_outputs)
    finally:
        torch._C._set_grad_enabled(grad_was_enabled)
    return grads if isinstance(grads, tuple) else (grads,)


class _FunctionCall(IsolatedCall):
    """One call of an autograd Function, run through the emulated context.

    Only ``run_isolated_forward``/``run_isolated_backward`` run on workers;
    the bookkeeping around them runs on the caller (see
    :meth:`IsolatedCall.input_grads`).
    """

    def __init__(self, func: FunctionType, args: Tuple[Any, ...], index: int, count: int,
                 ctx: EmulatedAutogradContext, outputs: Any) -> None:
        self.func = func
        self.index, self.count = index, count
        self.num_args = len(args)
        self.tensor_positions = [k for k, a in enumerate(args) if isinstance(a, Tensor)]
        self.inputs = [args[k] for k in self.tensor_positions]
        self.results: Tuple[Any, ...] = outputs if isinstance(outputs, tuple) else (outputs,)
        self.output_positions = [k for k, o in enumerate(self.results) if isinstance(o, Tensor)]
        self.outputs = [self.results[k] for k in self.output_positions]
        self.ctx: Optional[EmulatedAutogradContext] = ctx
        self.materialize_grads = ctx.materialize_grads
        self.non_differentiable = ctx.non_differentiable
        detached = ctx._inputs  # type: ignore[attr-defined]
        input_at = {id(detached[k]): n for n, k in enumerate(self.tensor_positions)}
        if ctx.dirty_tensors:
            output_at = {id(o): n for n, o in enumerate(self.outputs)}
            self.dirty = [(output_at[id(t)], input_at[id(t)]) for t in ctx.dirty_tensors
                          if id(t) in output_at and id(t) in input_at]
        self.aliases = _aliases(self.outputs, input_at, {n for n, _ in self.dirty})

    def _name(self) -> str:
        return f"{self.func.__name__} (call {self.index} of {self.count})"

    def outer_outputs(self, caller_inputs: Sequence[Tensor]) -> List[Tensor]:
        """The outputs as ``apply`` returns them where no node is made (no
        grad mode, or no input requires grad): an input returned (as is, or
        modified in place) is the caller's tensor, its detached alias if it
        requires grad; a view of an input is that view of the caller's
        tensor."""
        outputs = list(self.outputs)
        for k, j in self.dirty:
            x = caller_inputs[j]
            torch.autograd.graph.increment_version(x)  # as apply's mark_dirty
            outputs[k] = x.detach() if x.requires_grad else x
        for k, j, view in self.aliases:
            x = caller_inputs[j]
            if view is not None:
                with torch.no_grad():
                    outputs[k] = view._view_func(x)  # type: ignore[attr-defined]
            elif x.requires_grad:
                outputs[k] = x.detach()
            else:
                with torch.no_grad():
                    outputs[k] = x.view_as(x)
        return outputs

    def backward(self, grad_outputs: Grads) -> Tuple[Optional[Tensor], ...]:
        ctx = self.ctx
        if ctx is None:
            raise RuntimeError(f"{self._name()}: backward after its state was freed")
        if len(self.output_positions) == len(self.results):
            return run_isolated_backward(self.func, ctx, *grad_outputs)
        grads_by_output: List[Optional[Tensor]] = [None] * len(self.results)
        for k, g in zip(self.output_positions, grad_outputs):
            grads_by_output[k] = g
        return run_isolated_backward(self.func, ctx, *grads_by_output)

    def input_grads(self, raw: Any) -> Grads:
        grads: Tuple[Optional[Tensor], ...] = raw
        n = self.num_args
        if len(grads) < n or any(g is not None for g in grads[n:]):
            raise RuntimeError(
                f"function {self.func.__name__}.backward returned an incorrect number of "
                f"gradients (expected {n}, got {len(grads)}) in {self._name()}")
        if len(self.tensor_positions) == n:
            return list(grads[:n])
        for k, grad in enumerate(grads[:n]):
            if grad is not None and k not in self.tensor_positions:
                raise RuntimeError(
                    f"function {self.func.__name__}.backward returned a gradient different "
                    f"from None at position {k}, but the input is not a tensor, in {self._name()}")
        return [grads[k] for k in self.tensor_positions]

    def release(self) -> None:
        self.ctx = None


def _aliases(outputs: Sequence[Tensor], input_at: Dict[int, int], dirty: Set[int]
             ) -> List[Tuple[int, int, Optional[Tensor]]]:
    """``(output position, input position, view or None)`` for each output
    that is one of the (detached) inputs as is, or a view of one made by view
    ops alone (see :attr:`moe_autograd.node.IsolatedCall.aliases`)."""
    aliases: List[Tuple[int, int, Optional[Tensor]]] = []
    for k, out in enumerate(outputs):
        if k in dirty:
            continue
        if id(out) in input_at:
            aliases.append((k, input_at[id(out)], None))
        elif replayable_view(out) and id(out._base) in input_at:
            aliases.append((k, input_at[id(out._base)], out))
    return aliases


def _as_tuple(value: Any) -> Tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


@opaque_to_dynamo
def map_with_parallel_backward(func: FunctionType, *args_per_call: Sequence[Any],
                               mode: Optional[str] = None) -> Tuple[Tuple[Any, ...], ...]:
    """Calls ``func.apply(*args)`` once per element of ``args_per_call``, with
    every forward, and later every backward, running concurrently on workers.

    Returns one tuple of outputs per call (a tuple even when ``forward``
    returns one tensor). Outputs and gradients equal separate ``apply`` calls.
    ``mode`` (``"auto"``, ``"inline"``, ``"lanes"``, ``"parallel"``; default
    ``MOE_AUTOGRAD_MODE`` or auto) picks how the calls run, see
    :mod:`moe_autograd.policy`; results are the same in every mode.
    """
    if not (isinstance(func, type) and issubclass(func, torch.autograd.Function)):
        raise TypeError(f"func must be a torch.autograd.Function subclass, got {func!r}")
    n = len(args_per_call)
    args = [tuple(a) for a in args_per_call]
    if sequential_mode(args) is not None:
        return _apply_inline(func, args, None if functorch_active() else _fork(n))
    rngs = _fork(n)
    site = frozenset((func,))
    decision = choose(site, n, mode)
    with Measure(site, n, decision) as measure:
        if decision.mode == INLINE:
            return _apply_inline(func, args, rngs, measure)
        return _map(func, args, rngs, decision, measure)


def _fork(n: int) -> List[CallRng]:
    """One random stream per call, forked in call order on this thread."""
    return CallRng.fork_many(n)


def _apply_inline(func: FunctionType, args: List[Tuple[Any, ...]],
                  rngs: Optional[List[CallRng]], measure: Optional[Measure] = None
                  ) -> Tuple[Tuple[Any, ...], ...]:
    """The loop itself: ``func.apply`` call after call, each in its stream
    (``rngs`` None: under a ``torch.func`` transform, its randomness rules)."""
    results = []
    apply = func.apply
    for i, a in enumerate(args):
        started = measure.start() if measure is not None else None
        try:
            with rngs[i].activate() if rngs is not None else nullcontext():
                results.append(_as_tuple(apply(*a)))
        except BaseException as error:
            error.add_note(f"{func.__name__}: call {i} of {len(args)}")
            raise
        finally:
            if started is not None:
                measure.stop(i, started)  # type: ignore[union-attr]
    return tuple(results)


def _map(func: FunctionType, args: List[Tuple[Any, ...]], rngs: List[CallRng],
         decision: Decision, measure: Measure) -> Tuple[Tuple[Any, ...], ...]:
    n = len(args)
    if _has_setup_context(func):
        args = [_bind_defaults(func, a) for a in args]
    state = capture()
    saves = [None if state is None else state.saves() for _ in range(n)]

    def task(i: int) -> Callable[[], Tuple[EmulatedAutogradContext, Any]]:
        def run() -> Tuple[EmulatedAutogradContext, Any]:
            try:
                with rngs[i].activate():
                    return run_isolated_forward(func, *args[i])
            except BaseException:
                rngs[i].failed()
                raise
        return bind(state, measure.timed(i, run), saves[i])

    lanes = decision.lanes if decision.mode == LANES else None
    if lanes is None or lanes > 1:
        mark_concurrent(rngs)
    collector = function_collector(func)
    if collector is not None:  # calls that wait (remote): started together, no worker each
        ran = run_applies(func, collector, args, f"{func.__name__}: call", measure)
    else:
        try:
            ran = run_all([task(i) for i in range(n)], f"{func.__name__}: call", lanes=lanes)
        except BaseException:
            rewind_unrun_draws(rngs)
            raise
    calls = [_FunctionCall(func, args[i], i, n, ctx, outputs) for i, (ctx, outputs) in enumerate(ran)]
    for call, s in zip(calls, saves):
        call.saves = s
        call.collector = collector
    made_node = torch.is_grad_enabled() and any(call.needs_grad for call in calls)
    # A call that modifies a view in place (mark_dirty) gets a node of its
    # own: autograd lets such a node return only that one tensor, as apply.
    alone = [i for i, call in enumerate(calls) if any(
        call.inputs[j]._is_view() for _, j in call.dirty)] if made_node else []
    if alone and n > 1:
        together = [i for i in range(n) if i not in alone]
        attached: List[List[Tensor]] = [[] for _ in calls]
        if together:
            for i, outs in zip(together, attach([calls[i] for i in together], name=func.__name__,
                                                lanes=lanes)):
                attached[i] = outs
        for i in alone:
            attached[i] = attach([calls[i]], name=func.__name__)[0]
    else:
        attached = attach(calls, name=func.__name__, lanes=lanes)
    if not made_node:
        attached = [call.outer_outputs([args[i][k] for k in call.tensor_positions])
                    if call.dirty or call.aliases else outs
                    for i, (call, outs) in enumerate(zip(calls, attached))]
    results = []
    for call, outs in zip(calls, attached):
        values = list(call.results)
        for k, o in zip(call.output_positions, outs):
            values[k] = o
        results.append(tuple(values))
    return tuple(results)
