"""How a batch of calls runs: inline on the caller, in CPU lanes, or fanned out.

Why
---
Fanning calls out to workers pays only when they can overlap. A call of a few
microseconds loses to the hand-off itself; CPU-bound calls on a small machine
gain little from 32 workers that each bring an intra-op team onto the same
cores; calls that wait (sleep, network, a device) gain everything. The
runtime learns which kind a *site* is (the Function class of a map, or the set
of expert types / functions of a ``parallel_apply``) from its own
measurements, and runs each batch in one of three modes:

==========  ==================================================================
``inline``   one call after another on the caller, as a loop would
             (``map_with_parallel_backward``: ``func.apply``; ``parallel_apply``
             without checkpointing: the experts themselves)
``lanes``    ``cores // intra-op threads`` workers, each running a share of
             the calls in order, forward and backward
``parallel`` every call on a worker of its own (the default for a new site)
==========  ==================================================================

Each batch measures, per call, its wall time and its thread's CPU time
(inside the call, so queueing for a worker and other threads of the process
do not count), and its own wall time. The next batch of the site then runs:

* ``lanes`` if the batch was *CPU-bound*: the process's CPU time (all its
  threads, intra-op teams included) filled at least :data:`BUSY_SHARE` of
  the cores the batch could use (``cores`` fanned out, one thread inline),
  and the calls' own threads account for a fair share of it (at least
  ``1 / (2 x intra-op threads)``, so that another busy thread of the
  process, a data loader say, does not make waiting calls look CPU-bound).
  As many lanes run as fit the cores with the caller's intra-op threads each,
  so nothing oversubscribes them (``inline`` when one lane fits). The lanes
  keep the caller's intra-op thread count: CPU reductions split their work by
  thread count, so fewer threads per lane would change results in the last
  bits;
* ``inline`` if a call takes less than :data:`INLINE_BELOW_S` of wall time
  (the hand-off to a worker would cost as much as the call; a call that waits
  longer than that, on a network or a device, stays fanned out);
* ``parallel`` otherwise: its calls wait, and overlap.

A site leaves ``parallel`` only after :data:`EVIDENCE` batches agree, and the
profile is a moving average, so one odd batch does not flip it.

``mode=`` on the entry points, or ``MOE_AUTOGRAD_MODE`` (``auto``, ``inline``,
``lanes``, ``parallel``), forces a mode; :func:`execution_stats` says which
mode each site ran in and why, and the ``moe_autograd.policy`` logger says it
at DEBUG level whenever a site changes mode.

Invariant: the mode changes only where and when calls run, never what they
compute: every call still draws from its own random stream forked in call
order, so outputs and gradients are identical in every mode. (A parameter
shared by several calls gets its gradient terms summed in the loop's order in
every mode: the parallel node lists its inputs last call first, the order in
which the engine runs a loop's calls.)
"""
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import nn

__all__ = ["INLINE", "LANES", "PARALLEL", "MODES", "INLINE_BELOW_S", "Decision", "choose",
           "record", "execution_stats", "site_of", "forced_mode", "cores", "Measure"]

INLINE, LANES, PARALLEL = "inline", "lanes", "parallel"
MODES = (INLINE, LANES, PARALLEL)
#: Wall time per call below which a call runs inline.
INLINE_BELOW_S = 300e-6
#: Share of the usable cores a batch must keep busy to count as CPU-bound.
BUSY_SHARE = 0.6
#: Batches of a site measured before it may leave ``parallel``.
EVIDENCE = 2
_SMOOTHING = 0.3
_log = logging.getLogger("moe_autograd.policy")
T = TypeVar("T")


def cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def forced_mode(mode: Optional[str]) -> Optional[str]:
    """``mode`` if given, else ``MOE_AUTOGRAD_MODE``; None for ``auto``."""
    raw = mode if mode is not None else os.environ.get("MOE_AUTOGRAD_MODE", "auto")
    value = raw.strip().lower()
    if value == "auto":
        return None
    if value not in MODES:
        source = "mode" if mode is not None else "MOE_AUTOGRAD_MODE"
        raise ValueError(f"{source} must be one of auto, {', '.join(MODES)}; got {raw!r}")
    return value


def site_of(experts: Sequence[Any]) -> Hashable:
    """The site of a batch: the distinct kinds of its experts (module types,
    functions' code, a Function class)."""
    kinds = set()
    for e in experts:
        if isinstance(e, nn.Module):
            kinds.add(type(e))
        else:
            kinds.add(getattr(e, "__code__", None) or getattr(e, "__func__", None) or type(e))
    return frozenset(kinds)


class _Profile:
    __slots__ = ("wall_per_call", "cpu_per_call", "busy", "on_cpu", "batches", "last",
                 "reason", "modes")

    def __init__(self) -> None:
        self.wall_per_call = 0.0
        self.cpu_per_call = 0.0
        self.busy = 0.0  # share of the usable cores the calls kept busy
        self.on_cpu = 0.0  # share of the calls' own wall time spent on the CPU
        self.batches = 0
        self.last = PARALLEL
        self.reason = "new site"
        self.modes: Dict[str, int] = {}


class Decision:
    """The mode of one batch and, for ``lanes``, how many."""

    __slots__ = ("mode", "lanes", "reason")

    def __init__(self, mode: str, lanes: int, reason: str) -> None:
        self.mode, self.lanes, self.reason = mode, lanes, reason

    def __repr__(self) -> str:
        return f"Decision({self.mode!r}, lanes={self.lanes}, {self.reason!r})"


_profiles: Dict[Hashable, _Profile] = {}
_names: Dict[Hashable, str] = {}
_lock = threading.Lock()


def _name(site: Hashable) -> str:
    name = _names.get(site)
    if name is None:
        parts = []
        for kind in site:  # type: ignore[attr-defined]
            parts.append(getattr(kind, "co_name", None) or getattr(kind, "__qualname__", None)
                         or repr(kind))
        name = _names[site] = "+".join(sorted(parts))
    return name


def _lanes_for(n: int) -> int:
    return max(1, min(n, cores() // max(1, torch.get_num_threads())))


def choose(site: Hashable, n: int, mode: Optional[str] = None) -> Decision:
    """The mode for a batch of ``n`` calls at ``site`` (``mode`` forces it)."""
    forced = forced_mode(mode)
    if forced is not None:
        return Decision(forced, _lanes_for(n) if forced == LANES else n, "forced")
    profile = _profiles.get(site)
    if profile is None or profile.batches < EVIDENCE:
        return Decision(PARALLEL, n, "new site")
    if profile.busy >= BUSY_SHARE:
        lanes = _lanes_for(n)
        why = f"CPU-bound (cores {profile.busy:.0%} busy)"
        if lanes == 1:
            return Decision(INLINE, 1, why + "; one lane fits the cores")
        return Decision(LANES, lanes, why)
    if profile.wall_per_call < INLINE_BELOW_S:
        return Decision(INLINE, 1, f"calls take {profile.wall_per_call * 1e6:.0f} us")
    return Decision(PARALLEL, n, f"calls wait ({profile.on_cpu:.0%} of their time on CPU)")


class Measure:
    """Measures one batch: ``with Measure(site, n, decision) as m:``, with
    each call run through ``m.timed(i, fn)``."""

    __slots__ = ("site", "n", "decision", "walls", "cpus", "_wall", "_process")

    def __init__(self, site: Hashable, n: int, decision: Decision) -> None:
        self.site, self.n, self.decision = site, n, decision
        self.walls = [0.0] * n
        self.cpus = [0.0] * n

    @staticmethod
    def start() -> Tuple[float, float]:
        """The clocks before call ``i`` runs on this thread (see :meth:`stop`)."""
        return time.perf_counter(), time.thread_time()

    def stop(self, i: int, started: Tuple[float, float]) -> None:
        """Records call ``i``'s wall and thread CPU time since :meth:`start`."""
        self.cpus[i] = time.thread_time() - started[1]
        self.walls[i] = time.perf_counter() - started[0]

    def timed(self, i: int, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn``, recording its times as call ``i`` wherever it runs."""
        def run() -> T:
            started = self.start()
            try:
                return fn()
            finally:
                self.stop(i, started)
        return run

    def __enter__(self) -> "Measure":
        self._wall = time.perf_counter()
        self._process = time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None and self.n:
            record(self.site, self.n, time.perf_counter() - self._wall,
                   time.process_time() - self._process, sum(self.walls), sum(self.cpus),
                   self.decision)


def record(site: Hashable, n: int, batch_wall: float, process_cpu: float, call_wall: float,
           call_cpu: float, decision: Decision) -> None:
    """Folds one batch's measurements into the site's profile."""
    if decision.reason == "forced":  # counted, but learns nothing: auto never ran it
        with _lock:
            forced = _profiles.setdefault(site, _Profile())
            key = f"{decision.mode} (forced)"
            forced.modes[key] = forced.modes.get(key, 0) + 1
        return
    usable = 1 if decision.mode == INLINE else min(decision.lanes, cores())
    busy = process_cpu / max(batch_wall, 1e-9) / usable
    if call_cpu < process_cpu / (2 * max(1, torch.get_num_threads())):
        busy = 0.0  # the CPU went to other threads of the process, not to the calls
    on_cpu = call_cpu / max(call_wall, 1e-9)
    per_call, wall_per_call = call_cpu / n, call_wall / n
    with _lock:
        profile = _profiles.setdefault(site, _Profile())
        if profile.batches == 0:
            profile.cpu_per_call, profile.busy, profile.on_cpu = per_call, busy, on_cpu
            profile.wall_per_call = wall_per_call
        else:
            a = _SMOOTHING
            profile.wall_per_call += a * (wall_per_call - profile.wall_per_call)
            profile.cpu_per_call += a * (per_call - profile.cpu_per_call)
            profile.busy += a * (busy - profile.busy)
            profile.on_cpu += a * (on_cpu - profile.on_cpu)
        profile.batches += 1
        profile.modes[decision.mode] = profile.modes.get(decision.mode, 0) + 1
        changed = profile.last != decision.mode
        profile.last, profile.reason = decision.mode, decision.reason
    if changed and _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s: %d calls run %s (%s)", _name(site), n, decision.mode, decision.reason)


def execution_stats() -> List[Dict[str, Any]]:
    """Per site: the mode of its last batch and why, batches per mode, and
    the measured CPU per call and share of the cores kept busy."""
    with _lock:
        items: List[Tuple[Hashable, _Profile]] = list(_profiles.items())
    return [{
        "site": _name(site), "mode": p.last, "reason": p.reason, "batches": dict(p.modes),
        "wall_per_call_us": round(p.wall_per_call * 1e6, 1),
        "cpu_per_call_us": round(p.cpu_per_call * 1e6, 1), "cores_busy": round(p.busy, 3),
        "on_cpu": round(p.on_cpu, 3),
    } for site, p in items]


def _reset() -> None:
    """Forgets every profile (tests)."""
    with _lock:
        _profiles.clear()

