"""Per-expert counters and logs that tell an operator what the fault tolerance absorbed.

Counters are written from the forward's thread and from backward (the
engine's thread), so every update takes the lock. Latencies keep a bounded
window, so a long training run does not grow them.

Every masked call (forward: it raised, missed the layer's deadline or, with
``detect_anomalies``, returned non-finite values) and every backward treated
as a constant is *reported* (:meth:`StatsBook.report`): its error text is
kept as the expert's ``last_error`` (what ``MixtureOfExperts.stats()``
shows) and logged as a WARNING on ``moe_autograd.moe.stats``, naming the
layer's expert, the call and the error (its first line: a remote error's
server traceback stays in ``last_error``).

Invariants:

* Every report updates ``last_error``, whether or not it is logged.
* At most one line per expert every :data:`~moe_autograd.logs.LOG_EVERY_S`
  seconds is logged (a broken expert does not flood the log); the line that
  gets through says how many were held back. Each layer limits its own
  experts.
"""
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional

from ..logs import RateLimit, held_back

__all__ = ["ExpertStats", "StatsBook", "MAX_ERROR_CHARS", "error_text"]

_WINDOW = 1024
MAX_ERROR_CHARS = 1000  # of an error text kept and logged
_log = logging.getLogger(__name__)


@dataclass
class ExpertStats:
    """What happened to one expert's calls so far."""

    calls: int = 0
    failures: int = 0
    timeouts: int = 0
    non_finite: int = 0
    backward_calls: int = 0
    backward_failures: int = 0
    backward_timeouts: int = 0
    latencies_ms: Deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    last_error: Optional[str] = None

    def latency_percentile(self, q: float) -> Optional[float]:
        """The ``q``-th percentile (0-100) of recent forward latencies, in ms."""
        if not self.latencies_ms:
            return None
        ordered = sorted(self.latencies_ms)
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[index]

    def summary(self) -> Dict[str, object]:
        return {
            "calls": self.calls, "failures": self.failures, "timeouts": self.timeouts,
            "non_finite": self.non_finite, "backward_calls": self.backward_calls,
            "backward_failures": self.backward_failures,
            "backward_timeouts": self.backward_timeouts,
            "p50_ms": self.latency_percentile(50), "p90_ms": self.latency_percentile(90),
            "p99_ms": self.latency_percentile(99), "last_error": self.last_error,
        }


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def error_text(error: BaseException) -> str:
    """``Type: message``, at most :data:`MAX_ERROR_CHARS` characters."""
    return _shorten(f"{type(error).__name__}: {error}".strip())


class StatsBook:
    """Thread-safe :class:`ExpertStats` for every expert of a layer."""

    def __init__(self, num_experts: int) -> None:
        self._lock = threading.Lock()
        self._stats: List[ExpertStats] = [ExpertStats() for _ in range(num_experts)]
        self._limit = RateLimit()

    def __getstate__(self) -> Dict[str, object]:
        # A copied or pickled layer (deepcopy, torch.save) carries its counts,
        # not the lock.
        with self._lock:
            return {"stats": [ExpertStats(**{**vars(s), "latencies_ms": deque(s.latencies_ms, maxlen=_WINDOW)})
                              for s in self._stats]}

    def __setstate__(self, state: Dict[str, object]) -> None:
        self._lock = threading.Lock()
        self._stats = state["stats"]  # type: ignore[assignment]
        for stats in self._stats:  # counts pickled before last_error existed
            if not hasattr(stats, "last_error"):
                stats.last_error = None
        self._limit = RateLimit()

    def record(self, expert: int, **increments: int) -> None:
        with self._lock:
            stats = self._stats[expert]
            for name, value in increments.items():
                setattr(stats, name, getattr(stats, name) + value)

    def record_latency(self, expert: int, ms: float) -> None:
        with self._lock:
            self._stats[expert].latencies_ms.append(ms)

    def report(self, expert: int, name: str, backward: bool, error: str) -> None:
        """Expert ``expert`` (``name``, e.g. ``expert 3 (RemoteExpert(...))``)
        was masked in forward, or treated as a constant in ``backward``, for
        ``error`` (the call's error text, or why it has none). Call after
        :meth:`record` counted the call: the line names it by that count
        (``forward call 17 masked``). Keeps the text as the expert's
        ``last_error`` and logs a WARNING, rate-limited per expert."""
        error = _shorten(error)
        with self._lock:
            stats = self._stats[expert]
            what = (f"backward call {stats.backward_calls} treated as a constant" if backward
                    else f"forward call {stats.calls} masked")
            stats.last_error = f"{what}: {error}"
        if not _log.isEnabledFor(logging.WARNING):
            return
        held = self._limit.allow(expert)
        if held is not None:
            first, _, rest = error.partition("\n")  # a remote error's server traceback
            _log.warning("MixtureOfExperts: %s: %s: %s%s%s", name, what, first,
                         " (more in stats()[%d]['last_error'])" % expert if rest.strip() else "",
                         held_back(held, self._limit.every))

    def snapshot(self) -> List[Dict[str, object]]:
        with self._lock:
            return [s.summary() for s in self._stats]

    def totals(self) -> Dict[str, int]:
        keys = ("calls", "failures", "timeouts", "non_finite", "backward_failures",
                "backward_timeouts")
        with self._lock:
            return {k: sum(getattr(s, k) for s in self._stats) for k in keys}
