"""The fleet's registry: which servers host which experts, and who is alive.

Why: in an elastic world (:mod:`.membership`) servers come and go, so a
client cannot be configured with worker names; it asks by *expert* name.
Servers publish what they host in the world's rendezvous store (the TCPStore
that rank 0 hosts, which every member already reaches), next to torch's own
keys; clients read it, cache it and refresh it when it changes. No extra
service, no DHT: the store is the directory.

Store layout (prefix ``moe_autograd/fleet/``)::

    key                 value                               written by
    ------------------  ----------------------------------  -------------------------
    version             counter, +1 on every roster change  publish / unpublish / reap
    roster              JSON {server: rank} (published)     compare-and-set loops
    server/<server>     JSON record (rank, experts with     the server (overwritten
                        their backward strategy, state)     on every state change)
    beat/<name>-<rank>  counter, +1 every beat interval     each participant's beat
                        (one key per incarnation)           thread (servers, clients)
    evicted/<server>    the rank of a reaped incarnation    the reaper
    stop                "1": servers should leave now       the coordinator's shutdown

Invariants:

* Keys that others ``get`` are never deleted (a TCPStore ``get`` of a missing
  key blocks until the store's timeout); the roster is the truth about who
  is published, records are overwritten, never removed.
* Roster updates are compare-and-set loops (concurrent servers lose no
  update), each followed by a ``version`` bump; readers poll ``version``
  (one round trip) and re-read the roster only when it moved.
* Liveness is judged on the reader's own clock: a beat counter that has not
  moved for ``dead_after`` seconds means dead (no clock agreement between
  machines is needed). A name seen for the first time is given the benefit
  of the doubt for one ``dead_after``.
* All methods are thread-safe (TCPStore clients serialise their requests).
"""
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

__all__ = ["PREFIX", "ServerRecord", "Registry", "BeatWatch", "observe_alive"]

PREFIX = "moe_autograd/fleet/"
_CAS_TRIES = 1000


@dataclass(frozen=True)
class ServerRecord:
    """What a server publishes about itself."""

    name: str
    rank: int
    experts: Dict[str, str] = field(default_factory=dict)  # expert -> "stateless"/"stateful"
    state: str = "serving"   # serving, draining, left, reaped
    published_at: float = 0.0  # the server's wall clock (for reports only)

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "rank": self.rank, "experts": self.experts,
                           "state": self.state, "published_at": self.published_at})

    @staticmethod
    def from_json(text: str) -> "ServerRecord":
        d = json.loads(text)
        return ServerRecord(str(d["name"]), int(d["rank"]),
                            {str(k): str(v) for k, v in dict(d.get("experts", {})).items()},
                            str(d.get("state", "serving")), float(d.get("published_at", 0.0)))


class Registry:
    """The fleet's keys in the world's store ``raw`` (a TCPStore client)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    # -- keys ------------------------------------------------------------------
    @staticmethod
    def _key(*parts: str) -> str:
        return PREFIX + "/".join(parts)

    def _get(self, key: str) -> Optional[str]:
        return self.raw.get(key).decode() if self.raw.check([key]) else None

    # -- roster ----------------------------------------------------------------
    def version(self) -> int:
        return int(self.raw.add(self._key("version"), 0))

    def roster(self) -> Dict[str, int]:
        text = self._get(self._key("roster"))
        return {str(k): int(v) for k, v in json.loads(text).items()} if text else {}

    def _update_roster(self, change: Mapping[str, Optional[int]]) -> Dict[str, int]:
        """Applies ``change`` (name -> rank, or None to remove) atomically."""
        key = self._key("roster")
        for _ in range(_CAS_TRIES):
            current = self._get(key) or ""
            roster = {str(k): int(v) for k, v in json.loads(current).items()} if current else {}
            for name, rank in change.items():
                if rank is None:
                    roster.pop(name, None)
                else:
                    roster[name] = rank
            desired = json.dumps(roster, sort_keys=True)
            if desired == current or self.raw.compare_set(key, current, desired).decode() == desired:
                self.raw.add(self._key("version"), 1)
                return roster
        raise RuntimeError("the fleet's roster is contended beyond reason")  # pragma: no cover

    def publish(self, record: ServerRecord) -> None:
        """Writes ``record`` and lists the server: clients resolve it from now on."""
        self.raw.set(self._key("server", record.name), record.to_json())
        self._update_roster({record.name: record.rank})

    def unpublish(self, name: str, rank: int, state: str) -> None:
        """Removes ``name`` from the roster if its incarnation ``rank`` is the
        one listed, and marks its record ``state`` (``draining``, ``left``,
        ``reaped``)."""
        record = self.record(name)
        if record is not None and record.rank == rank:
            self.raw.set(self._key("server", name),
                         ServerRecord(name, rank, record.experts, state,
                                      record.published_at).to_json())
        if self.roster().get(name) == rank:
            self._update_roster({name: None})

    def record(self, name: str) -> Optional[ServerRecord]:
        text = self._get(self._key("server", name))
        return ServerRecord.from_json(text) if text else None

    def records(self, names: Sequence[str]) -> Dict[str, ServerRecord]:
        keys = [self._key("server", n) for n in names]
        if not keys:
            return {}
        # published servers always have a record (written before the roster)
        values = self.raw.multi_get(keys)
        return {n: ServerRecord.from_json(bytes(v).decode()) for n, v in zip(names, values)}

    # -- heartbeats ------------------------------------------------------------
    def _beat_key(self, name: str, rank: int) -> str:
        return self._key("beat", f"{name}-{rank}")

    def beat(self, name: str, rank: int) -> int:
        """One heartbeat of the incarnation ``(name, rank)``."""
        return int(self.raw.add(self._beat_key(name, rank), 1))

    def published_beats(self, incarnations: Mapping[str, int]) -> Dict[str, int]:
        """Beat counters of published incarnations, in one round trip (a
        server beats before it publishes, so their keys exist)."""
        names = list(incarnations)
        if not names:
            return {}
        values = self.raw.multi_get([self._beat_key(n, incarnations[n]) for n in names])
        return {n: int(bytes(v).decode()) for n, v in zip(names, values)}

    def beats(self, incarnations: Mapping[str, int]) -> Dict[str, int]:
        """Current beat counters of those incarnations (``name -> rank``)
        that ever beat, by name."""
        out: Dict[str, int] = {}
        for name, rank in incarnations.items():
            key = self._beat_key(name, rank)
            if self.raw.check([key]):
                out[name] = int(self.raw.add(key, 0))
        return out

    # -- eviction and stop -----------------------------------------------------
    def evict(self, name: str, rank: int) -> None:
        self.raw.set(self._key("evicted", name), str(rank))

    def evicted(self, name: str, rank: int) -> bool:
        return self._get(self._key("evicted", name)) == str(rank)

    def request_stop(self) -> None:
        self.raw.set(self._key("stop"), "1")

    def stop_requested(self) -> bool:
        return bool(self.raw.check([self._key("stop")]))


class BeatWatch:
    """Liveness from beat counters, on this process's clock."""

    def __init__(self, dead_after: float) -> None:
        self.dead_after = dead_after
        self._seen: Dict[str, Tuple[int, float]] = {}  # name -> (counter, when it last moved)
        self._lock = threading.Lock()

    def update(self, counters: Mapping[str, int], now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            for name, value in counters.items():
                old = self._seen.get(name)
                if old is None or old[0] != value:
                    self._seen[name] = (value, now)

    def alive(self, name: str, now: Optional[float] = None) -> bool:
        """True if ``name``'s counter moved within ``dead_after`` (or was
        first seen that recently); False for names never seen."""
        now = time.monotonic() if now is None else now
        with self._lock:
            seen = self._seen.get(name)
        return seen is not None and now - seen[1] < self.dead_after

    def silent_for(self, name: str, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            seen = self._seen.get(name)
        return float("inf") if seen is None else now - seen[1]

    def forget(self, name: str) -> None:
        with self._lock:
            self._seen.pop(name, None)


def observe_alive(registry: Registry, incarnations: Mapping[str, int], window: float) -> List[str]:
    """Those of ``incarnations`` (``name -> rank``) that look alive now: one
    with a beat counter must see it move within ``window`` seconds; one that
    never beat (not a fleet participant) cannot be judged and counts as alive."""
    first = registry.beats(incarnations)
    if not first:
        return list(incarnations)
    deadline = time.monotonic() + window
    moved: Set[str] = set()
    while time.monotonic() < deadline and len(moved) < len(first):
        time.sleep(min(0.05, window))
        now = registry.beats({n: incarnations[n] for n in first})
        moved |= {n for n, v in now.items() if v != first[n]}
    return [n for n in incarnations if n not in first or n in moved]
