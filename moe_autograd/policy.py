"""How a batch of calls runs: inline on the caller, in CPU lanes, or fanned out.

Why
---
Fanning calls out to workers pays only when they can overlap. A call of a few
microseconds loses to the hand-off itself; CPU-bound calls on a small machine
gain nothing from 32 workers that each bring an intra-op team onto the same
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
``parallel`` every call on a worker of its own (the first batch of a site)
==========  ==================================================================

What is measured
----------------
Each call's wall time (forward only) splits three ways, on its own thread:

* *on a CPU*: the thread's CPU time (:func:`time.thread_time`);
* *queued*: runnable but waiting for a core, whoever holds it (the batch's
  other calls, their intra-op threads, other processes): the kernel's
  run-queue delay of the thread (``/proc/thread-self/schedstat``);
* *blocked*: the rest, neither on a CPU nor queued for one: asleep, on I/O,
  on a reply, on a device, or on a lock. A call handed to a collector
  (:mod:`moe_autograd.collect`) is blocked for its whole wall time.

Only waiting can overlap when calls fan out, so only *blocked* time counts as
waiting: a core-bound call that queues for a core is not waiting (the old
rule's mistake: 16 compute-bound calls fanned out on 2 cores are each on a
CPU ~15% of their time, because they queue). The process's CPU against the
cores does not decide either where the run queue can be read: on a machine
shared with other processes a compute-bound batch does not fill the cores.

Calls that contend also block, on something a sibling holds: the GIL, a
lock, their intra-op team's barrier while a teammate queues for a core. But
contention blocks calls unequally (one waits long, another hardly at all),
where calls that wait all wait. So a batch's *blocked share* is what every
call spent blocked: ``n x`` the least-blocked call's blocked time over the
calls' total wall time (at most their average share). Measured on 2 cores:
fanned-out tiny calls taking turns at the GIL are blocked 35-65% of their
time on average, but every call only 0-1%; calls that sleep 5 ms, 79-96% on
average and every call 73-95%.

A batch is *crowded* when its calls spent at least :data:`QUEUE_SHARE` of
their time queued for a core: fanned out, they competed for the cores with
each other; within the cores (``inline``, ``lanes``), with other processes.
Either way a crowded batch teaches nothing; the others are *clear*. The
site's blocked share is a moving average over clear batches only (the first
sets it).

The rule
--------
A site's *first* batch fans out (``parallel``) and is measured, unless its
experts are made only of ``torch.nn``'s own modules on the CPU, without
hooks (:func:`computes`: no user code runs in their calls, so they cannot
wait or meet each other): that first batch runs within the cores as a
probe. Then:

* ``inline`` if a call takes less than :data:`INLINE_BELOW_S` of its own time
  (wall minus queued; the hand-off to a worker would cost as much as the
  call; a call that waits longer than that stays fanned out);
* if the site has no clear batch yet (its first batch was crowded), the
  batch runs within the cores (the mode for CPU-bound calls below), and is
  measured: a *probe*;
* ``parallel`` if the calls are blocked at least :data:`WAIT_SHARE` of their
  time: they wait, and overlap;
* otherwise the calls are *CPU-bound*: ``lanes``, as many as fit the cores
  with the caller's intra-op threads each, so nothing oversubscribes them
  (``inline`` when one lane fits). The lanes keep the caller's intra-op
  thread count: CPU reductions split their work by thread count, so fewer
  threads per lane would change results in the last bits.

So the second batch runs in the site's mode: a compute-bound site's first
batch is crowded (and its probe is its mode) or shows its calls blocking
unequally; a waiting site's first batch is clear, and says so. (A site that
both computes and waits may take a third.)

When a site's batch runs within the cores after a fanned-out one, the free
memory the workers' malloc arenas keep is first handed back to the system
(:func:`moe_autograd.executor.release_free_memory`): the calls now allocate
on the caller's arena and would never reuse it (measured at 64 SwiGLU
experts, 4,096 tokens, 2 cores: 190-230 MiB after the first batch).

Every batch is measured and folded in, whatever its mode, so a site that
changes kind changes mode (drift): within the cores every batch is clear;
fanned out, clear batches keep the average current, and after
:data:`RECHECK` crowded ones in a row a waiting site is probed within the
cores again (a *recheck*: it sets the averages afresh; the interval
doubles, up to :data:`RECHECK_MAX`, each time the site still waits). Once a
site has more than one clear batch it leaves its mode only when the average
is past :data:`WAIT_SHARE` by :data:`HYSTERESIS`, so a site that half
computes and half waits does not flip back and forth.

Where the run queue cannot be read (not Linux, a kernel without schedstat),
blocked is all the time off a CPU, and a fanned-out batch is crowded when the
process's CPU time kept at least :data:`BUSY_SHARE` of the usable cores busy
with the calls' own threads accounting for a fair share of it (``1 / (2 x
intra-op threads)``): right on an otherwise idle machine only. Elsewhere the
run queue is read (~3 us a read, two per call) around every call, except in
forced batches and in inline batches of a site known to be tiny.

Invariants
----------
* A site's first batch fans out, so experts that meet each other meet in
  it (but for a site of torch.nn modules on the CPU, whose calls only
  compute); its second runs in the mode the first's measurements pick, for
  a site that computes (within the cores) and for one that waits (fanned
  out).
* A batch that runs within the cores after a fanned-out batch of its site
  first returns the free memory of the malloc arenas to the system.
* After the first batch, CPU-bound calls never run on more threads (lanes x
  intra-op threads) than the cores, except in the single batch that probes
  them.
* Time queued for a core never counts as waiting, blocked time counts only
  as far as every call of the batch had it, and a crowded batch never moves
  the average the mode follows.
* ``execution_stats()`` gives, per site, the mode of its last batch, the
  reason in the measured terms above, and the shares behind it.
* The mode changes only where and when calls run, never what they compute:
  every call still draws from its own random stream forked in call order, so
  outputs and gradients are identical in every mode. (A parameter shared by
  several calls gets its gradient terms summed in the loop's order in every
  mode: the parallel node lists its inputs last call first, the order in
  which the engine runs a loop's calls.)

Known limits, measured on 2 cores shared with other processes (load average
up to 20): a waiting site's calls queue after each wake-up, so the first
batch of a site whose calls wait only a few milliseconds can be crowded; it
then gets its probe (a slow batch, where experts that meet each other
break: those need ``mode="parallel"``) and fans out from its third batch.
With other processes keeping the cores busy several times over, every
fanned-out call of an intra-op team can block while its teammate queues, and
a compute-bound site's first batch can then look like waiting: it stays
fanned out (taking its share of the loaded cores) until a clear batch says
otherwise. A site whose calls differ in kind (some wait, some compute) counts
as waiting only as far as all its calls wait.

``mode=`` on the entry points, or ``MOE_AUTOGRAD_MODE`` (``auto``, ``inline``,
``lanes``, ``parallel``), forces a mode (forced batches teach auto nothing);
:func:`execution_stats` says which mode each site ran in and why, and the
``moe_autograd.policy`` logger says it at DEBUG level whenever a site changes
mode.
"""
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import nn

from .executor import release_free_memory

__all__ = ["INLINE", "LANES", "PARALLEL", "MODES", "INLINE_BELOW_S", "WAIT_SHARE", "Decision",
           "choose", "computes", "record", "execution_stats", "site_of", "forced_mode",
           "cores", "Measure"]

INLINE, LANES, PARALLEL = "inline", "lanes", "parallel"
MODES = (INLINE, LANES, PARALLEL)
#: A call's own time (wall minus queued for a core) below which calls run inline.
INLINE_BELOW_S = 300e-6
#: Share of the calls' wall time spent blocked (neither on a CPU nor queued
#: for one) from which a site counts as waiting, and fans out.
WAIT_SHARE = 0.5
#: How far past :data:`WAIT_SHARE` a site's average must go for it to change
#: mode once it has more than one clear batch.
HYSTERESIS = 0.1
#: Share of a fanned-out batch's call time queued for a core from which the
#: batch is *crowded*: its blocked time may be contention, not waiting.
QUEUE_SHARE = 0.25
#: Without run-queue accounting: share of the usable cores a fanned-out batch
#: must keep busy to count as crowded.
BUSY_SHARE = 0.6
#: Crowded fanned-out batches after which a waiting site is measured within
#: the cores again; doubled each time it still waits, up to RECHECK_MAX.
RECHECK, RECHECK_MAX = 8, 256
#: Batches of a site measured before the policy picks its mode.
EVIDENCE = 1
_SMOOTHING = 0.3
_log = logging.getLogger("moe_autograd.policy")
T = TypeVar("T")


def cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


# -- the run queue -------------------------------------------------------------
# The second field of /proc/thread-self/schedstat is the thread's run_delay:
# nanoseconds spent runnable on a run queue, waiting for a CPU. The kernel
# adds each wait when the thread gets a CPU, so read by the running thread
# itself it is exact. One descriptor per thread (kept in a thread-local and
# closed when the thread's locals go, or when a forked child replaces it),
# re-read with pread: ~3 us a read.
_SCHEDSTAT = "/proc/thread-self/schedstat"
_sched = threading.local()
_fork_generation = 0


class _Descriptor:
    """A raw descriptor that is closed with its holder: a thread's locals are
    dropped when it ends, and a file object dropped unclosed would warn
    (``ResourceWarning``) once per thread."""

    __slots__ = ("fd",)

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _schedstat_works() -> bool:
    """Whether the kernel keeps the counters (it prints ``0 0 0`` when its
    scheduler statistics are off; this thread has run, so not 0 then)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return int(f.read().split()[0]) > 0
    except (OSError, ValueError, IndexError):
        return False


_SCHED_OK = _schedstat_works()


def _after_fork() -> None:  # a child's descriptors name its parent's threads
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _queued_s() -> Optional[float]:
    """Seconds this thread has spent waiting for a CPU, or None where the
    kernel does not say."""
    try:
        if getattr(_sched, "generation", -1) != _fork_generation:
            _sched.file = None  # closes a forked parent's descriptor first
            _sched.file = _Descriptor(_SCHEDSTAT)
            _sched.generation = _fork_generation
        return int(os.pread(_sched.file.fd, 64, 0).split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return None


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
    __slots__ = ("own", "cpu", "blocked", "queued", "on_cpu", "clear", "busy", "queue_known",
                 "crowded", "crowded_own", "crowding", "crowded_batches", "unclear", "recheck",
                 "batches", "last", "settled", "reason", "modes")

    def __init__(self) -> None:
        # Averages over the clear batches (the first sets them): per call, its
        # own time (wall minus queued for a core) and CPU time; as shares of the
        # calls' wall time, blocked (neither on a CPU nor queued for one, the
        # share the mode follows), queued for a core, and on a CPU.
        self.own = self.cpu = self.blocked = self.queued = self.on_cpu = 0.0
        self.clear = 0
        self.busy = 0.0  # share of the usable cores the process kept busy (every batch)
        self.queue_known = False  # the last clear batch read the run queue
        # The last crowded batch: its queued share (or busy share, without a
        # run queue), its own time per call, and what it was in words.
        self.crowded = self.crowded_own = 0.0
        self.crowding = ""
        self.crowded_batches = 0
        self.unclear = 0  # crowded fanned-out batches since the last clear one
        self.recheck = RECHECK  # unclear batches before a waiting site is probed again
        self.batches = 0
        self.last = PARALLEL  # the mode of the last batch
        self.settled = PARALLEL  # the mode of the last batch that was not a probe
        self.reason = "new site"
        self.modes: Dict[str, int] = {}


class Decision:
    """The mode of one batch, for ``lanes`` how many, why, and whether the
    batch runs within the cores to measure the site (a *probe*)."""

    __slots__ = ("mode", "lanes", "reason", "probe")

    def __init__(self, mode: str, lanes: int, reason: str, probe: bool = False) -> None:
        self.mode, self.lanes, self.reason, self.probe = mode, lanes, reason, probe

    def __repr__(self) -> str:
        return f"Decision({self.mode!r}, lanes={self.lanes}, {self.reason!r})"


_profiles: Dict[Hashable, _Profile] = {}
_names: Dict[Hashable, str] = {}
_lock = threading.Lock()
NEW_SITE = "new site: the first batch fans out and is measured"
COMPUTES = ("new site of torch.nn modules on the CPU (they only compute): the first batch "
            "runs within the cores and is measured")


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


def _within_cores(n: int, why: str, probe: bool = False) -> Decision:
    """``lanes`` that fit the cores, ``inline`` when one lane does."""
    lanes = _lanes_for(n)
    if lanes == 1:
        return Decision(INLINE, 1, why + "; one lane fits the cores", probe)
    return Decision(LANES, lanes, why, probe)


def computes(experts: Sequence[Any]) -> bool:
    """Whether the calls of ``experts`` can only compute: every expert is made
    of PyTorch's own ``torch.nn`` modules (no user code runs in a call: no
    custom ``forward``, no hooks on the modules; process-wide module hooks
    are not looked at), with its parameters and buffers on the CPU (an
    accelerator's kernels return before they finish)."""
    for expert in experts:
        if not isinstance(expert, nn.Module):
            return False
        for m in expert.modules():
            if not type(m).__module__.startswith("torch.nn.modules.") or (
                    m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                    or m._backward_pre_hooks):
                return False
            for t in (*m._parameters.values(), *m._buffers.values()):
                if t is not None and t.device.type != "cpu":
                    return False
    return True


def choose(site: Hashable, n: int, mode: Optional[str] = None,
           experts: Optional[Sequence[Any]] = None) -> Decision:
    """The mode for a batch of ``n`` calls at ``site`` (``mode`` forces it);
    ``experts``, where given, may tell a new site that only computes."""
    forced = forced_mode(mode)
    if forced is not None:
        lanes = _lanes_for(n) if forced == LANES else 1 if forced == INLINE else n
        return Decision(forced, lanes, "forced")
    profile = _profiles.get(site)
    if profile is None or profile.batches < EVIDENCE:
        if experts is not None and computes(experts):
            return _within_cores(n, COMPUTES, probe=True)
        return Decision(PARALLEL, n, NEW_SITE)
    decision = _decide(profile, n)
    if decision.mode != PARALLEL and profile.last == PARALLEL:
        # Leaving the workers: what their arenas keep free would stay resident.
        release_free_memory()
    return decision


def _waits(p: _Profile) -> bool:
    """Whether the site's clear average says its calls wait, with hysteresis
    around its settled mode once it has more than one clear batch."""
    margin = HYSTERESIS if p.clear > 1 else 0.0
    return p.blocked >= (WAIT_SHARE - margin if p.settled == PARALLEL else WAIT_SHARE + margin)


def _decide(p: _Profile, n: int) -> Decision:
    """The rule of the module docstring, from a site's profile."""
    own = p.own if p.clear else p.crowded_own
    if own < INLINE_BELOW_S:
        return Decision(INLINE, 1, f"calls take {own * 1e6:.0f} us")
    if p.clear == 0:
        return _within_cores(n, p.crowding + "; no clear batch yet: run within the cores",
                             probe=True)
    if _waits(p):
        if p.unclear >= p.recheck:
            return _within_cores(n, p.crowding + f" ({p.unclear} crowded batches): measured "
                                 "within the cores again", probe=True)
        return Decision(PARALLEL, n, f"calls wait: blocked {p.blocked:.0%} of their time "
                                     "(neither on a CPU nor queued for one)")
    if p.queue_known:
        why = (f"CPU-bound: blocked {p.blocked:.0%} of their time (on a CPU "
               f"{p.on_cpu:.0%}, queued for one {p.queued:.0%})")
    else:
        why = f"CPU-bound: blocked {p.blocked:.0%} of their time, cores {p.busy:.0%} busy"
    return _within_cores(n, why)


def _long_calls(site: Hashable) -> bool:
    """Whether the site's calls may take long enough for two run-queue reads
    (~6 us) not to matter: unknown yet, or not tiny."""
    profile = _profiles.get(site)
    return profile is None or not profile.clear or profile.own >= INLINE_BELOW_S


class Measure:
    """Measures one batch: ``with Measure(site, n, decision) as m:``, with
    each call run through ``m.timed(i, fn)`` (or between ``m.start()`` and
    ``m.stop(i, ...)`` on the thread that runs it).

    The run queue is read around every call, except in forced batches (they
    teach auto mode nothing) and in inline batches of a site whose calls are
    known to be tiny (there two reads would cost a fifth of a call)."""

    __slots__ = ("site", "n", "decision", "walls", "cpus", "queued", "_queue", "_wall",
                 "_process")

    def __init__(self, site: Hashable, n: int, decision: Decision) -> None:
        self.site, self.n, self.decision = site, n, decision
        self.walls = [0.0] * n
        self.cpus = [0.0] * n
        self.queued = [0.0] * n
        self._queue = _SCHED_OK and decision.reason != "forced" and (
            decision.mode != INLINE or _long_calls(site))

    def start(self) -> Tuple[float, float, float]:
        """The clocks before a call runs on this thread (see :meth:`stop`):
        read inside the wall clock's interval, so queued <= wall."""
        wall, cpu = time.perf_counter(), time.thread_time()
        queued = _queued_s() if self._queue else None
        return wall, cpu, -1.0 if queued is None else queued

    def stop(self, i: int, started: Tuple[float, float, float]) -> None:
        """Records call ``i``'s wall, thread CPU and queued time since
        :meth:`start`, on the same thread."""
        if started[2] >= 0:
            queued = _queued_s()
            if queued is not None:
                self.queued[i] = queued - started[2]
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
            # The share of the calls' time that every call spent blocked (of
            # the calls that ended: a call a deadline gave up on has no times).
            ended = [(w, c, q) for w, c, q in zip(self.walls, self.cpus, self.queued) if w > 0]
            least = (len(ended) * min(max(w - c - q, 0.0) for w, c, q in ended)
                     / sum(w for w, _, _ in ended)) if ended else None
            record(self.site, self.n, time.perf_counter() - self._wall,
                   time.process_time() - self._process, sum(self.walls), sum(self.cpus),
                   self.decision, sum(self.queued) if self._queue else None, least)


def _ema(old: float, new: float, first: bool) -> float:
    return new if first else old + _SMOOTHING * (new - old)


def record(site: Hashable, n: int, batch_wall: float, process_cpu: float, call_wall: float,
           call_cpu: float, decision: Decision, call_queued: Optional[float] = None,
           least_blocked: Optional[float] = None) -> None:
    """Folds one batch's measurements into the site's profile: the calls'
    total wall, CPU and queued time (None: not measured), ``n`` times the
    blocked time of the least-blocked call over the total wall (None: not
    known), and the batch's wall and process CPU time."""
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
    wall = max(call_wall, 1e-9)
    queued = min(max(call_queued or 0.0, 0.0), max(call_wall - call_cpu, 0.0))
    blocked = max(call_wall - call_cpu - queued, 0.0) / wall
    if least_blocked is not None:
        # Contention blocks calls unequally (the GIL, a lock, an intra-op team
        # whose teammate queues: one call blocks long, another hardly at all);
        # calls that wait all wait. What every call waited bounds the share.
        blocked = min(blocked, least_blocked)
    # Crowded: the calls queued for cores (fanned out, or on a busy machine),
    # so their blocked time may be contention. Without a run queue to read,
    # only a fan-out that kept the cores busy counts as crowded.
    how = {PARALLEL: "fanned out", LANES: "in lanes"}.get(decision.mode, decision.mode)
    if call_queued is not None:
        crowding = queued / wall
        crowded = crowding >= QUEUE_SHARE
        why = f"{how}, calls queued for a core {crowding:.0%} of their time"
    else:
        crowding = busy
        crowded = decision.mode == PARALLEL and busy >= BUSY_SHARE
        why = f"{how}, the process kept {busy:.0%} of the cores busy"
    with _lock:
        p = _profiles.setdefault(site, _Profile())
        p.busy = _ema(p.busy, busy, p.batches == 0)
        if crowded:
            p.crowded, p.crowded_own, p.crowding = crowding, (call_wall - queued) / n, why
            p.crowded_batches += 1
            if decision.probe and p.clear:  # a recheck that taught nothing: back off
                p.unclear, p.recheck = 0, min(2 * p.recheck, RECHECK_MAX)
            else:
                p.unclear += 1
        elif call_queued is None and _SCHED_OK and p.clear:
            # Tiny calls run inline, the run queue not read: their own time
            # and CPU only (their time queued would count as blocked).
            p.own = _ema(p.own, call_wall / n, False)
            p.cpu = _ema(p.cpu, call_cpu / n, False)
        else:
            # A recheck follows a run of crowded batches that taught nothing:
            # what it measures replaces the averages, as a first batch would.
            recheck = decision.probe and p.clear > 0
            first = p.clear == 0 or recheck
            p.own = _ema(p.own, (call_wall - queued) / n, first)
            p.cpu = _ema(p.cpu, call_cpu / n, first)
            p.blocked = _ema(p.blocked, blocked, first)
            p.queued = _ema(p.queued, queued / wall, first)
            p.on_cpu = _ema(p.on_cpu, call_cpu / wall, first)
            p.queue_known = call_queued is not None
            p.clear += 1
            p.unclear = 0
            if recheck:  # back off while the site still waits
                p.recheck = min(2 * p.recheck, RECHECK_MAX) if _waits(p) else RECHECK
        p.batches += 1
        p.modes[decision.mode] = p.modes.get(decision.mode, 0) + 1
        changed = p.last != decision.mode
        p.last, p.reason = decision.mode, decision.reason
        if not decision.probe:
            p.settled = decision.mode
    if changed and _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s: %d calls run %s (%s)", _name(site), n, decision.mode, decision.reason)


def execution_stats() -> List[Dict[str, Any]]:
    """Per site: the mode of its last batch and why, and batches per mode;
    averaged over its clear batches (``clear_batches``: run within the
    cores, or fanned out without crowding them; None before the first), each
    call's own time (wall minus queued for a core) and CPU time, and the
    shares of the calls' wall time blocked (the share the mode follows),
    queued for a core (None: not measured) and on a CPU; the share of the
    usable cores the process kept busy (every batch); and ``crowded``, the
    queued share of its last crowded batch (the busy share where the run
    queue cannot be read; None: no batch was crowded)."""
    with _lock:
        items: List[Tuple[Hashable, _Profile]] = list(_profiles.items())

    def clear(p: _Profile, value: float, scale: float = 1.0) -> Optional[float]:
        return round(value * scale, 3 if scale == 1.0 else 1) if p.clear else None
    return [{
        "site": _name(site), "mode": p.last, "reason": p.reason, "batches": dict(p.modes),
        "clear_batches": p.clear, "wall_per_call_us": clear(p, p.own, 1e6),
        "cpu_per_call_us": clear(p, p.cpu, 1e6), "blocked": clear(p, p.blocked),
        "queued": clear(p, p.queued) if p.queue_known else None, "on_cpu": clear(p, p.on_cpu),
        "cores_busy": round(p.busy, 3),
        "crowded": round(p.crowded, 3) if p.crowded_batches else None,
    } for site, p in items]


def _forget(site: Hashable) -> None:
    """Forgets one site's profile: its next batch is a new site's (benchmarks)."""
    with _lock:
        _profiles.pop(site, None)


def _reset() -> None:
    """Forgets every profile (tests)."""
    with _lock:
        _profiles.clear()
