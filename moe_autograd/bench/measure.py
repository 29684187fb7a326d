"""Rows and the interleaved, paired measurement behind every benchmark row.

Why a module of its own: the in-process groups (:mod:`.core`,
:mod:`.checkpoint`) and the remote client process (:mod:`.remote`) measure the
same way, so their ratios mean the same thing.

Invariants (the methodology of the package doc, implemented here):

* Within one :func:`measure`, every repetition runs each variant once, in an
  order that rotates by one each repetition; warm-up runs are never timed.
* The collector is off during a timed sample (young generations collected
  just before it; a full collection before the warm-up).
* :func:`compare` reports medians of each variant and the median of the
  *paired* per-repetition ratios, with their interquartile range and count.
"""
import gc
import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Row", "Plan", "Step", "judge", "row", "measure", "compare", "quartiles"]

Step = Callable[[], None]


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


@dataclass(frozen=True)
class Plan:
    """Repetitions of one group: untimed warm-up runs, timed samples, and
    steps per sample (for steps too short to time one by one)."""

    warmup: int
    reps: int
    inner: int = 1

    @staticmethod
    def pick(quick: bool, full: "Plan", short: "Plan") -> "Plan":
        return short if quick else full


_GOAL_RE = re.compile(r"^\s*(<=|≤|<|>=|≥|>)?\s*([0-9]*\.?[0-9]+)\s*x?\s*$")


def judge(ratio: Optional[float], goal: Any) -> Tuple[Optional[str], Optional[bool]]:
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


def row(name: str, baseline: Optional[float], ours: Optional[float], ratio: Optional[float],
        goal: Any = None, note: str = "", unit: str = "ms") -> Row:
    goal_text, met = judge(ratio, goal)
    return Row(name, baseline, ours, ratio, goal_text, met, note, unit)


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
    one loop with the order rotating every repetition."""
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


def quartiles(values: Sequence[float]) -> Tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def compare(name: str, samples: Mapping[str, Sequence[float]], baseline: str, ours: str,
            goal: Any = None, note: str = "", scale: float = 1.0) -> Row:
    """A row from two variants of one :func:`measure`: medians of each, and the
    median of the paired per-repetition ratios. A ``baseline`` that is a
    constant (a physical limit) is given as samples all equal to it."""
    base, mine = samples[baseline], samples[ours]
    ratios = [m / b for m, b in zip(mine, base)]
    lo, hi = quartiles(ratios)
    spread = f"ratio IQR {lo:.2f}-{hi:.2f}, n={len(ratios)}"
    return row(name, statistics.median(base) * scale, statistics.median(mine) * scale,
               statistics.median(ratios), goal, f"{note}; {spread}" if note else spread)
