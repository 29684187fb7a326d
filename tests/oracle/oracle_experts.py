"""The expert modules the differential oracle composes (see ``test_oracle.py``).

An :class:`Expert` is a chain of *stages* (each a small module mapping a
hidden tensor to a hidden tensor: an MLP, BatchNorm, dropout, a nested
``parallel_apply``...) followed by an *output form* (a tensor, a tuple that
returns the input itself, a dataclass, ``self.aux = loss``...). Every stage
and form is one construct of the oracle's vocabulary, named by the strings in
:data:`STAGES` and :data:`OUTPUTS`; :func:`build_expert` turns names into a
module. Nothing here knows whether it runs under the runtime or in the
reference loop, except the nested stage, whose ``runner`` the harness sets.

Replay a failure with the command its message prints
(``pytest tests/oracle --fuzz-seed=S --fuzz-case=K``).
"""
from __future__ import annotations

import dataclasses
import time
import types
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import Tensor, nn
from torch.nn.utils import parametrizations

from moe_autograd import is_recomputing

WIDTH = 4
HIDDEN = 8
ROWS = 3
VOCAB = 6

#: ``runner(modules, inputs) -> outputs``: the nested stage's way to run a batch.
Runner = Callable[[Sequence[nn.Module], Sequence[Any]], List[Any]]


@dataclasses.dataclass
class ExpertOut:
    """An output wrapped in a dataclass (not a pytree node for torch)."""
    y: Tensor
    count: int


class StageContext:
    """What a stage may look at besides the hidden tensor: the call's raw
    arguments."""

    __slots__ = ("x", "idx", "mask", "scale")

    def __init__(self, x: Tensor, idx: Optional[Tensor], mask: Optional[Tensor],
                 scale: Optional[float]) -> None:
        self.x, self.idx, self.mask, self.scale = x, idx, mask, scale


class Stage(nn.Module):
    """A step of an expert: ``forward(h, ctx) -> h``."""

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class Mlp(Stage):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        return self.fc2(torch.relu(self.fc1(h)))


class Lin(Stage):
    def __init__(self, wrap: Optional[Callable[[nn.Linear], nn.Module]] = None) -> None:
        super().__init__()
        fc = nn.Linear(WIDTH, WIDTH)
        self.fc: nn.Module = wrap(fc) if wrap is not None else fc

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        return self.fc(h)


class Norm(Stage):
    """BatchNorm in train mode: running stats are buffers updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(WIDTH)

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        return self.bn(h)


class Counter(Stage):
    """A buffer and a plain tensor attribute updated in forward, whose values
    the output depends on (so call order matters for a shared module)."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Tensor
        self.register_buffer("count", torch.zeros(()))
        self.last: Optional[Tensor] = None
        self.calls_seen = 0

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        with torch.no_grad():
            self.count += 1
        self.calls_seen += 1
        self.last = h.detach().sum()
        return h * (1 + self.count.to(h.dtype) * 0.25)


class Embed(Stage):
    """A sparse-gradient embedding of the integer input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, sparse=True)

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        assert ctx.idx is not None
        return h + self.emb(ctx.idx).to(h.dtype)


class Dropout(Stage):
    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        return F.dropout(h, 0.5, training=True)


class Noise(Stage):
    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        return h + 0.125 * torch.randn_like(h)


class Bernoulli(Stage):
    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        return h * torch.bernoulli(torch.full_like(h, 0.75))


class InPlace(Stage):
    """In-place ops on an intermediate."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        t = self.fc(h)
        t.add_(0.5)
        t.relu_()
        return t


class InputInPlace(Stage):
    """An in-place op on the call's input inside the expert. ``active`` is
    set by the harness only where the loop itself can do it (no call of this
    module gets a leaf that requires grad): the stage must not look at the
    tensor to decide, the runtime may show it another one."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        x = ctx.x
        if not self.active:
            return h
        x.mul_(2)
        return h * 1 if h is not x else x


class Introspect(Stage):
    """Records what the expert sees of its input and of the thread's modes
    (``seen``, compared as a multiset: calls may run in any order)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Tuple[Any, ...]] = []

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        if is_recomputing():
            # A checkpointed call runs its forward again in backward; what it
            # does to objects other than its tensors and attributes happens
            # again (the README's Semantics): is_recomputing() tells it.
            return h
        x = ctx.x
        self.seen.append((
            "is_leaf", x.is_leaf, "requires_grad", x.requires_grad,
            "grad_fn", None if x.grad_fn is None else x.grad_fn.name(),
            "grad_enabled", torch.is_grad_enabled(),
            "inference_mode", torch.is_inference_mode_enabled(),
            "autocast", torch.is_autocast_enabled("cpu"),
            str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else None,
            "dtype", str(x.dtype), "is_inference", x.is_inference()))
        return h


class EnableGrad(Stage):
    """``torch.enable_grad()`` inside the expert (matters under a no_grad caller)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        with torch.enable_grad():
            return self.fc(h)


class RequiresGrad(Stage):
    """``x.requires_grad_()`` on the call's input inside the expert."""

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        if ctx.x.is_leaf and not ctx.x.requires_grad and ctx.x.is_floating_point():
            ctx.x.requires_grad_()
        return h + ctx.x if h is not ctx.x else h * 1


class InnerCheckpoint(Stage):
    """``torch.utils.checkpoint`` around a sub-block inside the expert; the
    non-reentrant one's block draws (dropout), so its recomputation must
    replay the call's random numbers. The reference runs that block as it is
    (``transparent``, set by the harness): non-reentrant checkpointing is
    transparent in the loop, so the reference does not share the
    recomputation's RNG path with the runtime it checks. (The reentrant one
    is not transparent: it refuses ``autograd.grad`` and ``inputs=``.)"""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.transparent = False

    def block(self, h: Tensor) -> Tensor:
        h = self.fc(h)
        return torch.tanh(h if self.reentrant else F.dropout(h, 0.25, self.training))

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        if self.transparent:
            return self.block(h)
        return tuc.checkpoint(self.block, h, use_reentrant=self.reentrant)


class Nested(Stage):
    """A nested batch of two calls inside the expert (``parallel_apply`` under
    the runtime, the reference loop in the reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])
        self.runner: Optional[Runner] = None

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        assert self.runner is not None, "the harness sets the nested runner"
        a, b = self.runner(list(self.subs), [h, h])
        return a + b


class RaiseForward(Stage):
    """Raises while armed (the harness arms it for one forward)."""

    MESSAGE = "oracle expert failed on purpose"

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        if self.armed:
            raise ValueError(self.MESSAGE)
        return h


class _FailingGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, stage: "RaiseBackward") -> Tensor:  # type: ignore[override]
        ctx.stage = stage
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        if ctx.stage.armed:
            raise ValueError(RaiseBackward.MESSAGE)
        return grad, None


class RaiseBackward(Stage):
    """Raises in backward while armed."""

    MESSAGE = "oracle expert backward failed on purpose"

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        return _FailingGrad.apply(h, self)


class UseInt(Stage):
    """Uses the integer and bool inputs and the ``scale`` keyword."""

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        if ctx.idx is not None:
            h = h + ctx.idx[:, None].to(h.dtype)
        if ctx.mask is not None:
            h = h * ctx.mask
        if ctx.scale is not None:
            h = h * ctx.scale
        return h


class Step(Stage):
    """Plain-attribute state the forward reads back (``self.step += 1``, a
    Python int, not a buffer): a recomputation must start from its value at
    the start of the forward, and a shared module must see calls in order
    (issue 34)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        self.step += 1
        return h * (1 + 0.125 * (self.step % 5))


class Keep(Stage):
    """Keeps an intermediate in a plain attribute (``self.keep = h``) that the
    call computes further from, with ``h.retain_grad()`` inside the forward
    when ``retain``: the caller reads ``expert.keep`` (and its ``.grad``)."""

    def __init__(self, retain: bool) -> None:
        super().__init__()
        self.retain = retain
        self.keep: Optional[Tensor] = None

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        h = h * 1.5
        self.keep = h
        if self.retain and h.requires_grad:
            h.retain_grad()
        return torch.tanh(h)


class _ThreadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, stage: "Threads") -> Tensor:  # type: ignore[override]
        ctx.stage = stage
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        if ctx.stage.record_backward:
            ctx.stage.threads_seen.append(("backward", torch.get_num_threads()))
        return grad, None


class Threads(Stage):
    """Records the intra-op thread count (``torch.get_num_threads()``) its
    forward and (``record_backward``) its backward see (``threads_seen``, compared as a multiset):
    the caller's ``torch.set_num_threads`` must reach the expert."""

    def __init__(self) -> None:
        super().__init__()
        self.threads_seen: List[Tuple[str, int]] = []
        #: Set by the harness where the loop's backward runs every call's
        #: whole backward (``backward(inputs=...)`` prunes the loop's, not the
        #: runtime's: D9).
        self.record_backward = False

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        if not is_recomputing():
            self.threads_seen.append(("forward", torch.get_num_threads()))
        return _ThreadsInBackward.apply(h, self) if h.requires_grad else h


class Mark(Stage):
    """Counts the forwards that reached it (``calls_seen``); ``slow`` (set by
    the harness for the interrupted batch only) makes each take a while first,
    so that a call still running when the batch's error reaches the caller
    shows up in a later count."""

    def __init__(self) -> None:
        super().__init__()
        self.calls_seen = 0
        self.slow = False

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        if self.slow:
            time.sleep(0.02)
        self.calls_seen += 1
        return h


class Interrupt(BaseException):
    """A ``BaseException`` that is not an ``Exception`` (as ``KeyboardInterrupt``,
    which pytest treats specially)."""


#: The exceptions the oracle's interrupt construct raises, by name.
INTERRUPTS: Dict[str, type] = {"Interrupt": Interrupt, "SystemExit": SystemExit,
                               "ValueError": ValueError}


class RaiseAny(Stage):
    """Raises ``armed`` (an exception class, set by the harness) in forward."""

    MESSAGE = "oracle expert interrupted on purpose"

    def __init__(self) -> None:
        super().__init__()
        self.armed: Optional[type] = None

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        if self.armed is not None:
            raise self.armed(self.MESSAGE)
        return h


# -- issue 46's constructs (drawn by oracle_cases._issue46) ---------------------------

class Task(Stage):
    """A plain attribute the forward reads and never sets (``self.task``):
    the harness sets it before each forward of an iteration and changes it
    again between the forwards and the backward; a checkpointed call must
    recompute with the value its forward saw (issue 46, class 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.task = 0

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        return self.fc(h) * (1 + 0.25 * self.task)


class TrainDropout(Stage):
    """An ``nn.Dropout`` (it follows ``training``): the harness's ``eval()``
    between forward and backward must not reach a checkpointed call's
    recomputation (issue 46, class 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        return self.drop(h)


class Drift(Stage):
    """A tensor (``kind``: a buffer, a Parameter that does not require grad,
    one that does) the harness ties across the distinct experts that have
    this stage, changed in place in forward and read after the change
    (``1 + shared`` saves nothing of it): calls must see it as the loop's
    calls do, in call order (issue 46, class 2)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        t = torch.linspace(0.1, 0.4, WIDTH)
        self.shared: Tensor
        if kind == "buffer":
            self.register_buffer("shared", t)
        else:
            self.shared = nn.Parameter(t, requires_grad=kind == "param_rg")

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        with torch.no_grad():
            self.shared.mul_(0.5).add_(h.detach().float().mean().to(self.shared.dtype) * 0.125)
        return h * (1 + self.shared)


class Teacher(Stage):
    """An EMA teacher: a frozen ``nn.Linear`` the harness ties across the
    distinct experts that have this stage, read (detached) and then updated
    in place from the stage's own Linear in forward. A torch.nn module that
    only computes orders nothing: a known limit (README's semantics table,
    strict xfail in tests/test_module_state.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.teacher = nn.Linear(WIDTH, WIDTH).requires_grad_(False)

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        out = self.fc(h) + self.teacher(h).detach()
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.fc.parameters()):
                t.mul_(0.75).add_(s.to(t.dtype), alpha=0.25)
        return out


class MutateSaved(Stage):
    """Changes in place an intermediate its own graph saved (``sin`` saves
    ``t``): the loop computes only under the caller's
    ``allow_mutation_on_saved_tensors()`` (drawn with it; issue 46, class 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        t = self.fc(h)
        y = t.sin()
        t.mul_(2)
        return y + t


class Seeded(Stage):
    """``torch.manual_seed`` inside the expert (``fork``: inside
    ``torch.random.fork_rng()``), a draw after it, and a dropout after that:
    it acts on the call's stream only (issue 46, class 4)."""

    SEED = 4646

    def __init__(self, fork: bool) -> None:
        super().__init__()
        self.fork = fork

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        if self.fork:
            with torch.random.fork_rng():
                torch.manual_seed(self.SEED)
                mask = torch.rand(h.shape) > 0.5
        else:
            torch.manual_seed(self.SEED)
            mask = torch.rand(h.shape) > 0.5
        return F.dropout(h, 0.25, training=True) * mask


class DataWrite(Stage):
    """A ``.data`` write to its Linear's weight in forward, before its use
    (issue 46, class 5): ``clamp`` (a max-norm constraint: doing it again
    changes nothing) or ``decay`` (``mul_(0.75)``: doing it again does)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        if self.op == "clamp":
            self.fc.weight.data.clamp_(-0.3, 0.3)
        else:
            self.fc.weight.data.mul_(0.75)
        return torch.tanh(self.fc(h))


class Tagged(Tensor):
    """A ``__torch_function__`` subclass that only tags its results: the
    inputs of the ``subclass`` construct (issue 46)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


def _compiled_eager(h: Tensor, w: Tensor) -> Tensor:
    return torch.tanh(h @ w) * 2 + h


def _compiled_aot_eager(h: Tensor, w: Tensor) -> Tensor:
    return torch.tanh(h @ w) * 2 + h


def _compiled_inductor(h: Tensor, w: Tensor) -> Tensor:
    return torch.tanh(h @ w) * 2 + h


#: One plain function per backend (dynamo caches per code object), compiled
#: on first use (importing dynamo and inductor costs seconds).
_TO_COMPILE = {"eager": _compiled_eager, "aot_eager": _compiled_aot_eager,
               "inductor": _compiled_inductor}
_COMPILED: Dict[Tuple[str, bool], Callable[[Tensor, Tensor], Tensor]] = {}

#: Whether the case under way runs a backward that keeps the graph (set by
#: the harness). AOTAutograd compiles a graph's backward at its first
#: backward and, if that one did not keep the graph, donates its buffers: a
#: later backward that keeps it raises, in the loop as in the runtime. Cases
#: share the compiled functions, and the loop and the runtime run separate
#: cache entries of them (the runtime's dispatch state is guarded), so which
#: side raised depended on earlier cases (seed 1795803072: case 258, then
#: case 1594 raised in the runtime only). Cases that keep the graph get
#: functions of their own, so every cache entry sees one kind of backward.
GRAPH_KEPT = [False]


def _copy(fn: Callable[..., Any], suffix: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own (a cache of its own in dynamo)."""
    code = fn.__code__.replace(co_name=fn.__name__ + suffix)
    return types.FunctionType(code, fn.__globals__, code.co_name)


def compiled(backend: str) -> Callable[[Tensor, Tensor], Tensor]:
    key = (backend, GRAPH_KEPT[0])
    if key not in _COMPILED:
        fn = _copy(_TO_COMPILE[backend], "_kept") if key[1] else _TO_COMPILE[backend]
        _COMPILED[key] = torch.compile(fn, backend=backend, dynamic=False)
    return _COMPILED[key]


def compile_backends() -> Tuple[str, ...]:
    """The backends the oracle compiles with: eager and aot_eager, and
    inductor where it can be imported."""
    try:
        import torch._inductor  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed / not usable here
        return ("eager", "aot_eager")
    return ("eager", "aot_eager", "inductor")


class Compiled(Stage):
    """A module-level function compiled with ``torch.compile(backend=...)``,
    of the hidden tensor and the stage's weight."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.5)

    def forward(self, h: Tensor, ctx: StageContext) -> Tensor:
        import torch._dynamo.config as dynamo_config
        # dynamo's limits are per thread (context variables): raised here, on
        # whichever thread the call runs, so that no variant (dtype, grad
        # mode, the runtime's dispatch keys...) runs eager past the limit on
        # one side and compiled on the other
        with dynamo_config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
            return compiled(self.backend)(h, self.w.to(h.dtype))


def _spectral(fc: nn.Linear) -> nn.Module:
    return parametrizations.spectral_norm(fc)


def _weight_norm(fc: nn.Linear) -> nn.Module:
    return parametrizations.weight_norm(fc)


def _orthogonal(fc: nn.Linear) -> nn.Module:
    return parametrizations.orthogonal(fc)


STAGES: Dict[str, Callable[[], Stage]] = {
    "mlp": Mlp,
    "linear": Lin,
    "bn": Norm,
    "counter": Counter,
    "spectral_norm": lambda: Lin(_spectral),
    "weight_norm": lambda: Lin(_weight_norm),
    "orthogonal": lambda: Lin(_orthogonal),
    "embedding": Embed,
    "dropout": Dropout,
    "randn_like": Noise,
    "bernoulli": Bernoulli,
    "inplace": InPlace,
    "enable_grad": EnableGrad,
    "input_inplace": InputInPlace,
    "introspect": Introspect,
    "requires_grad_": RequiresGrad,
    "ckpt_nonreentrant": lambda: InnerCheckpoint(False),
    "ckpt_reentrant": lambda: InnerCheckpoint(True),
    "nested": Nested,
    "raise_forward": RaiseForward,
    "raise_backward": RaiseBackward,
    "use_int": UseInt,
    # issue 30's constructs (drawn by oracle_cases._issue30)
    "step": Step,
    "keep": lambda: Keep(retain=True),
    "keep_plain": lambda: Keep(retain=False),
    "threads": Threads,
    "mark": Mark,
    "interrupt": RaiseAny,
    "compiled_eager": lambda: Compiled("eager"),
    "compiled_aot_eager": lambda: Compiled("aot_eager"),
    "compiled_inductor": lambda: Compiled("inductor"),
    # issue 46's constructs (drawn by oracle_cases._issue46)
    "task": Task,
    "train_dropout": TrainDropout,
    "drift_buffer": lambda: Drift("buffer"),
    "drift_param": lambda: Drift("param"),
    "drift_param_rg": lambda: Drift("param_rg"),
    "teacher": Teacher,
    "mutate_saved": MutateSaved,
    "seed": lambda: Seeded(False),
    "fork_seed": lambda: Seeded(True),
    "data_clamp": lambda: DataWrite("clamp"),
    "data_decay": lambda: DataWrite("decay"),
}

#: The stages whose tensor (``drift_*``) or module (``teacher``) the harness
#: ties across the distinct experts that have them.
TIED_STAGES = ("drift_buffer", "drift_param", "drift_param_rg", "teacher")

#: Stages that draw random numbers.
RANDOM_STAGES = frozenset({"dropout", "randn_like", "bernoulli", "ckpt_nonreentrant",
                           "train_dropout", "seed", "fork_seed"})
#: Stages with buffers or tensor attributes updated in forward.
STATEFUL_STAGES = frozenset({"bn", "counter", "spectral_norm", "keep", "keep_plain", "threads",
                             "mark", "step", "drift_buffer", "drift_param", "drift_param_rg",
                             "teacher", "data_clamp", "data_decay"})
#: Stages a case may share between distinct experts (one module object).
SHARED_STAGES = ("bn", "counter", "step")

OUTPUTS = ("tensor", "tuple", "list", "dict", "nontensor", "int_out", "identity", "input_pass",
           "input_view", "twice", "own_param", "internal_views", "aux", "dataclass",
           "namespace")


class Expert(nn.Module):
    """``stages`` in order, then ``gain`` (a Parameter), then the output form."""

    def __init__(self, stages: Sequence[str], output: str) -> None:
        super().__init__()
        self.stage_names = tuple(stages)
        self.stages = nn.ModuleList([STAGES[s]() for s in stages])
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.output = output
        self.aux: Optional[Tensor] = None

    def first_linear(self) -> Optional[nn.Linear]:
        """The first plain Linear of the expert (the caller's autocast pre-use)."""
        for m in self.modules():
            if type(m) is nn.Linear and not torch.nn.utils.parametrize.is_parametrized(m):
                return m
        return None

    def forward(self, x: Tensor, idx: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                scale: Optional[float] = None) -> Any:
        ctx = StageContext(x, idx, mask, scale)
        h = x
        for stage in self.stages:
            h = stage(h, ctx)
        h = h * self.gain.to(h.dtype) if h.is_floating_point() else h
        return self._form(x, h)

    def _form(self, x: Tensor, h: Tensor) -> Any:
        form = self.output
        if form == "tensor":
            return h
        if form == "tuple":
            return h, h * 2
        if form == "list":
            return [h, h.sum()]
        if form == "dict":
            return {"y": h, "n": 3, "none": None}
        if form == "nontensor":
            return h, None, 3, "text"
        if form == "int_out":
            return h, h.argmax(-1), h > 0
        if form == "identity":
            return x
        if form == "input_pass":
            return h, x
        if form == "input_view":
            return h, x[:, :2]
        if form == "twice":
            return h, h
        if form == "own_param":
            return h, self.gain
        if form == "internal_views":
            t = h * 1
            return t.view(-1), t[0]
        if form == "aux":
            self.aux = (h.float() ** 2).mean()
            return h
        if form == "dataclass":
            return ExpertOut(y=h, count=2)
        if form == "namespace":
            return SimpleNamespace(y=h, tag="t")
        raise ValueError(f"unknown output form {form!r}")


def build_expert(stages: Sequence[str], output: str) -> Expert:
    return Expert(stages, output)


def tensor_leaves(value: Any) -> List[Tensor]:
    """The tensors of an expert's result, in a fixed order, looking inside
    the containers the oracle's output forms use (dataclass, namespace too)."""
    found: List[Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        elif isinstance(v, dict):
            for key in sorted(v, key=str):
                walk(v[key])
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for field in dataclasses.fields(v):
                walk(getattr(v, field.name))
        elif isinstance(v, SimpleNamespace):
            for key in sorted(vars(v)):
                walk(vars(v)[key])

    walk(value)
    return found


def structure(value: Any) -> Any:
    """The result's shape with tensors replaced by a marker: containers,
    their types and the non-tensor values must match the loop's."""
    if isinstance(value, Tensor):
        return "<tensor>"
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(structure(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, structure(value[k])) for k in sorted(value, key=str)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,
                tuple((f.name, structure(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if isinstance(value, SimpleNamespace):
        return ("SimpleNamespace", tuple((k, structure(v)) for k, v in sorted(vars(value).items())))
    return repr(value)
