"""The one autograd node that runs many calls, forward and backward.

PyTorch's engine runs the CPU backward of one ``backward()`` on the calling
thread, node after node. To overlap many expert calls in backward, this module
hides every call's own graph behind ONE node, ``_ParallelNode``: its forward
returns the outputs that the calls already computed on workers, and its
backward hands each call's output gradients to a worker and joins them::

    inputs, parameters ──┬─ call 0 (own graph, run on a worker) ─┐
                         ├─ call 1 ─────────────────────────────┤──> _ParallelNode ──> outputs
                         └─ call n-1 ───────────────────────────┘
    backward: _ParallelNode.backward ─ fan out ─> call i.backward(grads_i) ─ join
              ──> the engine accumulates every input's and parameter's gradient

A *call record* (:class:`IsolatedCall`) is what the node needs of a call: its
tensor inputs (the caller's tensors AND the leaves its graph reaches, i.e. the
expert's parameters), its outputs, and a ``backward`` that runs on a worker.
Autograd Functions (:func:`map_with_parallel_backward`) and modules
(:func:`moe_autograd.parallel.parallel_apply`) supply their own records.

Invariants:

* Every tensor a call differentiates into is an input of the node, so the
  engine itself accumulates parameter gradients, exactly as for any other
  leaf: ``torch.autograd.grad`` w.r.t. parameters and ``backward(inputs=...)``
  work, hooks fire once per backward with the summed gradient of a shared
  parameter, and DDP's reducer sees its parameters become ready. A call whose
  backward fails under a tolerant :class:`BackwardPolicy` simply returns None.
* A call none of whose outputs received a gradient does not run its backward;
  its inputs get None, as under sequential autograd. Zeros are materialized
  for the other outputs of a partly used call only where the call asks for it
  (:attr:`IsolatedCall.materialize_grads`, as ``ctx.set_materialize_grads``).
* Outputs of a call that needs no gradient are non-differentiable
  (``requires_grad=False``, no ``grad_fn``), as the call alone would give.
* The node's outputs are new tensor objects (detached views), so no call's own
  graph is ever rewired by the outer engine. Outputs that alias the caller's
  tensors never reach the node: a record rebuilds them itself (see
  :meth:`moe_autograd.module_call.ModuleCall.rebuild`).
* Every call is joined before the node's backward returns or raises: a failing
  call never leaves another one running on half-freed state.
* Call records live until the engine releases the node (after a backward
  without ``retain_graph``, or when the outputs die), never longer.
"""
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import collect
from .phony import get_phony
from .saved import CallSaves
from .tls import bind, capture

__all__ = ["IsolatedCall", "BackwardPolicy", "attach", "Grads"]

Grads = List[Optional[Tensor]]


class IsolatedCall:
    """What :func:`attach` needs of one call. Subclasses fill ``inputs`` (every
    tensor the call's gradients flow into: the caller's tensors that may need
    gradients, then the leaves such as parameters that its graph reaches),
    ``outputs`` (tensors computed on a worker) and implement :meth:`backward`."""

    inputs: List[Tensor]
    outputs: List[Tensor]
    #: Output tensors (as objects in ``outputs``) autograd must not differentiate.
    non_differentiable: Sequence[Tensor] = ()
    #: Maps an output position to the input position it modified in place.
    dirty: Sequence[Tuple[int, int]] = ()
    #: Outputs that alias an input without modifying it: ``(output position,
    #: input position, view)``, where ``view`` is the call's own output, a
    #: view of that input whose view ops the node replays on the node's input,
    #: or None for the input returned as is. The node returns them as views
    #: of its inputs, so that autograd's rules for a custom Function's views
    #: (in-place refused) apply as to the call alone.
    aliases: Sequence[Tuple[int, int, Optional[Tensor]]] = ()
    #: When False, ``None`` output gradients are passed on as None.
    materialize_grads = True
    #: What the call saved for backward through the caller's saved-tensor
    #: hooks (see :mod:`moe_autograd.saved`); None without such hooks.
    saves: Optional[CallSaves] = None
    #: Starts this call's backward (with the other calls of the same
    #: collector) instead of a worker; None: :meth:`backward` runs on a
    #: worker (see :mod:`moe_autograd.collect`).
    collector: Optional["collect.Collector"] = None

    @property
    def needs_grad(self) -> bool:
        """Whether backward must reach this call (its inputs or parameters)."""
        return any(t.requires_grad for t in self.inputs)

    def backward(self, grad_outputs: Grads) -> Any:
        """Runs on a worker; returns what :meth:`input_grads` turns into one
        gradient per entry of ``inputs``. At least one entry of
        ``grad_outputs`` is a tensor."""
        raise NotImplementedError

    def input_grads(self, raw: Any) -> Grads:
        """Runs on the caller after the join (off the concurrent phase, where
        every bit of Python holds the GIL against the other calls)."""
        return raw  # type: ignore[no-any-return]

    def release(self) -> None:
        """Frees what the call kept for backward."""


class BackwardPolicy:
    """How the node treats calls that fail in backward.

    The default raises the first failure, after joining every call. With
    ``tolerate_failures`` a call that raises or misses ``timeout`` is treated
    as a constant (None gradients for its inputs and parameters: a late call
    that finishes afterwards changes nothing); ``check`` then sees each
    call's outcome (None for success, else its error; a :class:`TimeoutError`
    for a call past the deadline) and may raise.
    """

    def __init__(
        self,
        timeout: Optional[float] = None,
        tolerate_failures: bool = False,
        check: Optional[Callable[[List[Optional[BaseException]]], None]] = None,
    ) -> None:
        self.timeout = timeout
        self.tolerate_failures = tolerate_failures
        self.check = check


class _Plan:
    """What the node keeps between forward and backward."""

    def __init__(self, calls: Sequence[IsolatedCall], policy: Optional[BackwardPolicy],
                 name: str) -> None:
        self.calls: Optional[Sequence[IsolatedCall]] = calls
        self.policy = policy
        self.name = name
        self.lock = threading.Lock()
        # Taken in grad mode (the node's forward runs without it).
        self.constant = [not call.needs_grad for call in calls]
        #: ``lanes`` for the backward (see :func:`moe_autograd.executor.run_all`).
        self.lanes: Optional[int] = None
        #: Position in ``[phony, *flat inputs]`` of an input to pass first.
        self.view_first: Optional[int] = None
        # The node's inputs list the calls last first: the engine then sums the
        # gradient terms of a tensor shared by several calls in the order a
        # loop's backward produces them (later calls first), bit for bit.
        self.input_offsets = [0] * len(calls)
        offset = 0
        for i in reversed(range(len(calls))):
            self.input_offsets[i] = offset
            offset += len(calls[i].inputs)
        # Output metadata, to materialize zero gradients without keeping outputs.
        self.output_meta = [
            [(o.shape, o.dtype, o.device) for o in call.outputs] for call in calls
        ]

    def release(self) -> None:
        with self.lock:
            calls, self.calls = self.calls, None
        for call in calls or ():
            call.release()
            if call.saves is not None:
                call.saves.release()


_CreationMeta = torch._C._autograd.CreationMeta
_REPLAYABLE = (_CreationMeta.DEFAULT, _CreationMeta.NO_GRAD_MODE)


def replayable_view(t: Tensor) -> bool:
    """Whether ``t`` is a view that its base's view ops alone made (not the
    output of a custom Function, which its node must see, nor of a
    multi-output view op such as ``unbind``), so that replaying those ops on
    another base (``t._view_func(base)``) gives what the loop gives."""
    return t._is_view() and torch._C._autograd._get_creation_meta(t) in _REPLAYABLE


def _node_order(plan: "_Plan", tensors: List[Any]) -> List[Any]:
    """``[phony, *flat inputs]`` (or their gradients) in the node's input
    order: as they are, or with the view the call modifies in place first."""
    k = plan.view_first
    return tensors if k is None else [tensors[k], *tensors[:k], *tensors[k + 1:]]


def _flat_inputs(plan: "_Plan", tensors: Sequence[Tensor]) -> Sequence[Tensor]:
    """The flat inputs (without the phony) from the node's inputs."""
    k = plan.view_first
    if k is None:
        return tensors[1:]
    rest = tensors[1:]  # phony, then the others
    return [*rest[1:k], tensors[0], *rest[k:]]


def _identity(x: Any) -> Any:
    return x


class _NoDoubleBackward(torch.autograd.Function):
    """Passes the node's input gradients through, connected to the node's
    inputs, with a backward that raises: with ``create_graph`` the gradients
    must never be differentiated silently as constants.

    ``torch.autograd.function.once_differentiable`` is not enough here: it
    guards only when an incoming gradient requires grad, and its error node
    hangs off fresh leaves, so ``torch.autograd.grad(..., inputs)`` never
    reaches it. A gradient penalty on ``grad(y.sum(), x, create_graph=True)``
    would then lose its second-order term without a word."""

    @staticmethod
    def forward(ctx: Any, n: int, *tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        return tuple(None if g is None else g.view_as(g) for g in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        raise RuntimeError(
            "trying to differentiate twice a function that was marked with "
            "@once_differentiable: the gradients of a parallel call (parallel_apply, "
            "map_with_parallel_backward) do not support double backward")


class _ParallelNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _Plan, *tensors: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        inputs = _flat_inputs(plan, tensors)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        outputs: List[Tensor] = []
        non_differentiable: List[Tensor] = []
        dirty: List[Tensor] = []
        assert plan.calls is not None
        for call, constant, offset in zip(plan.calls, plan.constant, plan.input_offsets):
            if not (constant or call.dirty or call.non_differentiable or call.aliases):
                outputs.extend([out.detach() for out in call.outputs])
                continue
            dirty_at = dict(call.dirty)
            alias_at = {k: (j, view) for k, j, view in call.aliases}
            nondiff = {id(t) for t in call.non_differentiable}
            for k, out in enumerate(call.outputs):
                if k in dirty_at:
                    result = inputs[offset + dirty_at[k]]
                    dirty.append(result)
                elif k in alias_at:
                    j, view = alias_at[k]
                    base = inputs[offset + j]
                    result = base if view is None else view._view_func(base)  # type: ignore[attr-defined]
                else:
                    result = out.detach()
                if constant or id(out) in nondiff:
                    non_differentiable.append(result)
                outputs.append(result)
        if dirty:
            ctx.mark_dirty(*dirty)
        if non_differentiable:
            ctx.mark_non_differentiable(*non_differentiable)
        # Release the calls when the engine frees this node's saved state: a
        # backward without retain_graph, or the node's death. The token is only
        # referenced by the saved state (see attach() for the hooks).
        token = torch.empty(0)
        weakref.finalize(token, plan.release)
        ctx.save_for_backward(token)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        plan: _Plan = ctx.plan
        calls = plan.calls
        if calls is None:
            raise RuntimeError(f"{plan.name}: the calls' graphs were already freed; "
                               "pass retain_graph=True to backward twice")
        if not torch.is_grad_enabled():
            return _ParallelNode._backward(plan, calls, grad_outputs)
        # create_graph=True: the gradients come from the calls' own backward
        # and cannot be differentiated again: make that an error, never a constant.
        with torch.no_grad():
            grads = _ParallelNode._backward(plan, calls, grad_outputs)
        inputs = [t for call in reversed(calls) for t in call.inputs]
        return _NoDoubleBackward.apply(len(grads), *grads, *inputs)

    @staticmethod
    def _backward(plan: _Plan, calls: Sequence[IsolatedCall],
                  grad_outputs: Tuple[Optional[Tensor], ...]) -> Tuple[Optional[Tensor], ...]:
        per_call: List[Optional[Grads]] = []
        offset = 0
        for call, meta in zip(calls, plan.output_meta):
            grads = list(grad_outputs[offset:offset + len(meta)])
            offset += len(meta)
            if all(g is None for g in grads):
                per_call.append(None)  # unused: its backward does not run
                continue
            if call.materialize_grads:
                for k, (shape, dtype, device) in enumerate(meta):
                    if grads[k] is None and (dtype.is_floating_point or dtype.is_complex):
                        grads[k] = torch.zeros(shape, dtype=dtype, device=device)
            per_call.append(grads)
        input_grads = _run_backwards(plan, calls, per_call)
        flat = [g for grads in reversed(input_grads) for g in grads]
        for k, g in enumerate(flat):
            if g is not None and g.is_sparse:
                # A sparse gradient's values may be another gradient's memory
                # (embedding's backward keeps its incoming gradient): the
                # engine would then steal one into a .grad that the other's
                # accumulation changes. A loop's AccumulateGrad copies there.
                flat[k] = g.clone()
        return (None, *_node_order(plan, [None, *flat]))


def _check_grads(plan: _Plan, i: int, call: IsolatedCall, grads: Grads) -> Grads:
    n = len(call.inputs)
    if len(grads) != n:
        raise RuntimeError(f"{plan.name}: call {i} returned {len(grads)} gradients "
                           f"for {n} tensor inputs")
    for k, (grad, inp) in enumerate(zip(grads, call.inputs)):
        if grad is not None and grad.shape != inp.shape:
            try:
                grads[k] = grad.sum_to_size(inp.shape)
            except RuntimeError:
                raise RuntimeError(
                    f"{plan.name}: call {i} returned a gradient of shape {list(grad.shape)} "
                    f"for input {k} of shape {list(inp.shape)}") from None
    return grads


def _run_backwards(plan: _Plan, calls: Sequence[IsolatedCall],
                   per_call: List[Optional[Grads]]) -> List[Grads]:
    """Runs the backward of every call that has output gradients; the others
    get None for every input."""
    active = [i for i, grads in enumerate(per_call) if grads is not None]
    results: List[Grads] = [[None] * len(call.inputs) for call in calls]
    if not active:
        return results
    # The user's saved-tensor hooks unpack here, on the engine's thread inside
    # the outer graph task (a checkpoint frame recomputes once), never on workers.
    saves = [calls[i].saves for i in active if calls[i].saves is not None]
    for s in saves:
        s.materialize()  # type: ignore[union-attr]
    muted = _mute_tensor_hooks([t for i in active for t in calls[i].inputs])
    try:
        _run_active(plan, calls, per_call, active, results)
    finally:
        _restore_tensor_hooks(muted)
        for s in saves:
            s.drop()  # type: ignore[union-attr]
    return results


Muted = List[Tuple[Dict[Any, Any], List[Tuple[Any, Any]]]]


def _mute_tensor_hooks(tensors: Sequence[Tensor]) -> Muted:
    """Empties the ``register_hook`` hooks of the leaves among ``tensors``
    while the calls run their backward.

    A call's own graph reaches its expert's parameters, so the call's
    ``torch.autograd.grad`` captures their gradients at their
    ``AccumulateGrad`` node, and PyTorch runs a leaf's tensor hooks on every
    capture: a hook would fire once per call with a partial gradient, and a
    hook that rewrites the gradient (clipping, say) would apply twice. The
    engine runs them once, with the summed gradient, when it accumulates the
    node's results. (Post-accumulate hooks and DDP's hooks on the accumulator
    run only when it accumulates, never on a capture.) The hook dicts are
    emptied in place, so PyTorch's handles stay valid; a backward of another
    thread through the same parameters at this moment would miss them.
    """
    muted: Muted = []
    seen = set()
    for t in tensors:
        hooks = t._backward_hooks if t.is_leaf else None
        if hooks and id(hooks) not in seen:
            seen.add(id(hooks))
            muted.append((hooks, list(hooks.items())))
            hooks.clear()
    return muted


def _restore_tensor_hooks(muted: Muted) -> None:
    for hooks, items in muted:
        kept = list(hooks.items())  # registered meanwhile
        hooks.clear()
        hooks.update(items)
        hooks.update(kept)


def _on_device_thread(plan: _Plan, active: List[int]) -> bool:
    """Whether this backward runs on one of the engine's device threads (a
    thread PyTorch made, not Python) for calls with tensors on a device.

    The engine runs a device's nodes on its own thread for that device. A
    call's backward started from a pool worker would queue its device nodes
    on that thread, which is blocked here waiting for the worker: a deadlock
    (seen on CUDA). There, the calls' backwards run on this thread, one after
    another: the engine runs a backward started on its device thread inline.
    """
    if not isinstance(threading.current_thread(), threading._DummyThread):  # type: ignore[attr-defined]
        return False
    return any(device.type != "cpu" for i in active for _, _, device in plan.output_meta[i])


def _run_active(plan: _Plan, calls: Sequence[IsolatedCall], per_call: List[Optional[Grads]],
                active: List[int], results: List[Grads]) -> None:
    state = capture()
    policy = plan.policy
    strict = policy is None or not (policy.tolerate_failures or policy.timeout is not None)
    # On a device thread: one lane, this thread, and no deadline can hold.
    inline = _on_device_thread(plan, active)
    lanes = 1 if inline else plan.lanes

    def task(i: int) -> Callable[[], Any]:
        call = calls[i]
        grads = per_call[i]

        def run() -> Any:
            try:
                raw = call.backward(grads)  # type: ignore[arg-type]
                # A tolerant caller must see a malformed result as this call's failure.
                return raw if strict else _check_grads(plan, i, call, call.input_grads(raw))
            except BaseException as error:
                error.add_note(f"{plan.name} backward: call {i} of {len(calls)}")
                raise
        return bind(state, run)

    fns = [task(i) for i in active]
    mine, grads = [calls[i] for i in active], [per_call[i] for i in active]

    def finish(k: int, raw: Any, error: Optional[BaseException]
               ) -> Tuple[Any, Optional[BaseException]]:
        # A collected call's completion, as ``task`` ends a call on a worker.
        i = active[k]
        if error is None and not strict:
            try:
                raw = _check_grads(plan, i, calls[i], calls[i].input_grads(raw))
            except Exception as failure:  # noqa: BLE001 - this call's own failure
                error = failure
        if error is not None:
            error.add_note(f"{plan.name} backward: call {i} of {len(calls)}")
        return raw, error

    if strict:
        raws = collect.run_backwards(mine, grads, fns, lanes, finish)
        for i, raw in zip(active, raws):
            try:
                results[i] = _check_grads(plan, i, calls[i], calls[i].input_grads(raw))
            except BaseException as error:
                error.add_note(f"{plan.name} backward: call {i} of {len(calls)}")
                raise
        return
    assert policy is not None
    group = collect.submit_backwards(mine, grads, fns,
                                     None if policy.timeout is not None and not inline else lanes,
                                     finish, deadline=policy.timeout)
    # Under a deadline the caller never runs a call itself: it could not leave
    # a straggler before the deadline.
    if inline:
        group.wait()
    elif not group.wait(policy.timeout, help=policy.timeout is None):
        group.cancel()
    ok = [True] * len(calls)  # a call that did not run (unused) is no failure
    errors: List[Optional[BaseException]] = [None] * len(calls)
    for j, i in enumerate(active):
        ok[i] = group.succeeded(j)
        errors[i] = group.errors[j]
    if not policy.tolerate_failures and not all(ok):
        if any(e is not None for e in errors):
            raise next(e for e in errors if e is not None)
        late = ok.index(False)
        raise TimeoutError(f"{plan.name} backward: call {late} of {len(calls)} "
                           f"missed the {policy.timeout}s deadline")
    if policy.check is not None:
        policy.check([
            None if ok[i] else errors[i] or TimeoutError(
                f"{plan.name} backward: call {i} of {len(calls)} missed the "
                f"{policy.timeout}s deadline")
            for i in range(len(calls))
        ])
    for j, i in enumerate(active):
        if ok[i]:
            results[i] = group.results[j]  # type: ignore[assignment]


_named_nodes: Dict[type, type] = {}


def _node_named_as(function: Optional[type]) -> Any:
    """``_ParallelNode``, or a subclass named as ``function``, so that the
    outputs' ``grad_fn`` and autograd's own errors about them ("Output 0 of
    MyFunction is a view ...") name the Function a map runs, as ``apply``'s."""
    if function is None:
        return _ParallelNode
    node = _named_nodes.get(function)
    if node is None:
        node = _named_nodes[function] = type(function.__name__, (_ParallelNode,), {
            "__module__": __name__, "__qualname__": function.__qualname__})
    return node


def attach(calls: Sequence[IsolatedCall], policy: Optional[BackwardPolicy] = None,
           name: str = "parallel call",
           phony_device: Optional[torch.device] = None,
           lanes: Optional[int] = None,
           function: Optional[type] = None) -> List[List[Tensor]]:
    """Hangs the calls' outputs off one ``_ParallelNode``; returns each call's
    outputs as tensors of the caller's graph.

    Without grad mode, or when no call needs a gradient, the outputs are
    returned as they are. Calls' saved tensors are packed by the caller's
    hooks here, in call order. A phony input that requires grad keeps the node
    in the graph (PyTorch's own ``Function.apply`` drops a node none of whose
    inputs requires grad). ``function``: the autograd Function the calls run,
    whose name the node takes.
    """
    if not (torch.is_grad_enabled() and any(call.needs_grad for call in calls)):
        for call in calls:
            call.release()
        return [list(call.outputs) for call in calls]
    for call in calls:
        if call.saves is not None:
            call.saves.replay()
    plan = _Plan(calls, policy, name)
    plan.lanes = lanes
    if len(calls) == 1 and any(calls[0].inputs[j]._is_view() for _, j in calls[0].dirty):
        # A view modified in place: autograd's CopySlices sends the view's
        # gradient through the node's first input, which must be the view.
        plan.view_first = 1 + next(j for _, j in calls[0].dirty if calls[0].inputs[j]._is_view())
    phony = get_phony(phony_device or torch.device("cpu"), requires_grad=True)
    flat_inputs = [t for call in reversed(calls) for t in call.inputs]
    # The node saves only its release token. Identity hooks keep the caller's
    # saved-tensor hooks (offloading, say) from copying it, which would free the
    # calls before backward.
    with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
        flat = _node_named_as(function).apply(plan, *_node_order(plan, [phony, *flat_inputs]))
    result: List[List[Tensor]] = []
    offset = 0
    for meta in plan.output_meta:
        result.append(list(flat[offset:offset + len(meta)]))
        offset += len(meta)
    return result
