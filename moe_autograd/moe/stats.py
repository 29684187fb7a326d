"""Per-expert counters that tell an operator what the fault tolerance absorbed.

Counters are written from the forward's thread and from backward (the
engine's thread), so every update takes the lock. Latencies keep a bounded
window, so a long training run does not grow them.
"""
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional

__all__ = ["ExpertStats", "StatsBook"]

_WINDOW = 1024


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
            "p99_ms": self.latency_percentile(99),
        }


class StatsBook:
    """Thread-safe :class:`ExpertStats` for every expert of a layer."""

    def __init__(self, num_experts: int) -> None:
        self._lock = threading.Lock()
        self._stats: List[ExpertStats] = [ExpertStats() for _ in range(num_experts)]

    def __getstate__(self) -> Dict[str, object]:
        # A copied or pickled layer (deepcopy, torch.save) carries its counts,
        # not the lock.
        with self._lock:
            return {"stats": [ExpertStats(**{**vars(s), "latencies_ms": deque(s.latencies_ms, maxlen=_WINDOW)})
                              for s in self._stats]}

    def __setstate__(self, state: Dict[str, object]) -> None:
        self._lock = threading.Lock()
        self._stats = state["stats"]  # type: ignore[assignment]

    def record(self, expert: int, **increments: int) -> None:
        with self._lock:
            stats = self._stats[expert]
            for name, value in increments.items():
                setattr(stats, name, getattr(stats, name) + value)

    def record_latency(self, expert: int, ms: float) -> None:
        with self._lock:
            self._stats[expert].latencies_ms.append(ms)

    def snapshot(self) -> List[Dict[str, object]]:
        with self._lock:
            return [s.summary() for s in self._stats]

    def totals(self) -> Dict[str, int]:
        keys = ("calls", "failures", "timeouts", "non_finite", "backward_failures",
                "backward_timeouts")
        with self._lock:
            return {k: sum(getattr(s, k) for s in self._stats) for k in keys}
