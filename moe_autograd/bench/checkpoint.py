"""Checkpointed experts: memory kept for backward, time, early recomputation.

``checkpoint``
    16 experts of 8 x (Linear(512, 512) + ReLU), 256 tokens each, through
    :func:`~moe_autograd.parallel_apply` with ``checkpoint=True`` vs
    ``checkpoint=False``. Memory (see :func:`kept_bytes`): the bytes kept for
    backward between forward and backward, found with public means only.
    Goal: checkpointed <= 1.05 x the inputs' bytes. Time: checkpointed / plain
    forward + backward, goal <= 1.35 (one extra forward costs ~1/3 of a
    forward + backward).
``recompute-early``
    The same checkpointed experts feeding 4 more Linear(512, 512) layers, with
    :func:`~moe_autograd.recompute_early` at the output of the *last* of them,
    just before the loss (recomputation is queued as soon as backward starts,
    so it can overlap the backward of all 4 layers) vs without (it starts
    when the experts' outputs get their gradients). Reports the gain in ms and
    %, against its ceiling: the recomputation's own time, measured in the same
    loop as a no-grad forward of the experts. No goal.
``checkpoint/time-dropout``
    The ``checkpoint`` experts with ``Dropout(0.1)`` after every ReLU (the same
    weights), in the same loop as ``checkpoint/time``: a drawing call pays
    for its random ops only (one routed op per dropout), not per aten op.
    Goal <= 1.35.
``rng``
    The cost of the per-call random stream (:mod:`moe_autograd.rng`): 16
    small MLP experts (Linear(64, 64), ReLU, Linear(64, 64); 32 tokens),
    without and with ``Dropout(0.1)``, forward + backward through
    ``parallel_apply(mode="parallel")`` (every call on a worker, the mode that
    does not depend on what the policy learnt), against the same calls with the RNG
    machinery stubbed out (:class:`CallRng` ``fork`` returning a stream whose
    ``activate`` does nothing; dropout then draws from the global generator).
    Goal <= 1.05 for both; ``rng/stream-dropout-256`` repeats the dropout row
    with the ``compute`` row's experts (256 -> 1024 -> 256, 64 tokens). Two
    rows without a goal isolate the stream from the runtime: one small expert
    called directly, forward under ``CallRng.fork().activate()`` vs plain,
    backward outside.
"""
import os
import statistics
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..parallel import parallel_apply, recompute_early
from ..rng import CallRng
from .core import backward_all
from .measure import Plan, Row, compare, measure, row

__all__ = ["bench_checkpoint", "bench_recompute_early", "bench_rng", "kept_bytes", "deep_experts",
           "dropout_experts", "without_call_streams"]

EXPERTS, DEPTH, WIDTH, TOKENS, HEAD = 16, 8, 512, 256, 4
_MIB = 2.0 ** 20
_DEEP: Dict[str, list] = {}


def deep_experts() -> Tuple[List[nn.Module], List[Tensor]]:
    """16 experts of 8 x (Linear(512, 512) + ReLU) and 256 tokens each, built
    once and shared by the ``checkpoint`` and ``recompute-early`` groups."""
    if not _DEEP:
        torch.manual_seed(0)
        _DEEP["experts"] = [
            nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
            for _ in range(EXPERTS)
        ]
        _DEEP["xs"] = [torch.randn(TOKENS, WIDTH, requires_grad=True) for _ in range(EXPERTS)]
    return _DEEP["experts"], _DEEP["xs"]


def dropout_experts(p: float = 0.1) -> List[nn.Module]:
    """The :func:`deep_experts` with ``Dropout(p)`` after every ReLU, sharing
    their Linear layers (same weights, same compute plus the dropouts)."""
    experts, _ = deep_experts()
    return [nn.Sequential(*[m for layer in e.children() for m in
                            ((layer, nn.Dropout(p)) if isinstance(layer, nn.ReLU) else (layer,))])
            for e in experts]


def _storages(tensors: Sequence[Tensor]) -> Dict[int, int]:
    """``{data_ptr: nbytes}`` of the tensors' unique storages."""
    found: Dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


def kept_bytes(experts: Sequence[nn.Module], xs: Sequence[Tensor], checkpoint: bool
               ) -> Tuple[int, int]:
    """Runs forward + backward once; returns the bytes kept for backward after
    the forward as ``(saved, inputs)``, unique storages, parameters excluded:

    * ``saved``: the storages autograd saved during ``parallel_apply``, seen
      by a ``saved_tensors_hooks`` pack hook around it (the runtime packs the
      calls' saved tensors through the caller's hooks, in call order);
    * ``inputs``: the storages of the caller's inputs not already among them.
      Every call keeps its inputs until backward (a checkpointed one to
      recompute from) as detached views that share the caller's storage, so
      they are counted from the caller's tensors, not read from the runtime.
    """
    params = _storages([p for e in experts for p in e.parameters()])
    saved: Dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()  # dict writes are atomic under the GIL
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = parallel_apply(experts, xs, checkpoint=checkpoint)
    inputs = {ptr: n for ptr, n in _storages(xs).items() if ptr not in saved and ptr not in params}
    backward_all(outs)
    return sum(saved.values()), sum(inputs.values())


def bench_checkpoint(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=1, reps=12), Plan(warmup=0, reps=2))
    experts, xs = deep_experts()
    inputs = sum(_storages(xs).values())
    # The memory passes double as the first warm-up of both variants.
    plain_saved, plain_inputs = kept_bytes(experts, xs, checkpoint=False)
    ckpt_saved, ckpt_inputs = kept_bytes(experts, xs, checkpoint=True)
    plain, ckpt = plain_saved + plain_inputs, ckpt_saved + ckpt_inputs
    warning = ("WARNING: the hooks saw nothing of the plain calls: saved_tensors_hooks did not "
               "reach the workers, so 'saved' is not measured; " if plain_saved == 0 else "")

    dropped = dropout_experts()

    def step(mods: Sequence[nn.Module], checkpoint: bool, streams: bool = True
             ) -> Callable[[], None]:
        def run() -> None:
            with nullcontext() if streams else without_call_streams():
                outs = parallel_apply(mods, xs, checkpoint=checkpoint)
            backward_all(outs)
        return run

    def forward(mods: Sequence[nn.Module]) -> Callable[[], None]:
        def run() -> None:  # what a recomputation adds, at best: one no-grad forward
            with torch.no_grad():
                parallel_apply(mods, xs)
        return run

    # Two loops, one per set of experts, in the same run.
    s = measure({"plain": step(experts, False), "ours": step(experts, True),
                 "fwd": forward(experts)}, plan.reps, plan.warmup)
    s.update(measure({"plain-dropout": step(dropped, False), "ours-dropout": step(dropped, True),
                      "ours-dropout-nostream": step(dropped, True, streams=False),
                      "fwd-dropout": forward(dropped)}, plan.reps, plan.warmup))

    def floor(plain: str, fwd: str) -> str:
        ratios = [f / p for p, f in zip(s[plain], s[fwd])]
        return (f"one no-grad forward alone (what recomputation redoes) = "
                f"{statistics.median(ratios):.2f} of plain")

    rng_share = statistics.median(
        [(o - n) / p for o, n, p in zip(s["ours-dropout"], s["ours-dropout-nostream"],
                                         s["plain-dropout"])])
    shape = f"{EXPERTS} experts x {DEPTH} x Linear({WIDTH},{WIDTH}), {TOKENS} tokens"
    return [
        row("checkpoint/memory", inputs / _MIB, ckpt / _MIB, ckpt / inputs, 1.05,
            f"{warning}{shape}; kept for backward, unique storages, parameters excluded: "
            f"ours = packed by saved_tensors_hooks around parallel_apply "
            f"{ckpt_saved / _MIB:.1f} MiB + the caller's input storages (each call keeps its "
            f"inputs as detached views, to recompute from) {ckpt_inputs / _MIB:.1f} MiB; "
            f"baseline = inputs' bytes", unit="MiB"),
        row("checkpoint/memory-vs-plain", plain / _MIB, ckpt / _MIB, ckpt / plain, None,
            f"{warning}baseline = checkpoint=False: saved (hooks) {plain_saved / _MIB:.1f} MiB "
            f"+ inputs not saved {plain_inputs / _MIB:.1f} MiB", unit="MiB"),
        compare("checkpoint/time", s, "plain", "ours", 1.35,
                f"fwd+bwd; baseline = checkpoint=False; {floor('plain', 'fwd')}"),
        compare("checkpoint/time-dropout", s, "plain-dropout", "ours-dropout", 1.35,
                f"same experts with Dropout(0.1) after every ReLU (8 per expert); fwd+bwd; "
                f"baseline = checkpoint=False; {floor('plain-dropout', 'fwd-dropout')}; "
                f"random streams add {rng_share:+.3f} of plain (vs the same checkpointed calls "
                f"with CallRng.fork stubbed out)"),
    ]


def bench_recompute_early(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=1, reps=12), Plan(warmup=0, reps=2))
    experts, xs = deep_experts()
    torch.manual_seed(1)
    head = [nn.Linear(WIDTH, WIDTH) for _ in range(HEAD)]
    hooked: List[bool] = []

    def step(early: bool) -> None:
        outs = parallel_apply(experts, xs, checkpoint=True)
        h = head[0](torch.cat(outs))
        for layer in head[1:]:
            h = layer(torch.relu(h))
        if early:  # the last layer's output: backward reaches it first
            trigger, h = h, recompute_early(h, outs)
            hooked.append(h is not trigger)
        h.sum().backward()

    def recompute() -> None:  # the recomputation's work: the experts' forward on workers
        with torch.no_grad():
            parallel_apply(experts, xs)

    s = measure({"ours": lambda: step(True), "late": lambda: step(False), "recompute": recompute},
                plan.reps, plan.warmup)
    r = compare("recompute-early", s, "late", "ours", None,
                f"checkpointed experts + {HEAD} Linear({WIDTH},{WIDTH}); trigger = last layer's "
                f"output (before the loss); baseline = no recompute_early")
    if r.baseline is not None and r.ours is not None:
        gain = r.baseline - r.ours
        ceiling = statistics.median(s["recompute"])
        cores = os.cpu_count() or 1
        why = (f"limited: on {cores} cores recompute and backward compete for the same cores "
               f"(see note); " if cores <= 8 else "")
        r.note = (f"gain {gain:+.1f} ms ({gain / r.baseline:+.1%}) of at most ~{ceiling:.0f} ms "
                  f"(recompute alone, {ceiling / r.baseline:.0%} of the step); {why}" + r.note)
    if not all(hooked):
        r.note = ("WARNING: recompute_early returned its trigger unchanged (it found no "
                  "checkpointed calls behind the outputs), so both variants are the same; "
                  + r.note)
    return [r]


# -- the per-call random stream --------------------------------------------------------
SMALL_EXPERTS, SMALL_WIDTH, SMALL_TOKENS, DIRECT_CALLS = 16, 64, 32, 32
BIG_WIDTH, BIG_HIDDEN, BIG_TOKENS = 256, 1024, 64


class _NoStream:
    """What :meth:`CallRng.fork` returns under :func:`without_call_streams`."""

    seed = 0
    drew: Optional[bool] = None

    def activate(self) -> ContextManager[None]:
        return nullcontext()


_NO_STREAM = _NoStream()
_REAL_FORK = CallRng.__dict__["fork"]
_STUB_FORK = classmethod(lambda cls, generator=None: _NO_STREAM)


class without_call_streams:
    """Within the block, calls started on any thread get no random stream
    (:meth:`CallRng.fork` returns a stream whose ``activate`` does nothing):
    the runtime as it would be without RNG machinery, the baseline of the
    ``rng`` rows. Not re-entrant; for benchmarks only."""

    def __enter__(self) -> None:
        CallRng.fork = _STUB_FORK  # type: ignore[method-assign,assignment]

    def __exit__(self, *exc: Any) -> None:
        CallRng.fork = _REAL_FORK  # type: ignore[method-assign]


def _small_experts(dropout: bool, width: int = SMALL_WIDTH, hidden: int = SMALL_WIDTH
                   ) -> List[nn.Module]:
    torch.manual_seed(2)
    return [nn.Sequential(nn.Linear(width, hidden), nn.ReLU(),
                          *([nn.Dropout(0.1)] if dropout else []),
                          nn.Linear(hidden, width))
            for _ in range(SMALL_EXPERTS)]


def bench_rng(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=10, reps=40, inner=5), Plan(warmup=3, reps=7, inner=2))
    big_plan = Plan.pick(quick, Plan(warmup=3, reps=15), Plan(warmup=1, reps=3))
    torch.manual_seed(3)
    xs = [torch.randn(SMALL_TOKENS, SMALL_WIDTH, requires_grad=True) for _ in range(SMALL_EXPERTS)]
    big_xs = [torch.randn(BIG_TOKENS, BIG_WIDTH, requires_grad=True) for _ in range(SMALL_EXPERTS)]

    def runtime(mods: Sequence[nn.Module], inputs: Sequence[Tensor], stream: bool
                ) -> Callable[[], None]:
        def step() -> None:
            with nullcontext() if stream else without_call_streams():
                outs = parallel_apply(mods, inputs, mode="parallel")
            backward_all(outs)
        return step

    def direct(mod: nn.Module, stream: bool) -> Callable[[], None]:
        x = xs[0]

        def step() -> None:
            for _ in range(DIRECT_CALLS):
                with CallRng.fork().activate() if stream else nullcontext():
                    y = mod(x)
                y.sum().backward()
        return step

    # One loop per pair: with two variants, each runs after the other as often
    # as before it (a longer rotation always puts the same variant before it).
    shape = (f"{SMALL_EXPERTS} experts Linear({SMALL_WIDTH},{SMALL_WIDTH})-ReLU-"
             f"{{}}Linear({SMALL_WIDTH},{SMALL_WIDTH}), {SMALL_TOKENS} tokens")
    rows = []
    for dropout, label in ((False, "no-random"), (True, "dropout")):
        mods = _small_experts(dropout)
        drop = "Dropout(0.1)-" if dropout else ""
        s = measure({"stream": runtime(mods, xs, True), "none": runtime(mods, xs, False)},
                    plan.reps, plan.warmup, plan.inner)
        rows.append(compare(
            f"rng/stream-{label}", s, "none", "stream", 1.05,
            f"parallel_apply(mode='parallel') fwd+bwd, {shape.format(drop)}; baseline = same "
            f"calls, no per-call stream (CallRng.fork stubbed out)"))
        s = measure({"stream": direct(mods[0], True), "none": direct(mods[0], False)},
                    plan.reps, plan.warmup, plan.inner)
        r = compare(
            f"rng/direct-{label}", s, "none", "stream", None,
            "one such expert called directly, fwd under CallRng.fork().activate() vs plain, "
            "bwd outside; per call", scale=1 / DIRECT_CALLS)
        if r.baseline is not None and r.ours is not None:
            r.note = f"{(r.ours - r.baseline) * 1e3:+.1f} us per call; " + r.note
        rows.append(r)
    big = _small_experts(True, BIG_WIDTH, BIG_HIDDEN)
    s = measure({"stream": runtime(big, big_xs, True), "none": runtime(big, big_xs, False)},
                big_plan.reps, big_plan.warmup)
    rows.append(compare(
        "rng/stream-dropout-256", s, "none", "stream", 1.05,
        f"same, {SMALL_EXPERTS} experts Linear({BIG_WIDTH},{BIG_HIDDEN})-ReLU-Dropout(0.1)-"
        f"Linear({BIG_HIDDEN},{BIG_WIDTH}), {BIG_TOKENS} tokens (the compute row's experts)"))
    return rows
