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
    run                 JSON {run, founded_at, MAC}: the    the founder, once
                        run's random id
    version             counter, +1 on every roster change  publish / unpublish / reap
    roster              JSON {server: [rank, expires,       compare-and-set loops
                        MAC]} (published)
    server/<server>     JSON record (run, rank, experts     the server (overwritten
                        with their backward strategy,       on every state change,
                        state, expires, MAC)                and renewed)
    beat/<name>-<rank>  "<n>:<MAC>", n +1 every beat        each participant's beat
                        interval (one key per incarnation)  thread (servers, clients)
    evicted/<server>    "<rank>:<expires>:<MAC>" of a       the reaper
                        reaped incarnation
    stop                "<expires>:<MAC>": servers should   the coordinator's shutdown
                        leave now

Trust: the store itself authenticates nobody (torch's TCPStore), so what a
reader acts on is signed with the job's secret (:meth:`~.auth.JobSecret.sign`:
the run, roster entries, records, beats, eviction marks, the stop), and every
signature but the run's names the run (:attr:`Registry.run`, 128 random bits
the founder draws) and an expiry (wall clock, :data:`RECORD_TTL_S` for the
roster and records, which their servers renew; :data:`MARK_TTL_S` for an
eviction or a stop). An entry whose MAC does not verify, of another run, or
expired is ignored, counted and logged (:func:`~.auth.refuse`), so neither a
process without the secret nor a copy of an earlier run's records (same
secret) can publish a server, take a name, evict a server, stop the fleet or
keep a dead server listed. A beat counts only when its signed number grows:
a replayed beat is an old number. A name held by a live incarnation cannot be
published by another (:meth:`Registry.publish` refuses it).

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
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .auth import JobSecret, refuse

__all__ = ["PREFIX", "ServerRecord", "Registry", "BeatWatch", "observe_alive", "NameTaken",
           "NoRun", "RECORD_TTL_S", "MARK_TTL_S", "CLOCK_SLACK_S"]

PREFIX = "moe_autograd/fleet/"
_CAS_TRIES = 1000
#: How long a signed roster entry or record is valid; servers renew theirs
#: every quarter of it (:meth:`Registry.renew`).
RECORD_TTL_S = 6 * 3600.0
#: How long an eviction mark or a stop is valid (they are acted on at once).
MARK_TTL_S = 600.0
#: How far apart the writers' and readers' wall clocks may be.
CLOCK_SLACK_S = 300.0
#: How long a reader waits for the founder's run record.
RUN_WAIT_S = 30.0


class NoRun(RuntimeError):
    """The store holds no valid run record (no founder, or not this job's)."""


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
    boot: str = ""  # its process's boot id (hex): clients bind their requests to it

    def _fields(self) -> Dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "experts": self.experts,
                "state": self.state, "published_at": self.published_at, "boot": self.boot}

    def to_json(self, secret: JobSecret, run: str, expires: float) -> str:
        body = json.dumps(dict(self._fields(), run=run, expires=expires), sort_keys=True)
        return json.dumps({"record": body, "mac": secret.sign("server", body)})

    @staticmethod
    def from_json(text: str, secret: JobSecret, run: str) -> Optional["ServerRecord"]:
        """The record, or ``None`` (counted and logged) if it is not signed
        with ``secret``, of another run, expired, or malformed."""
        try:
            outer = json.loads(text)
            body = outer["record"]
            if not secret.verify(outer.get("mac"), "server", body):
                refuse("bad MAC", "a fleet record that is not signed with this job's secret",
                       once=text)
                return None
            d = json.loads(body)
            if d.get("run") != run:
                refuse("other run", f"a fleet record of {str(d.get('name'))[:60]!r} from "
                                    f"another run of this job", once=text)
                return None
            if not _fresh(float(d["expires"])):
                refuse("expired", f"an expired fleet record of {str(d.get('name'))[:60]!r}",
                       once=text)
                return None
            return ServerRecord(str(d["name"]), int(d["rank"]),
                                {str(k): str(v) for k, v in dict(d.get("experts", {})).items()},
                                str(d.get("state", "serving")), float(d.get("published_at", 0.0)),
                                str(d.get("boot", "")))
        except (ValueError, KeyError, TypeError, AttributeError):
            refuse("malformed", "a malformed fleet record", once=text)
            return None


def _number(text: str) -> float:
    """A signed expiry's value (a signed one was written by :func:`repr`)."""
    try:
        return float(text)
    except ValueError:
        return float("-inf")


def _fresh(expires: float) -> bool:
    """Whether a record that ``expires`` (the writer's wall clock) is still valid here."""
    return time.time() < expires + CLOCK_SLACK_S


class Registry:
    """The fleet's keys in the world's store ``raw`` (a TCPStore client),
    signed and checked with ``secret``."""

    def __init__(self, raw: Any, secret: JobSecret, run: Optional[str] = None) -> None:
        self.raw, self.secret = raw, secret
        self._run = run
        self._beat_numbers: Dict[Tuple[str, int], int] = {}  # this process's own beats
        self._highest: Dict[Tuple[str, int], int] = {}  # the highest signed beat seen, each
        self._lock = threading.Lock()

    # -- the run ---------------------------------------------------------------
    def found(self) -> str:
        """Draws this run's id and writes its signed record (the founder, once)."""
        run, at = secrets.token_hex(16), time.time()
        self.raw.set(self._key("run"), json.dumps({"run": run, "founded_at": at,
                                                   "mac": self.secret.sign("run", run, repr(at))}))
        self._run = run
        return run

    @property
    def run(self) -> str:
        """This run's id, read from the store's signed run record once
        (raises :class:`NoRun` if it is missing or not this job's)."""
        if self._run is None:
            deadline = time.monotonic() + RUN_WAIT_S  # (a founder writes it as it starts)
            while not self.raw.check([self._key("run")]) and time.monotonic() < deadline:
                time.sleep(0.05)
            text = self._get(self._key("run"))
            try:
                found = json.loads(text) if text else None
                ok = isinstance(found, dict) and self.secret.verify(
                    found.get("mac"), "run", str(found.get("run")), repr(found.get("founded_at")))
            except ValueError:
                ok = False
            if not ok:
                if text:
                    refuse("bad MAC", "a fleet run record that is not signed with this job's "
                                      "secret", once=f"run:{text}")
                raise NoRun("the fleet's store holds no run record of this job: is its founder "
                            "(Fleet.start) this job's, and running?")
            assert isinstance(found, dict)
            self._run = str(found["run"])
        return self._run

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
            if self._entry_ok(str(name), entry):
                out[str(name)] = int(entry[0])
        return out

    def _entry_ok(self, name: str, entry: Any, count: bool = True) -> bool:
        """Whether a roster entry is signed for this run and not expired
        (counted and logged if not, with ``count``)."""
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int)
                and isinstance(entry[1], (int, float))):
            reason = "malformed"
        elif not self.secret.verify(entry[2], "roster", self.run, name, str(entry[0]),
                                    repr(float(entry[1]))):
            reason = "bad MAC"
        elif not _fresh(float(entry[1])):
            reason = "expired"
        else:
            return True
        if count:
            refuse(reason, f"a fleet roster entry for {name[:60]!r} that is not signed for "
                           f"this run of this job, or expired", once=f"roster:{name}:{entry}")
        return False

    def _signed_entry(self, name: str, rank: int) -> List[Any]:
        expires = time.time() + RECORD_TTL_S
        return [rank, expires, self.secret.sign("roster", self.run, name, str(rank),
                                                repr(expires))]

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
                    entries[name] = self._signed_entry(name, rank)
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
                    and self._entry_ok(record.name, entry, count=False) \
                    and live(record.name, int(entry[0])):
                refuse("name taken", f"a publication of {record.name!r} (rank {record.rank}) "
                                     f"while rank {entry[0]} holds it")
                raise NameTaken(f"the name {record.name!r} is published by a live server "
                                f"(rank {entry[0]}); choose another name")
        check(self._entries(self._get(self._key("roster"))))
        self.raw.set(self._key("server", record.name), self._signed(record))
        self._update_roster({record.name: record.rank}, check)

    def _signed(self, record: ServerRecord) -> str:
        return record.to_json(self.secret, self.run, time.time() + RECORD_TTL_S)

    def renew(self, record: ServerRecord) -> None:
        """Signs ``record`` and its roster entry again with a new expiry (a
        published server, every quarter of :data:`RECORD_TTL_S`), if its
        incarnation is still the one listed."""
        if self.roster().get(record.name) != record.rank:
            return
        self.raw.set(self._key("server", record.name), self._signed(record))
        self._update_roster({record.name: record.rank})

    def unpublish(self, name: str, rank: int, state: str) -> None:
        """Removes ``name`` from the roster if its incarnation ``rank`` is the
        one listed, and marks its record ``state`` (``draining``, ``left``,
        ``reaped``)."""
        record = self.record(name)
        if record is not None and record.rank == rank:
            self.raw.set(self._key("server", name),
                         self._signed(ServerRecord(name, rank, record.experts, state,
                                                   record.published_at, record.boot)))
        if self.roster().get(name) == rank:
            self._update_roster({name: None})

    def record(self, name: str) -> Optional[ServerRecord]:
        text = self._get(self._key("server", name))
        return ServerRecord.from_json(text, self.secret, self.run) if text else None

    def records(self, names: Sequence[str]) -> Dict[str, ServerRecord]:
        """The signed records of ``names`` (those whose record fails are left out)."""
        keys = [self._key("server", n) for n in names]
        if not keys:
            return {}
        # published servers always have a record (written before the roster)
        values = self.raw.multi_get(keys)
        out: Dict[str, ServerRecord] = {}
        for name, value in zip(names, values):
            record = ServerRecord.from_json(bytes(value).decode(), self.secret, self.run)
            if record is not None and record.name == name:
                out[name] = record
        return out

    # -- heartbeats ------------------------------------------------------------
    def _beat_key(self, name: str, rank: int) -> str:
        return self._key("beat", f"{name}-{rank}")

    def beat(self, name: str, rank: int) -> int:
        """One heartbeat of the incarnation ``(name, rank)``: its next number,
        signed for this run."""
        with self._lock:
            n = self._beat_numbers.get((name, rank), 0) + 1
            self._beat_numbers[(name, rank)] = n
        self.raw.set(self._beat_key(name, rank),
                     f"{n}:{self.secret.sign('beat', self.run, name, str(rank), str(n))}")
        return n

    def _beat_value(self, name: str, rank: int, value: Any) -> Optional[int]:
        """A beat's number if it is signed for this run (else None, counted)."""
        text = bytes(value).decode(errors="replace") if not isinstance(value, str) else value
        number, _, mac = text.partition(":")
        if number.isdigit() and self.secret.verify(mac, "beat", self.run, name, str(rank),
                                                   number):
            with self._lock:  # never lower than seen: a replayed older beat moves nothing
                high = max(self._highest.get((name, rank), 0), int(number))
                self._highest[(name, rank)] = high
            return high
        refuse("bad MAC", f"a heartbeat of {name[:60]!r} that is not signed for this run of "
                          f"this job", once=f"beat:{name}:{rank}:{text[:200]}")
        return None

    def published_beats(self, incarnations: Mapping[str, int]) -> Dict[str, int]:
        """Beat numbers of published incarnations (signed ones), in one
        round trip (a server beats before it publishes, so their keys exist)."""
        names = list(incarnations)
        if not names:
            return {}
        values = self.raw.multi_get([self._beat_key(n, incarnations[n]) for n in names])
        out: Dict[str, int] = {}
        for name, value in zip(names, values):
            number = self._beat_value(name, incarnations[name], value)
            if number is not None:
                out[name] = number
        return out

    def beats(self, incarnations: Mapping[str, int]) -> Dict[str, int]:
        """Current signed beat numbers of those incarnations (``name ->
        rank``) that ever beat, by name."""
        out: Dict[str, int] = {}
        for name, rank in incarnations.items():
            key = self._beat_key(name, rank)
            if self.raw.check([key]):
                number = self._beat_value(name, rank, self.raw.get(key))
                if number is not None:
                    out[name] = number
        return out

    # -- eviction and stop -----------------------------------------------------
    def evict(self, name: str, rank: int) -> None:
        expires = time.time() + MARK_TTL_S
        self.raw.set(self._key("evicted", name),
                     f"{rank}:{expires!r}:"
                     f"{self.secret.sign('evicted', self.run, name, str(rank), repr(expires))}")

    def evicted(self, name: str, rank: int) -> bool:
        text = self._get(self._key("evicted", name))
        if text is None:
            return False
        mark, _, rest = text.partition(":")
        expires, _, mac = rest.partition(":")
        if not self.secret.verify(mac, "evicted", self.run, name, mark, expires):
            refuse("bad MAC", f"an eviction mark for {name!r} that is not signed for this run "
                              f"of this job", once=f"evicted:{name}:{text}")
            return False
        if not _fresh(_number(expires)):
            refuse("expired", f"an expired eviction mark for {name!r}",
                   once=f"evicted:{name}:{text}")
            return False
        return mark == str(rank)

    def request_stop(self) -> None:
        expires = time.time() + MARK_TTL_S
        self.raw.set(self._key("stop"),
                     f"{expires!r}:{self.secret.sign('stop', self.run, repr(expires))}")

    def stop_requested(self) -> bool:
        text = self._get(self._key("stop"))
        if text is None:
            return False
        expires, _, mac = text.partition(":")
        if not self.secret.verify(mac, "stop", self.run, expires):
            refuse("bad MAC", "a fleet stop request that is not signed for this run of this job",
                   once=f"stop:{text}")
            return False
        if not _fresh(_number(expires)):
            refuse("expired", "an expired fleet stop request", once=f"stop:{text}")
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
                if old is None or value > old[0]:  # a replayed beat is an older number
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
        moved |= {n for n, v in now.items() if v > first[n]}
    return [n for n in incarnations if n not in first or n in moved]
