"""Which replica a fleet expert's call goes to: measured latency and queue.

Why
---
A fleet (:class:`~.fleet.Fleet`, :class:`~.ray_fleet.RayFleet`) resolves an
expert's name to several live replicas. Calls used to stick to the oldest
one (``balance="order"``): one slow replica, an overloaded machine or a
slower link then sets the pace of every step, while the others idle. Here
each fleet keeps one :class:`ReplicaBalancer` that its
:class:`~.replicas.FleetExpert` s share: what this client measured of each
replica, and which one each call should take.

How
---
*Power of two choices* (Mitzenmacher) on a cost in the style of Finagle's
"peak EWMA" balancer: two distinct candidates are drawn at random (from the
balancer's own :class:`random.Random`, injected for tests), and the call goes
to the one with the lower score::

    score(replica) = (ewma_forward + ewma_backward) * (1 + in_flight(replica))

* ``ewma_forward`` / ``ewma_backward``: exponentially weighted moving
  averages (weight ``alpha`` on the newest sample) of the round trips this
  client observed for the expert on that replica: a forward from send to
  reply, and the backward of a call (it goes to the replica that ran the
  forward, so choosing a forward chooses its backward too);
* ``in_flight(replica)``: the calls of the expert (forwards and backwards)
  that this client has sent to that replica and not seen end: its queue as
  this client knows it, the signal that spreads concurrent calls of the same
  expert (threads, pipelined steps, several layers sharing a fleet) at once,
  before their latencies show it. Calls of *other* experts on the same
  server are not counted: a server runs calls concurrently, so they slow a
  replica only as far as its measured round trips say (counting them made
  the four calls of one MoE step, each of another expert, look like a queue
  of four and pushed calls onto a replica five times slower; the bench row
  ``remote/replicas-slow-one`` measured it);
* two random candidates rather than the best one: every client that knows
  the same numbers would otherwise pile onto the same replica (herding), and
  a replica whose estimate is stale still gets compared.

Lifecycle of a replica's entry (one per expert name and worker)::

    state       entered when                             how calls reach it
    ----------  ---------------------------------------  -----------------------------------
    unmeasured  first seen as a candidate (also after    explored first: one call, to the
                forget(): the server left or rejoined)   unmeasured candidate with the fewest
                                                         calls in flight (then in fleet order)
    measured    a call on it ended well                  the two-choice draw, by score
    stale       no call on it ended for ``probe_after``  explored once more (a re-probe); its
                s (it lost every draw meanwhile)         next sample replaces the estimate
    penalised   a call on it failed or timed out         left out of the draw while another
                (``streak`` failures in a row)           candidate is not penalised; re-probed
                                                         after probe_after * 2**(streak-1) s
                                                         (at most 32x); a call that ends
                                                         well makes it measured again, its
                                                         sample replacing the estimate

Invariants (each has a test in ``tests/remote/test_balance.py`` that names it):

1. Deterministic: the same candidates, outcomes, clock readings and seed
   give the same choices (no other source of randomness or time is read).
2. Thread-safe: one lock guards every entry and counter; :meth:`choose`
   counts the chosen call in flight under that lock, so concurrent choosers
   of the same expert see each other's calls.
3. Every call counted in flight (:meth:`choose`, :meth:`begin`) is ended
   exactly once by its caller (:meth:`end`), whatever the outcome; a count
   never goes below zero.
4. A penalised or stale replica is re-probed: no replica is left without
   traffic for longer than its wait once it is a candidate again, so a
   recovered replica gets calls again.
5. :meth:`choose` returns one of the candidates it was given, and never
   blocks on anything but its lock (no I/O).

This module imports nothing of the package: it is pure bookkeeping, below
every engine.
"""
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["ReplicaBalancer", "BALANCE_POLICIES", "check_balance", "ALPHA", "PROBE_AFTER_S",
           "MAX_BACKOFF"]

#: How a fleet expert picks among live replicas: ``"latency"`` (the
#: default: two choices on measured latency and queue, this module) or
#: ``"order"`` (the oldest live replica, sticking to the one that served
#: last: the behaviour before issue 32).
BALANCE_POLICIES = ("latency", "order")
ALPHA = 0.1          # weight of the newest sample in the moving averages
PROBE_AFTER_S = 10.0  # a replica without a call ending for this long is probed again
MAX_BACKOFF = 32     # a replica failing again and again is re-probed at most this much later


def check_balance(value: str, what: str = "balance") -> str:
    """``value`` if it names a policy of :data:`BALANCE_POLICIES`, else ``ValueError``."""
    if value not in BALANCE_POLICIES:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, BALANCE_POLICIES))}, "
                         f"got {value!r}")
    return value


@dataclass
class _Entry:
    """What this client knows of one expert on one replica."""

    forward: Optional[float] = None   # EWMA of the forward round trip, seconds
    backward: Optional[float] = None  # EWMA of the backward round trip, seconds
    last: float = -math.inf           # when a call on it last ended (well or not)
    explored: float = -math.inf       # when it was last chosen to be explored
    calls: int = 0                    # forwards ended (well or not)
    probes: int = 0                   # times chosen to be explored (not by a draw)
    backwards: int = 0                # backwards ended (well or not)
    failures: int = 0                 # calls (either pass) that failed
    streak: int = 0                   # failures in a row (0: not penalised)
    renew: bool = False               # the next backward sample replaces its average

    def cost(self) -> Optional[float]:
        if self.forward is None:
            return None
        return self.forward + (self.backward or 0.0)


class ReplicaBalancer:
    """Chooses among the live replicas of an expert (see the module docstring).

    ``alpha``: weight of the newest sample in the moving averages;
    ``probe_after``: seconds after which a replica that ended no call is
    probed again (also the first wait of a penalised one); ``rng``: the
    random source of the two-choice draw (default: a fresh, unseeded
    :class:`random.Random`; pass ``random.Random(seed)`` for reproducible
    choices); ``clock``: the time source (default :func:`time.monotonic`;
    a fake one for tests). One balancer serves any number of threads.
    """

    def __init__(self, *, alpha: float = ALPHA, probe_after: float = PROBE_AFTER_S,
                 rng: Optional[random.Random] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha of ReplicaBalancer must be in (0, 1], got {alpha!r}")
        if not probe_after > 0.0:
            raise ValueError(f"probe_after of ReplicaBalancer must be positive seconds, got "
                             f"{probe_after!r}")
        self.alpha, self.probe_after = float(alpha), float(probe_after)
        self.rng = rng if rng is not None else random.Random()
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: Dict[Tuple[str, str], _Entry] = {}
        self._in_flight: Dict[Tuple[str, str], int] = {}  # (expert, worker) -> calls

    def __getstate__(self) -> Dict[str, Any]:  # a copy starts afresh (no lock to copy)
        return {"alpha": self.alpha, "probe_after": self.probe_after}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(alpha=state["alpha"], probe_after=state["probe_after"])  # type: ignore[misc]

    # -- choosing -------------------------------------------------------------------
    def _wait(self, entry: _Entry) -> float:
        """How long after its last call (or probe) the entry is explored again."""
        if entry.streak:
            return self.probe_after * min(2 ** (entry.streak - 1), MAX_BACKOFF)
        return self.probe_after

    def _due(self, entry: _Entry, now: float) -> bool:
        """Whether the entry must be explored (unmeasured, stale or penalised,
        and not explored within its wait)."""
        return now - max(entry.last, entry.explored) >= self._wait(entry)

    def choose(self, expert: str, candidates: Sequence[str]) -> str:
        """The replica of ``expert`` among ``candidates`` (live workers, in the
        fleet's order) that the next forward goes to; it is counted in flight
        at once, and the caller must :meth:`end` it."""
        if not candidates:
            raise ValueError(f"no candidate replica of expert {expert!r} to choose from")
        with self._lock:
            now = self.clock()
            entries = [self._entries.setdefault((expert, w), _Entry()) for w in candidates]
            due = [k for k, e in enumerate(entries) if self._due(e, now)]
            if due:  # unmeasured first, then stale or penalised replicas past their wait
                k = min(due, key=lambda j: (self._in_flight.get((expert, candidates[j]), 0), j))
                entries[k].explored = now
                entries[k].probes += 1
            else:
                k = self._draw(expert, candidates, entries)
            key = (expert, candidates[k])
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
            return candidates[k]

    def _draw(self, expert: str, candidates: Sequence[str], entries: List[_Entry]) -> int:
        """Two choices among the candidates that are not penalised (all of
        them if every one is)."""
        pool = [k for k, e in enumerate(entries) if not e.streak] or list(range(len(entries)))
        if len(pool) == 1:
            return pool[0]
        a, b = self.rng.sample(pool, 2)
        known = [c for c in (e.cost() for e in entries) if c is not None]
        neutral = sum(known) / len(known) if known else 1.0  # an entry being explored

        def score(k: int) -> float:
            cost = entries[k].cost()
            queue = self._in_flight.get((expert, candidates[k]), 0)
            return (neutral if cost is None else cost) * (1 + queue)
        return b if score(b) < score(a) else a

    def begin(self, expert: str, worker: str) -> None:
        """Counts a call of ``expert`` to ``worker`` in flight that
        :meth:`choose` did not (a backward, or a forward that another policy
        placed)."""
        with self._lock:
            key = (expert, worker)
            self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def end(self, expert: str, worker: str, phase: str, seconds: float,
            ok: Optional[bool]) -> None:
        """Ends a call counted in flight: ``phase`` ``"forward"`` or
        ``"backward"``, its round trip in ``seconds``; ``ok`` True (a
        sample), False (a failure or a timeout: the replica is penalised) or
        None (the call never reached the replica's judgement, e.g. its
        arguments could not travel: nothing recorded)."""
        with self._lock:
            key = (expert, worker)
            count = self._in_flight.get(key, 0)
            if count <= 1:
                self._in_flight.pop(key, None)
            else:
                self._in_flight[key] = count - 1
            if ok is None:
                return
            now = self.clock()
            entry = self._entries.setdefault((expert, worker), _Entry())
            if phase == "forward":
                entry.calls += 1
            else:
                entry.backwards += 1
            if not ok:
                entry.failures += 1
                entry.streak += 1
                entry.last = now
                return
            # a stale or penalised estimate says nothing of the replica now: replaced
            fresh = entry.streak > 0 or (now - seconds) - entry.last >= self.probe_after
            entry.streak = 0
            entry.last = now
            old = entry.forward if phase == "forward" else entry.backward
            if phase == "forward":
                entry.renew = entry.renew or fresh  # its backward average is as stale
            else:
                fresh, entry.renew = fresh or entry.renew, False
            value = seconds if old is None or fresh else old + self.alpha * (seconds - old)
            if phase == "forward":
                entry.forward = value
            else:
                entry.backward = value

    def forget(self, worker: str) -> None:
        """Drops what is known of ``worker``'s replicas (it left, or a new
        incarnation took its name): unmeasured again. Calls in flight to it
        stay counted until they end."""
        with self._lock:
            for key in [k for k in self._entries if k[1] == worker]:
                del self._entries[key]

    # -- what it knows ----------------------------------------------------------------
    def in_flight(self, expert: str, worker: str) -> int:
        """Calls of ``expert`` this client has in flight to ``worker``."""
        with self._lock:
            return self._in_flight.get((expert, worker), 0)

    def stats(self, expert: Optional[str] = None) -> Dict[str, Dict[str, Dict[str, Any]]]:
        """The balancer's view, ``{expert: {worker: {...}}}`` (one expert's
        alone with ``expert``): ``forward_ms`` / ``backward_ms`` (the moving
        averages; None until measured), ``in_flight`` (this client's calls
        of the expert in flight to the worker), ``calls`` (forwards ended
        there), ``probes`` (forwards sent there to explore it, not won in a
        draw), ``backwards``, ``failures`` (calls of either pass that
        failed) and ``penalised`` (failures in a row, 0 when healthy)."""
        with self._lock:
            out: Dict[str, Dict[str, Dict[str, Any]]] = {}
            for (name, worker), e in sorted(self._entries.items()):
                if expert is not None and name != expert:
                    continue
                out.setdefault(name, {})[worker] = {
                    "forward_ms": None if e.forward is None else e.forward * 1e3,
                    "backward_ms": None if e.backward is None else e.backward * 1e3,
                    "in_flight": self._in_flight.get((name, worker), 0), "calls": e.calls,
                    "probes": e.probes, "backwards": e.backwards, "failures": e.failures, "penalised": e.streak}
            return out
