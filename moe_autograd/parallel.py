"""``parallel_apply``: module calls that overlap in forward AND backward.

:func:`torch.nn.parallel.parallel_apply` overlaps forward only; its backward
runs call after call on the engine's thread. Here each call is a
:class:`~moe_autograd.module_call.ModuleCall` run on a worker with grad enabled
on an isolated graph, and :func:`moe_autograd.node.attach` hangs all outputs
off one node whose backward runs each call's graph on a worker again.

Recomputation of checkpointed calls is a step of its own, as the pipeline
libraries' ``Recompute`` node is: a ``_StartRecompute`` node joined to each
call's first output queues it on a worker as soon as that output has its
gradient, and :func:`recompute_early` starts it earlier, at a tensor the user
names, so it need not wait for the node's backward.

:func:`start_calls` / :func:`finish_calls` are the two halves of
:func:`parallel_apply` for callers that wait on their own terms (the MoE
layer's deadlines and quorum).

Under forward-mode AD or a ``torch.func`` transform, :func:`parallel_apply`
runs its calls in a loop on the caller (see :mod:`moe_autograd.transforms`);
:func:`start_calls` raises there. The entry points are opaque to dynamo
(``torch.compile`` breaks the graph around them instead of tracing the pool).
"""
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from .collect import call_type, run as run_calls, submit as submit_calls
from .dependency import fork, join
from .executor import CallCancelled, TaskGroup, in_order, is_interruption, predecessors
from .call_streams import Ready, record_ready
from .module_call import Expert, ModuleCall, call_inline, check_flips
from .node import BackwardPolicy, attach
from .policy import INLINE, LANES, Measure, choose, site_of
from .rng import CallRng, mark_concurrent, rewind_unrun_draws
from .tls import autocast_enabled, bind, capture
from .transforms import check_parallel_mode, functorch_active, opaque_to_dynamo, sequential_mode

__all__ = ["parallel_apply", "recompute_early", "start_calls", "finish_calls", "ModuleCall"]


class _StartRecompute(torch.autograd.Function):
    """The ``Recompute`` node: its backward queues recomputation and returns."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, calls: List[ModuleCall]) -> Tensor:  # type: ignore[override]
        ctx.calls = calls
        return phony.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[None, None]:  # type: ignore[override]
        for call in ctx.calls:
            call.start_recompute()
        return None, None


def _hook_recompute(tensor: Tensor, calls: List[ModuleCall]) -> Tensor:
    """``tensor`` joined to a phony whose backward starts the recomputations."""
    tensor, phony = fork(tensor)
    phony = _StartRecompute.apply(phony, calls)
    return join(tensor, phony)


_CALLS_ATTR = "_moe_autograd_calls"


@opaque_to_dynamo
def recompute_early(trigger: Tensor, outputs: Any) -> Tensor:
    """Starts recomputing the checkpointed calls that produced ``outputs`` as
    soon as backward reaches ``trigger`` (e.g. the output of the layer after
    the experts). Use the returned tensor in place of ``trigger``."""
    calls: List[ModuleCall] = []
    for leaf in tree_flatten(outputs)[0]:
        for call in getattr(leaf, _CALLS_ATTR, ()):
            if call not in calls:
                calls.append(call)
    if not calls or not trigger.requires_grad:
        return trigger
    return _hook_recompute(trigger, calls)


def _as_args(value: Any) -> Tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _per_call(value: Union[bool, Sequence[bool]], n: int, what: str) -> List[bool]:
    if isinstance(value, bool):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"parallel_apply: {what} has {len(values)} entries for {n} calls")
    return [bool(v) for v in values]


def _import_lazy_modules() -> None:
    """PyTorch imports sympy on the first backward with explicit gradients,
    which takes seconds: paid here, on the caller's thread, before any
    deadline starts, rather than inside the first calls' deadlines."""
    import torch.fx.experimental.symbolic_shapes  # noqa: F401


def _make_calls(modules: Sequence[Expert], inputs: Sequence[Any],
                kwargs: Optional[Sequence[Optional[Mapping[str, Any]]]],
                checkpoint: Union[bool, Sequence[bool]], check_finite_grads: bool, name: str,
                labels: Optional[Sequence[str]],
                validate: Optional[Callable[[ModuleCall], None]], lanes: Optional[int],
                ) -> Tuple[List[ModuleCall], List[Callable[[], ModuleCall]]]:
    """The call records, created (their random streams forked) here in call
    order, and one forward task per call (run on ``lanes`` threads, or each
    on its own: see :func:`~moe_autograd.rng.mark_concurrent`)."""
    n = len(modules)
    flags = _per_call(checkpoint, n, "checkpoint")
    state = capture()
    rngs = CallRng.fork_many(n)
    if lanes is None or lanes > 1:
        mark_concurrent(rngs)
    # An expert may ask for its own record type (remote experts: calls that a
    # collector sends, see moe_autograd.collect); a checkpointed call keeps ours.
    calls = [
        ((not flags[i] and call_type(modules[i])) or ModuleCall)(
            modules[i], _as_args(inputs[i]), (kwargs[i] if kwargs else None) or {},
            checkpoint=flags[i], check_finite_grads=check_finite_grads,
            validate=validate, index=i, state=state, rng=rngs[i],
            name=f"{name}: {labels[i] if labels else f'call {i} of {n}'}")
        for i in range(n)
    ]
    _import_lazy_modules()
    grad_enabled = torch.is_grad_enabled()
    devices = [d for call in calls for d in getattr(call, "cuda_devices", ())]
    if devices:  # what every call's CUDA streams wait for: the caller's work so far
        ready = record_ready(devices)
        for call in calls:
            call.ready = ready

    def task(call: ModuleCall) -> Callable[[], ModuleCall]:
        def run() -> ModuleCall:
            try:
                with torch.set_grad_enabled(grad_enabled):
                    return call.forward()
            except BaseException:
                call.rng.failed()
                raise
        return bind(state, run, call.saves)

    return calls, _in_call_order(calls, [task(c) for c in calls])


def _autocast_shares_casts(modules: Sequence[Expert]) -> bool:
    """Whether the calls run under autocast with its weight cache, in grad
    mode, with parameters that need gradients: then they run as the loop.

    The cache is one for all threads. A parameter's cast is made once, by
    whichever call (or the caller, earlier) casts it first, and every later
    use shares that cast's autograd node, where the loop sums their gradients
    in the low precision before casting them back once. Calls on isolated
    graphs would each cast back their own part. With
    ``torch.autocast(..., cache_enabled=False)`` every use casts afresh, in
    the loop as here, and the calls fan out."""
    if not torch.is_grad_enabled() or not torch.is_autocast_cache_enabled():
        return False
    if not autocast_enabled():
        return False
    return any(p.requires_grad for m in modules if isinstance(m, nn.Module)
               for p in m.parameters())


def _in_call_order(calls: Sequence[ModuleCall], tasks: List[Callable[[], ModuleCall]]
                   ) -> List[Callable[[], ModuleCall]]:
    """The tasks, each call that reaches a stateful module object an earlier
    call of the batch also reaches (:meth:`ModuleCall.order_keys`: the
    expert itself, or a submodule with buffers, hooks or a forward of its
    own: a norm shared by distinct experts, say) starting only once those
    earlier calls have finished: that module's state (buffers, attributes
    its forward sets) evolves as in the loop. Calls a collector starts
    (remote experts) keep their own order.

    A waiting call blocks its thread, which cannot deadlock: a group's calls
    start in call order, so the calls it waits for have started already. A
    call whose predecessor was interrupted (:func:`is_interruption`) does
    not run, as the loop stops there."""
    waits = predecessors([call.order_keys() for call in calls])
    stops: Dict[int, BaseException] = {}

    def check(i: int) -> None:
        stop = next((stops[j] for j in waits[i] if j in stops), None)
        if stop is not None:
            raise CallCancelled(f"{calls[i].name}: not run: an earlier call reaching "
                                f"the same module raised {type(stop).__name__}")

    def failed(i: int, error: BaseException) -> None:
        if is_interruption(error):
            stops[i] = error
        elif isinstance(error, CallCancelled) and waits[i]:
            stops[i] = error  # passed on to the calls after it

    return in_order(tasks, waits, check, failed)


def _check_lengths(name: str, n: int, inputs: Sequence[Any],
                   kwargs: Optional[Sequence[Optional[Mapping[str, Any]]]]) -> None:
    if len(inputs) != n:
        raise ValueError(f"{name}: {n} modules but {len(inputs)} inputs")
    if kwargs is not None and len(kwargs) != n:
        raise ValueError(f"{name}: {n} modules but {len(kwargs)} kwargs")


def start_calls(modules: Sequence[Expert], inputs: Sequence[Any],
                kwargs: Optional[Sequence[Optional[Mapping[str, Any]]]] = None, *,
                checkpoint: Union[bool, Sequence[bool]] = False,
                check_finite_grads: bool = False,
                name: str = "parallel_apply", labels: Optional[Sequence[str]] = None,
                validate: Optional[Callable[[ModuleCall], None]] = None,
                lanes: Optional[int] = None, measure: Optional[Measure] = None,
                deadline: Optional[float] = None,
                ) -> Tuple[List[ModuleCall], TaskGroup[ModuleCall]]:
    """Queues every call's forward on the pool, each call on a worker of its
    own (or on ``lanes`` threads, the caller's included when it helps); the
    caller joins the group.

    ``labels`` name the calls in errors and profiler ranges (default
    ``call <i> of <n>``); ``validate`` runs on the worker after each forward
    and fails the call by raising; ``measure`` times each call for the
    execution policy; ``deadline`` (seconds), when the caller stops waiting,
    tells collected calls not to hold back an answer past it (see
    :mod:`moe_autograd.collect`).
    """
    _check_lengths(name, len(modules), inputs, kwargs)
    check_parallel_mode(name, [inputs, kwargs, modules])
    calls, tasks = _make_calls(modules, inputs, kwargs, checkpoint, check_finite_grads, name,
                               labels, validate, lanes)
    if measure is not None:
        tasks = [measure.timed(i, t) for i, t in enumerate(tasks)]
    return calls, submit_calls(calls, tasks, lanes, measure, deadline=deadline)


def finish_calls(calls: Sequence[ModuleCall], policy: Optional[BackwardPolicy] = None,
                 name: str = "parallel_apply", lanes: Optional[int] = None) -> List[Any]:
    """Hangs the finished calls off one node; returns their results. With
    ``lanes`` their backward runs on that many threads (see ``run_all``)."""
    if not calls:
        return []
    if not any(call.needs_grad for call in calls):
        for call in calls:  # an input the expert made require grad, and returned
            call.adopt_requires_grad()
        check_flips(calls)
        results = [call.rebuild(call.outputs) for call in calls]
        for call in calls:
            call.release()
        return results
    # An expert may enable grad under a caller's no_grad: its outputs then
    # have a graph, as in the loop, and the node must carry it.
    with nullcontext() if torch.is_grad_enabled() else torch.enable_grad():
        for call in calls:
            call.prepare()
        check_flips(calls)
        attached = attach(calls, policy, name=name, phony_device=calls[0].device, lanes=lanes)
    results = []
    for call, outs in zip(calls, attached):
        if call.checkpoint:
            differentiable = [k for k, o in enumerate(outs) if o.requires_grad]
            if lanes is not None:
                # Within the cores: each lane recomputes its calls as their
                # backward starts (queued on workers as soon as the outputs
                # get their gradients, they would crowd the cores).
                call.recompute_in_backward = True
            elif differentiable:
                k = differentiable[0]
                outs[k] = _hook_recompute(outs[k], [call])
            for out in outs:  # what recompute_early looks for
                setattr(out, _CALLS_ATTR, (call,))
        results.append(call.rebuild(outs))
    return results


@opaque_to_dynamo
def parallel_apply(modules: Sequence[Expert], inputs: Sequence[Any],
                   kwargs: Optional[Sequence[Optional[Mapping[str, Any]]]] = None, *,
                   checkpoint: Union[bool, Sequence[bool]] = False,
                   mode: Optional[str] = None) -> List[Any]:
    """Calls ``modules[i](*inputs[i], **kwargs[i])`` for every ``i``, forward and
    backward concurrently on workers; returns the outputs in order.

    ``inputs[i]`` is a tensor or a tuple of arguments. Gradients (inputs and
    parameters, shared modules included) equal those of a plain loop. With
    ``checkpoint`` (a bool, or one per call), a call keeps only its inputs and
    recomputes its forward on a worker in backward. ``mode`` (``"auto"``,
    ``"inline"``, ``"lanes"``, ``"parallel"``; default ``MOE_AUTOGRAD_MODE`` or
    auto) picks how the calls run, see :mod:`moe_autograd.policy`; results
    are the same in every mode.
    """
    n = len(modules)
    _check_lengths("parallel_apply", n, inputs, kwargs)
    flags = _per_call(checkpoint, n, "checkpoint")
    if sequential_mode([(inputs, kwargs), modules]) is not None:
        return _inline(modules, inputs, kwargs, forked=not functorch_active())
    if _autocast_shares_casts(modules):
        return _inline(modules, inputs, kwargs)
    site = site_of(modules)
    decision = choose(site, n, mode, modules)
    with Measure(site, n, decision) as measure:
        if decision.mode == INLINE and not any(flags):
            return _inline(modules, inputs, kwargs, measure=measure)
        lanes = decision.lanes if decision.mode in (LANES, INLINE) else None
        calls, tasks = _make_calls(modules, inputs, kwargs, flags, False, "parallel_apply",
                                   None, None, lanes)
        try:
            run_calls(calls, [measure.timed(i, t) for i, t in enumerate(tasks)],
                      "parallel_apply: call", lanes=lanes, measure=measure)
        except BaseException:
            rewind_unrun_draws([call.rng for call in calls])
            raise
        return finish_calls(calls, lanes=lanes)


def _inline(modules: Sequence[Expert], inputs: Sequence[Any],
            kwargs: Optional[Sequence[Optional[Mapping[str, Any]]]],
            forked: bool = True, measure: Optional[Measure] = None) -> List[Any]:
    """The loop itself, each call in its own random stream (forked first, in
    call order, as in every mode; not under a ``torch.func`` transform, whose
    randomness rules apply there)."""
    n = len(modules)
    rngs: List[Optional[CallRng]] = list(CallRng.fork_many(n)) if forked else [None] * n
    results = []
    ready: Ready = {}  # filled by the first call on each CUDA device
    for i in range(n):
        name = f"parallel_apply: call {i} of {n}"
        def call(i: int = i, name: str = name) -> Any:
            return call_inline(modules[i], _as_args(inputs[i]),
                               (kwargs[i] if kwargs else None) or {}, rngs[i], name, i, ready)
        try:
            results.append(measure.timed(i, call)() if measure is not None else call())
        except BaseException as error:
            error.add_note(name)
            raise
    return results
