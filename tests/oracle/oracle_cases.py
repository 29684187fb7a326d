"""The oracle's case generator: expert patterns x caller patterns x modes x
``checkpoint`` x dtypes, drawn from a seed.

A :class:`Case` is plain data (frozen dataclasses of strings, ints and
bools): :func:`generate` draws case ``index`` of fuzz seed ``seed`` from
``random.Random(f"{seed}:{index}")``, so one case replays without the others
(``pytest tests/oracle --fuzz-seed=S --fuzz-case=K``).
:func:`constructs` names what a case is made of; the tables of
``oracle_known.py`` and the triage tool key on those names.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

from oracle_experts import (OUTPUTS, RANDOM_STAGES, SHARED_STAGES, STATEFUL_STAGES,
                            TIED_STAGES, compile_backends)
from oracle_functions import FUNCTIONS, RANDOM_FUNCTIONS

MODES = ("inline", "lanes", "parallel", "auto")
DTYPES = ("float32", "float64", "bfloat16")
GRAD_MODES = ("grad", "no_grad", "inference")
FRAMES = ("none", "autocast", "ckpt_nonreentrant", "ckpt_reentrant")
POST_OPS = ("out_mul_", "in_add_")
HOOKS = ("in", "out", "param", "post_acc")
GRAD_METHODS = ("backward", "autograd_grad", "backward_inputs")
OPTIMIZERS = ("none", "sgd", "adamw")
#: Input kinds of a call: a leaf that requires grad, one that does not, a
#: non-leaf (computed from a leaf), and extra integer / bool / keyword inputs.
X_KINDS = ("leaf_rg", "leaf", "nonleaf")
EXTRAS = ("none", "idx", "mask", "scale")

# Stage pools, weighted by how often a case draws them.
_STAGE_WEIGHTS = {
    "mlp": 6, "linear": 6, "bn": 3, "counter": 3, "spectral_norm": 2, "weight_norm": 2,
    "orthogonal": 1, "embedding": 2, "dropout": 2, "randn_like": 1, "bernoulli": 1,
    "inplace": 2, "input_inplace": 1, "introspect": 2, "enable_grad": 2, "requires_grad_": 2, "ckpt_nonreentrant": 1,
    "ckpt_reentrant": 1, "nested": 2, "use_int": 2,
}
_OUTPUT_WEIGHTS = {
    "tensor": 10, "tuple": 3, "list": 2, "dict": 2, "nontensor": 2, "int_out": 2,
    "identity": 2, "input_pass": 2, "input_view": 2, "twice": 2, "own_param": 2,
    "internal_views": 2, "aux": 2, "dataclass": 2, "namespace": 2,
}
assert set(_OUTPUT_WEIGHTS) == set(OUTPUTS)


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """One call of the batch."""
    stages: Tuple[str, ...]
    output: str
    x_kind: str
    extra: str
    #: The earlier call whose module object this call uses (the same module twice).
    share_with: Optional[int] = None
    #: The earlier call whose input tensor object this call passes again.
    same_input_as: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Case:
    """One oracle case: the batch, how the caller makes it, and what it does after."""
    seed: int
    index: int
    calls: Tuple[CallSpec, ...]
    mode: str
    checkpoint: Union[bool, Tuple[bool, ...]]
    dtype: str
    grad_mode: str
    frame: str
    #: The caller used an expert's weight under autocast before the call.
    pre_autocast_use: bool
    #: Tie the first Linear weight of every expert to call 0's (one Parameter).
    tied: bool
    post_ops: Tuple[str, ...]
    hooks: Tuple[str, ...]
    retain_grad: bool
    grad_method: str
    second_backward: bool
    optimizer: str
    iterations: int
    #: ``(call, "forward" | "backward")``: that call's expert raises in the first iteration.
    raise_at: Optional[Tuple[int, str]]
    #: A ``map_with_parallel_backward`` case: the name of its Function (see
    #: ``oracle_functions``); the calls' stages are empty then.
    function: Optional[str] = None
    # -- issue 30's constructs (drawn by ``_issue30``, from a stream of their own) --
    #: ``(stage, position)``: one stateful stage module object (``bn``,
    #: ``counter``) in the stages of every distinct expert, at ``position``
    #: (0: first, -1: last).
    shared_stage: Optional[Tuple[str, int]] = None
    #: The caller adds what the experts kept (``self.keep``, stage ``keep``)
    #: to the loss.
    keep_in_loss: bool = False
    #: ``"with_inputs"``: ``autograd.grad`` / ``backward(inputs=...)`` also
    #: names the kept tensors; ``"alone"``: names only them.
    keep_named: Optional[str] = None
    #: ``torch.autograd.functional.jacobian`` / ``jvp`` / ``hvp`` of a function
    #: of call 0's input that runs the whole batch, instead of the backward.
    transform: Optional[str] = None
    #: The caller's ``torch.set_num_threads`` around each iteration.
    threads: Optional[int] = None
    #: ``(call, exception, other)``: before the first iteration, a batch in
    #: which call ``call``'s expert raises ``exception`` (a BaseException that
    #: is not an Exception) in forward, and call ``other``'s (if any) a
    #: ValueError.
    interrupt: Optional[Tuple[int, str, Optional[int]]] = None
    # -- issue 46's constructs (drawn by ``_issue46``, from a stream of their own) --
    #: What the caller changes between an iteration's forward(s) and its
    #: backward: ``"task"`` (the ``task`` stages' plain attribute), ``"eval"``
    #: (``eval()`` on every expert; ``train()`` again at the next iteration).
    between: Tuple[str, ...] = ()
    #: Forwards of the batch per iteration before its one backward (the
    #: ``task`` stages' attribute is the forward's number in each).
    forwards: int = 1
    #: The caller's autograd setting around every iteration (forward and
    #: backward): ``"allow_mutation"`` (``allow_mutation_on_saved_tensors``),
    #: ``"saved_hooks"`` (a lossy ``saved_tensors_hooks`` pack: a bf16 round
    #: trip), ``"disable_saved_hooks"`` (``disable_saved_tensors_hooks``).
    caller_ctx: Optional[str] = None
    #: The calls' floating inputs are a ``__torch_function__`` subclass.
    subclass: bool = False

    @property
    def n(self) -> int:
        return len(self.calls)

    @property
    def draws(self) -> bool:
        """Whether an expert draws random numbers (compare with the reference
        loop that activates per-call streams, not the plain loop)."""
        return (any(s in RANDOM_STAGES for c in self.calls for s in c.stages)
                or self.function in RANDOM_FUNCTIONS)

    @property
    def backward(self) -> bool:
        return self.grad_mode == "grad"

    def checkpoint_of(self, i: int) -> bool:
        return self.checkpoint if isinstance(self.checkpoint, bool) else self.checkpoint[i]

    def describe(self) -> str:
        entry = (f"map_with_parallel_backward({self.function})" if self.function
                 else "parallel_apply")
        lines = [f"case {self.index} of seed {self.seed}: {entry}, {self.n} call(s), mode={self.mode}, "
                 f"checkpoint={self.checkpoint}, dtype={self.dtype}, grad_mode={self.grad_mode}, "
                 f"frame={self.frame}, iterations={self.iterations}"]
        for i, c in enumerate(self.calls):
            extras = []
            if c.share_with is not None:
                extras.append(f"same module as call {c.share_with}")
            if c.same_input_as is not None:
                extras.append(f"same input as call {c.same_input_as}")
            lines.append(f"  call {i}: stages={list(c.stages)} output={c.output} x={c.x_kind} "
                         f"extra={c.extra}" + (f" ({', '.join(extras)})" if extras else ""))
        lines.append(f"  caller: pre_autocast_use={self.pre_autocast_use} tied={self.tied} "
                     f"post_ops={list(self.post_ops)} hooks={list(self.hooks)} "
                     f"retain_grad={self.retain_grad} grad_method={self.grad_method} "
                     f"second_backward={self.second_backward} optimizer={self.optimizer} "
                     f"raise_at={self.raise_at}")
        lines.append(f"  issue 30: shared_stage={self.shared_stage} keep_in_loss={self.keep_in_loss} "
                     f"keep_named={self.keep_named} transform={self.transform} "
                     f"threads={self.threads} interrupt={self.interrupt}")
        lines.append(f"  issue 46: between={list(self.between)} forwards={self.forwards} "
                     f"caller_ctx={self.caller_ctx} subclass={self.subclass}")
        return "\n".join(lines)


def _weighted(rng: random.Random, weights: dict, k: int) -> List[str]:
    names = list(weights)
    return rng.choices(names, weights=[weights[n] for n in names], k=k)


def _call(rng: random.Random, dtype: str, i: int, raise_stage: Optional[str]) -> CallSpec:
    stages = _weighted(rng, _STAGE_WEIGHTS, rng.choice((1, 1, 2, 2, 3)))
    if dtype == "bfloat16":
        stages = [s if s != "orthogonal" else "linear" for s in stages]
    stages = list(dict.fromkeys(stages))  # each stage once per expert
    if raise_stage is not None:
        stages.insert(rng.randrange(len(stages) + 1), raise_stage)
    extra = "idx" if "embedding" in stages else rng.choice(EXTRAS + ("none",) * 3)
    x_kind = rng.choice(X_KINDS)
    if "requires_grad_" in stages and rng.random() < 0.7:
        x_kind = "leaf"  # where it does something
    return CallSpec(stages=tuple(stages), output=_weighted(rng, _OUTPUT_WEIGHTS, 1)[0],
                    x_kind=x_kind, extra=extra)


def generate(seed: int, index: int) -> Case:
    """Case ``index`` of fuzz seed ``seed``."""
    rng = random.Random(f"{seed}:{index}")
    n = rng.choice((1, 2, 2, 2, 3, 3))
    dtype = rng.choice(DTYPES)
    raise_at: Optional[Tuple[int, str]] = None
    if n >= 2 and rng.random() < 0.06:
        raise_at = (rng.randrange(n), rng.choice(("forward", "backward")))
    function = rng.choice(sorted(FUNCTIONS)) if rng.random() < 0.12 else None
    if function is not None:
        raise_at = None
    calls: List[CallSpec] = []
    for i in range(n):
        if function is not None:
            share = rng.randrange(i) if i and rng.random() < 0.2 else None
            calls.append(CallSpec(stages=(), output="tensor", x_kind=rng.choice(X_KINDS),
                                  extra="none", share_with=share))
            continue
        stage = None
        if raise_at is not None and raise_at[0] == i:
            stage = "raise_forward" if raise_at[1] == "forward" else "raise_backward"
        call = _call(rng, dtype, i, stage)
        if raise_at is not None and "ckpt_reentrant" in call.stages:
            # two failing calls: which error surfaces first is its own finding (D13)
            call = dataclasses.replace(call, stages=tuple(
                s for s in call.stages if s != "ckpt_reentrant"))
        if raise_at is not None and call.output in ("dataclass", "namespace"):
            call = dataclasses.replace(call, output="tensor")  # the runtime refuses those first
        if i and rng.random() < 0.2 and (raise_at is None or raise_at[0] != i):  # the same module object as an earlier call
            j = rng.randrange(i)
            call = dataclasses.replace(calls[j], x_kind=call.x_kind, extra=calls[j].extra,
                                       share_with=calls[j].share_with if calls[j].share_with
                                       is not None else j)
        if i and rng.random() < 0.1:
            j = rng.randrange(i)
            # An input that one call modifies in place and another reads: the
            # runtime's calls race (reported as D23), not drawn.
            if "input_inplace" not in call.stages + calls[j].stages and not any(
                    c.same_input_as == j and "input_inplace" in c.stages for c in calls):
                call = dataclasses.replace(call, same_input_as=j, x_kind=calls[j].x_kind)
        calls.append(call)
    mode = rng.choice(MODES)
    ck_choice = rng.random()
    checkpoint: Union[bool, Tuple[bool, ...]] = (
        False if ck_choice < 0.5 or function is not None else True if ck_choice < 0.75
        else tuple(rng.random() < 0.5 for _ in range(n)))
    grad_mode = rng.choices(GRAD_MODES, weights=(8, 1.5, 0.5))[0]
    frame = "none"
    if grad_mode == "grad":
        frame = rng.choices(FRAMES, weights=(10, 2, 1, 1))[0]
    elif rng.random() < 0.2:
        frame = "autocast"
    if frame == "ckpt_reentrant":
        # A Parameter returned from a reentrant checkpoint's function gets the
        # checkpoint's grad_fn in the loop itself: its backward recurses forever.
        calls = [dataclasses.replace(c, output="tensor") if c.output == "own_param" else c
                 for c in calls]
    pre_autocast_use = frame == "autocast" and rng.random() < 0.5
    backward = grad_mode == "grad"
    grad_method = rng.choices(GRAD_METHODS, weights=(6, 2, 2))[0] if backward else "backward"
    optimizer = "none"
    if backward and grad_method != "autograd_grad" and rng.random() < 0.3:
        optimizer = rng.choice(("sgd", "adamw"))
        if any("embedding" in c.stages for c in calls):
            optimizer = "sgd"  # AdamW refuses sparse gradients (in the loop too)
    iterations = 1
    if backward and rng.random() < 0.3 or mode == "auto" and rng.random() < 0.5:
        iterations = rng.choice((2, 2, 3))
    case = Case(
        seed=seed, index=index, calls=tuple(calls), mode=mode, checkpoint=checkpoint,
        dtype=dtype, grad_mode=grad_mode, frame=frame, pre_autocast_use=pre_autocast_use,
        tied=n >= 2 and rng.random() < 0.1,
        post_ops=tuple(op for op in POST_OPS if rng.random() < 0.15),
        hooks=tuple(h for h in HOOKS if backward and rng.random() < 0.15),
        retain_grad=backward and rng.random() < 0.15,
        grad_method=grad_method,
        second_backward=backward and grad_method == "backward" and rng.random() < 0.1,
        optimizer=optimizer, iterations=iterations, raise_at=raise_at, function=function,
    )
    case = _issue30(case, random.Random(f"{seed}:{index}:issue30"))
    return _issue46(case, random.Random(f"{seed}:{index}:issue46"))


#: The compile backends a case may draw, and how often (inductor compiles
#: for seconds: rare).
_BACKEND_WEIGHTS = {"eager": 10, "aot_eager": 10, "inductor": 10}


def _issue30(case: Case, rng: random.Random) -> Case:
    """Issue 30's constructs, drawn from their own stream ``rng`` so that the
    rest of every case (and every known divergence's witness) stays as it was:
    a stateful stage shared by distinct experts, tensors kept from inside a
    call, functional transforms, the caller's thread count, compiled stages,
    BaseExceptions, and (issue 34) plain-attribute state the forward reads
    back."""
    if case.function is not None:
        return case
    calls = list(case.calls)
    changes: Dict[str, object] = {}

    def add(i: int, stage: str, at: Optional[int] = None) -> None:
        """``stage`` in call ``i``'s expert (and so in every call sharing it)."""
        i = calls[i].share_with if calls[i].share_with is not None else i
        stages = list(calls[i].stages)
        if stage in stages:
            return
        pos = rng.randrange(len(stages) + 1) if at is None else (len(stages) if at < 0 else at)
        stages.insert(pos, stage)
        for k, c in enumerate(calls):
            if k == i or c.share_with == i:
                calls[k] = dataclasses.replace(c, stages=tuple(stages))

    roots = [i for i, c in enumerate(calls) if c.share_with is None]
    backward = case.grad_mode == "grad"
    # 1. one stateful stage module in several distinct experts
    if len(roots) >= 2 and rng.random() < 0.08:
        changes["shared_stage"] = (rng.choice(SHARED_STAGES), rng.choice((0, -1)))
    # 2. tensors kept from inside a call
    if rng.random() < 0.12:
        for i in rng.sample(roots, rng.randint(1, len(roots))):
            add(i, rng.choice(("keep", "keep", "keep_plain")))
        changes["keep_in_loss"] = backward and rng.random() < 0.5
        if backward and case.grad_method != "backward" and rng.random() < 0.9:
            changes["keep_named"] = rng.choice(("with_inputs", "with_inputs", "alone"))
    # 3. functional transforms over the whole batch
    if (backward and case.frame == "none" and case.raise_at is None and rng.random() < 0.08
            and not any({"input_inplace", "ckpt_reentrant"} & set(c.stages) for c in calls)):
        changes.update(transform=rng.choice(("jacobian", "jacobian", "jvp", "hvp")),
                       grad_method="backward", second_backward=False, hooks=(),
                       retain_grad=False, keep_named=None)
    # 4. the caller's thread count
    threads = rng.random()
    if threads < 0.06:
        for i in rng.sample(roots, rng.randint(1, len(roots))):
            add(i, "threads")
        if threads < 0.045:
            changes["threads"] = 1
    # 5. compiled stages, each backend
    if rng.random() < 0.05:
        backends = [b for b in compile_backends()
                    if b != "inductor" or (case.dtype == "float32" and case.frame == "none"
                                           and backward)]
        backend = rng.choices(backends, weights=[_BACKEND_WEIGHTS[b] for b in backends])[0]
        for i in rng.sample(roots, rng.randint(1, len(roots))):
            add(i, f"compiled_{backend}")
    # 6. BaseExceptions in forward (not with the other raise construct)
    if case.n >= 2 and case.raise_at is None and rng.random() < 0.04:
        k = rng.randrange(case.n)
        root_k = calls[k].share_with if calls[k].share_with is not None else k
        others = [j for j in range(case.n)
                  if (calls[j].share_with if calls[j].share_with is not None else j) != root_k]
        other = rng.choice(others) if others and rng.random() < 0.5 else None
        changes["interrupt"] = (k, rng.choice(("Interrupt", "SystemExit")), other)
        add(k, "interrupt")
        if other is not None:
            add(other, "interrupt")
        for i in roots:
            add(i, "mark", -1)
    # 7. plain-attribute state the forward reads back (issue 34)
    if rng.random() < 0.06:
        for i in rng.sample(roots, rng.randint(1, len(roots))):
            add(i, "step")
    if calls == list(case.calls) and not changes:
        return case
    # The runtime refuses these outputs in forward (a clear error, the
    # contract): the constructs above would never be reached.
    calls = [dataclasses.replace(c, output="tensor") if c.output in ("dataclass", "namespace")
             else c for c in calls]
    return dataclasses.replace(case, calls=tuple(calls), **changes)  # type: ignore[arg-type]


def _issue46(case: Case, rng: random.Random) -> Case:
    """Issue 46's constructs, drawn from their own stream ``rng`` (the rest
    of every case, and every known divergence's witness, stays as it was):
    state the caller changes between forward and backward, tensors tied
    across distinct experts and changed in forward, the caller's autograd
    settings (``allow_mutation_on_saved_tensors``, its own
    ``saved_tensors_hooks``, ``disable_saved_tensors_hooks``), a seed set
    inside an expert, ``.data`` writes, tensor-subclass inputs."""
    if case.function is not None:
        return case
    calls = list(case.calls)
    changes: Dict[str, object] = {}
    roots = [i for i, c in enumerate(calls) if c.share_with is None]
    backward = case.grad_mode == "grad"

    def add(i: int, stage: str) -> None:
        """``stage`` in call ``i``'s expert (and so in every call sharing it)."""
        share = calls[i].share_with
        i = share if share is not None else i
        stages = list(calls[i].stages)
        if stage in stages:
            return
        stages.insert(rng.randrange(len(stages) + 1), stage)
        for k, c in enumerate(calls):
            if k == i or c.share_with == i:
                calls[k] = dataclasses.replace(c, stages=tuple(stages))

    def some_roots() -> List[int]:
        return rng.sample(roots, rng.randint(1, len(roots)))

    # 1. attributes and train/eval changed between forward(s) and backward
    # (not inside a checkpoint frame: the loop's own frame recomputes with
    # what the caller changed, torch.utils.checkpoint's semantics, and raises
    # or computes other values)
    if rng.random() < 0.035 and case.frame not in ("ckpt_nonreentrant", "ckpt_reentrant"):
        between: List[str] = []
        if rng.random() < 0.75:
            for i in some_roots():
                add(i, "task")
            between.append("task")
        if not between or rng.random() < 0.5:
            between.append("eval")
            if rng.random() < 0.6:
                for i in some_roots():
                    add(i, "train_dropout")
        changes["between"] = tuple(between)
        if backward and case.transform is None:
            changes["forwards"] = rng.choice((1, 2, 3))
    # 2. a tensor tied across distinct experts and changed in forward; an EMA
    # teacher shared by them (a known limit)
    if len(roots) >= 2 and rng.random() < 0.04:
        stage = rng.choices(("drift_buffer", "drift_param", "drift_param_rg", "teacher"),
                            weights=(3, 2, 2, 2))[0]
        for i in rng.sample(roots, rng.randint(2, len(roots))):
            add(i, stage)
    # 3. a seed set inside an expert (fork_rng or not)
    if rng.random() < 0.03:
        for i in some_roots():
            add(i, rng.choice(("seed", "fork_seed")))
    # 4. .data writes in forward
    if rng.random() < 0.03:
        for i in some_roots():
            add(i, rng.choice(("data_clamp", "data_clamp", "data_decay")))
    # 5. the caller's autograd settings around the calls
    ctx = rng.random()
    if ctx < 0.025:
        changes["caller_ctx"] = "allow_mutation"
        for i in some_roots():
            add(i, "mutate_saved")
    elif ctx < 0.05:
        changes["caller_ctx"] = "saved_hooks"
    elif ctx < 0.065:
        changes["caller_ctx"] = "disable_saved_hooks"
    # 6. tensor-subclass inputs
    if rng.random() < 0.025:
        changes["subclass"] = True
    if calls == list(case.calls) and not changes:
        return case
    calls = [dataclasses.replace(c, output="tensor") if c.output in ("dataclass", "namespace")
             else c for c in calls]
    return dataclasses.replace(case, calls=tuple(calls), **changes)  # type: ignore[arg-type]


#: Stages that change in place a tensor an earlier op of the call saved (its
#: input after a Linear saved it; an EMA teacher's weights after its forward).
SAVED_THEN_CHANGED = frozenset({"input_inplace", "teacher"})


def constructs(case: Case) -> FrozenSet[str]:
    """The names of everything a case is made of (``stage:bn``,
    ``output:aux``, ``caller:autocast``, ``mode:lanes``, ``shared+stateful``...)."""
    names = {f"mode:{case.mode}", f"dtype:{case.dtype}", f"grad_mode:{case.grad_mode}",
             f"frame:{case.frame}", f"grad_method:{case.grad_method}",
             f"optimizer:{case.optimizer}"}
    flags = [case.checkpoint_of(i) for i in range(case.n)]
    names.add("checkpoint:all" if all(flags) else "checkpoint:none" if not any(flags)
              else "checkpoint:mixed")
    for i, c in enumerate(case.calls):
        names.update(f"stage:{s}" for s in c.stages)
        names.add(f"output:{c.output}")
        names.add(f"x:{c.x_kind}")
        names.add(f"extra:{c.extra}")
        if c.share_with is not None:
            names.add("shared")
            if STATEFUL_STAGES & set(c.stages):
                names.add("shared+stateful")
        if c.same_input_as is not None:
            names.add("same_input")
    if case.function is not None:
        names.update(("entry:map", f"fn:{case.function}"))
    names.update(f"post:{p}" for p in case.post_ops)
    names.update(f"hook:{h}" for h in case.hooks)
    for flag, name in ((case.pre_autocast_use, "pre_autocast_use"), (case.tied, "tied"),
                       (case.retain_grad, "retain_grad"),
                       (case.second_backward, "second_backward"),
                       (case.iterations > 1, "iterations>1"), (case.draws, "draws")):
        if flag:
            names.add(name)
    if case.raise_at is not None:
        names.add(f"raise:{case.raise_at[1]}")
    # issue 30
    if case.shared_stage is not None:
        names.add(f"shared_stage:{case.shared_stage[0]}")
    if case.keep_in_loss:
        names.add("keep:in_loss")
    if case.keep_named is not None:
        names.add(f"keep:named_{case.keep_named}")
        names.add(f"keep:named_{case.keep_named}+{case.grad_method}")
    if case.transform is not None:
        names.add(f"transform:{case.transform}")
    if case.threads is not None:
        names.add(f"threads:{case.threads}")
    if case.interrupt is not None:
        names.add(f"interrupt:{case.interrupt[1]}")
        if case.interrupt[2] is not None:
            names.add("interrupt+value_error:" + (
                "earlier" if case.interrupt[2] < case.interrupt[0] else "later"))
    # issue 46
    names.update(f"between:{b}" for b in case.between)
    if case.forwards > 1:
        names.add("forwards>1")
    if case.caller_ctx is not None:
        names.add(f"caller:{case.caller_ctx}")
        if case.caller_ctx == "saved_hooks" and any(
                SAVED_THEN_CHANGED & set(c.stages) for c in case.calls):
            # (the runtime packs a call's saves once it returned: one changed
            # in place later in the call raises, naming the call)
            names.add("caller:saved_hooks+saved_then_changed")
    if case.subclass:
        names.add("subclass")
    tied = [s for s in TIED_STAGES
            if len({_root(case, i) for i, c in enumerate(case.calls) if s in c.stages}) >= 2]
    names.update(f"tied:{s}" for s in tied)
    if case.grad_mode == "grad" and any(flags):
        if "post:in_add_" in names:
            names.add("checkpoint+post:in_add_")
        if "post:out_mul_" in names and any(c.output in ("identity", "input_view", "input_pass")
                                            for c in case.calls):
            names.add("checkpoint+post:out_mul_on_input")
        if any(flags[i] and "input_inplace" in c.stages for i, c in enumerate(case.calls)):
            names.add("checkpoint+stage:input_inplace")
        if any(flags[i] and "requires_grad_" in c.stages and c.x_kind == "leaf"
               for i, c in enumerate(case.calls)):
            names.add("checkpoint+stage:requires_grad_")
        # issue 46: a checkpointed expert whose forward changes a parameter
        # (its own, or one it shares with other experts) in place
        names.update(f"checkpoint+stage:{s}"
                     for s in ("drift_param", "drift_param_rg", "teacher", "data_decay")
                     if any(flags[i] and s in c.stages for i, c in enumerate(case.calls)))
    roots = [_input_root(case, i) for i in range(case.n)]
    if any("requires_grad_" in c.stages and c.x_kind == "leaf"
           # a checkpointed call raises first (unless its forward runs without
           # grad, in a reentrant frame, where it is not checkpointed)
           and not (flags[i] and case.grad_mode == "grad" and case.frame != "ckpt_reentrant")
           and roots[i] in roots[i + 1:] for i, c in enumerate(case.calls)):
        names.add("requires_grad_+later_same_input")
    return frozenset(names)


def _root(case: Case, i: int) -> int:
    """The call whose module object call ``i`` uses."""
    share = case.calls[i].share_with
    return i if share is None else share


def _input_root(case: Case, i: int) -> int:
    """The call whose input tensor call ``i`` gets (``same_input_as`` chains)."""
    while case.calls[i].same_input_as is not None:
        i = case.calls[i].same_input_as  # type: ignore[assignment]
    return i


def cases(seed: int, count: int, only: Optional[Sequence[int]] = None) -> List[Case]:
    indices = list(only) if only is not None else range(count)
    return [generate(seed, k) for k in indices]
