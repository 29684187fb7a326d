"""Runs one oracle case on one side (the runtime, or the reference loop) and
records everything observable; compares two such records.

:func:`execute` builds the case's experts and inputs from the case's seed
(the same on both sides), makes the batch of calls the way the caller pattern
says (grad mode, autocast, a checkpoint frame...), then does what the caller
does after (in-place ops, hooks, ``backward`` / ``autograd.grad``, optimizer
steps, more iterations), appending :class:`Log` entries as it goes: output
values (bitwise) and metadata, aliasing relations, module buffers and tensor
attributes, the global RNG state, every ``.grad``, hook logs, exceptions.
:func:`compare` walks two logs side by side and returns the first
divergence, or ``None``.

The reference side runs ``[m(*args) for m, args in zip(modules, inputs)]``;
when an expert draws random numbers, each call inside its own
``CallRng.fork_many(n)`` stream (as ``moe_autograd.parallel._inline``), the
documented per-call-stream semantics.

Replay a failure: ``pytest tests/oracle --fuzz-seed=S --fuzz-case=K``, or
``python tests/oracle/oracle_triage.py --seed S --case K`` for the full
record of both sides.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import re
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import Tensor, nn

from moe_autograd import map_with_parallel_backward, parallel_apply
from moe_autograd.rng import CallRng

from oracle_cases import Case
from oracle_experts import (GRAPH_KEPT, INTERRUPTS, ROWS, STAGES, VOCAB, WIDTH, Drift, Expert,
                            InnerCheckpoint, InputInPlace, Interrupt, Keep, Mark, Nested,
                            RaiseAny, RaiseBackward, RaiseForward, Tagged, Task, Teacher,
                            Threads, structure, tensor_leaves)
from oracle_functions import FUNCTIONS

RUNTIME, LOOP = "runtime", "loop"
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
_CALL_NAMED = re.compile(r"call \d+ of \d+")
#: The node's refusal to be differentiated twice (``torch.autograd.functional.jvp``,
#: ``hvp``: double backward through the batch's gradients): it names the batch
#: (``parallel_apply: ...``), not a call, and is the contract there.
_DOUBLE_BACKWARD = re.compile(
    r"trying to differentiate twice a function that was marked with @once_differentiable: "
    r"the gradients of a parallel call")
#: What the harness records as a step's error: every Exception, and the
#: BaseExceptions the oracle's experts raise (never KeyboardInterrupt, nor
#: pytest's own outcomes, such as a timeout's failure).
_RECORDED = (Exception, Interrupt, SystemExit)


# -- fingerprints ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class TensorFP:
    """What is observable of a tensor at one moment; equality is bitwise
    (metadata, then the raw bytes: NaN equals the same NaN)."""
    meta: Tuple[Any, ...]
    data: Tensor  # uint8 bytes (dense), or coalesced indices' + values' bytes (sparse)
    shown: Tensor  # the values, for messages only

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TensorFP) and self.meta == other.meta
                and torch.equal(self.data, other.data))

    def __repr__(self) -> str:
        return f"Tensor{self.meta} {self.shown.flatten()[:8].tolist()}"


def _safe(read: Callable[[], Any]) -> Any:
    """``read()``, or the error it raises (autograd metadata of a view whose
    base was modified in place in another grad mode raises)."""
    try:
        return read()
    except RuntimeError as error:
        # Autograd's message names the node that made a view: the runtime's
        # is its parallel node, the loop's the Function (a documented difference).
        message = re.sub(r"^(Output [0-9]+ of )[A-Za-z_0-9]+", r"\1<node>", str(error))
        return f"raises {message[:40]}"


def _bytes(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def fp(t: Optional[Tensor]) -> Optional[TensorFP]:
    """The fingerprint of ``t`` (None stays None)."""
    if t is None:
        return None
    meta = (str(t.dtype), tuple(t.shape), _safe(lambda: t.requires_grad),
            _safe(lambda: t.grad_fn is None), _safe(lambda: t.is_leaf), str(t.layout),
            t.is_inference())
    if t.is_sparse:
        c = t.detach().coalesce()
        return TensorFP(meta, torch.cat([_bytes(c.indices()), _bytes(c.values())]),
                        c.values().clone())
    return TensorFP(meta + (tuple(t.stride()),), _bytes(t), t.detach().clone())


@dataclasses.dataclass(frozen=True)
class Raised:
    """A step that raised."""
    type_name: str
    text: str  # message, notes and causes

    @property
    def names_call(self) -> bool:
        """A clear error: it names the call, or is the node's refusal of a
        double backward (naming the batch)."""
        return bool(_CALL_NAMED.search(self.text) or _DOUBLE_BACKWARD.search(self.text))

    @property
    def runtime_own(self) -> bool:
        """The runtime's own error (its message, not a note, names the call)."""
        first = self.text.split(" | ", 1)[0]
        return bool(_CALL_NAMED.search(first) or _DOUBLE_BACKWARD.search(first))

    def __eq__(self, other: object) -> bool:  # the comparator looks at the details
        return isinstance(other, Raised) and self.type_name == other.type_name

    def __repr__(self) -> str:
        return f"{self.type_name}: {self.text[:300]!r}"


def raised(error: BaseException) -> Raised:
    parts: List[str] = []
    e: Optional[BaseException] = error
    while e is not None and len(parts) < 6:
        parts.append(str(e))
        parts.extend(getattr(e, "__notes__", ()))
        e = e.__cause__ or e.__context__
    return Raised(type(error).__name__, " | ".join(parts))


OK = "ok"


class Log:
    """The record of one side: ``(key, value)`` entries in execution order."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.entries: List[Tuple[str, Any]] = []
        self.hooks: Dict[str, List[Any]] = {}

    def add(self, key: str, value: Any) -> None:
        self.entries.append((key, value))

    def hook(self, name: str, value: Any) -> None:
        self.hooks.setdefault(name, []).append(value)

    def dump(self) -> str:
        return "\n".join(f"{k}: {v!r}" for k, v in self.entries)


# -- building a case -------------------------------------------------------------------

Runner = Callable[..., List[Any]]


@dataclasses.dataclass
class World:
    """One side's experts, inputs and caller-side objects."""
    case: Case
    side: str
    modules: List[Expert]  # per call (a shared module appears several times)
    unique: nn.ModuleList
    args: List[Tuple[Any, ...]]
    kwargs: List[Dict[str, Any]]
    leaves: List[Tuple[str, Tensor]]  # the caller's tensors whose .grad is observable
    run_batch: Runner
    optimizer: Optional[torch.optim.Optimizer] = None
    #: What the map cases' Functions record (needs_input_grad, None gradients).
    fn_log: List[Tuple[Any, ...]] = dataclasses.field(default_factory=list)
    #: The outputs' types per iteration (the ``subclass`` construct), logged
    #: last so that a known type difference hides no other divergence.
    types: List[List[str]] = dataclasses.field(default_factory=list)


def reference_runner(draws: bool) -> Runner:
    """The plain loop; with ``draws``, each call in its own forked stream."""
    def run(modules: Sequence[nn.Module], inputs: Sequence[Any],
            kwargs: Optional[Sequence[Dict[str, Any]]] = None) -> List[Any]:
        args = [a if isinstance(a, tuple) else (a,) for a in inputs]
        kws = list(kwargs) if kwargs is not None else [{} for _ in modules]
        if not draws:
            return [m(*a, **k) for m, a, k in zip(modules, args, kws)]
        rngs = CallRng.fork_many(len(modules))
        results = []
        for m, a, k, rng in zip(modules, args, kws, rngs):
            with rng.activate():
                results.append(m(*a, **k))
        return results
    return run


def runtime_runner(case: Case, nested: bool = False) -> Runner:
    def run(modules: Sequence[nn.Module], inputs: Sequence[Any],
            kwargs: Optional[Sequence[Dict[str, Any]]] = None) -> List[Any]:
        return parallel_apply(modules, inputs, kwargs,
                              checkpoint=False if nested else case.checkpoint, mode=case.mode)
    return run


def map_runner(case: Case, side: str, log: List[Tuple[Any, ...]]) -> Runner:
    """The map cases' batch: ``F(x_i, w_i, 0.5, log)`` per call, ``w_i`` the
    call's module's ``gain``."""
    func = FUNCTIONS[case.function or ""]

    def run(modules: Sequence[nn.Module], inputs: Sequence[Any],
            kwargs: Optional[Sequence[Dict[str, Any]]] = None) -> List[Any]:
        args = [(a[0], m.gain, 0.5, log) for m, a in zip(modules, inputs)]
        if side == RUNTIME:
            return list(map_with_parallel_backward(func, *args, mode=case.mode))
        rngs: List[Any] = (CallRng.fork_many(len(args)) if case.draws
                           else [None] * len(args))
        results = []
        for a, rng in zip(args, rngs):
            with rng.activate() if rng is not None else contextlib.nullcontext():
                out = func.apply(*a)
            results.append(out if isinstance(out, tuple) else (out,))
        return results
    return run


def build(case: Case, side: str) -> World:
    """The case's experts and inputs, the same on both sides."""
    dtype = _DTYPES[case.dtype]
    torch.manual_seed(case.seed)
    modules: List[Any] = []  # Expert, per call
    unique = nn.ModuleList()
    for spec in case.calls:
        if spec.share_with is not None:
            modules.append(modules[spec.share_with])
            continue
        expert = Expert(spec.stages, spec.output).to(dtype)
        modules.append(expert)
        unique.append(expert)
    if case.shared_stage is not None:
        # one stateful stage module object in every distinct expert
        name, position = case.shared_stage
        shared = STAGES[name]().to(dtype)
        for expert in unique:
            if position < 0:
                expert.stages.append(shared)
            else:
                expert.stages.insert(position, shared)
    _tie(unique)
    if case.tied:
        first: Any = unique[0]
        for other in unique[1:]:
            other.gain = first.gain  # one Parameter in several experts
    nested_runner = (runtime_runner(case, nested=True) if side == RUNTIME
                     else reference_runner(case.draws))
    for sub in unique.modules():
        if isinstance(sub, Nested):
            sub.runner = nested_runner
    for spec, m in zip(case.calls, modules):
        for stage in m.modules():
            if isinstance(stage, InnerCheckpoint):
                # Not where an input is changed after the block: the loop's
                # torch.utils.checkpoint saved it (the plain block may have
                # saved a cast of it), so the loop raises there, as the
                # runtime: an expert's requires_grad_() (its recomputation
                # saves other tensors), an in-place op on an input.
                # Nor under the caller's lossy pack hooks (the block's frame
                # keeps its saves from them; the plain block's are packed) or
                # disable_saved_tensors_hooks (the frame's hooks raise, the
                # plain block registers none), nor where the caller calls
                # eval() before backward (the frame recomputes in eval mode:
                # torch.utils.checkpoint's semantics, in the loop too).
                stage.transparent = (
                    side != RUNTIME and not stage.reentrant and "in_add_" not in case.post_ops
                    and case.caller_ctx not in ("saved_hooks", "disable_saved_hooks")
                    and "eval" not in case.between
                    and not any({"requires_grad_", "input_inplace"} & set(other.stages)
                                for other in case.calls))
            if isinstance(stage, Threads):
                stage.record_backward = case.grad_method == "backward" and case.transform is None
            if isinstance(stage, InputInPlace):  # where the loop can do it
                stage.active = all(s.x_kind != "leaf_rg" for j, s in enumerate(case.calls)
                                   if modules[j] is m)
    g = torch.Generator().manual_seed(case.seed ^ 0x5EED)
    args: List[Tuple[Any, ...]] = []
    kwargs: List[Dict[str, Any]] = []
    leaves: List[Tuple[str, Tensor]] = []
    xs: List[Tensor] = []
    for i, spec in enumerate(case.calls):
        base = torch.randn(ROWS, WIDTH, generator=g).to(dtype)
        if case.subclass:
            base = base.as_subclass(Tagged)
        if spec.same_input_as is not None:
            x = xs[spec.same_input_as]
        elif spec.x_kind == "leaf_rg":
            x = base.requires_grad_()
            leaves.append((f"x{i}", x))
        elif spec.x_kind == "leaf":
            x = base
            leaves.append((f"x{i}", x))  # requires_grad_() inside an expert may flip it
        else:
            root = base.requires_grad_()
            leaves.append((f"root{i}", root))
            x = root * 1.5
        xs.append(x)
        idx = torch.randint(0, VOCAB, (ROWS,), generator=g)
        mask = torch.rand(ROWS, WIDTH, generator=g) > 0.3
        call_args: Tuple[Any, ...] = (x,)
        kw: Dict[str, Any] = {}
        if spec.extra == "idx":
            call_args = (x, idx)
        elif spec.extra == "mask":
            call_args = (x, None, mask)
        elif spec.extra == "scale":
            kw = {"scale": 0.5}
        args.append(call_args)
        kwargs.append(kw)
    run_batch = runtime_runner(case) if side == RUNTIME else reference_runner(case.draws)
    world = World(case, side, modules, unique, args, kwargs, leaves, run_batch)
    if case.function is not None:
        world.run_batch = map_runner(case, side, world.fn_log)
    params = list(unique.parameters())
    if case.optimizer == "sgd":
        world.optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    elif case.optimizer == "adamw":
        world.optimizer = torch.optim.AdamW(params, lr=0.01)
    return world


def _tie(unique: nn.ModuleList) -> None:
    """One tensor for all the ``drift_*`` stages of a kind, one teacher
    Linear for all the ``teacher`` stages, across the distinct experts (the
    first expert's; issue 46)."""
    drifts: Dict[str, Drift] = {}
    teacher: Optional[Teacher] = None
    for expert in unique:
        for stage in expert.stages:  # type: ignore[union-attr]
            if isinstance(stage, Drift):
                first = drifts.setdefault(stage.kind, stage)
                if first is not stage:
                    stage.shared = first.shared  # (a buffer, or a Parameter, as first's)
            elif isinstance(stage, Teacher):
                if teacher is None:
                    teacher = stage
                else:
                    stage.teacher = teacher.teacher


# -- observing --------------------------------------------------------------------------

def module_state(world: World) -> Dict[str, Any]:
    """Parameters' values, buffers, tensor attributes and counters of every module."""
    state: Dict[str, Any] = {}
    for name, m in world.unique.named_modules():
        for bname, b in m.named_buffers(recurse=False):
            state[f"{name}.{bname}"] = fp(b)
        for pname, p in m.named_parameters(recurse=False):
            state[f"{name}.{pname}"] = fp(p.detach())
        for attr, value in vars(m).items():
            if attr.startswith("_") or attr in ("training",):
                continue
            if isinstance(value, Tensor):
                state[f"{name}.{attr}"] = fp(value)
            elif attr in ("aux", "last") and value is None:
                state[f"{name}.{attr}"] = None
            elif attr in ("calls_seen", "step", "task"):
                state[f"{name}.{attr}"] = value
            elif attr in ("seen", "threads_seen"):
                state[f"{name}.{attr}"] = sorted(map(repr, value))
    return state


def kept(world: World) -> List[Tuple[str, Tensor]]:
    """The tensors the experts kept (``self.keep``, stage ``keep``) that require grad."""
    return [(f"{name}.keep", m.keep) for name, m in world.unique.named_modules()
            if isinstance(m, Keep) and isinstance(m.keep, Tensor) and m.keep.requires_grad]


def kept_grads(world: World) -> Dict[str, Any]:
    """Whether each kept tensor retains its gradient, and its ``.grad``
    (filled by retain_grad() or backward(inputs=...); reading it where it is
    not a leaf and does not retain warns)."""
    def read(t: Tensor) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (t.retains_grad, fp(t.grad))
    return {name: _safe(lambda t=t: read(t)) for name, t in kept(world)}


def grads(world: World) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, p in world.unique.named_parameters():
        out[f"p:{name}"] = fp(p.grad)
    for name, t in world.leaves:
        out[name] = (t.requires_grad, fp(t.grad))
    return out


def _items(world: World, results: Sequence[Any]) -> List[Tuple[str, Tensor]]:
    items: List[Tuple[str, Tensor]] = []
    for i, a in enumerate(world.args):
        items.extend((f"in{i}.{k}", t) for k, t in enumerate(a) if isinstance(t, Tensor))
    items.extend(world.leaves)
    items.extend((f"p:{n}", p) for n, p in world.unique.named_parameters())
    for i, r in enumerate(results):
        items.extend((f"out{i}.{k}", t) for k, t in enumerate(tensor_leaves(r)))
    return items


def relations(world: World, results: Sequence[Any]) -> Dict[str, Tuple[Any, ...]]:
    """For each output: which earlier object it is, whose autograd view it
    is, and whose memory it shares (by label)."""
    items = _items(world, results)
    rel: Dict[str, Tuple[Any, ...]] = {}
    for pos, (label, t) in enumerate(items):
        if not label.startswith("out"):
            continue
        same = next((l for l, u in items[:pos] if u is t), None)
        base = t._base
        view_of = None
        if base is not None:
            view_of = next((l for l, u in items if u is base or u._base is base), "elsewhere")
        shares = None
        if t.numel() and t.layout == torch.strided:
            ptr = t.untyped_storage().data_ptr()
            shares = next((l for l, u in items[:pos] if u.layout == torch.strided and u.numel()
                           and u.untyped_storage().data_ptr() == ptr), None)
        rel[label] = (same, view_of, shares)
    return rel


def _version(t: Tensor) -> int:
    return -1 if t.is_inference() else t._version  # inference tensors have none


def versions(world: World, results: Sequence[Any]) -> Dict[str, int]:
    return {label: _version(t) for label, t in _items(world, results)
            if not label.startswith("p:")}


def _delta(after: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
    return {k: v - before[k] for k, v in after.items() if k in before}


# -- running ----------------------------------------------------------------------------

def _grad_context(case: Case) -> contextlib.AbstractContextManager:
    if case.grad_mode == "no_grad":
        return torch.no_grad()
    if case.grad_mode == "inference":
        return torch.inference_mode()
    return contextlib.nullcontext()


def _forward(world: World, case: Case) -> Tuple[List[Any], Optional[Tensor]]:
    """The batch as the caller makes it: returns the per-call results and the
    caller's own use of a weight under autocast (or None)."""
    pre: Optional[Tensor] = None
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if case.frame == "autocast"
                else contextlib.nullcontext())
    with autocast:
        if case.pre_autocast_use:
            fl = world.modules[0].first_linear()
            if fl is not None:
                x0 = world.args[0][0]
                pre = F.linear(x0, fl.weight)
        if case.frame not in ("ckpt_nonreentrant", "ckpt_reentrant"):
            return world.run_batch(world.modules, world.args, world.kwargs), pre
    # A checkpoint frame around the call: its function returns the tensors flat.
    flat = [t for a in world.args for t in a if isinstance(t, Tensor)]
    counts: List[int] = []

    def fn(*tensors: Tensor) -> Tuple[Tensor, ...]:
        it = iter(tensors)
        args = [tuple(next(it) if isinstance(t, Tensor) else t for t in a) for a in world.args]
        results = world.run_batch(world.modules, args, world.kwargs)
        leaves = [tensor_leaves(r) for r in results]
        counts[:] = [len(l) for l in leaves]
        return tuple(t for l in leaves for t in l)

    out = tuc.checkpoint(fn, *flat, use_reentrant=case.frame == "ckpt_reentrant")
    results: List[Any] = []
    k = 0
    for c in counts:
        results.append(tuple(out[k:k + c]))
        k += c
    return results, pre


def _terms(world: World, results: Sequence[Any], pre: Optional[Tensor]) -> List[Tensor]:
    """The loss's terms: each output's weighted sum, ``self.aux``, what the
    experts kept (where the caller uses it), the caller's own autocast use."""
    terms: List[Tensor] = []
    for r in results:
        for t in tensor_leaves(r):
            if t.requires_grad and t.is_floating_point():
                w = (torch.arange(t.numel()) % 5 * 0.25 + 0.5).reshape(t.shape).to(t.dtype)
                terms.append((t * w).sum().double())
    for m in world.unique:
        if isinstance(m.aux, Tensor) and m.aux.requires_grad:
            terms.append(m.aux.double())
    if world.case.keep_in_loss:
        terms.extend((t.double() * 0.75).sum() for _, t in kept(world))
    if pre is not None and pre.requires_grad:
        terms.append(pre.double().sum())
    return terms


def _loss(world: World, results: Sequence[Any], pre: Optional[Tensor]) -> Optional[Tensor]:
    terms = _terms(world, results, pre)
    if not terms:
        return None
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


class _Stop(Exception):
    """Ends a side's run after a step raised (recorded in the log)."""


def _step(log: Log, key: str, fn: Callable[[], Any], fatal: bool = True) -> Any:
    try:
        value = fn()
    except _Stop:
        raise
    except _RECORDED as error:  # noqa: BLE001 - recorded and compared
        log.add(key, raised(error))
        if fatal:
            raise _Stop from error
        return error
    log.add(key, OK)
    return value


def _register_hooks(world: World, log: Log) -> None:
    case = world.case
    if "in" in case.hooks:
        for i, a in enumerate(world.args):
            t = a[0]
            if t.requires_grad:
                t.register_hook(lambda g, n=f"in{i}": log.hook(n, fp(g)))
    # (frozen parameters: a teacher's, a drift_param stage's, take no hook)
    if "param" in case.hooks:
        for name, p in world.unique.named_parameters():
            if p.requires_grad:
                p.register_hook(lambda g, n=name: log.hook(f"p:{n}", fp(g)))
    if "post_acc" in case.hooks:
        for name, p in world.unique.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda q, n=name: log.hook(f"post:{n}", fp(q.grad)))


def _save(world: World) -> Tuple[Any, ...]:
    """Everything a failed iteration may have touched, to restore it."""
    attrs = {(name, a): v if a == "keep" else copy.copy(v)
             for name, m in world.unique.named_modules()
             for a, v in vars(m).items()
             if a in ("aux", "last", "calls_seen", "seen", "keep", "threads_seen", "step")}
    grads_now = [(p, None if p.grad is None else p.grad.clone()) for p in world.unique.parameters()]
    leaf_grads = [(t, None if t.grad is None else t.grad.clone()) for _, t in world.leaves]
    inputs = [(t, t.detach().clone(), t.requires_grad) for a in world.args for t in a
              if isinstance(t, Tensor) and not t.is_inference()]
    return (copy.deepcopy(world.unique.state_dict()), attrs, torch.get_rng_state(),
            grads_now, leaf_grads, inputs)


def _restore(world: World, saved: Tuple[Any, ...]) -> None:
    state, attrs, rng, grads_now, leaf_grads, inputs = saved
    with torch.no_grad():
        world.unique.load_state_dict(state)
        for t, value, requires_grad in inputs:  # other calls may have changed them
            if not torch.equal(t, value):
                t.copy_(value)
            if t.is_leaf and t.requires_grad != requires_grad:
                t.requires_grad_(requires_grad)
    modules = dict(world.unique.named_modules())
    for (name, a), v in attrs.items():
        setattr(modules[name], a, v)
    torch.set_rng_state(rng)
    for t, g in grads_now + leaf_grads:
        t.grad = g


#: The loop side's ``_grads_changed`` of a case, for its runtime side
#: (``run_case`` runs the loop first).
_LOOP_PARTIAL: Dict[Tuple[int, int], Set[int]] = {}


def _grads_changed(saved: Tuple[Any, ...], failing: Any) -> List[int]:
    """Positions of the tensors whose ``.grad`` a failed backward changed,
    but the failing module's parameters (the loop may accumulate those of
    its ops after the failing one in forward; the runtime takes none of a
    failed call's gradients)."""
    own = {id(p) for p in failing.parameters()}
    changed = []
    for k, (t, g) in enumerate(saved[3] + saved[4]):
        if id(t) in own:
            continue
        if (t.grad is None) != (g is None) or (g is not None and not torch.equal(t.grad, g)):
            changed.append(k)
    return changed


def _arm(world: World, armed: bool) -> None:
    for m in world.unique.modules():
        if isinstance(m, (RaiseForward, RaiseBackward)):
            m.armed = armed


def _set_task(world: World, value: int) -> None:
    for m in world.unique.modules():
        if isinstance(m, Task):
            m.task = value


def _forwards(world: World, case: Case) -> Tuple[List[Any], Optional[Tensor]]:
    """``case.forwards`` batches (the ``task`` stages' attribute is the
    forward's number in each): their results one after another, and the
    first's caller-side autocast use."""
    results: List[Any] = []
    first: Optional[Tensor] = None
    for k in range(case.forwards):
        _set_task(world, k)
        found, pre = _forward(world, case)
        results.extend(found)
        if k == 0:
            first = pre
    return results, first


#: The value the caller gives the ``task`` stages' attribute between the
#: forwards and the backward (none of the forwards saw it).
BETWEEN_TASK = 7


def _iteration(world: World, log: Log, it: int) -> None:
    case = world.case
    tag = f"it{it}"
    if "eval" in case.between:
        world.unique.train()  # the previous iteration's backward ran after eval()
    before = versions(world, [])
    with _grad_context(case):
        results, pre = _step(log, f"{tag}.forward", lambda: _forwards(world, case))
    log.add(f"{tag}.structure", [structure(r) for r in results])
    log.add(f"{tag}.inputs", [[fp(t) for t in a if isinstance(t, Tensor)] for a in world.args])
    log.add(f"{tag}.fn_log", sorted(map(repr, world.fn_log)))
    log.add(f"{tag}.outputs", [[fp(t) for t in tensor_leaves(r)] for r in results])
    log.add(f"{tag}.pre", fp(pre))
    log.add(f"{tag}.relations", relations(world, results))
    log.add(f"{tag}.input_versions", _delta(versions(world, []), before))
    log.add(f"{tag}.state", module_state(world))
    log.add(f"{tag}.rng", fp(torch.get_rng_state()))
    outputs = [t for r in results for t in tensor_leaves(r)]
    if case.subclass:
        world.types.append([type(t).__name__ for t in outputs])
    if "out" in case.hooks:
        for k, t in enumerate(outputs):
            if t.requires_grad:
                t.register_hook(lambda g, n=f"{tag}.out{k}": log.hook(n, fp(g)))
    if case.retain_grad:
        for t in outputs:
            if t.requires_grad and not t.is_leaf:
                t.retain_grad()
    if case.post_ops:
        after_forward = versions(world, results)
        for op in case.post_ops:
            _step(log, f"{tag}.post.{op}", functools.partial(_post_op, world, results, op),
                  fatal=False)
        log.add(f"{tag}.post.outputs", [[fp(t) for t in tensor_leaves(r)] for r in results])
        log.add(f"{tag}.post.versions", _delta(versions(world, results), after_forward))
    # what the caller changes between the forwards and the backward (issue 46)
    if "task" in case.between:
        _set_task(world, BETWEEN_TASK)
    if "eval" in case.between:
        world.unique.eval()
    if not case.backward:
        return
    if case.transform is not None:
        _transform(world, log, tag)
        log.add(f"{tag}.grads", grads(world))
        log.add(f"{tag}.state.after_transform", module_state(world))
        if world.optimizer is not None:
            _step(log, f"{tag}.step", world.optimizer.step)
            log.add(f"{tag}.after_step", module_state(world))
        return
    loss = _step(log, f"{tag}.loss", lambda: _loss(world, results, pre))
    log.add(f"{tag}.loss.value", fp(loss))
    if loss is None:
        return
    saved = _save(world) if case.raise_at is not None and it == 0 else None
    _backward(world, log, tag, loss, saved)
    log.add(f"{tag}.grads", grads(world))
    if any(isinstance(m, Keep) for m in world.unique.modules()):
        log.add(f"{tag}.kept_grads", kept_grads(world))
    if case.retain_grad:
        log.add(f"{tag}.retained", [
            _safe(lambda t=t: fp(t.grad) if t.requires_grad and not t.is_leaf else None)
            for t in outputs])
    log.add(f"{tag}.fn_log.backward", sorted(map(repr, world.fn_log)))
    if case.second_backward:
        _step(log, f"{tag}.backward2", lambda: loss.backward())
        log.add(f"{tag}.grads2", grads(world))
    if world.optimizer is not None:
        _step(log, f"{tag}.step", world.optimizer.step)
        log.add(f"{tag}.after_step", module_state(world))


def _post_op(world: World, results: Sequence[Any], op: str) -> None:
    if op == "out_mul_":
        floats = [t for r in results for t in tensor_leaves(r) if t.is_floating_point()]
        if floats:
            floats[0].mul_(2)
    elif op == "in_add_":
        with torch.no_grad():
            world.args[0][0].add_(1)


def _backward(world: World, log: Log, tag: str, loss: Tensor,
              saved: Optional[Tuple[Any, ...]]) -> None:
    case = world.case
    named = kept(world) if case.keep_named is not None else []
    if case.grad_method == "autograd_grad":
        targets = [(n, t) for n, t in world.leaves if t.requires_grad]
        targets += [(f"p:{n}", p) for n, p in world.unique.named_parameters() if p.requires_grad]
        if named:
            targets = named if case.keep_named == "alone" else targets + named
        got = _step(log, f"{tag}.autograd_grad", lambda: torch.autograd.grad(
            loss, [t for _, t in targets], allow_unused=True))
        log.add(f"{tag}.autograd_grad.values", {n: fp(g) for (n, _), g in zip(targets, got)})
        return
    if case.grad_method == "backward_inputs":
        chosen: List[Tensor] = [p for p in world.unique[0].parameters() if p.requires_grad]
        chosen += [t for _, t in world.leaves[:1] if t.requires_grad]
        if named:
            chosen = [t for _, t in named] if case.keep_named == "alone" else chosen + [
                t for _, t in named]
        if not chosen:
            return
        _step(log, f"{tag}.backward", lambda: loss.backward(inputs=chosen))
        return
    _step(log, f"{tag}.backward",
          lambda: loss.backward(retain_graph=case.second_backward))


def _transform(world: World, log: Log, tag: str) -> None:
    """``torch.autograd.functional.jacobian`` (of the loss's terms), ``jvp`` or
    ``hvp`` (of the loss) as functions of call 0's input, each evaluation
    running the whole batch (call 0's input replaced wherever a call gets it)."""
    case = world.case
    x0 = world.args[0][0]

    def terms(x: Tensor) -> List[Tensor]:
        args = [tuple(x if t is x0 else t for t in a) for a in world.args]
        results = world.run_batch(world.modules, args, world.kwargs)
        return _terms(world, results, None)

    def vector(x: Tensor) -> Tensor:
        found = terms(x)
        return torch.stack(found) if found else torch.zeros(1, dtype=torch.float64)

    def scalar(x: Tensor) -> Tensor:
        found = terms(x)
        return torch.stack(found).sum() if found else torch.zeros((), dtype=torch.float64)

    x = x0.detach().clone()
    v = (torch.arange(x.numel()) % 3 * 0.5 - 0.25).reshape(x.shape).to(x.dtype)
    functional = torch.autograd.functional
    if case.transform == "jacobian":
        got = _step(log, f"{tag}.transform", lambda: (functional.jacobian(vector, x),))
    elif case.transform == "jvp":
        got = _step(log, f"{tag}.transform", lambda: functional.jvp(scalar, x, v))
    else:
        got = _step(log, f"{tag}.transform", lambda: functional.hvp(scalar, x, v))
    log.add(f"{tag}.transform.values", [fp(t) for t in got])


@contextlib.contextmanager
def _caller_settings(case: Case) -> Any:
    """The caller's intra-op thread count (``threads``), restored after."""
    saved_threads = torch.get_num_threads()
    if case.threads is not None:
        torch.set_num_threads(case.threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != saved_threads:
            torch.set_num_threads(saved_threads)


def _pack_lossy(t: Tensor) -> Any:
    """The caller's lossy pack hook (``saved_hooks``): a bf16 round trip of
    floating tensors."""
    if t.is_floating_point() and t.layout == torch.strided:
        return (t.dtype, t.detach().to(torch.bfloat16))
    return (None, t)


def _unpack_lossy(packed: Any) -> Tensor:
    dtype, t = packed
    return t if dtype is None else t.to(dtype)


#: ``disable_saved_tensors_hooks``'s message (``disable_saved_hooks``).
DISABLED = "oracle: the caller disabled saved-tensor hooks"


def _caller_autograd(case: Case) -> contextlib.AbstractContextManager:
    """The caller's autograd setting around every iteration (issue 46)."""
    graph = torch.autograd.graph
    if case.caller_ctx == "allow_mutation":
        return graph.allow_mutation_on_saved_tensors()
    if case.caller_ctx == "saved_hooks":
        return graph.saved_tensors_hooks(_pack_lossy, _unpack_lossy)
    if case.caller_ctx == "disable_saved_hooks":
        return graph.disable_saved_tensors_hooks(DISABLED)
    return contextlib.nullcontext()


def execute(case: Case, side: str) -> Log:
    """Runs ``case`` on ``side`` and returns what it observed."""
    with _caller_settings(case):
        return _execute(case, side)


def _execute(case: Case, side: str) -> Log:
    log = Log(side)
    world = build(case, side)
    torch.manual_seed(case.seed + 1)  # the same global RNG state on both sides
    log.add("start.state", module_state(world))
    _register_hooks(world, log)
    try:
        with _caller_autograd(case):
            for it in range(case.iterations):
                if it and world.optimizer is not None:
                    world.optimizer.zero_grad()
                if case.raise_at is not None and it == 0:
                    _failing_iteration(world, log)
                if case.interrupt is not None and it == 0:
                    _interrupted_iteration(world, log)
                _iteration(world, log, it)
    except _Stop:
        # Which hooks fired before a step that raised on both sides depends
        # on the order the engine ran the nodes in: not compared.
        log.add("hooks", "<a step raised>")
    else:
        log.add("hooks", {k: v for k, v in sorted(log.hooks.items())})
    log.add("end.rng", fp(torch.get_rng_state()))
    if case.subclass:
        log.add("end.types", world.types)
    return log


def _failing_iteration(world: World, log: Log) -> None:
    """The first iteration with one expert armed to raise: both sides must
    raise the expert's error (the runtime's naming the call), leave no partial
    ``.grad`` write (runtime), and run the next iteration normally (state is
    restored to before the failure on both sides: what a failed batch leaves
    in modules is not part of the contract)."""
    case = world.case
    assert case.raise_at is not None
    call, where = case.raise_at
    saved = _save(world)
    _arm(world, True)
    try:
        with _grad_context(case):
            results, pre = _forward(world, case)
        if where == "backward" and case.backward:
            loss = _loss(world, results, pre)
            if loss is not None:
                if case.grad_method == "autograd_grad":
                    torch.autograd.grad(loss, [p for p in world.unique.parameters()],
                                        allow_unused=True)
                else:
                    loss.backward()
        outcome: Any = OK
    except Exception as error:  # noqa: BLE001
        outcome = raised(error)
    finally:
        _arm(world, False)
    log.add("fail.outcome", outcome)  # compared as any step's outcome
    if isinstance(outcome, Raised):
        expected = RaiseForward.MESSAGE if where == "forward" else RaiseBackward.MESSAGE
        log.add("fail.message", expected in outcome.text)
        # Any call of the armed module may be the one named (a shared module
        # fails in several calls; the loop's backward meets the last first).
        armed = world.modules[call]
        names = [f"call {i} of {case.n}" for i, m in enumerate(world.modules) if m is armed]
        # Only the armed expert's own error must name it (the loop may fail
        # elsewhere first, a frame's recomputation say: fail.outcome compares).
        log.add("fail.names_call",
                any(n in outcome.text for n in names)
                if log.side == RUNTIME and expected in outcome.text else True)
        # A failed backward may write the .grad of what it reached before the
        # failure (parameter gradients stream in the loop's order), never the
        # failing call's, and never one the loop's failed backward left alone
        # (the loop may write more: its engine interleaves the calls' nodes).
        changed = set(_grads_changed(saved, armed))
        if log.side == LOOP:
            _LOOP_PARTIAL[(case.seed, case.index)] = changed
            log.add("fail.partial_grads_within_loop", True)
        else:
            loop_changed = _LOOP_PARTIAL.pop((case.seed, case.index), set())
            log.add("fail.partial_grads_within_loop", changed <= loop_changed)
    log.hooks.clear()  # the loop's hooks may fire before the failure, the runtime's not
    _restore(world, saved)


def _marks(world: World) -> Dict[str, int]:
    return {name: m.calls_seen for name, m in world.unique.named_modules()
            if isinstance(m, Mark)}


#: How long the runtime side waits after an interrupted batch raised before
#: it counts again which forwards ran (the loop's calls cannot run on).
JOIN_S = 0.15


def _interrupted_iteration(world: World, log: Log) -> None:
    """A batch (forward) in which one expert raises a BaseException that is
    not an Exception (``Interrupt``, ``SystemExit``), and maybe another a
    ValueError: both sides must raise the first in call order; every call
    before it must have run; no call may still run once the error reached
    the caller (each expert's ``mark`` stage counts its forwards: counted
    right away and again ``JOIN_S`` later). State is then restored as after
    any failed batch."""
    case = world.case
    assert case.interrupt is not None
    call, name, other = case.interrupt
    saved = _save(world)

    def raiser(i: int) -> RaiseAny:
        return next(m for m in world.modules[i].modules() if isinstance(m, RaiseAny))
    raiser(call).armed = INTERRUPTS[name]
    if other is not None:
        raiser(other).armed = ValueError
    armed = {id(m) for m in world.unique.modules() if isinstance(m, RaiseAny) and m.armed}
    first = next(i for i, m in enumerate(world.modules)
                 if any(id(s) in armed for s in m.modules()))
    marks = {id(m): m for m in world.unique.modules() if isinstance(m, Mark)}
    for m in marks.values():
        m.slow = True
    try:
        with _grad_context(case):
            _forward(world, case)
        outcome: Any = OK
    except _RECORDED as error:  # noqa: BLE001 - recorded and compared
        outcome = raised(error)
    finally:
        for m in world.unique.modules():
            if isinstance(m, RaiseAny):
                m.armed = None
    right_after = _marks(world)
    counted = {k: m.calls_seen for k, m in marks.items()}
    if log.side == RUNTIME:
        time.sleep(JOIN_S)
    later = _marks(world)
    for m in marks.values():
        m.slow = False
    log.add("interrupt.outcome", outcome)
    log.add("interrupt.ran_after_the_error", {k: later[k] - v for k, v in right_after.items()})
    # every call before the first raising one ran (its module's mark counted it)
    before: Dict[int, int] = {}
    for m in world.modules[:first]:
        mark = next(s for s in m.modules() if isinstance(s, Mark))
        before[id(mark)] = before.get(id(mark), 0) + 1
    log.add("interrupt.earlier_calls_ran",
            all(counted[k] >= n for k, n in before.items()))
    log.hooks.clear()
    _restore(world, saved)


# -- comparing --------------------------------------------------------------------------

@dataclasses.dataclass
class Divergence:
    key: str
    path: str
    loop: Any
    runtime: Any
    kind: str  # "value" | "unexpected_error" | "missing_error" | "steps"

    def __str__(self) -> str:
        return (f"{self.kind} at {self.key}{self.path}:\n"
                f"    loop:    {self.loop!r}\n    runtime: {self.runtime!r}")


def _diff(a: Any, b: Any, path: str = "") -> Optional[Tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}[{k!r}]", a.get(k, "<absent>"), b.get(k, "<absent>")
            d = _diff(a[k], b[k], f"{path}[{k!r}]")
            if d is not None:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return f"{path}.len", a, b
        for k, (x, y) in enumerate(zip(a, b)):
            d = _diff(x, y, f"{path}[{k}]")
            if d is not None:
                return d
        return None
    return None if a == b else (path, a, b)


def compare(loop: Log, runtime: Log, may_raise: bool) -> Tuple[str, Optional[Divergence]]:
    """``("equal" | "clear_error" | "diverged", divergence)``.

    A step where the runtime raised an error naming the call (``call i of
    n``) while the loop did not, or raised another type than the loop's, is
    accepted only if ``may_raise`` (the case has a construct of the
    raise-is-the-contract table)."""
    for (lk, lv), (rk, rv) in zip(loop.entries, runtime.entries):
        if lk != rk:
            return "diverged", Divergence(lk, "", lk, rk, "steps")
        if isinstance(rv, Raised) and not isinstance(lv, Raised):
            if rv.names_call and may_raise:
                return "clear_error", None
            return "diverged", Divergence(lk, "", lv, rv, "unexpected_error")
        if isinstance(lv, Raised) and not isinstance(rv, Raised):
            return "diverged", Divergence(lk, "", lv, rv, "missing_error")
        if isinstance(lv, Raised) and isinstance(rv, Raised) and (
                lv != rv or (rv.runtime_own and not lv.runtime_own)):
            if rv.names_call and may_raise:  # both raise; the runtime's is a clear one
                return "clear_error", None
            return "diverged", Divergence(lk, "", lv, rv, "value")
        d = _diff(lv, rv)
        if d is not None:
            return "diverged", Divergence(lk, d[0], d[1], d[2], "value")
    if len(loop.entries) != len(runtime.entries):
        k = min(len(loop.entries), len(runtime.entries))
        longer = loop.entries if len(loop.entries) > k else runtime.entries
        return "diverged", Divergence(longer[k][0], "", len(loop.entries), len(runtime.entries),
                                      "steps")
    return "equal", None


def run_case(case: Case) -> Tuple[Log, Log]:
    """Both sides of ``case``: ``(loop, runtime)``."""
    GRAPH_KEPT[0] = case.second_backward or case.transform is not None
    loop = execute(case, LOOP)
    runtime = execute(case, RUNTIME)
    return loop, runtime
