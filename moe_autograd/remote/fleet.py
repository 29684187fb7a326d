"""The trainer's view of an elastic fleet: servers found by name, admitted by proof.

Why: a fixed RPC world (``world_size`` known up front) cannot take a server
that starts late, and a lost server can only be masked, never replaced.
Volunteer or spot machines come and go; the world here is dynamic
(:mod:`.membership`, on torch's ``init_rpc(world_size=None)``), servers
publish their experts (:mod:`.registry`, in the world's store; the server's
side is :mod:`.elastic`), and clients resolve an expert *name* to a live,
admitted server at call time (:class:`~.replicas.FleetExpert`).

:class:`Fleet`: :meth:`Fleet.start` founds the world (rank 0, hosting the
store: the training process, usually), or :meth:`Fleet.join` joins one. A
watch thread keeps a cache of the registry (one store round trip per
``poll``, a re-read only when it changed) and of the servers' heartbeats;
the founder also runs the *reaper*, which removes crashed servers from the
world (so joins keep working and names can be reused) and releases a
membership token whose holder died.

Admission: a server is resolved only once it has proved the job's secret
twice over: its roster entry and record are signed with it (the registry
drops anything else), and it answers a sealed ``info`` challenge with a
sealed reply naming the rank and experts it published (:mod:`.channel`).
Until then it is never called; a worker that answers the challenge without
the secret is recorded as a ``refused`` event and never admitted.

Lifecycle of a server as a fleet sees it (``events``: what is recorded, and logged:
``lost`` and ``refused`` as WARNING, the others INFO)::

    state      entered when                               chosen for new calls?
    ---------  -----------------------------------------  ---------------------------------
    unseen     not in the roster, or its entry or         no
               record is not signed with the secret
    published  a signed roster entry and record           no
    admitted   it answered the sealed challenge as that   yes, while its beats move (as
               rank (event "joined")                      the experts' ``balance`` picks)
    refused    its answer to the challenge failed         no (event "refused", once per
               authentication                             incarnation)
    suspect    a call to it failed on the transport, or   no, for ``suspect_for`` seconds
               its beats stood still (event "lost")
    left       unpublished (event "left"), or reaped      no
               (event "reaped")

Invariants:

* Every thread here is a daemon that stops at :meth:`Fleet.shutdown`, or at
  interpreter exit for a fleet never shut down (:mod:`.stopping`); every
  wait is bounded.
* The store and RPC listen where the world is (:mod:`.rpc_bind`): on
  ``127.0.0.1`` unless an address is named.

Trust: torch RPC trusts every member of its world (see :mod:`.rpc_engine`):
keep the world on a private network. What the secret adds is that no
process without it is published, resolved or called by this fleet, and that
every message to an admitted server is authenticated. No NAT traversal:
every member must reach the store and every other member directly.
"""
import logging
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from . import membership, rpc_bind, stopping
from .auth import JobSecret, bind_boot, resolve_secret
from .compression import Compression, resolve as resolve_codec
from .balance import ReplicaBalancer, check_balance
from .channel import request
from .errors import RemoteAuthError
from .registry import BeatWatch, Registry, ServerRecord, observe_alive
from .replicas import FORGET_EVENTS, FleetEvent, FleetExpert, log_event
from .transport import Transport, get_transport

__all__ = ["Fleet", "CHALLENGE_EVERY_S"]

CHALLENGE_EVERY_S = 0.2  # a published server that did not answer yet is asked again after this
_log = logging.getLogger(__name__)


def _options_address(options: Any) -> Tuple[str, int]:
    return membership.store_address(options.init_method)


class Fleet:
    """A client's view of the fleet, and (for the founder) its reaper.

    Build one with :meth:`start` (found the world as rank 0: this process
    hosts the store and must outlive the fleet) or :meth:`join`. Then
    :meth:`expert` / :meth:`experts` give modules that call experts by name.

    ``poll``: seconds between reads of the registry's version (a join is seen
    within it; one store round trip each); heartbeats are read every
    ``beat_interval``; ``dead_after``: seconds of silent heartbeats after which a server
    counts as dead (and, with ``reap``, is reaped once a ping fails too);
    ``suspect_for``: seconds a server whose call failed on the transport is
    skipped (default ``dead_after``). ``secret``: the job's
    :class:`~moe_autograd.remote.JobSecret` (default: the process's).
    ``compression``: the codec its experts' tensors travel in (``None``: raw;
    ``"fp16"``, ``"bf16"``, ``"int8"``; one expert may say otherwise).
    ``balance``: how its experts choose among live replicas by default,
    ``"latency"`` (measured round trips and calls in flight) or ``"order"``
    (the oldest, sticking to the last that served); ``balancer``: the
    :class:`~moe_autograd.remote.ReplicaBalancer` they share (default: a
    new one; pass one with a seeded ``rng`` for reproducible choices).
    :meth:`replica_stats` is its view.
    """

    def __init__(self, raw: Any, name: str, rank: int, *, founder: bool,
                 transport: Optional[Transport] = None, poll: float = 0.02,
                 beat_interval: float = 0.1, dead_after: float = 1.0,
                 suspect_for: Optional[float] = None, reap: Optional[bool] = None,
                 ping_timeout: float = 1.0, member_timeout: float = 2.0,
                 token_stuck_after: float = 30.0, secret: Optional[JobSecret] = None,
                 compression: Union[None, str, Compression] = None,
                 balance: str = "latency", balancer: Optional[ReplicaBalancer] = None) -> None:
        if dead_after <= 2 * beat_interval:
            raise ValueError(f"dead_after ({dead_after:g} s) must exceed two beat intervals "
                             f"({beat_interval:g} s)")
        self.name, self.rank, self.founder = membership.check_name(name), rank, founder
        self.secret = resolve_secret(secret)
        self.compression = resolve_codec(compression, "compression of Fleet")
        self.balance = check_balance(balance, "balance of Fleet")
        self.balancer = balancer if balancer is not None else ReplicaBalancer()
        self.transport: Transport = transport or get_transport()
        self.poll, self.beat_interval, self.dead_after = poll, beat_interval, dead_after
        self.suspect_for = dead_after if suspect_for is None else suspect_for
        self.ping_timeout, self.member_timeout = ping_timeout, member_timeout
        self.token_stuck_after = token_stuck_after
        self._raw = raw
        self.registry = Registry(raw, self.secret)
        if founder:
            self.registry.found()  # this run's id: every signed record names it
        self._beats = BeatWatch(dead_after)
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._roster: Dict[str, int] = {}
        self._records: Dict[str, ServerRecord] = {}
        self._version = -1
        self._suspects: Dict[str, float] = {}
        self._lost: Set[Tuple[str, int]] = set()
        self._first_served: Dict[Tuple[str, int], float] = {}
        self._admitted: Set[Tuple[str, int]] = set()
        self._refused: Set[Tuple[str, int]] = set()
        self._asked: Dict[Tuple[str, int], float] = {}  # when each candidate was last challenged
        self._token_seen: Tuple[str, float] = ("", 0.0)
        self._candidates: Dict[str, int] = {}  # published, not admitted yet
        self._last_miss_refresh = 0.0
        self.events: List[FleetEvent] = []
        self._halt = threading.Event()
        self._threads = [threading.Thread(target=self._watch, daemon=True,
                                          name=f"moe_autograd-fleet-watch-{name}")]
        if founder if reap is None else reap:
            self._threads.append(threading.Thread(target=self._reaper, daemon=True,
                                                  name=f"moe_autograd-fleet-reaper-{name}"))
        self._member = False
        self.registry.beat(name, rank)
        for thread in self._threads:
            thread.start()
        stopping.track(self)

    # -- construction ----------------------------------------------------------
    @classmethod
    def start(cls, name: str = "trainer", master_addr: str = "127.0.0.1",
              master_port: int = 29500, *, options: Any = None, rpc_timeout: float = 60.0,
              num_worker_threads: int = 16, transports: Optional[Sequence[str]] = None,
              **fleet_options: Any) -> "Fleet":
        """Founds a dynamic world at ``master_addr:master_port`` as rank 0 (this
        process hosts its store) and returns its fleet, reaper included."""
        options = options or rpc_bind.backend_options(
            master_addr, master_port, rpc_timeout=rpc_timeout,
            num_worker_threads=num_worker_threads, transports=transports)
        membership.found_world(name, options)
        try:
            raw = membership.connect_store(*_options_address(options))
            fleet = cls(raw, name, 0, founder=True, **fleet_options)
        except BaseException:
            from torch.distributed import rpc

            rpc.shutdown(graceful=False)
            raise
        fleet._member = True
        return fleet

    @classmethod
    def join(cls, name: str, master_addr: str = "127.0.0.1", master_port: int = 29500, *,
             options: Any = None, rpc_timeout: float = 60.0, num_worker_threads: int = 16,
             transports: Optional[Sequence[str]] = None, join_timeout: float = 30.0,
             **fleet_options: Any) -> "Fleet":
        """Joins the running world at ``master_addr:master_port`` as a client."""
        options = options or rpc_bind.backend_options(
            master_addr, master_port, rpc_timeout=rpc_timeout,
            num_worker_threads=num_worker_threads, transports=transports)
        membership.check_support()
        raw = membership.connect_store(*_options_address(options), timeout=join_timeout)
        rank = membership.allocate_rank(raw)
        fleet = cls(raw, name, rank, founder=False, **fleet_options)
        try:
            window = 3 * fleet.beat_interval
            membership.join_world(name, options, raw, rank, timeout=join_timeout,
                                  alive=lambda m: observe_alive(fleet.registry, m, window))
        except BaseException:
            fleet._stop_threads()
            raise
        fleet._member = True
        return fleet

    # -- resolution ------------------------------------------------------------
    def replicas(self, expert: str) -> List[str]:
        """Live servers hosting ``expert`` now, oldest incarnation first."""
        now = time.monotonic()
        with self._lock:
            found = [(rank, name) for name, rank in self._roster.items()
                     if expert in self._records[name].experts
                     and self._suspects.get(name, 0.0) <= now]
        return [name for _, name in sorted(found) if self._beats.alive(name, now)]

    def refresh_on_miss(self) -> None:
        """Re-reads the registry's version now (a store round trip), at most
        every ``poll / 4`` seconds: a name with no replica in the cache may
        have one that joined since the last poll, and a replacement is then
        used by the first call after its publication."""
        now = time.monotonic()
        if now - self._last_miss_refresh < self.poll / 4:
            return
        self._last_miss_refresh = now
        try:
            self._poll_once(beats=False)
        except Exception:  # noqa: BLE001 - the store is busy or gone: the cache stands
            pass

    def servers(self) -> Dict[str, Tuple[str, ...]]:
        """Live servers and the experts each hosts."""
        now = time.monotonic()
        with self._lock:
            roster = dict(self._roster)
            records = dict(self._records)
        return {name: tuple(records[name].experts) for name in sorted(roster, key=lambda n: roster[n])
                if self._beats.alive(name, now)}

    def expert(self, name: str, *, forward_timeout: Optional[float] = None,
               backward_timeout: Optional[float] = None,
               attempt_timeout: Optional[float] = None,
               compression: Union[None, str, Compression] = None,
               balance: Optional[str] = None) -> FleetExpert:
        """A module that calls the expert ``name`` on a live replica.
        ``compression``: its codec on the wire (``None``: the fleet's);
        ``balance``: this expert's policy (default: the fleet's)."""
        return FleetExpert(self, name, forward_timeout=forward_timeout,
                           backward_timeout=backward_timeout, attempt_timeout=attempt_timeout,
                           compression=compression, balance=balance)

    def experts(self, names: Sequence[str], **options: Any) -> List[FleetExpert]:
        """:meth:`expert` for each name (e.g. the experts of a MixtureOfExperts)."""
        return [self.expert(name, **options) for name in names]

    def replica_stats(self) -> Dict[str, Dict[str, Dict[str, Any]]]:
        """What the balancer measured, ``{expert: {worker: {forward_ms,
        backward_ms, in_flight, calls, backwards, failures, penalised}}}``
        (see :meth:`~moe_autograd.remote.ReplicaBalancer.stats`)."""
        return self.balancer.stats()

    def wait_for(self, experts: Sequence[str], timeout: float = 30.0) -> None:
        """Blocks until every name in ``experts`` has a live replica."""
        deadline = time.monotonic() + timeout
        while True:
            missing = [e for e in experts if not self.replicas(e)]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no live server hosts {missing} after {timeout:g} s; "
                                   f"live: {self.servers()}")
            time.sleep(self.poll / 2)

    def refresh(self) -> None:
        """Reads the registry now (the watch thread does so every ``poll``)."""
        self._poll_once()

    def first_served(self, worker: str) -> Optional[float]:
        """When (``time.monotonic()``) a call of this process was first served
        by the current incarnation of ``worker``."""
        with self._lock:
            rank = self._roster.get(worker)
            return None if rank is None else self._first_served.get((worker, rank))

    # -- what FleetExpert reports ----------------------------------------------
    def _served(self, worker: str) -> None:
        now = time.monotonic()
        with self._lock:
            rank = self._roster.get(worker)
            if rank is not None:
                self._first_served.setdefault((worker, rank), now)

    def suspect(self, worker: str, why: str = "") -> None:
        """Skips ``worker`` for ``suspect_for`` seconds (a transport failure)."""
        now = time.monotonic()
        with self._lock:
            self._suspects[worker] = now + self.suspect_for
            rank = self._roster.get(worker)
        self._note_lost(worker, rank, why or "a call failed on the transport")

    def _note_lost(self, worker: str, rank: Optional[int], why: str) -> None:
        with self._lock:
            if rank is None or (worker, rank) in self._lost:
                return
            self._lost.add((worker, rank))
            record = self._records.get(worker)
            self._emit(FleetEvent("lost", worker, tuple(record.experts) if record else (),
                                  time.monotonic(), why))

    def _emit(self, event: FleetEvent) -> None:
        """Records ``event`` in ``events`` and logs it (``lost`` and
        ``refused`` as WARNING, the others INFO, on ``moe_autograd.remote.fleet``)."""
        self.events.append(event)
        if event.kind in FORGET_EVENTS:
            self.balancer.forget(event.worker)
        log_event(_log, f"fleet {self.name!r}", event)

    # -- the watch thread -----------------------------------------------------
    def _watch(self) -> None:
        last_beat = 0.0
        while not self._halt.wait(self.poll):
            try:
                now = time.monotonic()
                beat = now - last_beat >= self.beat_interval
                if beat:  # our own heartbeat, and a look at the servers'
                    self.registry.beat(self.name, self.rank)
                    last_beat = now
                self._poll_once(beats=beat)
            except Exception:  # noqa: BLE001 - the store is gone or busy: try again
                if self._halt.is_set():
                    return

    def _poll_once(self, beats: bool = True) -> None:
        """Re-reads the roster if its version moved (one round trip when it
        did not) and, with ``beats``, the servers' heartbeats (one more)."""
        with self._poll_lock:
            version = self.registry.version()
            if version != self._version or self._candidates:
                roster = self.registry.roster()
                roster.pop(self.name, None)
                records = self.registry.records(list(roster))
                roster = {n: r for n, r in roster.items()
                          if n in records and records[n].rank == r}
                self._candidates = {n: r for n, r in roster.items()
                                    if (n, r) not in self._admitted
                                    and (n, r) not in self._refused}
                for name, rank in list(self._candidates.items()):
                    if self._challenge(name, rank, records[name]):
                        del self._candidates[name]
                self._apply({n: r for n, r in roster.items() if (n, r) in self._admitted},
                            records)
                self._version = version
            if not beats:
                return
            with self._lock:
                roster = dict(self._roster)
            self._beats.update(self.registry.published_beats(roster))
            now = time.monotonic()
            for name, rank in roster.items():
                if not self._beats.alive(name, now):
                    self._note_lost(name, rank, f"no heartbeat for {self.dead_after:g} s")

    def _challenge(self, name: str, rank: int, record: ServerRecord) -> bool:
        """Admits ``name`` (incarnation ``rank``) if it answers a sealed
        ``info`` request with a sealed reply for that rank, serving what its
        record says; True once admitted (see the module docstring)."""
        key = (name, rank)
        now = time.monotonic()
        if key in self._refused or now - self._asked.get(key, -CHALLENGE_EVERY_S) \
                < CHALLENGE_EVERY_S:
            return False
        self._asked[key] = now
        if record.boot:  # bound to the process that signed its record: from the challenge on
            try:
                bind_boot(name, bytes.fromhex(record.boot))
            except ValueError:
                return False
        try:
            status, info = request(self.transport, name, {"op": "info"}, self.ping_timeout,
                                   secret=self.secret, label="info"
                                   ).result(self.ping_timeout + 0.2)
        except RemoteAuthError as error:
            with self._lock:
                self._refused.add(key)
                self._emit(FleetEvent("refused", name, tuple(record.experts),
                                      time.monotonic(), str(error)))
            return False
        except Exception:  # noqa: BLE001 - not reachable yet: asked again later
            return False
        served = info.get("experts") if status == "ok" and isinstance(info, dict) else None
        if not (isinstance(served, dict) and info.get("rank") == rank
                and set(record.experts) <= set(served)):
            return False
        with self._lock:
            self._admitted.add(key)
            self._asked.pop(key, None)
        return True

    def _apply(self, roster: Dict[str, int], records: Dict[str, ServerRecord]) -> None:
        now = time.monotonic()
        with self._lock:
            old, old_records = self._roster, self._records
            for name, rank in old.items():
                if roster.get(name) != rank:
                    record = self.registry.record(name)
                    state = record.state if record is not None and record.rank == rank else "?"
                    kind = "reaped" if state == "reaped" else "left"
                    self._emit(FleetEvent(kind, name, tuple(old_records[name].experts),
                                          now, state))
                    self._beats.forget(name)
            for name, rank in roster.items():
                if old.get(name) != rank:
                    self._emit(FleetEvent("joined", name, tuple(records[name].experts),
                                          now, f"rank {rank}"))
                    self._suspects.pop(name, None)
                    self._beats.forget(name)
                    self._beats.update({name: -1}, now)  # alive from now: it just published
            self._roster, self._records = roster, records

    # -- the reaper (the founder's) ---------------------------------------------
    def _reaper(self) -> None:
        period = max(2 * self.poll, 0.1)
        while not self._halt.wait(period):
            try:
                self._reap_once()
            except Exception:  # noqa: BLE001 - store or RPC trouble: next round
                if self._halt.is_set():
                    return

    def _reap_once(self) -> None:
        listed = membership.members(self._raw)
        with self._lock:
            roster = dict(self._roster)
        watched = {**listed, **roster}
        watched.pop(self.name, None)
        counters = self.registry.beats(watched)
        self._beats.update(counters)
        now = time.monotonic()
        silent = [n for n in counters if not self._beats.alive(n, now)]
        dead = [n for n in silent if not self._answers_ping(n)]
        if dead:
            removed = membership.reap(self._raw, dead, member_timeout=self.member_timeout)
            for name in dead:
                rank = removed.get(name, watched[name])
                self.registry.evict(name, rank)
                self.registry.unpublish(name, rank, "reaped")
                self._beats.forget(name)
            self._poll_once()
        self._release_stuck_token(now)

    def _answers_ping(self, worker: str) -> bool:
        """Whether ``worker`` answers at all (a sealed ``info``; a refusal is
        an answer too: the process is alive)."""
        try:
            request(self.transport, worker, {"op": "info"}, self.ping_timeout,
                    secret=self.secret, label="info").result(self.ping_timeout + 0.2)
        except RemoteAuthError:
            return True
        except Exception:  # noqa: BLE001 - unknown, dead or stopped
            return False
        return True

    def _release_stuck_token(self, now: float) -> None:
        held, holder = membership.token_holder(self._raw)
        if not held:
            self._token_seen = ("", now)
            return
        if held != self._token_seen[0]:
            self._token_seen = (held, now)
            return
        if now - self._token_seen[1] < self.token_stuck_after:
            return
        if holder is not None and holder != self.name and self._beats.alive(holder, now):
            return  # its holder still beats: a slow operation, not a dead holder
        membership.release_stuck_token(self._raw, held)
        self._token_seen = ("", now)

    # -- shutdown -----------------------------------------------------------------
    def _stop_threads(self, timeout: float = 5.0) -> None:
        self._halt.set()
        stopping.untrack(self)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=timeout)

    def _halt_at_exit(self) -> None:
        self._stop_threads(stopping.EXIT_JOIN_S)

    def shutdown(self, timeout: float = 10.0, stop_servers: Optional[bool] = None) -> None:
        """Leaves the world. The founder (by default) first asks every server to
        leave and waits up to ``timeout`` seconds for them, since the world's
        store goes away with it. Idempotent."""
        if self._halt.is_set():
            return
        deadline = time.monotonic() + timeout
        if self.founder if stop_servers is None else stop_servers:
            try:  # wait until every fleet participant has left the RPC world
                self.registry.request_stop()
                while time.monotonic() < deadline:
                    others = {n: r for n, r in membership.members(self._raw).items()
                              if n != self.name}
                    if not self.registry.beats(others):
                        break
                    time.sleep(self.poll)
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        self._stop_threads()
        if self._member:
            self._member = False
            try:
                membership.leave_world(timeout=max(deadline - time.monotonic(), 1.0),
                                       member_timeout=self.member_timeout)
            except Exception:  # noqa: BLE001 - RPC is shut down locally in any case
                pass

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
