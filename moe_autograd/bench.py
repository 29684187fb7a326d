"""Benchmarks of the runtime against its baselines, measured side by side.

Run ``python -m moe_autograd bench [--quick] [--only NAME...] [--markdown]``.
Every row compares a baseline with ours in the *same* process and the *same*
loop; ``ratio`` is ours / baseline, so lower is better everywhere.

Methodology
-----------
* **Interleaving.** Within one row, every repetition runs each variant once,
  back to back, and the order rotates from one repetition to the next. Slow
  drift (another job on the machine, thermal or frequency changes, the
  allocator growing) then hits baseline and ours alike instead of whichever
  variant happened to run during the disturbance, and no variant always runs
  right after a particular other one.
* **Medians, paired.** Time columns are medians over repetitions: a few samples
  hit by a preemption or a page fault storm do not move them, where they would
  drag a mean. The ratio is the median of the per-repetition ratios (each pair
  was measured seconds apart), which cancels drift further; it may differ a
  little from the quotient of the two medians. The note gives the ratio's
  interquartile range and the number of repetitions: a wide range means a
  noisy machine, not a slow runtime.
* **Warm-up.** Each row first runs every variant untimed (thread start-up,
  first-touch allocation of gradients, lazy initialisation), then times.
* **GC.** The collector is disabled during each timed sample, as :mod:`timeit`
  does; the young generations are collected before each sample and a full
  collection runs before each row.
* ``--quick`` only cuts repetitions (and, for the two heavy rows, the warm-up):
  a smoke run of the whole table, not numbers to publish.

Rows and goals
--------------
``latency``
    32 calls of an autograd Function that sleeps L = 5 ms in forward and in
    backward, through :func:`~moe_autograd.map_with_parallel_backward`. All
    calls overlap in both passes, so the physical limit of forward + backward
    is 2L; goal: ours <= 1.3 x 2L. For comparison: ``latency/naive-pool`` (a
    ``ThreadPoolExecutor`` forward and one pool round trip per call in backward,
    inside a custom Function, as the seed did: the engine runs those backward
    nodes one after another, ~L + N*L) and ``latency/sequential`` (a plain
    ``apply`` loop, ~2*N*L).
``overhead``
    64 identity calls on tensors of 4 elements: the per-call cost of
    forward + backward through :func:`~moe_autograd.map_with_parallel_backward`
    vs a plain ``apply`` loop and one backward. Goal: <= 1.5x.
``compute``
    16 MLP experts (256 -> 1024 -> ReLU -> 256), 64 tokens each, forward +
    backward through :func:`~moe_autograd.parallel_apply` vs a Python loop.
    No goal: see the note printed with the row.
``checkpoint``
    16 experts of 8 x (Linear(512, 512) + ReLU), 256 tokens each, through
    ``parallel_apply`` with ``checkpoint=True`` vs ``checkpoint=False``.
    Memory: the unique storages (by ``untyped_storage().data_ptr()``) that
    autograd saves during the call, seen through
    ``torch.autograd.graph.saved_tensors_hooks`` around ``parallel_apply`` (the
    runtime applies the caller's hooks on its workers), plus the tensors the
    call records hold themselves and the hooks do not see (the inputs a
    checkpointed call keeps for its recomputation), parameters excluded. Goal:
    checkpointed <= 1.05 x the inputs' bytes. Time: checkpointed / plain
    forward + backward, goal <= 1.35 (one extra forward costs ~1/3 of a
    forward + backward).
``recompute-early``
    The same checkpointed experts feeding 4 more Linear(512, 512) layers before
    the loss, with :func:`~moe_autograd.recompute_early` at the output of the
    first of them (recomputation starts as soon as backward reaches it) vs
    without (it starts when the experts' outputs get their gradients). Reports
    the gain; no goal.
``remote``, ``moe``
    Rows from :func:`moe_autograd.bench_remote.run` and
    :func:`moe_autograd.moe.bench.run`, when those modules exist; each returns
    a list of dicts with keys ``name, baseline_ms, ours_ms, ratio, goal, note``.
"""
import argparse
import datetime
import gc
import importlib
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from .autograd import map_with_parallel_backward, run_isolated_backward, run_isolated_forward
from .executor import DEFAULT_WORKERS
from .parallel import parallel_apply, recompute_early

__all__ = ["Row", "main", "run_benchmarks", "GROUPS"]

Step = Callable[[], None]


# -- results -------------------------------------------------------------------
@dataclass
class Row:
    """One line of the table. ``goal`` is a string such as ``"<= 1.30"``."""

    name: str
    baseline: Optional[float]
    ours: Optional[float]
    ratio: Optional[float]
    goal: Optional[str] = None
    met: Optional[bool] = None
    note: str = ""
    unit: str = "ms"


_GOAL_RE = re.compile(r"^\s*(<=|≤|<|>=|≥|>)?\s*([0-9]*\.?[0-9]+)\s*x?\s*$")


def _judge(ratio: Optional[float], goal: Any) -> Tuple[Optional[str], Optional[bool]]:
    """Normalises a goal (a number = a maximum ratio, or ``"<= 1.5"``-like
    text) and says whether ``ratio`` meets it (None when it cannot tell)."""
    if goal is None or goal == "":
        return None, None
    if isinstance(goal, (int, float)) and not isinstance(goal, bool):
        op, bound = "<=", float(goal)
    else:
        match = _GOAL_RE.match(str(goal))
        if match is None:
            return str(goal), None
        op = {"≤": "<=", "≥": ">=", None: "<="}.get(match.group(1), match.group(1))
        bound = float(match.group(2))
    text = f"{op} {bound:.2f}"
    if ratio is None or not math.isfinite(ratio):
        return text, None
    met = {"<=": ratio <= bound, "<": ratio < bound,
           ">=": ratio >= bound, ">": ratio > bound}[op]
    return text, met


def _row(name: str, baseline: Optional[float], ours: Optional[float], ratio: Optional[float],
         goal: Any = None, note: str = "", unit: str = "ms") -> Row:
    goal_text, met = _judge(ratio, goal)
    return Row(name, baseline, ours, ratio, goal_text, met, note, unit)


# -- timing --------------------------------------------------------------------
def _time_ms(step: Step, inner: int) -> float:
    gc.collect(1)  # the young generations: last sample's cycles (a full pass costs ~0.1 s)
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(inner):
            step()
        return (time.perf_counter() - start) * 1e3 / inner
    finally:
        if enabled:
            gc.enable()


def measure(variants: Mapping[str, Step], reps: int, warmup: int, inner: int = 1
            ) -> Dict[str, List[float]]:
    """Milliseconds per step of every variant, ``reps`` samples each, taken in
    one loop with the order rotating every repetition (see the module doc)."""
    names = list(variants)
    gc.collect()
    for _ in range(warmup):
        for name in names:
            variants[name]()
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(_time_ms(variants[name], inner))
    return samples


def _quartiles(values: Sequence[float]) -> Tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _compare(name: str, samples: Mapping[str, List[float]], baseline: str, ours: str,
             goal: Any = None, note: str = "", scale: float = 1.0) -> Row:
    """A row from two variants of one :func:`measure`: medians of each, and the
    median of the paired per-repetition ratios."""
    base, mine = samples[baseline], samples[ours]
    ratios = [m / b for m, b in zip(mine, base)]
    lo, hi = _quartiles(ratios)
    spread = f"ratio IQR {lo:.2f}-{hi:.2f}, n={len(ratios)}"
    return _row(name, statistics.median(base) * scale, statistics.median(mine) * scale,
                statistics.median(ratios), goal, f"{note}; {spread}" if note else spread)


@dataclass(frozen=True)
class Plan:
    """Repetitions of one group: untimed warm-up runs, timed samples, and
    steps per sample (for steps too short to time one by one)."""

    warmup: int
    reps: int
    inner: int = 1


def _plan(quick: bool, full: Plan, short: Plan) -> Plan:
    return short if quick else full


# -- 1. latency-bound ----------------------------------------------------------
LATENCY_CALLS = 32
LATENCY_S = 0.005


class _Sleep(torch.autograd.Function):
    """Waits L in forward and in backward, like a remote or I/O-bound expert."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        time.sleep(LATENCY_S)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        time.sleep(LATENCY_S)
        return grad


class _PoolCall(torch.autograd.Function):
    """The seed's scheme: the inner Function's forward runs on the calling
    (pool) thread; its backward is one pool round trip per call, and the
    engine runs these nodes one after another."""

    @staticmethod
    def forward(ctx: Any, func: Any, pool: ThreadPoolExecutor,  # type: ignore[override]
                *args: Tensor) -> Any:
        inner_ctx, outputs = run_isolated_forward(func, *args)
        ctx.inner = (func, inner_ctx, pool)
        return outputs

    @staticmethod
    def backward(ctx: Any,  # type: ignore[override]
                 *grads: Tensor) -> Tuple[Optional[Tensor], ...]:
        func, inner_ctx, pool = ctx.inner
        return (None, None, *pool.submit(run_isolated_backward, func, inner_ctx, *grads).result())


def bench_latency(quick: bool) -> List[Row]:
    plan = _plan(quick, Plan(warmup=2, reps=15), Plan(warmup=1, reps=2))
    n, limit_ms = LATENCY_CALLS, 2 * LATENCY_S * 1e3
    xs = [torch.randn(8, requires_grad=True) for _ in range(n)]
    grads = [torch.ones(8) for _ in range(n)]
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="bench-naive")

    def ours() -> None:
        outs = [r[0] for r in map_with_parallel_backward(_Sleep, *[(x,) for x in xs])]
        torch.autograd.backward(outs, grads)

    def naive() -> None:
        outs = list(pool.map(lambda x: _PoolCall.apply(_Sleep, pool, x), xs))
        torch.autograd.backward(outs, grads)

    def sequential() -> None:
        outs = [_Sleep.apply(x) for x in xs]
        torch.autograd.backward(outs, grads)

    try:
        variants = {"ours": ours, "naive": naive, "sequential": sequential}
        s = measure(variants, plan.reps, plan.warmup)
    finally:
        pool.shutdown()
    s["limit"] = [limit_ms] * len(s["ours"])
    return [
        _compare("latency", s, "limit", "ours", 1.3,
                 f"baseline = physical limit 2L; {n} calls, L = {LATENCY_S * 1e3:g} ms"),
        _compare("latency/naive-pool", s, "naive", "ours", None,
                 "baseline = ThreadPoolExecutor fwd, per-call pool bwd (seed)"),
        _compare("latency/sequential", s, "sequential", "ours", None,
                 "baseline = plain apply loop"),
    ]


# -- 2. overhead ---------------------------------------------------------------
OVERHEAD_CALLS = 64


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


def bench_overhead(quick: bool) -> List[Row]:
    plan = _plan(quick, Plan(warmup=20, reps=40, inner=10), Plan(warmup=5, reps=7, inner=5))
    n = OVERHEAD_CALLS
    xs = [torch.randn(4, requires_grad=True) for _ in range(n)]
    grads = [torch.ones(4) for _ in range(n)]

    def ours() -> None:
        outs = [r[0] for r in map_with_parallel_backward(_Identity, *[(x,) for x in xs])]
        torch.autograd.backward(outs, grads)

    def plain() -> None:
        outs = [_Identity.apply(x) for x in xs]
        torch.autograd.backward(outs, grads)

    s = measure({"ours": ours, "plain": plain}, plan.reps, plan.warmup, plan.inner)
    return [_compare("overhead", s, "plain", "ours", 1.5,
                     f"per call, {n} calls on shape [4]; baseline = apply loop", scale=1 / n)]


# -- 3. compute-bound ----------------------------------------------------------
def _mlp(d_in: int, d_hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_in))


def _backward_all(outs: Sequence[Tensor]) -> None:
    torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])


def bench_compute(quick: bool) -> List[Row]:
    plan = _plan(quick, Plan(warmup=3, reps=20), Plan(warmup=1, reps=4))
    torch.manual_seed(0)
    experts = [_mlp(256, 1024) for _ in range(16)]
    xs = [torch.randn(64, 256, requires_grad=True) for _ in experts]

    def ours() -> None:
        _backward_all(parallel_apply(experts, xs))

    def loop() -> None:
        _backward_all([e(x) for e, x in zip(experts, xs)])

    s = measure({"ours": ours, "loop": loop}, plan.reps, plan.warmup)
    return [_compare("compute", s, "loop", "ours", None,
                     f"16 MLP experts 256-1024-256 x 64 tokens; baseline = Python loop; "
                     f"intra-op threads {torch.get_num_threads()}")]


# -- 4. checkpoint (a) ---------------------------------------------------------
_DEEP: Dict[str, Any] = {}


def _deep_experts() -> Tuple[List[nn.Module], List[Tensor]]:
    """16 experts of 8 x (Linear(512, 512) + ReLU) and 256 tokens each, built
    once and shared by the ``checkpoint`` and ``recompute-early`` groups."""
    if not _DEEP:
        torch.manual_seed(0)
        _DEEP["experts"] = [
            nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())])
            for _ in range(16)
        ]
        _DEEP["xs"] = [torch.randn(256, 512, requires_grad=True) for _ in range(16)]
    return _DEEP["experts"], _DEEP["xs"]


def _storage_key(t: Tensor) -> Tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _calls_under(outs: Sequence[Tensor]) -> List[Any]:
    """The call records of every parallel node in ``outs``' graphs (found by
    walking ``grad_fn``: a node's ctx keeps its plan)."""
    calls: List[Any] = []
    seen: Set[Any] = set()
    stack: List[Any] = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        plan = getattr(fn, "plan", None)
        calls.extend(getattr(plan, "calls", None) or ())
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return calls


def kept_bytes(experts: Sequence[nn.Module], xs: Sequence[Tensor], checkpoint: bool
               ) -> Tuple[int, int]:
    """Runs forward + backward once; returns the bytes kept for backward after
    the forward: ``(seen by saved_tensors_hooks, held by the calls themselves
    and not seen by the hooks)``, unique storages, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for e in experts for p in e.parameters()}
    saved: Dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        ptr, nbytes = _storage_key(t)
        if ptr not in params:
            saved[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = parallel_apply(experts, xs, checkpoint=checkpoint)
    held: Dict[int, int] = {}
    for call in _calls_under(outs):
        # A call keeps its (detached) inputs for backward or recomputation.
        for leaf in getattr(call, "_leaves", None) or ():
            if isinstance(leaf, Tensor):
                ptr, nbytes = _storage_key(leaf)
                if ptr not in params and ptr not in saved:
                    held[ptr] = nbytes
    _backward_all(outs)
    return sum(saved.values()), sum(held.values())


def bench_checkpoint(quick: bool) -> List[Row]:
    plan = _plan(quick, Plan(warmup=1, reps=12), Plan(warmup=0, reps=2))
    experts, xs = _deep_experts()
    mib = 2.0 ** 20
    inputs = sum(x.untyped_storage().nbytes() for x in xs)
    # The memory passes double as the first warm-up of both variants.
    plain_saved, plain_held = kept_bytes(experts, xs, checkpoint=False)
    ckpt_saved, ckpt_held = kept_bytes(experts, xs, checkpoint=True)
    plain, ckpt = plain_saved + plain_held, ckpt_saved + ckpt_held

    def ours() -> None:
        _backward_all(parallel_apply(experts, xs, checkpoint=True))

    def base() -> None:
        _backward_all(parallel_apply(experts, xs, checkpoint=False))

    s = measure({"ours": ours, "plain": base}, plan.reps, plan.warmup)
    return [
        _row("checkpoint/memory", inputs / mib, ckpt / mib, ckpt / inputs, 1.05,
             f"baseline = inputs' bytes; ours = saved {ckpt_saved / mib:.1f} MiB "
             f"+ held by calls {ckpt_held / mib:.1f} MiB", unit="MiB"),
        _row("checkpoint/memory-vs-plain", plain / mib, ckpt / mib, ckpt / plain, None,
             "baseline = checkpoint=False", unit="MiB"),
        _compare("checkpoint/time", s, "plain", "ours", 1.35,
                 "fwd+bwd; baseline = checkpoint=False"),
    ]


# -- 5. early recompute (b) ----------------------------------------------------
def bench_recompute_early(quick: bool) -> List[Row]:
    plan = _plan(quick, Plan(warmup=1, reps=12), Plan(warmup=0, reps=2))
    experts, xs = _deep_experts()
    torch.manual_seed(1)
    head = [nn.Linear(512, 512) for _ in range(4)]

    hooked: List[bool] = []

    def step(early: bool) -> None:
        outs = parallel_apply(experts, xs, checkpoint=True)
        h = head[0](torch.cat(outs))
        if early:
            trigger, h = h, recompute_early(h, outs)
            hooked.append(h is not trigger)
        for layer in head[1:]:
            h = layer(torch.relu(h))
        h.sum().backward()

    s = measure({"ours": lambda: step(True), "late": lambda: step(False)}, plan.reps, plan.warmup)
    row = _compare("recompute-early", s, "late", "ours", None,
                   "checkpointed experts + 4 Linear(512,512); trigger = 1st layer's output; "
                   "baseline = no recompute_early")
    if row.baseline is not None and row.ours is not None:
        gain = row.baseline - row.ours
        row.note = f"gain {gain:+.1f} ms ({gain / row.baseline:+.1%}); " + row.note
    if not all(hooked):
        row.note = ("WARNING: recompute_early returned its trigger unchanged (it found no "
                    "checkpointed calls behind the outputs), so both variants are the same; "
                    + row.note)
    return [row]


# -- 6. rows from optional modules ---------------------------------------------
def _external(group: str, module: str) -> Callable[[bool], List[Row]]:
    def run(quick: bool) -> List[Row]:
        try:
            mod = importlib.import_module(module)
        except ImportError as error:
            why = "not present" if getattr(error, "name", None) in _parents(module) else f"{error}"
            return [_row(group, None, None, None, note=f"skipped: {module} {why}")]
        results = mod.run(quick)
        return [_from_dict(d) for d in results]
    return run


def _parents(module: str) -> List[str]:
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _number(value: Any) -> Optional[float]:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _from_dict(d: Mapping[str, Any]) -> Row:
    baseline, ours = _number(d.get("baseline_ms")), _number(d.get("ours_ms"))
    ratio = _number(d.get("ratio"))
    if ratio is None and baseline and ours is not None:
        ratio = ours / baseline
    row = _row(str(d.get("name", "?")), baseline, ours, ratio, d.get("goal"),
               str(d.get("note") or ""))
    if isinstance(d.get("met"), bool):
        row.met = d["met"]
    return row


# -- the table -----------------------------------------------------------------
GROUPS: Dict[str, Callable[[bool], List[Row]]] = {
    "latency": bench_latency,
    "overhead": bench_overhead,
    "compute": bench_compute,
    "checkpoint": bench_checkpoint,
    "recompute-early": bench_recompute_early,
    "remote": _external("remote", "moe_autograd.bench_remote"),
    "moe": _external("moe", "moe_autograd.moe.bench"),
}

NOTES: Dict[str, str] = {
    "latency": "Sleeping calls release the GIL, so all 32 overlap in forward and, through the "
               "one parallel node, in backward too; the naive pool overlaps forward only, "
               "since the engine runs its 32 backward nodes one after another.",
    "overhead": "Pure bookkeeping: worker hand-off, the emulated autograd context and the one "
                "parallel node, against the engine's own per-call cost.",
    "compute": "No goal. On this machine the Python loop already keeps every core busy: each "
               "ATen kernel runs on torch's intra-op threads, and workers release the GIL inside "
               "kernels, so parallel_apply can only overlap the Python glue and small kernels; "
               "concurrent workers also compete for the same cores (each brings its own "
               "intra-op team). A ratio near 1 means the runtime costs nothing here; gains need "
               "idle cores, an accelerator, or latency-bound experts.",
    "checkpoint": "Memory: unique storages packed by saved_tensors_hooks around "
                  "parallel_apply (the runtime applies them on its workers), plus what the call "
                  "records hold outside autograd (a checkpointed call's inputs); parameters "
                  "excluded. Time: one extra forward per call, ideally +1/3.",
    "recompute-early": "The gain is bounded by the backward work after the trigger (here one "
                       "Linear and the concat); on a CPU with few cores the recomputation and "
                       "that backward compete for the same cores.",
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def machine_info(quick: bool) -> List[Tuple[str, str]]:
    """``(label, value)`` pairs for the table's header."""
    cores = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = cores
    workers = os.environ.get("MOE_AUTOGRAD_WORKERS") or f"unset (default {DEFAULT_WORKERS})"
    info = [
        ("cpu", _cpu_model()),
        ("cores", f"{cores}" + (f" ({usable} usable)" if usable != cores else "")),
        ("torch", f"{torch.__version__}, intra-op threads {torch.get_num_threads()}"),
        ("python", platform.python_version()),
        ("MOE_AUTOGRAD_WORKERS", workers),
        ("date", datetime.datetime.now().astimezone().isoformat(timespec="seconds")),
        ("mode", "quick" if quick else "full"),
    ]
    try:
        info.append(("load average", " ".join(f"{v:.2f}" for v in os.getloadavg())))
    except OSError:
        pass
    commit = _commit()
    if commit:
        info.append(("commit", commit))
    return info


def _fmt(value: Optional[float], unit: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if abs(value) >= 100:
        text = f"{value:.1f}"
    elif abs(value) >= 1:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3g}"
    return f"{text} {unit}" if unit else text


def _cells(row: Row) -> List[str]:
    met = "-" if row.met is None else ("yes" if row.met else "NO")
    return [row.name, _fmt(row.baseline, row.unit), _fmt(row.ours, row.unit),
            _fmt(row.ratio), row.goal or "-", met, row.note]


HEADERS = ["name", "baseline", "ours", "ratio", "goal", "met?", "note"]


def format_text(info: Sequence[Tuple[str, str]], rows: Sequence[Row],
                notes: Sequence[str]) -> str:
    lines = [f"{label + ':':<22}{value}" for label, value in info]
    lines.append("ratio = ours / baseline (lower is better); times are medians, "
                 "ratios medians of paired repetitions")
    lines.append("")
    table = [HEADERS] + [_cells(r) for r in rows]
    widths = [max(len(line[k]) for line in table) for k in range(len(HEADERS) - 1)]
    for k, line in enumerate(table):
        cols = [c.ljust(w) if j in (0, 4, 5) else c.rjust(w)  # text left, numbers right
                for j, (c, w) in enumerate(zip(line, widths))]
        lines.append("  ".join(cols + [line[-1]]).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ----")
    if notes:
        lines.append("")
        lines.extend(f"* {n}" for n in notes)
    return "\n".join(lines)


def format_markdown(info: Sequence[Tuple[str, str]], rows: Sequence[Row],
                    notes: Sequence[str]) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|")
    lines = [f"- **{label}**: {esc(value)}" for label, value in info]
    lines += ["", "ratio = ours / baseline (lower is better); times are medians, "
              "ratios medians of paired repetitions", ""]
    lines.append("| " + " | ".join(HEADERS) + " |")
    lines.append("|" + "|".join([":---", "---:", "---:", "---:", ":---", ":---", ":---"]) + "|")
    for row in rows:
        lines.append("| " + " | ".join(esc(c) for c in _cells(row)) + " |")
    if notes:
        lines.append("")
        lines.extend(f"- {esc(n)}" for n in notes)
    return "\n".join(lines)


def run_benchmarks(groups: Sequence[str], quick: bool,
                   progress: Optional[Callable[[str], None]] = None) -> Tuple[List[Row], List[str]]:
    """Runs the groups in order; returns their rows and the notes that apply."""
    rows: List[Row] = []
    notes: List[str] = []
    for group in groups:
        if progress is not None:
            progress(group)
        start = time.perf_counter()
        try:
            produced = GROUPS[group](quick)
        except Exception as error:  # one broken group must not lose the others' numbers
            why = f"FAILED: {type(error).__name__}: {error}"
            produced = [_row(group, None, None, None, note=why)]
        if progress is not None:
            progress(f"{group} done in {time.perf_counter() - start:.1f} s")
        rows.extend(produced)
        if group in NOTES:
            notes.append(f"{group}: {NOTES[group]}")
    return rows, notes


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_autograd bench",
        description="Baseline vs moe_autograd, measured side by side in one run.")
    parser.add_argument("--quick", action="store_true",
                        help="few repetitions (a smoke run, well under 20 s)")
    parser.add_argument("--only", nargs="+", choices=list(GROUPS), metavar="NAME",
                        help=f"run only these groups: {', '.join(GROUPS)}")
    parser.add_argument("--markdown", action="store_true",
                        help="print a Markdown table (for BENCHMARKS.md)")
    args = parser.parse_args(argv)
    groups = [g for g in GROUPS if args.only is None or g in args.only]

    def progress(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    info = machine_info(args.quick)
    rows, notes = run_benchmarks(groups, args.quick, progress)
    formatter = format_markdown if args.markdown else format_text
    print(formatter(info, rows, notes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
