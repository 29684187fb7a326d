"""``ModuleCall``: one expert call on an isolated graph, plain or checkpointed.

Lifecycle::

    plain:        forward (grad on, graph kept) -> prepare ........ backward(grads) -> release
    checkpointed: forward (grad on, nothing saved, inputs kept) -> prepare -> recompute (same
                  RNG, forward's autocast and module state; queued on a worker when the
                  outputs get gradients, or on its lane as its backward starts when the
                  batch runs within the cores) -> backward(grads) -> release

The call's tensor inputs are detached leaves (``requires_grad`` kept), so its
graph ends at them and never reaches into the caller's graph. Its record's
``inputs`` (the parallel node's inputs for this call) are the caller's tensors
that require grad followed by its *parameters*: the other leaves its graph
reaches (a checkpointed call's forward builds its graph too, with saved-tensor
hooks that keep nothing, so the expert sees grad mode as in the loop and its
outputs require grad as the loop's), then one copy of a tensor per extra
gradient term its graph gives it (a tensor read on several paths, see
:mod:`moe_autograd.terms`). Backward
computes the gradients with ``torch.autograd.grad`` and returns one per entry
(a split tensor's terms one per slot); the engine accumulates them, so no
``.grad`` is touched here.

Invariants:

* Every call draws its random numbers from its own :class:`~moe_autograd.rng.
  CallRng`, forked on the caller's thread in call order: results depend on the
  seed, never on thread interleaving, and a checkpointed call replays its
  forward's randomness exactly.
* A checkpointed call recomputes under the autocast / inference state of its
  forward (not of the backward's thread), as ``torch.utils.checkpoint`` does.
* A checkpointed call whose recomputed graph reaches a tensor that requires
  grad but is neither an input nor a leaf its forward's graph reached raises,
  naming the call: its gradient would otherwise be lost silently.
* A checkpointed call's parameters changed where autograd does not see it
  (``.data`` writes, which bump no version counter) are caught by a checksum
  (:func:`_checksums`: the sum of each parameter's bit pattern) taken as its
  forward starts and ends and as its recomputation starts. Changed by the
  forward itself (``self.w.data.clamp_(...)``): the recomputation starts
  from the values it finds, so its outputs are compared bit for bit with the
  forward's (kept for that case only) and it raises, naming the call, if
  they differ; the parameters are set back to what the recomputation found
  either way (the loop changes them once). Changed only after the forward:
  it raises (the loop's backward would mix the forward's activations with
  the new values).
* :meth:`ModuleCall.release` drops every tensor the call holds, the caller's
  inputs included.
* The node carries only the result's *roots*: tensors the call's graph made.
  An input returned as is, a parameter or constant, the same tensor twice, a
  view of an input / parameter / output are rebuilt in the caller's graph as
  the loop gives them (:meth:`ModuleCall._plan_outputs`), and a tensor the
  forward left in a plain attribute of its module is a hidden root, rebound
  to the caller's tensor (:mod:`moe_autograd.module_state`).
* A gradient that reaches one of the call's input leaves outside the call's
  own backward raises, naming the call (:func:`_guard_leaves`): the caller's
  graph found the call's through something the node does not carry.
"""
import threading
import weakref
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten as _tree_flatten, tree_unflatten

from .checkpoint import enable_checkpointing, enable_recomputing
from .executor import TaskGroup, get_pool
from .kept import KeptTensors
from .node import Grads, IsolatedCall, replayable_view
from .module_state import ModuleState, may_change, submodules
from .call_streams import Ready, call_streams, cuda_devices, hand_back, record_ready
from .rng import CallRng
from .skip.tracker import SkipTracker, use_skip_tracker
from .stream import use_device
from .terms import ACCUMULATE_GRAD, Edges, TermSplit
from .saved import CallSaves, user_hooks
from .tls import CallerState, bind

__all__ = ["ModuleCall", "Expert", "call_inline", "check_flips", "ForeignGraphError"]

Expert = Callable[..., Any]


def _device_of(module: Expert, leaves: Sequence[Any]) -> torch.device:
    if isinstance(module, nn.Module):
        for p in module.parameters():
            return p.device
    for v in leaves:
        if isinstance(v, Tensor):
            return v.device
    return torch.device("cpu")


_PROBE = torch.empty(0, requires_grad=True)


def _next_sequence_nr() -> Optional[int]:
    """The sequence number the next autograd node made on this thread gets
    (PyTorch numbers nodes per thread); None where no graph is recorded."""
    if torch.is_inference_mode_enabled():
        return None
    with torch.enable_grad():
        node = _PROBE.view(0).grad_fn
    return None if node is None else int(node._sequence_nr()) + 1


class ForeignGraphError(RuntimeError):
    """A call's graph reaches into its caller's graph through a tensor it did
    not receive as an argument."""


def _graph_leaves(outputs: Sequence[Tensor], known: Set[int],
                  made: Optional[Tuple[int, int]] = None, name: str = "call",
                  edges: Optional[Edges] = None,
                  roots: Optional[Dict[Tuple[int, int], int]] = None,
                  consumed: Optional[Set[int]] = None) -> List[Tensor]:
    """Every leaf tensor that requires grad under ``outputs``' graphs, other
    than those whose ``id`` is in ``known``, in a stable order; with
    ``edges``, also every edge into each leaf (see :mod:`moe_autograd.terms`);
    with ``roots`` (``(id(grad_fn), output_nr) -> position``), the positions
    of those the graph consumes (an edge of one of its nodes leads there)
    added to ``consumed`` (see :mod:`moe_autograd.kept`).

    ``made`` is the range of sequence numbers of the nodes the call made (on
    its thread): a non-leaf node outside it belongs to another graph, the
    caller's, which a closure over a non-leaf tensor reaches. Its gradient
    would be computed here, inside the call's backward, where hooks on that
    tensor would see partial gradients: that raises instead.
    """
    seen: Set[Any] = set()
    leaves: List[Tensor] = []
    for o in outputs:  # an output may be a leaf itself (an expert returning a weight)
        if o.grad_fn is None and o.requires_grad and id(o) not in known:
            known.add(id(o))
            leaves.append(o)
    stack: List[Any] = [o.grad_fn for o in reversed(outputs) if o.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            if id(variable) not in known:
                known.add(id(variable))
                leaves.append(variable)
            continue
        if made is not None and not made[0] <= fn._sequence_nr() < made[1]:
            raise ForeignGraphError(
                f"{name}: the expert differentiates into its caller's graph through a tensor "
                f"it did not receive as an argument (a closure over a non-leaf tensor, reached "
                f"at {fn.name()}); pass that tensor as an input of the call")
        next_functions = fn.next_functions
        if roots is not None and consumed is not None:
            for next_fn, nr in next_functions:
                at = roots.get((id(next_fn), nr))
                if at is not None:
                    consumed.add(at)
        if edges is not None:
            for j, (next_fn, _) in enumerate(next_functions):
                if type(next_fn) is ACCUMULATE_GRAD:
                    edges.setdefault(id(next_fn.variable), []).append((fn, j))  # type: ignore[attr-defined]
        stack.extend(next_fn for next_fn, _ in reversed(next_functions))
    return leaves


_PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device,
          torch.Size)


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size)


def tree_flatten(tree: Any) -> Tuple[List[Any], TreeSpec]:
    """``torch.utils._pytree.tree_flatten`` with ``torch.Size`` a leaf: as a
    node it unflattens to a plain tuple (``x.shape`` returned or passed would
    come back without ``numel()``)."""
    return _tree_flatten(tree, is_leaf=_is_size)


def _holds_tensor(value: Any, depth: int = 3) -> bool:
    fields = getattr(value, "__dict__", None)
    if depth and isinstance(fields, dict):
        return any(isinstance(v, Tensor)
                   or (not isinstance(v, _PLAIN) and _holds_tensor(v, depth - 1))
                   for v in tree_flatten(list(fields.values()))[0])
    return False


def _check_leaves(name: str, leaves: Sequence[Any]) -> None:
    """Refuses a result whose tensors hide in objects that are not pytrees
    (a dataclass, a ``SimpleNamespace``): they would leave the call on its
    isolated graph, and their gradients would never reach its inputs."""
    for leaf in leaves:
        if not isinstance(leaf, (Tensor, *_PLAIN)) and _holds_tensor(leaf):
            raise TypeError(
                f"{name}: the expert returned a {type(leaf).__name__} holding tensors; outputs are "
                "followed through pytrees only (tuples, lists, dicts, namedtuples, types "
                "registered with torch.utils._pytree, e.g. register_dataclass): register the "
                "type or return its tensors in a tuple or dict")


def _guard_leaves(call: "ModuleCall") -> None:
    """A hook on each of the call's input leaves that raises when a gradient
    reaches it other than in the call's own backward: the caller's backward
    found the call's graph through something the node does not carry (a
    tensor stashed in a list, a closure, a global), and the loop would have
    given that gradient to the caller's tensor. Never silent."""
    ref = weakref.ref(call)
    name = call.name

    def guard(grad: Tensor) -> None:
        owner = ref()
        if owner is None or not owner._in_backward:
            raise RuntimeError(
                f"{name}: a backward reached this call's graph other than through its outputs "
                "(a tensor the expert left somewhere other than its result or a plain tensor "
                "attribute of its module: a list, a closure, a global); the gradient for the "
                "call's input would be lost. Return that tensor from the expert instead")
    for leaf in call._grad_leaves:
        leaf.register_hook(guard)


def check_flips(calls: Sequence["ModuleCall"]) -> None:
    """Raises where an expert called ``requires_grad_()`` on an input that a
    later call of the batch also received: that call got it as a leaf that
    did not require grad (the calls start together), where the loop's later
    call would see it requiring grad (and, in grad mode, track its use)."""
    for i, call in enumerate(calls):
        for t in call.flipped:
            for later in calls[i + 1:]:
                if any(o is t for o in later._originals or ()):
                    raise RuntimeError(
                        f"{call.name}: the expert called requires_grad_() on an input that "
                        f"{later.name.rsplit(': ', 1)[-1]} also receives; that call started "
                        "before and does not track it (the loop's would): pass the tensor "
                        "requiring grad")


def _run_expert(module: Expert, args: Sequence[Any], kwargs: Mapping[str, Any],
                device: torch.device, name: str) -> Any:
    """One expert call as every mode runs it: on its device, with a skip
    tracker of its own, under a profiler range named after the call."""
    with use_device(device), use_skip_tracker(SkipTracker()), \
            torch.profiler.record_function(name):
        return module(*args, **kwargs)


def call_inline(module: Expert, args: Tuple[Any, ...], kwargs: Mapping[str, Any],
                rng: Optional[CallRng], name: str, index: int = 0,
                ready: Optional[Ready] = None) -> Any:
    """The call as a loop makes it, on this thread and in the caller's graph,
    drawing from ``rng`` (the ``inline`` mode of :mod:`moe_autograd.policy`),
    on CUDA on call ``index``'s streams after ``ready``'s events (those of
    its devices missing there are recorded into it first)."""
    leaves = tree_flatten((args, kwargs))[0]
    device = _device_of(module, leaves)
    devices = cuda_devices(leaves, device)
    if ready is not None and any(d not in ready for d in devices):
        ready.update(record_ready(d for d in devices if d not in ready))
    with call_streams(devices, index, leaves, ready) as pairs, \
            rng.activate() if rng is not None else nullcontext():
        result = _run_expert(module, args, kwargs, device, name)
    if pairs:
        hand_back(pairs, tree_flatten(result)[0])
    return result


def _checksums(params: Sequence[Tensor]) -> Tensor:
    """One int64 per parameter: the sum of its bytes read as 64-bit words
    (and of its last bytes one by one), wrapping: any write that changes a
    value changes it, but for writes that only permute words or cancel out.
    Read as int64 words it runs at memory speed (a float32 read as int32 and
    summed into int64 was measured 14 times slower: not vectorised)."""
    with torch.no_grad():
        if not params:
            return torch.zeros(0, dtype=torch.int64)
        device = params[0].device
        sums = []
        for p in params:
            raw = p.detach().reshape(-1).view(torch.uint8)
            whole = raw.numel() // 8 * 8
            try:
                total = raw[:whole].view(torch.int64).sum()
            except RuntimeError:  # (a storage offset not 8-byte aligned)
                total = raw[:whole].clone().view(torch.int64).sum()
            if whole < raw.numel():
                total = total + raw[whole:].sum(dtype=torch.int64)
            sums.append(total.to(device))
        return torch.stack(sums)


def _drop(t: Tensor) -> None:
    return None


def _saving_nothing(name: str, watch: Optional[Dict[int, Tensor]] = None,
                    seen: Optional[List[Tuple[Tensor, int]]] = None) -> Any:
    """Saved-tensor hooks that keep nothing: a checkpointed call's forward
    runs with grad on, as the loop's, and keeps only its graph's shape. A
    backward through that graph (the expert's own, inside its forward; or the
    caller's, through a tensor the expert left elsewhere than its result and
    its plain tensor attributes) raises, naming the call. Of the tensors in
    ``watch`` (by id: the expert's buffers), those the forward saves go to
    ``seen`` with their version (the loop's saved-tensor check, see
    :meth:`ModuleCall._check_saved_buffers`)."""
    def pack(t: Tensor) -> None:
        if watch is not None and seen is not None and watch.get(id(t)) is t:
            seen.append((t, t._version))
        return None

    def unreachable(packed: None) -> Tensor:
        raise RuntimeError(
            f"{name}: a backward reached the checkpointed call's forward graph (autograd.grad or "
            "backward inside the expert's forward, or a tensor the expert left in a list, a "
            "closure or a global), which keeps nothing for backward: return that tensor from "
            "the expert, or call it with checkpoint=False")
    return torch.autograd.graph.saved_tensors_hooks(pack if watch else _drop, unreachable)


class ModuleCall(IsolatedCall):
    """One call of an expert (module or callable) on an isolated graph."""

    materialize_grads = False  # unused outputs simply get no gradient

    def __init__(self, module: Expert, args: Tuple[Any, ...], kwargs: Mapping[str, Any], *,
                 checkpoint: bool = False, check_finite_grads: bool = False,
                 name: str = "call", index: int = 0,
                 validate: Optional[Callable[["ModuleCall"], None]] = None,
                 state: Optional[CallerState] = None, rng: Optional[CallRng] = None) -> None:
        self.module, self.name, self.index, self.validate = module, name, index, validate
        self.checkpoint = checkpoint and torch.is_grad_enabled()
        self.check_finite_grads = check_finite_grads
        leaves, self._in_spec = tree_flatten((args, kwargs))
        #: The caller's own arguments, for outputs that are inputs; dropped by
        #: :meth:`rebuild`, which runs once per call (even after release: a
        #: node with no outputs is freed at once).
        self._originals: Optional[List[Any]] = leaves
        #: How the result's tensors are rebuilt (None: each is a root, in order).
        self._layout: Optional[List[Tuple[str, int]]] = None
        self._roots: List[Tuple[int, bool]] = []
        self._tensors: Optional[List[Tensor]] = None
        self._visible = 0
        self._in_backward = 0  # its own backward runs (see _guard_leaves)
        #: Versions of a checkpointed call's tensor inputs at its forward.
        self._versions: List[int] = []
        self._n_inputs = 0
        #: A checkpointed call's outputs (the node's, weakly) and their
        #: versions when it returned: one modified in place since must not be
        #: needed by the recomputed graph (see :meth:`_recompute_now`).
        self._out_versions: List[Tuple["weakref.ref[Tensor]", int]] = []
        self._module_state: Optional[ModuleState] = None
        #: A checkpointed call's parameter checksums (forward start, end).
        self._sums: Optional[Tuple[Tensor, Tensor]] = None
        #: Its forward's outputs, kept only if that forward changed its
        #: parameters where autograd does not see it (see the docstring).
        self._forward_values: Optional[List[Tensor]] = None
        self.inputs = [v for v in leaves if isinstance(v, Tensor) and v.requires_grad]
        self._leaves: Optional[List[Any]] = [
            v.detach().requires_grad_(v.requires_grad) if isinstance(v, Tensor) else v
            for v in leaves
        ]
        self._grad_leaves = [v for v in self._leaves if isinstance(v, Tensor) and v.requires_grad]
        self.params: List[Tensor] = []
        self.device = _device_of(module, leaves)
        #: The CUDA devices it works on: it runs on its own streams there,
        #: after the events of its batch's forward (set by the batch) and of
        #: its backward (see :mod:`moe_autograd.call_streams`).
        self.cuda_devices = cuda_devices(leaves, self.device)
        self.ready: Optional[Ready] = None
        self._backward_ready: Optional[Ready] = None
        self.rng = rng if rng is not None else CallRng.fork()
        #: The caller's thread state at the call, also for its recomputation.
        self.state = state
        self.saves = None if (self.checkpoint or state is None) else state.saves()
        #: A checkpointed call's: what its recomputation saves, for the
        #: caller's saved-tensor hooks (see :meth:`recompute_for_hooks`).
        self.recompute_saves = (state.saves() if self.checkpoint and state is not None
                                and user_hooks(state.saved_tensor_hooks) else None)
        self._recomputed_for_hooks = False
        self._lock = threading.Lock()
        self._made: Optional[Tuple[int, int]] = None  # sequence numbers of the nodes it made
        #: Tensors its graph reaches on several edges: their terms go to the
        #: engine one by one (see :mod:`moe_autograd.terms`).
        self._split: Optional[TermSplit] = None
        #: The caller's tensors the expert called ``requires_grad_()`` on.
        self.flipped: List[Tensor] = []
        self._recompute: Optional[TaskGroup[None]] = None
        #: Set when the batch runs within the cores (lanes): the recomputation
        #: runs in the call's backward, on its lane, unless recompute_early
        #: queued it first.
        self.recompute_in_backward = False
        self._local_outputs: Optional[List[Tensor]] = None
        self.outputs: List[Tensor] = []
        self.result: Any = None
        #: The expert's module tree, once walked (see :meth:`order_keys`).
        self._submodules: Optional[List[nn.Module]] = None
        #: The buffers a checkpointed forward saved, with their versions then.
        self._saved_buffers: List[Tuple[Tensor, int]] = []
        #: Positions of the roots its graph consumes, and how they get their
        #: whole gradient (see :mod:`moe_autograd.kept`).
        self._consumed: List[int] = []
        self._kept: Optional[KeptTensors] = None

    def order_keys(self) -> List[int]:
        """The ids of the module objects whose state this call's forward may
        change (:func:`~moe_autograd.module_state.may_change`; the expert
        itself always) and of the parameters and buffers those modules hold
        themselves: calls sharing one run in call order (see
        :func:`moe_autograd.parallel._in_call_order`). None for a call a
        collector starts, or of a plain function."""
        module = self.module
        if self.collector is not None or not isinstance(module, nn.Module):
            return []
        tree = self._submodules = submodules(module)
        changing = [m for m in tree if may_change(m)]
        # The tensors such a module holds itself are keys too: distinct experts
        # that share a parameter or a buffer and may change it in forward run
        # in call order (issue 46); a torch.nn module that only computes (a tied
        # Linear) orders nothing, so experts sharing one still overlap.
        return [id(module), *(id(m) for m in changing if m is not module),
                *(id(t) for m in changing for store in (m._parameters, m._buffers)
                  for t in store.values() if t is not None)]

    # -- forward ---------------------------------------------------------------
    def _call(self) -> Any:
        assert self._leaves is not None
        args, kwargs = tree_unflatten(self._leaves, self._in_spec)
        return _run_expert(self.module, args, kwargs, self.device, self.name)

    def forward(self) -> "ModuleCall":
        """Runs the call on this thread (a worker), on its own CUDA streams
        (see :mod:`moe_autograd.call_streams`); fills ``outputs``."""
        with call_streams(self.cuda_devices, self.index, self._leaves or (), self.ready) as pairs:
            attrs = self._forward()
        if pairs:
            hand_back(pairs, [*self.outputs, *attrs])
        return self

    def _forward(self) -> List[Tensor]:
        module = self.module
        state = (ModuleState(module, self.checkpoint, self._submodules)
                 if isinstance(module, nn.Module) else None)
        if self.checkpoint:
            assert self._leaves is not None
            self._versions = self._input_versions()
            self._n_inputs = len(self._versions)
            constant = [v for v in self._leaves if isinstance(v, Tensor) and not v.requires_grad]
            # Grad on, as in the loop (the expert sees it; its outputs and
            # attributes require grad as the loop's; the graph says which
            # leaves it reaches), but nothing saved: the graph is only looked
            # at, and the recomputation builds the one backward runs.
            first = _next_sequence_nr()
            params = ([(p, p._version) for p in module.parameters()]
                      if isinstance(module, nn.Module) else [])
            watch = ({id(b): b for m in self._submodules or submodules(module)
                      for b in m._buffers.values() if b is not None}
                     if isinstance(module, nn.Module) else {})
            self._saved_buffers = []
            before = _checksums([p for p, _ in params])
            with _saving_nothing(self.name, watch, self._saved_buffers), enable_checkpointing(), \
                    self.rng.activate():
                try:
                    result = self._call()
                except RuntimeError as error:
                    if "leaf Variable that requires grad" not in str(error):
                        raise
                    raise RuntimeError(
                        f"{self.name}: the checkpointed expert modified in place an input that "
                        "requires grad; its recomputation would see other values: clone the "
                        "input first, or call this expert with checkpoint=False") from error
            last = _next_sequence_nr() if first is not None else None
            self._made = None if first is None or last is None else (first, last)
            if any(p._version != version for p, version in params):
                raise RuntimeError(
                    f"{self.name}: the checkpointed expert modified one of its parameters in place "
                    "in its forward; its recomputation would modify it again: call this expert "
                    "with checkpoint=False")
            after = _checksums([p for p, _ in params])
            self._sums = (before, after)
            if any(v.requires_grad for v in constant):
                # The loop tracks such an input from the requires_grad_() on;
                # a recomputation would track it from the start of the call.
                raise RuntimeError(
                    f"{self.name}: the checkpointed expert called requires_grad_() on an input "
                    "that did not require grad; its recomputation cannot reproduce where the "
                    "loop starts tracking it: pass it requiring grad, or call this expert "
                    "with checkpoint=False")
        else:
            # Under no_grad too: an expert may enable grad itself.
            first = _next_sequence_nr()
            with self.rng.activate():
                result = self._call()
            last = _next_sequence_nr() if first is not None else None
            self._made = None if first is None or last is None else (first, last)
        out_leaves, self._out_spec = tree_flatten(result)
        _check_leaves(self.name, out_leaves)
        self._out_leaves = out_leaves
        self.outputs = [v for v in out_leaves if isinstance(v, Tensor)]
        if self._sums is not None and not torch.equal(*self._sums):
            self._forward_values = [o.detach().clone() for o in self.outputs]
        if self.validate is not None:
            self.validate(self)
        attrs = state.compare() if state is not None else []
        # A checkpointed call keeps it whatever its forward did: its
        # recomputation sees the state that forward saw, even if the user
        # changed the module since (attributes, train/eval: issue 46).
        self._module_state = state if state is not None and (attrs or self.checkpoint) else None
        self._plan_outputs(attrs)
        return attrs

    def _plan_outputs(self, attrs: Sequence[Tensor] = ()) -> None:
        """Which of the result's tensors the node must carry (its *roots*),
        and how every other one is rebuilt in the caller's graph as the loop
        would give it: an input returned as is is the caller's tensor itself;
        a tensor of no graph of the call's (a parameter, a constant) passes
        through; the same tensor twice is one object twice; a view of an
        input, of a parameter or of another output is replayed as that view of
        its outer base, so PyTorch's own view and in-place rules apply to it
        (the base of a view of an internal tensor is a hidden root)."""
        assert self._leaves is not None
        self._visible = len(self.outputs)
        tensors = self.outputs + list(attrs)
        inputs = {id(v): j for j, v in enumerate(self._leaves) if isinstance(v, Tensor)}
        known: Dict[int, Tuple[str, int]] = {}  # id(tensor) -> where its outer tensor is
        layout: List[Tuple[str, int]] = []
        roots: List[Tuple[int, bool]] = []  # (position, whether its base is the root)

        def source(t: Tensor, k: int, hidden: bool) -> Tuple[str, int]:
            found = known.get(id(t))
            if found is not None:
                return found
            if id(t) in inputs:
                found = ("input", inputs[id(t)])
            elif t.grad_fn is None:
                found = ("self", k)  # a parameter or a constant: the loop returns it as is
            else:
                found = ("root", len(roots))
                roots.append((k, hidden))
            known[id(t)] = found
            return found

        for k, t in enumerate(tensors):
            base = t._base if replayable_view(t) else None
            if id(t) in known or base is None:
                layout.append(source(t, k, False))
            else:
                where, at = source(base, k, True)
                layout.append(("view-" + where, at))
                known[id(t)] = ("same", k)
        if not attrs and all(kind == "root" for kind, _ in layout) and len(roots) == len(tensors):
            self._layout = None  # the common case
        else:
            self._layout = layout
            self._roots = roots
            self.outputs = self._roots_of(tensors)
        self._tensors = tensors if self._layout is not None else None
        if not self.checkpoint:
            self._local_outputs = self.outputs
        self.non_differentiable = [o for o in self.outputs if not o.requires_grad]

    def _roots_of(self, tensors: Sequence[Tensor]) -> List[Tensor]:
        if self._layout is None:
            return list(tensors)
        roots = []
        for k, hidden in self._roots:
            t = tensors[k]
            base = t._base if hidden else t
            if base is None:
                raise RuntimeError(f"{self.name}: the recomputation returned a tensor that is "
                                   f"not a view where the forward returned a view (output {k})")
            roots.append(base)
        return roots

    def _input_versions(self) -> List[int]:
        """The version counters of the call's tensor inputs (its leaves share
        the caller's tensors' counters) and, once known, of its parameters."""
        assert self._leaves is not None
        inputs = [v._version for v in self._leaves if isinstance(v, Tensor)]
        return inputs + [p._version for p in self.params] if self.params else inputs

    def prepare(self) -> None:
        """On the caller, after the forward: appends the call's parameters to
        its ``inputs`` (the leaves its forward's graph reaches, checkpointed
        or not), and the extra slots of its split terms."""
        self.adopt_requires_grad()
        differentiable = [o for o in self.outputs if o.requires_grad]
        edges: Edges = {}
        roots: Optional[Dict[Tuple[int, int], int]] = None
        consumed: Set[int] = set()
        # The roots' nodes, held for the walk: a node's Python object (so its
        # id) lives only while someone holds it (torch 2.12 and older let it
        # go, and the walk met another object, with another id, for the node)
        held = [(k, o.grad_fn, o.output_nr) for k, o in enumerate(self.outputs)
                if o.requires_grad and o.grad_fn is not None]
        if len(differentiable) > 1:  # one root cannot lead to another
            roots = {(id(fn), nr): k for k, fn, nr in held}
        self.params = _graph_leaves(differentiable, set(map(id, self._grad_leaves)),
                                    self._made, self.name, edges, roots, consumed)
        del held
        self._consumed = sorted(consumed)
        self._split = TermSplit.of(self.inputs + self.params, self._grad_leaves + self.params,
                                   edges)
        if self.checkpoint:
            self._versions += [p._version for p in self.params]
        self.inputs = self.inputs + self.params
        if self._split is not None:
            self.inputs += self._split.extras
        _guard_leaves(self)

    def adopt_requires_grad(self) -> None:
        """An expert that called ``requires_grad_()`` on one of its inputs
        made the caller's tensor require grad in the loop: so here too."""
        leaves, originals = self._leaves, self._originals
        if leaves is None or originals is None or not any(
                isinstance(v, Tensor) and v.requires_grad and not o.requires_grad
                for v, o in zip(leaves, originals)):
            return
        pairs = [(o, v) for o, v in zip(originals, leaves)
                 if isinstance(v, Tensor) and v.requires_grad]
        self.flipped = [o for o, _ in pairs if not o.requires_grad]
        for o in self.flipped:
            o.requires_grad_()
        self.inputs = [o for o, _ in pairs]
        self._grad_leaves = [v for _, v in pairs]

    @property
    def needs_grad(self) -> bool:
        # Not the caller's grad mode: an expert may enable grad itself.
        return any(o.requires_grad for o in self.outputs)

    @property
    def streams(self) -> bool:
        return bool(self.params)

    def rebuild(self, outer_outputs: Sequence[Tensor]) -> Any:
        """The call's result with ``outer_outputs`` (the node's, one per root)
        in place of its tensors (see :meth:`_plan_outputs`)."""
        if self.checkpoint:
            self._out_versions = [(weakref.ref(o), o._version) for o in outer_outputs]
        if self._layout is None:
            self._originals = None
            self._follow(outer_outputs)
            it = iter(outer_outputs)
            leaves = [next(it) if isinstance(v, Tensor) else v for v in self._out_leaves]
            return tree_unflatten(leaves, self._out_spec)
        tensors = self._tensors
        originals = self._originals
        assert tensors is not None and originals is not None
        self._tensors = self._originals = None  # the result holds what it needs
        outer: List[Tensor] = []
        for k, (kind, at) in enumerate(self._layout):
            if kind == "root":
                value = outer_outputs[at]
            elif kind == "input":
                value = originals[at]
            elif kind == "self":
                value = tensors[at]
            elif kind == "same":
                value = outer[at]
            else:  # a view, replayed on its outer base
                base_kind = kind[len("view-"):]
                base = (outer_outputs[at] if base_kind == "root" else originals[at]
                        if base_kind == "input" else tensors[k]._base)
                value = tensors[k]._view_func(base)  # type: ignore[attr-defined]
            outer.append(value)
        visible = self._visible
        if self._module_state is not None:
            self._module_state.rebind(tensors[visible:], outer[visible:])
        self._follow(outer_outputs)
        it = iter(outer[:visible])
        leaves = [next(it) if isinstance(v, Tensor) else v for v in self._out_leaves]
        return tree_unflatten(leaves, self._out_spec)

    def _follow(self, outer_outputs: Sequence[Tensor]) -> None:
        """The roots the call's graph consumes get their whole gradient
        (see :mod:`moe_autograd.kept`); a root the expert called
        ``retain_grad()`` on and that nothing in the call consumes: its outer
        tensor retains its gradient (the node's gradient for it is the loop's
        whole gradient)."""
        consumed = set(self._consumed)
        for at, inner in enumerate(self.outputs):
            if (at not in consumed and inner.retains_grad
                    and outer_outputs[at].requires_grad and not outer_outputs[at].is_leaf):
                outer_outputs[at].retain_grad()
        if not consumed:
            return
        kept = KeptTensors(self.name)
        layout = self._layout
        for at in self._consumed:
            outer = outer_outputs[at]
            if not outer.requires_grad:
                continue
            k = at if layout is None else layout.index(("root", at))
            state = self._module_state
            name = (f"output {k}" if k < self._visible or state is None else
                    f"the tensor the expert kept in {state.set_attrs[k - self._visible][1]!r}")
            kept.add(outer, at, name, self.outputs[at].retains_grad)
        self._kept = kept if kept.items else None

    # -- recomputation ---------------------------------------------------------
    def _recompute_now(self) -> None:
        rng = self.rng
        # A forward that drew no random number replays without the RNG routing:
        # the same ops draw nothing again.
        versions = self._input_versions()
        if versions != self._versions:
            what = ("an input" if versions[:self._n_inputs] != self._versions[:self._n_inputs]
                    else "a parameter (an optimizer step before the backward?)")
            raise RuntimeError(
                f"{self.name}: {what} of the checkpointed call was modified in place after the "
                "call; its recomputation would see other values (as a tensor autograd saved "
                "for backward, it must not change before the backward)")
        params: List[Tensor] = (list(self.module.parameters())
                                if isinstance(self.module, nn.Module) else [])
        held = self._check_sums(params)
        state = self._module_state
        try:
            with call_streams(self.cuda_devices, self.index, ready=self.ready), \
                    torch.enable_grad(), enable_recomputing(), \
                    state.replayed() if state is not None else nullcontext(), \
                    rng.activate() if rng.drew is not False else nullcontext():
                result = self._call()
                attrs = state.attrs() if state is not None else []
        finally:
            if held is not None:
                with torch.no_grad():
                    for p, value in zip(params, held):
                        p.data.copy_(value)  # as the forward left them: the loop's
        if held is not None:
            self._check_replayed(result)
        outputs = self._roots_of([v for v in tree_flatten(result)[0] if isinstance(v, Tensor)]
                                 + attrs)
        for k in self._modified_outputs():
            # The caller modified this output in place since the call: so is
            # its recomputed twin, for autograd's own check (a node of the
            # recomputed graph that saved it raises in backward, as the
            # loop's, and only where the backward runs through that node).
            torch.autograd.graph.increment_version(outputs[k])
        known = set(map(id, self._grad_leaves)) | set(map(id, self.params))
        # Empty leaves (the phonies that order nodes, a remote call's say)
        # carry no gradient to lose.
        edges: Edges = {}
        stray = [t for t in _graph_leaves([o for o in outputs if o.requires_grad], known,
                                          edges=edges if self._split is not None else None)
                 if t.numel()]
        if stray:
            raise RuntimeError(
                f"{self.name}: the checkpointed call's recomputation differentiates into "
                f"{len(stray)} tensor(s) that its forward did not reach (neither its inputs "
                "nor leaves of its forward's graph): the expert is not deterministic given "
                "its inputs, module state and random stream, so it cannot be recomputed")
        if self._split is not None:
            self._split.rebind(self._grad_leaves + self.params, edges)
        self._local_outputs = outputs

    def _check_sums(self, params: List[Tensor]) -> Optional[List[Tensor]]:
        """Before the recomputation (see the module docstring): ``None`` if
        its parameters are as its forward found and left them; a copy of
        them if its forward changed them where autograd does not see it (its
        recomputation is then checked against its outputs); raises if only
        something after the forward did."""
        if self._sums is None:
            return None
        before, after = self._sums
        now = _checksums(params)
        if torch.equal(now, after) and torch.equal(before, after):
            return None
        if self._forward_values is None:
            raise RuntimeError(
                f"{self.name}: a parameter of the checkpointed call was changed after the call "
                "where autograd does not see it (through .data or a detached alias); its "
                "recomputation would see other values than its forward: change it before "
                "the forward or after the backward, or call this expert with checkpoint=False")
        return [p.detach().clone() for p in params]

    def _check_replayed(self, result: Any) -> None:
        expected = self._forward_values
        assert expected is not None
        got = [v for v in tree_flatten(result)[0] if isinstance(v, Tensor)]
        if len(got) != len(expected) or not all(
                a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.detach(), b)
                for a, b in zip(got, expected)):
            raise RuntimeError(
                f"{self.name}: the checkpointed expert changed its parameters in its forward "
                "where autograd does not see it (through .data or a detached alias), and its "
                "recomputation, which starts from the changed values, computes other outputs "
                "than the forward: call this expert with checkpoint=False (or change the "
                "parameters before using them, so that a second change is a no-op)")

    def _modified_outputs(self) -> List[int]:
        """Positions of the outputs modified in place since the call returned."""
        return [k for k, (ref, version) in enumerate(self._out_versions)
                if (o := ref()) is not None and o._version != version]

    def start_recompute(self) -> None:
        """Queues the recomputation on a worker unless it is queued already."""
        if not self.checkpoint:
            return
        with self._lock:
            if self._recompute is not None or self._leaves is None:
                return
            # The forward's thread state (autocast...), without saved-tensor
            # hooks: the recomputed graph is used at once.
            # A forward in the default state recomputes in it too, whatever
            # the thread that runs the recomputation is in (the engine's,
            # inside the caller's autocast, say).
            state = self.state if self.state is not None else CallerState.plain()
            self._recompute = get_pool().submit([bind(state, self._recompute_now,
                                                      self.recompute_saves)])

    def _wait_recompute(self) -> None:
        if self._recomputed_for_hooks:  # this backward's, done by recompute_for_hooks
            self._recomputed_for_hooks = False
            return
        if self.recompute_in_backward and self._recompute is None and self._leaves is not None:
            # Its batch runs within the cores: recompute here, on the lane
            # that runs this call's backward, rather than on another worker.
            state = self.state if self.state is not None else CallerState.plain()
            bind(state, self._recompute_now, self.recompute_saves)()
            return
        self.start_recompute()
        group = self._recompute
        assert group is not None
        group.wait()  # runs it here if no worker took it yet
        if group.errors[0] is not None:
            raise group.errors[0]

    def recompute_for_hooks(self) -> Optional[CallSaves]:
        """For a checkpointed call made under the caller's saved-tensor hooks,
        on the engine's thread before the call's backward: recomputes (on a
        worker, or here), then has the caller's ``pack`` see every tensor the
        recomputation saved, in the order saved, and ``unpack`` it for the
        backward (:mod:`.saved`): the hooks see what the call saves, as they
        do without checkpointing (issue 46), and run on this thread only.
        Returns the record (its unpacked values go after the backward)."""
        saves = self.recompute_saves
        if saves is None or self._leaves is None:
            return None
        self._wait_recompute()
        self._recomputed_for_hooks = True
        saves.replay(self.name)
        return saves

    # -- backward --------------------------------------------------------------
    @property
    def hands_gradients(self) -> bool:
        return self._kept is not None

    def backward_starts(self) -> None:
        if self.cuda_devices:
            self._backward_ready = record_ready(self.cuda_devices)
        if self._kept is not None:
            self._kept.started()

    def backward(self, grad_outputs: Grads) -> Grads:
        if self._leaves is None:
            raise RuntimeError(f"{self.name}: backward after its graph was freed")
        self._in_backward += 1
        try:
            # On its own CUDA streams, those of its forward (where the engine
            # runs its graph's backward ops anyway).
            with call_streams(self.cuda_devices, self.index, grad_outputs,
                              self._backward_ready) as pairs:
                grads = self._backward(grad_outputs)
            if pairs:
                hand_back(pairs, grads)
            return grads
        finally:
            self._in_backward -= 1

    def _check_saved_buffers(self) -> None:
        """A checkpointed call's forward saved these buffers (BatchNorm's
        running statistics in eval mode, say): one modified in place since
        fails the backward, as the loop's saved-tensor check does (the
        recomputation would read the forward's copy and compute)."""
        for buffer, version in self._saved_buffers:
            if buffer._version != version:
                raise RuntimeError(
                    f"{self.name}: one of the variables needed for gradient computation has "
                    f"been modified by an inplace operation: a buffer of the expert "
                    f"({list(buffer.shape)}, version {buffer._version}; expected version "
                    f"{version}) that the checkpointed call's forward saved for backward was "
                    f"modified after the call, as in the loop")

    def _backward(self, grad_outputs: Grads) -> Grads:
        if self.checkpoint:
            self._check_saved_buffers()
            self._wait_recompute()
        outputs = self._local_outputs
        assert outputs is not None
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if g is not None and o.requires_grad]
        if not pairs:
            return [None] * len(self.inputs)
        targets = self._grad_leaves + self.params
        # A parameter whose requires_grad the user turned off since the forward
        # gets no gradient, as in the loop (its graph no longer accumulates it).
        live = [k for k, t in enumerate(targets) if t.requires_grad]
        follow = self._kept.roots if self._kept is not None else []
        split = self._split
        try:
            with split.capture() if split is not None else nullcontext():
                found = torch.autograd.grad([p[0] for p in pairs],
                                            [targets[k] for k in live]
                                            + [outputs[r] for r in follow],
                                            [p[1] for p in pairs],
                                            retain_graph=self.retain_graph,
                                            allow_unused=True)
            if follow:
                # Handed here, as the call's backward ends: the engine may never
                # take its input gradients (backward(inputs=...) naming no tensor
                # of this call's but one it computes further from).
                self._kept.hand(list(found[len(live):]))  # type: ignore[union-attr]
            computed: List[Optional[Tensor]] = [None] * len(targets)
            for k, grad in zip(live, found):
                computed[k] = grad
        except RuntimeError as error:
            if "use_reentrant" not in str(error):
                raise
            raise RuntimeError(
                f"{self.name}: the expert uses torch.utils.checkpoint(use_reentrant=True), which "
                "cannot run inside a parallel call's backward (each call's backward is a "
                "torch.autograd.grad); use use_reentrant=False, or parallel_apply(..., "
                "checkpoint=True)") from error
        if self.check_finite_grads:
            for g in computed:
                if g is not None and not bool(torch.isfinite(g).all()):
                    raise FloatingPointError(f"{self.name}: non-finite gradient")
        return list(computed) if split is None else split.apply(list(computed))

    def release(self) -> None:
        # A checkpointed call outlives release (its outputs' tag and the
        # Recompute node reference it): drop the caller's tensors too.
        self.inputs = []
        self.params = []
        self.outputs = []
        self._grad_leaves = []
        self._saved_buffers = []
        self._leaves = None
        self._local_outputs = None
        self._recompute = None
        self._split = None
        self.state = None
        if self.recompute_saves is not None:
            self.recompute_saves.release()
        self._kept = None
