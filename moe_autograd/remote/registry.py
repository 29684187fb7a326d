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
    roster              JSON {server: [rank, MAC]}          compare-and-set loops
                        (published)
    server/<server>     JSON record (rank, experts with     the server (overwritten
                        their backward strategy, state,     on every state change)
                        MAC)
    beat/<name>-<rank>  counter, +1 every beat interval     each participant's beat
                        (one key per incarnation)           thread (servers, clients)
    evicted/<server>    "<rank>:<MAC>" of a reaped          the reaper
                        incarnation
    stop                "<MAC>": servers should leave now   the coordinator's shutdown

Trust: the store itself authenticates nobody (torch's TCPStore), so what a
reader acts on is signed with the job's secret (:meth:`~.auth.JobSecret.sign`:
roster entries, records, eviction marks, the stop): an entry whose MAC does
not verify is ignored, counted and logged (:func:`~.auth.refuse`), so a
process without the secret cannot publish a server, take a name, evict a
server or stop the fleet. Heartbeat counters are not signed: a stranger who
reaches the store can make a dead server look alive (its calls then fail on
the transport and are retried elsewhere) or disrupt the store, not
impersonate. A name held by a live incarnation cannot be published by
another (:meth:`Registry.publish` refuses it).

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
* Readers see only signed entries: :meth:`Registry.roster` and
  :meth:`Registry.record` drop (and count) the others.
"""
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .auth import JobSecret, refuse

__all__ = ["PREFIX", "ServerRecord", "Registry", "BeatWatch", "observe_alive", "NameTaken"]

PREFIX = "moe_autograd/fleet/"
_CAS_TRIES = 1000


class NameTaken(RuntimeError):
    """A server name is published by another live incarnation."""


@dataclass(frozen=True)
class ServerRecord:
    """What a server publishes about itself."""

    name: str
    rank: int
    experts: Dict[str, str] = field(default_factory=dict)  # expert -> "stateless"/"stateful"
    state: str = "serving"   # serving, draining, left, reaped
    published_at: float = 0.0  # the server's wall clock (for reports only)

    def _fields(self) -> Dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "experts": self.experts,
                "state": self.state, "published_at": self.published_at}

    def to_json(self, secret: JobSecret) -> str:
        body = json.dumps(self._fields(), sort_keys=True)
        return json.dumps({"record": body, "mac": secret.sign("server", body)})

    @staticmethod
    def from_json(text: str, secret: JobSecret) -> Optional["ServerRecord"]:
        """The record, or ``None`` (counted and logged) if it is not signed
        with ``secret`` or malformed."""
        try:
            outer = json.loads(text)
            body = outer["record"]
            if not secret.verify(outer.get("mac"), "server", body):
                refuse("bad MAC", "a fleet record that is not signed with this job's secret",
                       once=text)
                return None
            d = json.loads(body)
            return ServerRecord(str(d["name"]), int(d["rank"]),
                                {str(k): str(v) for k, v in dict(d.get("experts", {})).items()},
                                str(d.get("state", "serving")), float(d.get("published_at", 0.0)))
        except (ValueError, KeyError, TypeError, AttributeError):
            refuse("malformed", "a malformed fleet record", once=text)
            return None


class Registry:
    """The fleet's keys in the world's store ``raw`` (a TCPStore client),
    signed and checked with ``secret``."""

    def __init__(self, raw: Any, secret: JobSecret) -> None:
        self.raw, self.secret = raw, secret

    # -- keys ------------------------------------------------------------------
    @staticmethod
    def _key(*parts: str) -> str:
        return PREFIX + "/".join(parts)

    def _get(self, key: str) -> Optional[str]:
        return self.raw.get(key).decode() if self.raw.check([key]) else None

    # -- roster ----------------------------------------------------------------
    def version(self) -> int:
        return int(self.raw.add(self._key("version"), 0))

    def _entries(self, text: Optional[str]) -> Dict[str, Any]:
        if not text:
            return {}
        try:
            found = json.loads(text)
        except ValueError:
            refuse("malformed", "a malformed fleet roster", once=text)
            return {}
        return found if isinstance(found, dict) else {}

    def roster(self) -> Dict[str, int]:
        """``name -> rank`` of the published servers whose entries are signed."""
        out: Dict[str, int] = {}
        for name, entry in self._entries(self._get(self._key("roster"))).items():
            if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int) \
                    and self.secret.verify(entry[1], "roster", str(name), str(entry[0])):
                out[str(name)] = int(entry[0])
            else:
                refuse("bad MAC", f"a fleet roster entry for {str(name)[:60]!r} that is not "
                                  "signed with this job's secret", once=f"roster:{name}:{entry}")
        return out

    def _update_roster(self, change: Mapping[str, Optional[int]],
                       check: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, int]:
        """Applies ``change`` (name -> rank, or None to remove) atomically;
        ``check(entries)`` may refuse it (raises) against what is there."""
        key = self._key("roster")
        for _ in range(_CAS_TRIES):
            current = self._get(key) or ""
            entries = self._entries(current)
            if check is not None:
                check(entries)
            for name, rank in change.items():
                if rank is None:
                    entries.pop(name, None)
                else:
                    entries[name] = [rank, self.secret.sign("roster", name, str(rank))]
            desired = json.dumps(entries, sort_keys=True)
            if desired == current or self.raw.compare_set(key, current, desired).decode() == desired:
                self.raw.add(self._key("version"), 1)
                return self.roster()
        raise RuntimeError("the fleet's roster is contended beyond reason")  # pragma: no cover

    def publish(self, record: ServerRecord, live: Optional[Callable[[str, int], bool]] = None
                ) -> None:
        """Writes ``record`` and lists the server: clients resolve it from now
        on. Raises :class:`NameTaken` if the roster lists the name with
        another rank that ``live(name, rank)`` says is still alive (a later
        joiner cannot take a live server's name)."""
        def check(entries: Dict[str, Any]) -> None:
            entry = entries.get(record.name)
            if isinstance(entry, list) and entry and entry[0] != record.rank and live is not None \
                    and self.secret.verify(entry[1] if len(entry) > 1 else None, "roster",
                                           record.name, str(entry[0])) \
                    and live(record.name, int(entry[0])):
                refuse("name taken", f"a publication of {record.name!r} (rank {record.rank}) "
                                     f"while rank {entry[0]} holds it")
                raise NameTaken(f"the name {record.name!r} is published by a live server "
                                f"(rank {entry[0]}); choose another name")
        check(self._entries(self._get(self._key("roster"))))
        self.raw.set(self._key("server", record.name), record.to_json(self.secret))
        self._update_roster({record.name: record.rank}, check)

    def unpublish(self, name: str, rank: int, state: str) -> None:
        """Removes ``name`` from the roster if its incarnation ``rank`` is the
        one listed, and marks its record ``state`` (``draining``, ``left``,
        ``reaped``)."""
        record = self.record(name)
        if record is not None and record.rank == rank:
            self.raw.set(self._key("server", name),
                         ServerRecord(name, rank, record.experts, state,
                                      record.published_at).to_json(self.secret))
        if self.roster().get(name) == rank:
            self._update_roster({name: None})

    def record(self, name: str) -> Optional[ServerRecord]:
        text = self._get(self._key("server", name))
        return ServerRecord.from_json(text, self.secret) if text else None

    def records(self, names: Sequence[str]) -> Dict[str, ServerRecord]:
        """The signed records of ``names`` (those whose record fails are left out)."""
        keys = [self._key("server", n) for n in names]
        if not keys:
            return {}
        # published servers always have a record (written before the roster)
        values = self.raw.multi_get(keys)
        out: Dict[str, ServerRecord] = {}
        for name, value in zip(names, values):
            record = ServerRecord.from_json(bytes(value).decode(), self.secret)
            if record is not None and record.name == name:
                out[name] = record
        return out

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
        self.raw.set(self._key("evicted", name),
                     f"{rank}:{self.secret.sign('evicted', name, str(rank))}")

    def evicted(self, name: str, rank: int) -> bool:
        text = self._get(self._key("evicted", name))
        if text is None:
            return False
        mark, _, mac = text.partition(":")
        if not self.secret.verify(mac, "evicted", name, mark):
            refuse("bad MAC", f"an eviction mark for {name!r} that is not signed with this "
                              "job's secret", once=f"evicted:{name}:{text}")
            return False
        return mark == str(rank)

    def request_stop(self) -> None:
        self.raw.set(self._key("stop"), self.secret.sign("stop"))

    def stop_requested(self) -> bool:
        text = self._get(self._key("stop"))
        if text is None:
            return False
        if not self.secret.verify(text, "stop"):
            refuse("bad MAC", "a fleet stop request that is not signed with this job's secret",
                   once=f"stop:{text}")
            return False
        return True


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
