"""One daemon thread per process that expires remote calls at their deadlines.

Why: a call that waits on the network must end at its deadline although no
thread waits on it (calls complete by callback, see
:mod:`moe_autograd.remote.batching` and the Ray backend). One thread per
watcher keeps a heap of deadlines; both the coalesced requests and the Ray
backend's pending calls use it.

Invariants:

* An entry holds its target weakly: a call that finished (and its tensors)
  is not kept until a far deadline; a target that must fire although nothing
  else holds it is :meth:`DeadlineWatch.hold` ed until :meth:`let_go`.
* Entries whose target is gone or no longer due (``live``) are compacted
  away once the heap doubles past 4,096, so a process that makes many calls
  with far deadlines does not grow it without bound.
* ``fire`` runs on the watcher's thread, outside its lock.
* A forked child gets a fresh watcher (the parent's thread does not exist
  there): make the module-level instance with :func:`per_process`.
"""
import heapq
import itertools
import os
import threading
import time
import weakref
from typing import Any, Callable, List, Set, Tuple

__all__ = ["DeadlineWatch", "per_process"]

_Entry = Tuple[float, int, Any, Any]


class DeadlineWatch:
    """Calls ``fire(target, arg)`` at each entry's deadline, while
    ``live(target, arg)`` (checked when compacting) says it may still fire."""

    def __init__(self, name: str, fire: Callable[[Any, Any], None],
                 live: Callable[[Any, Any], bool]) -> None:
        self._name, self._fire, self._live = name, fire, live
        self._heap: List[_Entry] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._started = False
        self._compact_at = 4096
        self._held: Set[Any] = set()

    def hold(self, target: Any) -> None:
        with self._cond:
            self._held.add(target)

    def let_go(self, target: Any) -> None:
        with self._cond:
            self._held.discard(target)

    def add(self, deadline: float, target: Any, arg: Any) -> None:
        """``fire(target, arg)`` at ``deadline`` (``time.monotonic()``)."""
        with self._cond:
            if not self._started:
                self._started = True
                threading.Thread(target=self._run, daemon=True, name=self._name).start()
            heapq.heappush(self._heap, (deadline, next(self._seq), weakref.ref(target), arg))
            if self._heap[0][0] == deadline:
                self._cond.notify()
            if len(self._heap) > self._compact_at:
                self._heap = [e for e in self._heap if self._alive(e)]
                heapq.heapify(self._heap)
                self._compact_at = max(4096, 2 * len(self._heap))

    def _alive(self, entry: _Entry) -> bool:
        target = entry[2]()
        return target is not None and self._live(target, entry[3])

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap))
                if not due:
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
                    continue
            for _, _, ref, arg in due:
                target = ref()
                if target is not None:
                    self._fire(target, arg)


def per_process(make: Callable[[], DeadlineWatch]) -> Callable[[], DeadlineWatch]:
    """A getter of this process's watcher, made again in a forked child."""
    box = [make()]

    def renew() -> None:
        box[0] = make()
    os.register_at_fork(after_in_child=renew)
    return lambda: box[0]
