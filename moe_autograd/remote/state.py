"""Server-side call state of the ``stateful`` backward strategy.

Why: a stateful server keeps each call's autograd graph (its detached inputs
and outputs) between the forward and the backward request, so backward needs
no recomputation. Clients crash, drop their outputs, or time out, so the store
must free states without their backward and never grow without bound.

Lifecycle of one state (keyed by the client's call id)::

    event                                   what happens
    -------------------------------------   -----------------------------------
    forward that needs a graph              stored (oldest evicted past max_states)
    backward request                        popped, used once, freed
    client drops the graph (finalizer)      release request -> freed
    release that overtakes its forward      tombstone: the late forward stores nothing
    no backward within state_ttl seconds    swept (on every put, and by a timer)
    server closed                           all freed

Invariants:

* ``len(store) <= max_states`` at all times.
* A popped, released, expired or evicted id is remembered (bounded) with the
  reason, so a late backward gets an error that says why its state is gone.
"""
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List

from torch import Tensor

__all__ = ["CallState", "StateStore"]

_REMEMBERED = 8192  # reasons of gone ids kept for error messages and tombstones


@dataclass
class CallState:
    """What a stateful forward keeps for its backward."""

    expert: str
    leaves: List[Any]       # the call's arguments; tensors are detached leaves
    outputs: List[Tensor]   # the graph's outputs on the server
    expires: float = field(default=0.0)


class StateStore:
    """A bounded, TTL-swept map ``call id -> CallState``; thread-safe."""

    def __init__(self, ttl: float, max_states: int) -> None:
        if ttl <= 0:
            raise ValueError(f"state_ttl must be positive, got {ttl}")
        if max_states < 1:
            raise ValueError(f"max_states must be at least 1, got {max_states}")
        self.ttl, self.max_states = float(ttl), int(max_states)
        self._states: "OrderedDict[str, CallState]" = OrderedDict()
        self._gone: "OrderedDict[str, str]" = OrderedDict()
        self._lock = threading.Lock()
        self.counts: Dict[str, int] = {"stored": 0, "used": 0, "released": 0,
                                       "expired": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._states)

    def _forget(self, call_id: str, reason: str) -> None:
        self._gone[call_id] = reason
        self._gone.move_to_end(call_id)
        while len(self._gone) > _REMEMBERED:
            self._gone.popitem(last=False)

    def _sweep_locked(self, now: float) -> int:
        n = 0
        while self._states:
            call_id, state = next(iter(self._states.items()))
            if state.expires > now:
                break
            del self._states[call_id]
            self._forget(call_id, f"expired after state_ttl={self.ttl:g} s without a backward")
            n += 1
        self.counts["expired"] += n
        return n

    def put(self, call_id: str, state: CallState) -> bool:
        """Stores ``state``; False if the id was released (or used) already."""
        now = time.monotonic()
        state.expires = now + self.ttl
        with self._lock:
            self._sweep_locked(now)
            if call_id in self._gone or call_id in self._states:
                return False
            while len(self._states) >= self.max_states:
                old, _ = self._states.popitem(last=False)
                self._forget(old, f"evicted: the server holds at most max_states={self.max_states}")
                self.counts["evicted"] += 1
            self._states[call_id] = state
            self.counts["stored"] += 1
        return True

    def pop(self, call_id: str) -> CallState:
        """Takes the state for its backward; LookupError says why it is missing."""
        with self._lock:
            state = self._states.pop(call_id, None)
            if state is None:
                reason = self._gone.get(call_id, "unknown call id (never stored on this server)")
                raise LookupError(f"no state for call {call_id!r}: {reason}")
            self._forget(call_id, "used by an earlier backward (stateful state is used once)")
            self.counts["used"] += 1
            return state

    def release(self, call_ids: Iterable[str]) -> int:
        """Frees states whose client gave them up; tombstones unknown ids."""
        n = 0
        with self._lock:
            for call_id in call_ids:
                if self._states.pop(call_id, None) is not None:
                    n += 1
                if call_id not in self._gone:
                    self._forget(call_id, "released by the client")
            self.counts["released"] += n
        return n

    def sweep(self) -> int:
        """Frees expired states; returns how many."""
        with self._lock:
            return self._sweep_locked(time.monotonic())

    def clear(self) -> None:
        with self._lock:
            self._states.clear()

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return dict(self.counts, live=len(self._states))
