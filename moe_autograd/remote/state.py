"""Server-side call state of the ``stateful`` backward strategy.

Why: a stateful server keeps each call's autograd graph (its detached inputs
and outputs) between the forward and the backward request, so backward needs
no recomputation. Clients crash, drop their outputs, or time out, so the store
must free states without their backward and never grow without bound; and
several clients share one server, so no client may use, free or crowd out
another client's states.

A state is keyed by its call id (128 random bits drawn by the client, so ids
cannot be guessed) and records its *owner*: the authenticated session of the
client that created it (its job's key id and its session's 128 random bits,
:class:`~moe_autograd.remote.auth.Caller`), never a name a client declares. Lifecycle of one state::

    event                                    what happens
    ---------------------------------------  ---------------------------------------
    forward that needs a graph               stored under its id with its owner; an id
                                             that is held or remembered is an error
    owner's backward request                 validated (expert, gradients) while the
                                             state stays stored, then popped, used
                                             once, freed; a rejected request leaves
                                             the state usable
    backward/release from another session    refused; the state is left intact
    owner drops the graph (finalizer)        release request -> freed
    release that overtakes its forward       tombstone: the late forward is refused
    owner past max_states_per_client         the owner's own oldest state is evicted
    server past max_states / max_bytes       the oldest state of the client holding
                                             the most (count / bytes) is evicted; a
                                             tie spares the others: the newcomer's
                                             own client pays
    no backward within state_ttl seconds     swept (on every put, and by a timer)
    server closed                            all freed

Invariants:

* ``len(store) <= max_states`` and ``store.nbytes <= max_bytes`` at all times;
  each client holds at most ``max_states_per_client`` states.
* A client's states are evicted by its own volume, or by another client only
  while it holds more (states or bytes) than that client: one client's
  traffic cannot push out the states of a client holding no more than it does.
* Only the owner can take or release a state; every refusal leaves the store
  unchanged except for the ``refused`` counter.
* A popped, released, expired or evicted id is remembered (bounded) with its
  owner and the reason, so a late backward gets an error that says why its
  state is gone, and the id cannot be stored again while it is remembered.
* All of this holds under concurrent requests: every method takes one lock.
"""
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from torch import Tensor

from .auth import refuse

__all__ = ["CallState", "StateStore", "StateError"]

_REMEMBERED = 8192  # reasons of gone ids kept for error messages and tombstones
_RELEASED = "released by the client"


class StateError(LookupError):
    """A request named a call state it may not use (missing, or another's)."""


@dataclass
class CallState:
    """What a stateful forward keeps for its backward."""

    expert: str
    owner: str              # the session that created the call (Caller.owner)
    leaves: List[Any]       # the call's arguments; tensors are detached leaves
    outputs: List[Tensor]   # the graph's outputs on the server
    nbytes: int = 0         # what the state holds (see ExpertServer: materialised inputs + outputs)
    expires: float = field(default=0.0)


class StateStore:
    """A bounded, TTL-swept map ``call id -> CallState`` with per-client
    quotas; thread-safe. See the module docstring for the policy."""

    def __init__(self, ttl: float, max_states: int, *,
                 max_states_per_client: Optional[int] = None,
                 max_bytes: Optional[int] = None) -> None:
        if not (isinstance(ttl, (int, float)) and ttl > 0):  # also refuses nan
            raise ValueError(f"state_ttl must be a positive number of seconds, got {ttl!r}")
        if max_states < 1:
            raise ValueError(f"max_states must be at least 1, got {max_states}")
        per_client = max_states if max_states_per_client is None else max_states_per_client
        if per_client < 1:
            raise ValueError(f"max_states_per_client must be at least 1, got {per_client}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_state_bytes must be positive or None, got {max_bytes}")
        self.ttl, self.max_states = float(ttl), int(max_states)
        self.max_states_per_client = min(int(per_client), self.max_states)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self._states: "OrderedDict[str, CallState]" = OrderedDict()  # expiry order
        self._owned: Dict[str, "OrderedDict[str, None]"] = {}  # owner -> its ids, oldest first
        self._owner_bytes: Dict[str, int] = {}
        self._bytes = 0
        self._gone: "OrderedDict[str, Tuple[str, str]]" = OrderedDict()  # id -> (owner, reason)
        self._lock = threading.Lock()
        self.counts: Dict[str, int] = {"stored": 0, "used": 0, "released": 0,
                                       "expired": 0, "evicted": 0, "refused": 0}

    def __len__(self) -> int:
        return len(self._states)

    @property
    def nbytes(self) -> int:
        """Bytes held by the live states, as each state counted them."""
        return self._bytes

    # -- helpers, called with the lock held ------------------------------------
    def _forget(self, call_id: str, owner: str, reason: str) -> None:
        self._gone[call_id] = (owner, reason)
        self._gone.move_to_end(call_id)
        while len(self._gone) > _REMEMBERED:
            self._gone.popitem(last=False)

    def _drop(self, call_id: str) -> CallState:
        state = self._states.pop(call_id)
        owned = self._owned[state.owner]
        del owned[call_id]
        if not owned:
            del self._owned[state.owner]
        self._bytes -= state.nbytes
        left = self._owner_bytes.pop(state.owner) - state.nbytes
        if owned:
            self._owner_bytes[state.owner] = left
        return state

    def _evict_oldest_of(self, owner: str, why: str) -> None:
        call_id = next(iter(self._owned[owner]))
        self._drop(call_id)
        self._forget(call_id, owner, f"evicted: {why}")
        self.counts["evicted"] += 1

    def _largest(self, newcomer: str, size: Callable[[str], int]) -> str:
        # Ties go to the newcomer: a client never evicts an equal holder.
        best, best_size = newcomer, size(newcomer) if newcomer in self._owned else -1
        for owner in self._owned:
            if size(owner) > best_size:
                best, best_size = owner, size(owner)
        return best

    def _sweep_locked(self, now: float) -> int:
        n = 0
        while self._states:
            call_id, state = next(iter(self._states.items()))
            if state.expires > now:
                break
            self._drop(call_id)
            self._forget(call_id, state.owner,
                         f"expired after state_ttl={self.ttl:g} s without a backward")
            n += 1
        self.counts["expired"] += n
        return n

    def _check_new_locked(self, owner: str, call_id: str, expert: str) -> None:
        where = f"forward of expert {expert!r}: call id {call_id!r}"
        if call_id in self._states:
            raise StateError(f"{where} is already held by a pending call: call ids must be "
                             "unique (a forward never reuses one)")
        gone = self._gone.get(call_id)
        if gone is not None:
            if gone == (owner, _RELEASED):
                raise StateError(f"{where} was released by the client before its forward "
                                 "arrived (the client gave up on it)")
            raise StateError(f"{where} was used before: call ids must be unique")

    # -- the operations ----------------------------------------------------------
    def check_new(self, owner: str, call_id: str, expert: str) -> None:
        """Raises :class:`StateError` if ``call_id`` cannot be stored (held,
        used before, or released by its client): lets a server refuse a
        duplicate before running the forward."""
        with self._lock:
            self._check_new_locked(owner, call_id, expert)

    def put(self, call_id: str, state: CallState) -> None:
        """Stores ``state``, evicting as the module docstring says; raises
        :class:`StateError` for an id that is held or was seen before, and
        :class:`MemoryError` for a state larger than ``max_bytes``."""
        now = time.monotonic()
        state.expires = now + self.ttl if math.isfinite(self.ttl) else math.inf
        owner = state.owner
        if self.max_bytes is not None and state.nbytes > self.max_bytes:
            raise MemoryError(f"the state of expert {state.expert!r} (call {call_id!r}) needs "
                              f"{state.nbytes} bytes, more than max_state_bytes="
                              f"{self.max_bytes} of the whole server")
        with self._lock:
            self._sweep_locked(now)
            self._check_new_locked(owner, call_id, state.expert)
            while len(self._owned.get(owner, ())) >= self.max_states_per_client:
                self._evict_oldest_of(owner, "this client holds at most max_states_per_client="
                                             f"{self.max_states_per_client} states")
            while len(self._states) >= self.max_states:
                victim = self._largest(owner, lambda o: len(self._owned[o]))
                self._evict_oldest_of(victim, f"the server holds at most max_states="
                                              f"{self.max_states} (the client holding the "
                                              "most gives way)")
            if self.max_bytes is not None:
                while self._bytes + state.nbytes > self.max_bytes:
                    victim = self._largest(owner, lambda o: self._owner_bytes[o])
                    self._evict_oldest_of(victim, f"the server's states hold at most "
                                                  f"max_state_bytes={self.max_bytes} bytes "
                                                  "(the client holding the most gives way)")
            self._states[call_id] = state
            self._owned.setdefault(owner, OrderedDict())[call_id] = None
            self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + state.nbytes
            self._bytes += state.nbytes
            self.counts["stored"] += 1

    def take(self, owner: str, call_id: str, expert: str,
             check: Optional[Callable[[CallState], None]] = None) -> CallState:
        """Pops the state for its backward, after checking that ``owner``
        created it for ``expert`` and running ``check(state)`` (e.g. the
        gradients' shapes): any failure raises and leaves the state stored."""
        with self._lock:
            state = self._states.get(call_id)
            if state is None:
                gone_owner, reason = self._gone.get(call_id, (owner, ""))
                if not reason or gone_owner != owner:
                    reason = "unknown call id (never stored on this server for this client)"
                raise StateError(f"backward of expert {expert!r}: no state for call "
                                 f"{call_id!r}: {reason}")
            if state.owner != owner:
                self.counts["refused"] += 1
                refuse("not the owner", f"a backward of call {call_id[:8]}... of expert "
                                        f"{expert!r} by another session")
                raise StateError(f"backward of expert {expert!r}: call {call_id!r} belongs to "
                                 "another session, not this client's: only its owner may run "
                                 "its backward")
            if state.expert != expert:
                self.counts["refused"] += 1
                raise StateError(f"backward of expert {expert!r}: call {call_id!r} belongs to "
                                 f"expert {state.expert!r}, not {expert!r}")
            if check is not None:
                check(state)  # raises: the state stays for the real backward
            self._drop(call_id)
            self._forget(call_id, owner, "used by an earlier backward (stateful state is used once)")
            self.counts["used"] += 1
            return state

    def release(self, owner: str, call_ids: Iterable[str]) -> int:
        """Frees ``owner``'s states among ``call_ids``; tombstones unknown ids
        (so a late forward stores nothing); skips (and counts as refused) ids
        held by another session. Returns how many states were freed."""
        n = 0
        with self._lock:
            for call_id in call_ids:
                state = self._states.get(call_id)
                if state is not None:
                    if state.owner != owner:
                        self.counts["refused"] += 1
                        refuse("not the owner", f"a release of call {call_id[:8]}... by another "
                                                "session")
                        continue
                    self._drop(call_id)
                    self._forget(call_id, owner, _RELEASED)
                    n += 1
                elif call_id not in self._gone:
                    self._forget(call_id, owner, _RELEASED)
            self.counts["released"] += n
        return n

    def sweep(self) -> int:
        """Frees expired states; returns how many."""
        with self._lock:
            return self._sweep_locked(time.monotonic())

    def clear(self) -> None:
        with self._lock:
            self._states.clear()
            self._owned.clear()
            self._owner_bytes.clear()
            self._bytes = 0

    def stats(self) -> Dict[str, int]:
        """Counters, ``live`` states, their ``bytes`` and how many ``clients`` hold some."""
        with self._lock:
            return dict(self.counts, live=len(self._states), bytes=self._bytes,
                        clients=len(self._owned))
