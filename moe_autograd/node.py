"""The autograd node that runs many calls, forward and backward.

PyTorch's engine runs the CPU backward of one ``backward()`` on the calling
thread, node after node. To overlap many expert calls in backward, this module
hides every call's own graph behind ONE node, ``_ParallelNode``: its forward
returns the outputs that the calls already computed on workers, and its
backward hands each call's output gradients to a worker::

    inputs, parameters ──┬─ call 0 (own graph, run on a worker) ─┐
                         ├─ call 1 ─────────────────────────────┤──> _ParallelNode ──> outputs
                         └─ call n-1 ───────────────────────────┘
    backward: _ParallelNode.backward ─ fan out ─> call i.backward(grads_i)

Parameter gradients *stream*: a call with parameters (a module's) also gets a
node of its own, ``_CallGradients``, between its tensors and the parallel
node. The parallel node's backward starts every call and returns at once; the
engine then runs the calls' nodes, later calls first as a loop's backward
does, and each waits for its own call and hands its input and parameter
gradients to the engine, which accumulates them (hooks, DDP's reducer) and
frees them, with the call's graph, before the next call's arrive::

    inputs, parameters ─┬─ _CallGradients 0 ─┐ token
                        ├─ ...               ├──> _ParallelNode ──> outputs
                        └─ _CallGradients n-1┘
    backward: _ParallelNode: start all ─> _CallGradients n-1: wait call n-1,
              its gradients to the engine (accumulated, freed) ─> ... ─> 0

Why this design: with one node, the engine could accumulate nothing before
every call had finished, so a step held every expert's parameter gradients at
once (hundreds of MB at 64 experts; glibc handed them back to the system after
every step and faulted them in again: the MoE layer spent several times
the loop's system time). The calls' nodes give the engine what a loop gives it, one
call's gradients at a time, in the loop's order, while the calls still run
concurrently. Calls without parameters (autograd Functions of a map, remote
calls) keep the one node: they have nothing to stream, and a node per call
costs a few microseconds.

A *call record* (:class:`IsolatedCall`) is what the nodes need of a call: its
tensor inputs (the caller's tensors AND the leaves its graph reaches, i.e. the
expert's parameters), its outputs, and a ``backward`` that runs on a worker.
Autograd Functions (:func:`map_with_parallel_backward`) and modules
(:func:`moe_autograd.parallel.parallel_apply`) supply their own records.

Invariants:

* Every tensor a call differentiates into is an input of a node, so the
  engine itself accumulates parameter gradients, exactly as for any other
  leaf: ``torch.autograd.grad`` w.r.t. parameters and ``backward(inputs=...)``
  work, hooks fire once per backward with the summed gradient of a shared
  parameter (the engine sums a call's terms in the loop's order, later calls
  first), and DDP's reducer sees its parameters become ready. A call whose
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
* A call's gradient node runs on the engine's thread for the call's device,
  as the loop's nodes of that call do (its token is on that device): a
  tensor's gradient terms from the calls and from the caller's own ops are
  then summed on one thread, in the loop's order, bit for bit.
* A failing call is raised in the loop's order (the last failing call first,
  as a loop's backward meets it) after every call was joined: none is left
  running on half-freed state. Streaming, the gradients of the calls handed
  over before it stay accumulated, as in a loop whose backward fails; a
  policy's ``check`` (the MoE layer's quorum) runs once every call is done,
  before the last call's gradients are handed over.
* A call record lives until the engine releases its node (the call's own when
  it streams: after its gradients were taken, without ``retain_graph``; or
  when the outputs die), never longer.
"""
import functools
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from . import collect
from .executor import in_order, is_interruption, on_worker, predecessors
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
    #: A checkpointed call's: what its recomputation saves, for those hooks
    #: (see :meth:`recompute_for_hooks`); None where there is nothing to replay.
    recompute_saves: Optional[CallSaves] = None
    #: Starts this call's backward (with the other calls of the same
    #: collector) instead of a worker; None: :meth:`backward` runs on a
    #: worker (see :mod:`moe_autograd.collect`).
    collector: Optional["collect.Collector"] = None
    #: Whether the backward under way may be followed by another through the
    #: same graph (the outer backward's ``retain_graph``, set as it starts):
    #: a call's own graph is kept only then (see :func:`keeps_graph`).
    retain_graph = True

    @property
    def hands_gradients(self) -> bool:
        """Whether the call's backward itself hands gradients to the caller's
        tensors (those it computes further from, see :mod:`moe_autograd.kept`):
        a pass that runs it then raises its failure even where the engine
        takes none of its input gradients (``backward(inputs=[kept])``)."""
        return False

    @property
    def needs_grad(self) -> bool:
        """Whether backward must reach this call (its inputs or parameters)."""
        return any(t.requires_grad for t in self.inputs)

    @property
    def streams(self) -> bool:
        """Whether the call's gradients go to the engine through a node of
        its own, as soon as its backward has finished (see :func:`attach`):
        worth it where it has parameter gradients to accumulate and free."""
        return False

    def recompute_for_hooks(self) -> Optional[CallSaves]:
        """On the node's thread as its backward starts, for a call with
        ``recompute_saves``: recomputes and packs what it saved with the
        caller's hooks; returns the record to unpack (see
        :meth:`moe_autograd.module_call.ModuleCall.recompute_for_hooks`)."""
        return None

    def backward_starts(self) -> None:
        """Runs on the node's thread as its backward starts, before
        :meth:`backward` is queued (a call on CUDA streams records there what
        its backward waits for, see :mod:`moe_autograd.call_streams`)."""

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
        #: The call records; a released call's entry is None.
        self.calls: List[IsolatedCall] = list(calls)
        self.policy = policy
        self.name = name
        self.lock = threading.Lock()
        #: Set when the engine freed the node's saved state (see ``release``).
        self.freed = False
        self._released = [False] * len(calls)
        # Taken in grad mode (the node's forward runs without it).
        self.constant = [not call.needs_grad for call in calls]
        #: ``lanes`` for the backward (see :func:`moe_autograd.executor.run_all`).
        self.lanes: Optional[int] = None
        #: Each call needing a gradient has its own gradient node (see
        #: ``_CallGradients``): its parameter gradients stream to the engine.
        self.streams = False
        #: Number of those nodes' tokens among the node's inputs.
        self.tokens = 0
        #: Position in ``[phony, *tokens, *flat inputs]`` of an input to pass first.
        self.view_first: Optional[int] = None
        #: The backward pass under way (streaming: its calls' gradients are
        #: handed to the engine by the calls' own nodes).
        self.current: Optional["_Pass"] = None
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
        #: The device of each call's gradient node's token (see ``_CallGradients``).
        self.token_devices = [_engine_device(meta) for meta in self.output_meta]

    def release(self) -> None:
        """The node's saved state is freed: its calls go, but those whose own
        gradient node still holds them (streaming: each call lives until its
        node is freed too)."""
        self.freed = True
        for i in range(len(self.calls)):
            if not (self.streams and not self.constant[i]):
                self.release_call(i)

    def finalized(self, i: Optional[int] = None) -> None:
        """The target of the tokens' finalizers: :meth:`release` (``i``
        None) or :meth:`release_call`. A token can die wherever a garbage
        collection runs, e.g. inside a call on a pool worker, holding that
        call's locks (a recomputation replaying its module's state): there,
        where a call to release has not ended in the current pass, waiting
        for it (or running it) could wait for that very thread, so the
        release waits on a thread of its own. Elsewhere (the engine's thread
        dropping the nodes of a stopped backward) it releases at once, as the
        next backward on that thread needs (the calls' hooks put back)."""
        current = self.current
        which = range(len(self.calls)) if i is None else [i]
        if current is not None and on_worker() and not current.idle(which):
            release = self.release if i is None else functools.partial(self.release_call, i)
            threading.Thread(target=release, name="moe_autograd-release", daemon=True).start()
        elif i is None:
            self.release()
        else:
            self.release_call(i)

    def release_call(self, i: int) -> None:
        with self.lock:
            if self._released[i]:
                return
            self._released[i] = True
        current = self.current
        if current is not None and i in current.position:
            current.released(i)  # never free a call a worker still runs
        call = self.calls[i]
        call.release()
        if call.saves is not None:
            call.saves.release()
        self.calls[i] = None  # type: ignore[call-overload]  # the record and all it holds


def _engine_device(meta: Sequence[Tuple[Any, Any, torch.device]]) -> torch.device:
    """The device whose engine thread runs a node with outputs ``meta``: the
    first that is not the CPU, as the engine picks a node's ready queue from
    its input buffer. A call's gradient node must run where the loop's nodes
    of that call run (a CUDA call's on the CUDA device thread): on another
    thread it would add its gradients to a shared tensor's buffer concurrently
    with the loop's other nodes (the caller's ``x.sin()``), in a racing order,
    and the sum would differ from the loop's in its last bits."""
    return next((device for _, _, device in meta if device.type != "cpu"), torch.device("cpu"))


_CreationMeta = torch._C._autograd.CreationMeta
_REPLAYABLE = (_CreationMeta.DEFAULT, _CreationMeta.NO_GRAD_MODE, _CreationMeta.INFERENCE_MODE)


def replayable_view(t: Tensor) -> bool:
    """Whether ``t`` is a view that its base's view ops alone made (not the
    output of a custom Function, which its node must see, nor of a
    multi-output view op such as ``unbind``), so that replaying those ops on
    another base (``t._view_func(base)``) gives what the loop gives."""
    return t._is_view() and torch._C._autograd._get_creation_meta(t) in _REPLAYABLE


def _node_order(plan: "_Plan", tensors: List[Any]) -> List[Any]:
    """``[phony, *tokens, *flat inputs]`` (or their gradients) in the node's
    input order: as they are, or with the view the call modifies in place first."""
    k = plan.view_first
    return tensors if k is None else [tensors[k], *tensors[:k], *tensors[k + 1:]]


def _flat_inputs(plan: "_Plan", tensors: Sequence[Tensor]) -> Sequence[Tensor]:
    """The flat inputs (after the phony and the tokens) from the node's inputs."""
    k = plan.view_first
    if k is not None:
        rest = tensors[1:]
        tensors = [*rest[:k], tensors[0], *rest[k:]]
    return tensors[1 + plan.tokens:]


def _identity(x: Any) -> Any:
    return x


def _alias(g: Tensor) -> Tensor:
    """``g`` as a new tensor object over the same data (a Function's output
    must not be one of its inputs); a sparse gradient (``nn.Embedding(...,
    sparse=True)``) has no views: a copy."""
    return g.view_as(g) if g.layout == torch.strided else g.clone()


class _NoDoubleBackward(torch.autograd.Function):
    """Passes the node's input gradients through, connected to the node's
    inputs AND to the gradients it received, with a backward that raises:
    with ``create_graph`` the gradients must never be differentiated
    silently as constants, whatever asks.

    ``torch.autograd.function.once_differentiable`` is not enough here: it
    guards only when an incoming gradient requires grad, and its error node
    hangs off fresh leaves, so ``torch.autograd.grad(..., inputs)`` never
    reaches it. A gradient penalty on ``grad(y.sum(), x, create_graph=True)``
    would then lose its second-order term without a word. Connected to the
    incoming gradients too, it also stops what differentiates the gradients
    with respect to those: ``torch.autograd.functional.jvp`` (the
    double-backward trick: with ``strict=False`` a missing path there is
    zeros), ``hvp``, ``hessian``."""

    @staticmethod
    def forward(ctx: Any, name: str, n: int,  # type: ignore[override]
                *tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        ctx.name = name
        return tuple(None if g is None else _alias(g) for g in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        raise RuntimeError(
            f"{ctx.name}: trying to differentiate twice a function that was marked with "
            "@once_differentiable: the gradients of a parallel call (parallel_apply, "
            "map_with_parallel_backward, MixtureOfExperts) do not support double backward, "
            "nor anything that differentiates them (create_graph=True then a gradient of "
            "the gradients: a gradient penalty, torch.autograd.functional.jvp, hvp, vhp, "
            "hessian); use torch.func transforms, which run the calls in a loop")


def _guarded(name: str, grads: Sequence[Optional[Tensor]], inputs: Sequence[Tensor],
             incoming: Sequence[Optional[Tensor]]) -> Tuple[Optional[Tensor], ...]:
    """``grads`` through :class:`_NoDoubleBackward`, hung off ``inputs`` and
    the ``incoming`` gradients that require grad."""
    tied = [g for g in incoming if g is not None and g.requires_grad]
    return _NoDoubleBackward.apply(name, len(grads), *grads, *inputs, *tied)


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
        weakref.finalize(token, plan.finalized)
        ctx.save_for_backward(token)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        plan: _Plan = ctx.plan
        calls = plan.calls
        if plan.freed:
            raise RuntimeError(f"{plan.name}: the calls' graphs were already freed; "
                               "pass retain_graph=True to backward twice")
        if not torch.is_grad_enabled():
            return _ParallelNode._backward(plan, calls, grad_outputs)
        # create_graph=True: the gradients come from the calls' own backward
        # and cannot be differentiated again: make that an error, never a constant.
        with torch.no_grad():
            grads = _ParallelNode._backward(plan, calls, grad_outputs)
        if plan.streams:
            # No gradient but the tokens': tied to the incoming gradients, which
            # the calls' nodes then tie theirs to.
            tokens = [k for k, g in enumerate(grads) if g is not None]
            if not tokens:
                return grads
            tied = dict(zip(tokens, _guarded(plan.name, [grads[k] for k in tokens], [],
                                             grad_outputs)))
            return tuple(tied.get(k, g) for k, g in enumerate(grads))
        inputs = [t for call in reversed(calls) for t in call.inputs]
        return _guarded(plan.name, grads, inputs, grad_outputs)

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
                    if grads[k] is None:  # as apply: integer outputs too
                        grads[k] = torch.zeros(shape, dtype=dtype, device=device)
            per_call.append(grads)
        backward = _Pass(plan, per_call)
        n_flat = sum(len(call.inputs) for call in calls)
        if plan.streams:
            # The calls run on; each call's node hands over its gradients as
            # it finishes (in the engine's order: later calls first).
            plan.current = backward
            torch.autograd.Variable._execution_engine.queue_callback(backward.finish)
            tokens = [torch.empty(0, device=plan.token_devices[i]) if i in backward.position
                      else None for i in reversed(range(len(calls))) if not plan.constant[i]]
            return (None, *_node_order(plan, [None, *tokens, *[None] * n_flat]))
        input_grads: List[Grads] = [[None] * len(call.inputs) for call in calls]
        try:
            backward.join()  # one wake-up for all (nothing streams to wait call by call)
            for i in reversed(backward.active):
                input_grads[i] = backward.grads_of(i)
        finally:
            backward.finish()
        flat = [g for grads in reversed(input_grads) for g in grads]
        return (None, *_node_order(plan, [None, *flat]))


class _CallGradients(torch.autograd.Function):
    """One call's gradients, handed to the engine when that call's backward
    has finished (streaming, see :func:`attach`).

    Its inputs are the call's tensors (the caller's and the parameters its
    graph reaches), its output a token the parallel node takes as an input:
    the engine runs it after the node, in its own order (the node of a later
    call first, as a loop's backward), and accumulates its parameters'
    gradients at once, then frees them with the call's graph."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, i: int, *inputs: Tensor) -> Tensor:  # type: ignore[override]
        ctx.plan, ctx.i, ctx.n = plan, i, len(inputs)
        ctx.set_materialize_grads(False)
        token = torch.empty(0)
        weakref.finalize(token, plan.finalized, i)
        ctx.save_for_backward(token)
        # On the call's device: the engine runs this node on that device's thread.
        return torch.empty(0, device=plan.token_devices[i])

    @staticmethod
    def backward(ctx: Any, grad: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        plan: _Plan = ctx.plan
        i: int = ctx.i
        current = plan.current
        if current is None or i not in current.position:  # unused in this backward
            return (None, None, *[None] * ctx.n)
        if not torch.is_grad_enabled():
            return (None, None, *current.grads_of(i))
        inputs = plan.calls[i].inputs
        with torch.no_grad():
            grads = current.grads_of(i)
        return (None, None, *_guarded(plan.name, grads, inputs, [grad]))


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


class _Muted:
    """The ``register_hook`` hooks of the leaves among the calls' inputs,
    emptied while the calls run their backward, each dict put back when the
    last call that reaches its leaf has finished.

    A call's own graph reaches its expert's parameters, so the call's
    ``torch.autograd.grad`` captures their gradients at their
    ``AccumulateGrad`` node, and PyTorch runs a leaf's tensor hooks on every
    capture: a hook would fire once per call with a partial gradient, and a
    hook that rewrites the gradient (clipping, say) would apply twice. The
    engine runs them once, with the summed gradient, when it accumulates the
    calls' results. (Post-accumulate hooks and DDP's hooks on the accumulator
    run only when it accumulates, never on a capture.) The hook dicts are
    emptied in place, so PyTorch's handles stay valid; a backward of another
    thread through the same parameters at this moment would miss them.
    """

    def __init__(self, calls: Sequence[IsolatedCall], active: Sequence[int]) -> None:
        self._entries: Dict[int, List[Any]] = {}  # id -> [hooks, items, calls left]
        self._of_call: Dict[int, List[int]] = {}
        for i in active:
            mine: List[int] = []
            for t in calls[i].inputs:
                hooks = t._backward_hooks if t.is_leaf else None
                if hooks is None or id(hooks) in mine:
                    continue
                key = id(hooks)
                entry = self._entries.get(key)
                if entry is not None:  # muted by another call (so empty now)
                    entry[2] += 1
                elif hooks:
                    self._entries[key] = [hooks, list(hooks.items()), 1]
                    hooks.clear()
                else:
                    continue
                mine.append(key)
            self._of_call[i] = mine

    def done(self, i: int) -> None:
        """Call ``i`` has finished: put back the hooks no running call reaches."""
        for key in self._of_call.pop(i, ()):
            entry = self._entries[key]
            entry[2] -= 1
            if entry[2] == 0:
                del self._entries[key]
                _restore(entry[0], entry[1])

    def restore_all(self) -> None:
        self._of_call.clear()
        entries, self._entries = self._entries, {}
        for hooks, items, _ in entries.values():
            _restore(hooks, items)


def _restore(hooks: Dict[Any, Any], items: List[Tuple[Any, Any]]) -> None:
    kept = list(hooks.items())  # registered meanwhile
    hooks.clear()
    hooks.update(items)
    hooks.update(kept)


_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def keeps_graph() -> bool:
    """On the engine's thread, in a node's backward: whether the backward
    under way keeps the graph (``retain_graph``, ``create_graph``), so that
    another backward may run through it. Only then does a call keep its own
    graph after its backward, as the loop's would be kept: a graph kept
    otherwise holds its buffers longer, and a compiled expert's backward
    (inductor's donated buffers) refuses to run with ``retain_graph``. True
    where PyTorch does not say (before 2.6)."""
    return True if _KEEP_GRAPH is None else bool(_KEEP_GRAPH())


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


def _hook_keys(call: Any) -> List[int]:
    """The modules of ``call``'s expert that have backward hooks (full ones:
    ``register_full_backward_hook``, or pre-hooks), by id; ``[0]`` for every
    call while global ones exist: what must fire in the loop's order."""
    module = getattr(call, "module", None)
    if not isinstance(module, torch.nn.Module):
        return []
    hooks = torch.nn.modules.module
    if hooks._global_backward_hooks or hooks._global_backward_pre_hooks:
        return [0]
    tree = getattr(call, "_submodules", None) or list(module.modules())
    return [id(m) for m in tree if m._backward_hooks or m._backward_pre_hooks]


def _hooks_in_order(calls: Sequence[Any], tasks: List[Callable[[], Any]]
                    ) -> List[Callable[[], Any]]:
    """The backward tasks (in the engine's order: later calls first), each
    call that reaches a module with backward hooks an earlier task's call
    also reaches starting only once that one ended: the hooks fire in the
    loop's order (issue 46; before, in ``parallel`` mode, in whichever order
    the workers finished). A waiting task blocks its thread, which cannot
    deadlock: tasks start in order, so the ones it waits for have started."""
    return in_order(tasks, predecessors([_hook_keys(call) for call in calls]))


class _Pass:
    """One backward pass of a node's calls.

    Lifecycle::

        started    the node's backward: the saved tensors of the active calls
                   (those with an output gradient) unpacked on the engine's
                   thread, their leaves' hooks muted, their backwards queued
                   last call first (workers, or the waiting thread itself)
        taken      ``grads_of(i)``, once per active call, last call first:
                   waits for call i (helping), checks its gradients, puts
                   back the hooks only it reached; a failure joins every call
                   first, then raises
        finished   ``finish()``: every call joined (a deadline's stragglers
                   cancelled), every hook back, the policy's ``check`` run on
                   all outcomes; idempotent: run when the last active call's
                   gradients are taken (a streaming node also queues it at the
                   end of the engine's pass, for calls the pass never reached:
                   there, under the default policy, the failure of a call
                   that hands gradients itself is raised, see
                   :attr:`IsolatedCall.hands_gradients`)

    Under the default policy the first failure met, in the loop's order
    (later calls first), is raised; under a tolerant one a failed or late
    call gives None gradients (a constant), but an interrupted one
    (``KeyboardInterrupt``, ``SystemExit``: not an ``Exception``) is raised,
    never masked.
    """

    def __init__(self, plan: _Plan, per_call: List[Optional[Grads]]) -> None:
        self.plan = plan
        calls = plan.calls
        self.active = [i for i, grads in enumerate(per_call) if grads is not None]
        self.position = {i: k for k, i in enumerate(reversed(self.active))}
        self._finished = False
        self._gone: Set[int] = set()  # calls freed
        self._taken: Set[int] = set()  # calls whose gradients went to the engine
        self._lock = threading.Lock()
        policy = plan.policy
        self.strict = policy is None or not (policy.tolerate_failures or policy.timeout is not None)
        self.deadline = None if policy is None or policy.timeout is None \
            else time.monotonic() + policy.timeout
        # The user's saved-tensor hooks unpack here, on the engine's thread inside
        # the outer graph task (a checkpoint frame recomputes once), never on workers.
        self._saves: Dict[int, CallSaves] = {
            i: saves for i in self.active if (saves := calls[i].saves) is not None}
        # A checkpointed call made under such hooks recomputes first, and the
        # hooks see what it saves there, in call order (the loop's packs).
        for i in self.active:
            if calls[i].recompute_saves is None:
                continue
            try:
                saves = calls[i].recompute_for_hooks()
            except Exception as error:
                if self.strict:
                    error.add_note(self._where(i))
                    raise
                failed = calls[i].recompute_saves
                if failed is not None:  # its backward meets it there
                    failed.fail(error, every=True)
                continue
            if saves is not None:
                self._saves[i] = saves
        # An unpack that fails (a frame's recomputation that raised) is tried
        # once, like the loop's; the saved tensors left raise it where a call's
        # backward needs them, as the loop meets it only there.
        failure: Optional[BaseException] = None
        for saves in self._saves.values():
            if failure is None:
                try:
                    saves.materialize()
                except Exception as error:  # noqa: BLE001 - raised by the calls that need it
                    failure = error
            if failure is not None:
                saves.fail(failure)
        self._muted = _Muted(calls, self.active)
        #: Calls whose backward hands gradients to the caller's tensors itself.
        self._hands = {i for i in self.active if calls[i].hands_gradients}
        retain = keeps_graph()
        for i in self.active:
            calls[i].retain_graph = retain
            calls[i].backward_starts()
        # On a device thread: one lane, this thread, and no deadline can hold.
        self.inline = _on_device_thread(plan, self.active)
        order = list(reversed(self.active))
        state = capture()
        strict = self.strict

        def task(i: int) -> Callable[[], Any]:
            call = calls[i]
            grads = per_call[i]

            def run() -> Any:
                try:
                    raw = call.backward(grads)  # type: ignore[arg-type]
                    # A tolerant caller must see a malformed result as this call's failure.
                    return raw if strict else _check_grads(plan, i, call, call.input_grads(raw))
                except BaseException as error:
                    error.add_note(self._where(i))
                    raise
            return bind(state, run)

        def finish(k: int, raw: Any, error: Optional[BaseException]
                   ) -> Tuple[Any, Optional[BaseException]]:
            # A collected call's completion, as ``task`` ends a call on a worker.
            i = order[k]
            if error is None and not strict:
                try:
                    raw = _check_grads(plan, i, calls[i], calls[i].input_grads(raw))
                except Exception as failure:  # noqa: BLE001 - this call's own failure
                    error = failure
            if error is not None:
                error.add_note(self._where(i))
            return raw, error

        lanes = 1 if self.inline else plan.lanes
        if self.deadline is not None and not self.inline:
            lanes = None  # under a deadline the caller never runs a call itself
        tasks = [task(i) for i in order]
        if lanes != 1:  # (one lane runs them in this order anyway)
            tasks = _hooks_in_order([calls[i] for i in order], tasks)
        self.group = collect.submit_backwards(
            [calls[i] for i in order], [per_call[i] for i in order],
            tasks, lanes, finish,
            deadline=None if policy is None else policy.timeout)

    def _left(self) -> Optional[float]:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def grads_of(self, i: int) -> Grads:
        """Call ``i``'s input gradients (see the lifecycle)."""
        plan, group, k = self.plan, self.group, self.position[i]
        call = plan.calls[i]
        helps = self.inline or self.deadline is None
        group.wait_for(k, None if self.inline else self._left(), help=helps)
        if self.strict:
            error = group.errors[k]
            if error is None:
                try:
                    grads = _check_grads(plan, i, call, call.input_grads(group.results[k]))
                except BaseException as failure:
                    failure.add_note(self._where(i))
                    error = failure
            if error is not None:
                self._fail()
                raise error
        elif group.succeeded(k):
            grads = group.results[k]  # type: ignore[assignment]
        elif not plan.policy.tolerate_failures or is_interruption(group.errors[k]):  # type: ignore[union-attr]
            self._fail()
            raise group.errors[k] or self._late(i)
        else:
            grads = [None] * len(call.inputs)
        group.results[k] = None  # the engine owns them now: freed once accumulated
        self._taken.add(i)
        self._muted.done(i)
        saves = self._saves.pop(i, None)
        if saves is not None:
            saves.drop()
        if len(self._taken) == len(self.position):
            self.finish()  # the last call: every outcome is known, check here
        return _no_shared_sparse(grads)

    def _fail(self) -> None:
        """A call failed: the engine stops this pass, so no other call's
        gradients will be taken. Joins them all and frees every call (the
        graph cannot be used again: a second backward says so)."""
        self.finish(check=False)
        self.plan.freed = True
        for i in range(len(self.plan.calls)):
            self.plan.release_call(i)

    def idle(self, which: Sequence[int]) -> bool:
        """Whether none of the calls ``which`` runs in this pass (or it ended)."""
        return self._finished or all(
            self.group.done(self.position[i]) for i in which if i in self.position)

    def released(self, i: int) -> None:
        """Call ``i`` is about to be freed (its node's state went: after its
        gradients were taken, or with the graph): waits until it no longer
        runs; once every active call went, some untaken (a backward that
        stopped on another node's error), finishes without the check."""
        if self._finished:
            return  # joined, or a straggler a deadline masked: it fails alone
        if self.deadline is None:
            self.group.wait_for(self.position[i])
        else:  # past the deadline a straggler is masked: it fails alone
            self.group.wait_for(self.position[i], self._left(), help=False)
        self._gone.add(i)
        if len(self._gone) == len(self.position) and self._gone != self._taken:
            self.finish(check=False)

    def _where(self, i: int) -> str:
        return f"{self.plan.name} backward: call {i} of {len(self.plan.calls)}"

    def _late(self, i: int) -> TimeoutError:
        policy = self.plan.policy
        return TimeoutError(f"{self._where(i)} missed the "
                            f"{policy.timeout if policy else None}s deadline")

    def join(self) -> None:
        """Waits until every call is done (helping), or a deadline passed
        (its stragglers cancelled)."""
        group = self.group
        if self.strict or self.inline:
            group.wait()
        elif not group.wait(self._left(), help=self.deadline is None):
            group.cancel()

    def finish(self, check: bool = True) -> None:
        """Joins every call, puts every hook back, runs the policy's check
        (see the lifecycle)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        group = self.group
        try:
            self.join()
        finally:
            self._muted.restore_all()
            for saves in self._saves.values():
                saves.drop()
            self._saves.clear()
            if self.plan.current is self:
                self.plan.current = None
        policy = self.plan.policy
        if check and self.strict:
            # A call whose gradients the engine never took (backward(inputs=...)
            # naming only tensors it kept): its failure would be lost, and with
            # it the whole gradients it was to hand (see moe_autograd.kept).
            for i in sorted(self._hands - self._taken, reverse=True):
                error = group.errors[self.position[i]]
                if error is not None:
                    self._fail()
                    raise error
            return
        if not check or policy is None or policy.check is None:
            return
        outcomes: List[Optional[BaseException]] = [None] * len(self.plan.calls)
        for i, k in self.position.items():
            if not group.succeeded(k):
                outcomes[i] = group.errors[k] or self._late(i)
        policy.check(outcomes)


def _no_shared_sparse(grads: Grads) -> Grads:
    """A sparse gradient's values may be another gradient's memory
    (embedding's backward keeps its incoming gradient): the engine would then
    steal one into a .grad that the other's accumulation changes. A loop's
    AccumulateGrad copies there; so does this."""
    for k, g in enumerate(grads):
        if g is not None and g.is_sparse:
            grads[k] = g.clone()
    return grads


def attach(calls: Sequence[IsolatedCall], policy: Optional[BackwardPolicy] = None,
           name: str = "parallel call",
           phony_device: Optional[torch.device] = None,
           lanes: Optional[int] = None) -> List[List[Tensor]]:
    """Hangs the calls' outputs off one ``_ParallelNode``; returns each call's
    outputs as tensors of the caller's graph.

    Without grad mode, or when no call needs a gradient, the outputs are
    returned as they are. Calls' saved tensors are packed by the caller's
    hooks here, in call order. A phony input that requires grad keeps the node
    in the graph (PyTorch's own ``Function.apply`` drops a node none of whose
    inputs requires grad).
    """
    if not (torch.is_grad_enabled() and any(call.needs_grad for call in calls)):
        outputs = [list(call.outputs) for call in calls]
        for call in calls:
            call.release()
        return outputs
    for call in calls:
        if call.saves is not None:
            call.saves.replay(getattr(call, "name", "call"))
    plan = _Plan(calls, policy, name)
    plan.lanes = lanes
    plan.streams = any(call.streams for call in calls)
    phony = get_phony(phony_device or torch.device("cpu"), requires_grad=True)
    flat_inputs = [t for call in reversed(calls) for t in call.inputs]
    # The nodes save only their release tokens. Identity hooks keep the caller's
    # saved-tensor hooks (offloading, say) from copying one, which would free
    # the calls before backward.
    with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
        tokens: List[Tensor] = []
        if plan.streams:
            # One gradient node per call, made in call order (the engine runs
            # later ones first); their tokens listed last call first.
            made = [_CallGradients.apply(plan, i, *call.inputs) if not plan.constant[i] else None
                    for i, call in enumerate(calls)]
            tokens = [t for t in reversed(made) if t is not None]
            plan.tokens = len(tokens)
        if len(calls) == 1 and any(calls[0].inputs[j]._is_view() for _, j in calls[0].dirty):
            # A view modified in place: autograd's CopySlices sends the view's
            # gradient through the node's first input, which must be the view.
            plan.view_first = 1 + plan.tokens + next(
                j for _, j in calls[0].dirty if calls[0].inputs[j]._is_view())
        flat = _ParallelNode.apply(
            plan, *_node_order(plan, [phony, *tokens, *flat_inputs]))
    result: List[List[Tensor]] = []
    offset = 0
    for meta in plan.output_meta:
        result.append(list(flat[offset:offset + len(meta)]))
        offset += len(meta)
    return result
