"""An elastic expert fleet: servers join and leave a running world, clients
call experts by name, training never stops.

Why: a fixed RPC world (``world_size`` known up front) cannot take a server
that starts late, and a lost server can only be masked, never replaced.
Volunteer or spot machines come and go; this module makes the world dynamic
(:mod:`.membership`, on torch's ``init_rpc(world_size=None)``), lets servers
publish their experts (:mod:`.registry`, in the world's store) and lets
clients resolve an expert *name* to a live server at call time.

Pieces:

* :class:`Fleet`, the client side: :meth:`Fleet.start` founds the world
  (rank 0, hosting the store: the training process, usually), or
  :meth:`Fleet.join` joins one. A watch thread keeps a cache of the registry
  (one store round trip per ``poll``, a re-read only when it changed) and of
  the servers' heartbeats; the founder also runs the *reaper*, which removes
  crashed servers from the world (so joins keep working and names can be
  reused) and releases a membership token whose holder died.
* :class:`FleetExpert`, an ``nn.Module`` calling the expert ``name`` on a
  live replica: a drop-in expert of :class:`~moe_autograd.moe.MixtureOfExperts`.
* :class:`ElasticServer`, the server side of one process (also
  ``python -m moe_autograd serve --join``): join, publish, beat, and leave
  cleanly (drain, then go).

Lifecycle of a server (one incarnation = one process = one rank)::

    state     entered when                          what clients see
    --------  ------------------------------------  ------------------------------------
    created   ElasticServer(...) (experts are       nothing
              registered in the process)
    joining   join(): rank from the store counter,  nothing
              beats start, waits until no listed
              member looks dead, init_rpc
    serving   its record is published (roster,      resolvable within one poll (20 ms)
              version bump)
    draining  leave(), SIGTERM/SIGINT, or the       unpublished: not chosen for new calls;
              coordinator's stop: unpublished,      calls in flight, pending backwards
              serves until idle (>= linger,         and stale callers are still served
              <= drain_timeout)
    closed    ExpertServer.close(); RPC leave       an unknown worker: a call fails at
              (members told, store entries gone)    once and retries another replica
    gone      beats stop                            -
    crashed   the process died (no leave)           calls fail at once (connection
                                                    reset) or at their deadline; the
                                                    server is suspected, then silent
    reaped    the reaper: beats silent for          as gone; the name can join again
              dead_after and a ping fails ->
              removed from every member
    evicted   a reaped server that was only         -
              stopped (SIGSTOP) wakes up: it
              finds its eviction mark and exits

Invariants:

* A forward is idempotent, so a failed attempt is retried on another live
  replica, each replica at most once per call, within the call's
  ``forward_timeout`` (each attempt gets what is left, or
  ``attempt_timeout``); a backward goes only to the replica that ran the
  forward (it holds the state, or the parameters whose gradients a stateless
  recomputation must produce): if it fails, the call's backward fails (the
  MoE layer treats it as a constant).
* A name with no live replica fails at once with :class:`NoLiveReplica` (a
  :class:`RemoteExpertError`): the MoE layer masks it like a failing expert.
* A server that joins is resolvable as soon as a watcher polls (``poll``
  seconds), so it serves from the next step on; a server that leaves through
  :meth:`ElasticServer.leave` fails no call that reached it or that it holds
  state for (within ``drain_timeout``).
* Every thread here is a daemon that stops at :meth:`Fleet.shutdown` /
  :meth:`ElasticServer.leave`, or at interpreter exit for a fleet or server
  never shut down (an ``atexit`` hook: a daemon thread inside a store or RPC
  call when the interpreter finalises would abort the process); every wait
  is bounded.

Trust: one world is one trust domain (any member can run any function in any
other; the store has no authentication); no NAT traversal: every member must
reach the store and every other member directly. See the README.
"""
import atexit
import os
import secrets
import signal
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple, Union

from torch import Tensor, nn

from . import membership
from .client import RemoteExpert
from .errors import RemoteExpertError, RemoteTimeoutError
from .registry import BeatWatch, Registry, ServerRecord, observe_alive
from .server import ExpertServer
from .transport import Transport, TransportError, check_timeout, get_transport

__all__ = ["Fleet", "FleetExpert", "FleetEvent", "ElasticServer", "NoLiveReplica", "Resolver",
           "serve_joined", "backend_options", "default_name"]

MembershipError = membership.MembershipError
Outputs = Union[Tensor, Tuple[Tensor, ...]]
EXIT_JOIN_S = 1.0  # at exit, how long the hook waits for each fleet's or server's threads
_running: "weakref.WeakSet[Any]" = weakref.WeakSet()  # fleets and servers whose threads run


def _stop_threads_at_exit() -> None:
    """The exit hook: stops the threads of the fleets and servers still running
    (registered after the transport's and the releaser's, so it runs first)."""
    for owner in list(_running):
        owner._halt_at_exit()


atexit.register(_stop_threads_at_exit)


class NoLiveReplica(RemoteExpertError):
    """No live server hosts the expert now (none joined yet, all left or died)."""


@dataclass(frozen=True)
class FleetEvent:
    """A change a :class:`Fleet` observed: ``joined``, ``left`` (a clean leave
    started), ``lost`` (a call failed on the transport, or the beats went
    silent) or ``reaped`` (removed after a crash)."""

    kind: str
    worker: str
    experts: Tuple[str, ...]
    at: float          # time.monotonic() of this process
    detail: str = ""


def backend_options(master_addr: str, master_port: int, *, rpc_timeout: float = 60.0,
                    num_worker_threads: int = 16,
                    transports: Optional[Sequence[str]] = None) -> Any:
    """TensorPipe options for a member of the world whose store is at
    ``master_addr:master_port`` (``transports=["uv"]`` when processes outnumber
    cores: TensorPipe's same-host ``shm`` transport busy-polls)."""
    from torch.distributed import rpc

    extra: Dict[str, Any] = {"_transports": list(transports)} if transports else {}
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{master_addr}:{master_port}",
                                           num_worker_threads=num_worker_threads,
                                           rpc_timeout=rpc_timeout, **extra)


def _ping() -> str:
    """Runs on a server: proves its RPC threads are alive."""
    return "pong"


def _caused_by_transport(error: BaseException) -> bool:
    """Whether a call failed on the way (not in the server): some exception
    in its cause/context chain is a transport error."""
    seen: Optional[BaseException] = error
    for _ in range(8):
        seen = seen.__cause__ or seen.__context__ if seen is not None else None
        if seen is None:
            return False
        if isinstance(seen, TransportError):
            return True
    return False


def _options_address(options: Any) -> Tuple[str, int]:
    return membership.store_address(options.init_method)


# -- the client side ------------------------------------------------------------------
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
    skipped (default ``dead_after``).
    """

    def __init__(self, raw: Any, name: str, rank: int, *, founder: bool,
                 transport: Optional[Transport] = None, poll: float = 0.02,
                 beat_interval: float = 0.1, dead_after: float = 1.0,
                 suspect_for: Optional[float] = None, reap: Optional[bool] = None,
                 ping_timeout: float = 1.0, member_timeout: float = 2.0,
                 token_stuck_after: float = 30.0) -> None:
        if dead_after <= 2 * beat_interval:
            raise ValueError(f"dead_after ({dead_after:g} s) must exceed two beat intervals "
                             f"({beat_interval:g} s)")
        self.name, self.rank, self.founder = membership.check_name(name), rank, founder
        self.transport: Transport = transport or get_transport()
        self.poll, self.beat_interval, self.dead_after = poll, beat_interval, dead_after
        self.suspect_for = dead_after if suspect_for is None else suspect_for
        self.ping_timeout, self.member_timeout = ping_timeout, member_timeout
        self.token_stuck_after = token_stuck_after
        self._raw = raw
        self.registry = Registry(raw)
        self._beats = BeatWatch(dead_after)
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._roster: Dict[str, int] = {}
        self._records: Dict[str, ServerRecord] = {}
        self._version = -1
        self._suspects: Dict[str, float] = {}
        self._lost: Set[Tuple[str, int]] = set()
        self._first_served: Dict[Tuple[str, int], float] = {}
        self._token_seen: Tuple[str, float] = ("", 0.0)
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
        _running.add(self)

    # -- construction ----------------------------------------------------------
    @classmethod
    def start(cls, name: str = "trainer", master_addr: str = "127.0.0.1",
              master_port: int = 29500, *, options: Any = None, rpc_timeout: float = 60.0,
              num_worker_threads: int = 16, transports: Optional[Sequence[str]] = None,
              **fleet_options: Any) -> "Fleet":
        """Founds a dynamic world at ``master_addr:master_port`` as rank 0 (this
        process hosts its store) and returns its fleet, reaper included."""
        options = options or backend_options(master_addr, master_port, rpc_timeout=rpc_timeout,
                                             num_worker_threads=num_worker_threads,
                                             transports=transports)
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
        options = options or backend_options(master_addr, master_port, rpc_timeout=rpc_timeout,
                                             num_worker_threads=num_worker_threads,
                                             transports=transports)
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
               attempt_timeout: Optional[float] = None) -> "FleetExpert":
        """A module that calls the expert ``name`` on a live replica."""
        return FleetExpert(self, name, forward_timeout=forward_timeout,
                           backward_timeout=backward_timeout, attempt_timeout=attempt_timeout)

    def experts(self, names: Sequence[str], **timeouts: Optional[float]) -> List["FleetExpert"]:
        """:meth:`expert` for each name (e.g. the experts of a MixtureOfExperts)."""
        return [self.expert(name, **timeouts) for name in names]

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
            self.events.append(FleetEvent("lost", worker, tuple(record.experts) if record else (),
                                          time.monotonic(), why))

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
            if version != self._version:
                roster = self.registry.roster()
                roster.pop(self.name, None)
                records = self.registry.records(list(roster))
                self._apply(roster, records)
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

    def _apply(self, roster: Dict[str, int], records: Dict[str, ServerRecord]) -> None:
        now = time.monotonic()
        with self._lock:
            old, old_records = self._roster, self._records
            for name, rank in old.items():
                if roster.get(name) != rank:
                    record = self.registry.record(name)
                    state = record.state if record is not None and record.rank == rank else "?"
                    kind = "reaped" if state == "reaped" else "left"
                    self.events.append(FleetEvent(kind, name, tuple(old_records[name].experts),
                                                  now, state))
                    self._beats.forget(name)
            for name, rank in roster.items():
                if old.get(name) != rank:
                    self.events.append(FleetEvent("joined", name, tuple(records[name].experts),
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
        try:
            pending = self.transport.call(worker, _ping, (), self.ping_timeout)
            return bool(pending.result(self.ping_timeout + 0.2) == "pong")
        except Exception:  # noqa: BLE001 - unknown, dead or stopped
            return False

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
        _running.discard(self)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=timeout)

    def _halt_at_exit(self) -> None:
        self._stop_threads(EXIT_JOIN_S)

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


class Resolver(Protocol):
    """What :class:`FleetExpert` needs of a fleet: :class:`Fleet` (torch RPC)
    or :class:`~moe_autograd.remote.ray_fleet.RayFleet` (Ray)."""

    transport: Transport

    def replicas(self, expert: str) -> List[str]: ...

    def refresh_on_miss(self) -> None: ...

    def servers(self) -> Dict[str, Tuple[str, ...]]: ...

    def suspect(self, worker: str, why: str = "") -> None: ...

    def _served(self, worker: str) -> None: ...


class FleetExpert(nn.Module):
    """Calls the expert ``name`` on a live replica that ``fleet`` resolves.

    ``forward_timeout`` bounds the whole call, retries included (``None``:
    each attempt has the transport's timeout); ``attempt_timeout`` bounds one
    attempt (so a stopped replica leaves time for another); ``backward_timeout``
    bounds the backward, which goes to the replica that ran the forward.
    A replica that fails is not tried again within the same call; a replica
    that failed on the transport is skipped by every call for the fleet's
    ``suspect_for``. ``last_worker`` is the replica of the latest successful
    forward, tried first next time; ``retries`` counts attempts after a failure.
    """

    def __init__(self, fleet: Resolver, name: str, *, forward_timeout: Optional[float] = None,
                 backward_timeout: Optional[float] = None,
                 attempt_timeout: Optional[float] = None) -> None:
        super().__init__()
        self.fleet, self.name = fleet, name
        self.forward_timeout = check_timeout(f"forward_timeout of FleetExpert {name!r}",
                                             forward_timeout)
        self.backward_timeout = check_timeout(f"backward_timeout of FleetExpert {name!r}",
                                              backward_timeout)
        self.attempt_timeout = check_timeout(f"attempt_timeout of FleetExpert {name!r}",
                                             attempt_timeout)
        self.last_worker: Optional[str] = None
        self.retries = 0

    def extra_repr(self) -> str:
        return f"name={self.name!r}"

    def replicas(self) -> List[str]:
        return self.fleet.replicas(self.name)

    def forward(self, *args: Any) -> Outputs:  # type: ignore[override]
        start = time.monotonic()
        deadline = None if self.forward_timeout is None else start + self.forward_timeout
        tried: List[str] = []
        # (worker, message, timed out): no exception objects are kept, since
        # their tracebacks hold frames whose locals (a later attempt's outputs,
        # hence its server-side state) only the cyclic GC would free.
        failures: List[Tuple[str, str, bool]] = []
        while True:
            candidates = [w for w in self.fleet.replicas(self.name) if w not in tried]
            if not candidates and not tried:  # none cached: one may have joined just now
                self.fleet.refresh_on_miss()
                candidates = self.fleet.replicas(self.name)
            if not candidates:
                raise self._no_replica(failures, start)
            preferred = self.last_worker
            worker = preferred if preferred in candidates else candidates[0]
            limit = self.attempt_timeout
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._no_replica(failures, start, timed_out=True)
                limit = left if limit is None else min(limit, left)
            tried.append(worker)
            if failures:
                self.retries += 1
            outputs, failure = self._attempt(worker, limit, args)
            if failure is None:
                assert outputs is not None
                self.last_worker = worker
                self.fleet._served(worker)
                return outputs
            failures.append(failure[:3])
            if failure[3]:
                self.fleet.suspect(worker, f"a call of {self.name!r} failed on the transport")

    def _attempt(self, worker: str, limit: Optional[float], args: Tuple[Any, ...]
                 ) -> Tuple[Optional[Outputs], Optional[Tuple[str, str, bool, bool]]]:
        """One call on ``worker``: ``(outputs, None)`` or ``(None, (worker,
        message, timed out, transport failure))``. A helper frame of its own,
        so that an exception's traceback never holds :meth:`forward`'s frame
        (whose locals end up holding a later attempt's outputs)."""
        expert = RemoteExpert(worker, self.name, forward_timeout=limit,
                              backward_timeout=self.backward_timeout,
                              transport=self.fleet.transport)
        try:
            return expert(*args), None
        except RemoteExpertError as error:
            failure = (worker, str(error), isinstance(error, RemoteTimeoutError),
                       _caused_by_transport(error))
            traceback.clear_frames(error.__traceback__)  # finished frames: free their locals
            return None, failure

    def _no_replica(self, failures: Sequence[Tuple[str, str, bool]], start: float,
                    timed_out: bool = False) -> RemoteExpertError:
        spent = time.monotonic() - start
        if not failures:
            return NoLiveReplica(f"expert {self.name!r}: no live server hosts it now "
                                 f"(live servers: {sorted(self.fleet.servers())})")
        shown = "; ".join(f"{w}: {m}" for w, m, _ in failures[:3])
        if timed_out or all(t for _, _, t in failures):
            return RemoteTimeoutError(f"expert {self.name!r} missed its {self.forward_timeout:g} "
                                      f"s deadline after {len(failures)} attempt(s) in "
                                      f"{spent:.3f} s: {shown}")
        return RemoteExpertError(f"expert {self.name!r} failed on every live replica "
                                 f"({len(failures)} attempt(s) in {spent:.3f} s): {shown}")


# -- the server side ------------------------------------------------------------------
class ElasticServer:
    """Serves ``servers`` (:class:`ExpertServer`\\ s built in this process) in
    the dynamic world at ``master_addr:master_port`` as ``name``.

    :meth:`join` joins and publishes; :meth:`serve` blocks until ``stop`` is
    set, the coordinator asks servers to stop, this server is evicted, or the
    world ends, and then leaves (:meth:`leave`: drain, close, RPC leave).
    ``linger``: seconds a draining server keeps serving at least (callers with
    a stale cache, stateless backwards of recent forwards); ``drain_timeout``:
    at most. See the module docstring for the lifecycle.
    """

    def __init__(self, servers: Union[ExpertServer, Sequence[ExpertServer]], name: str,
                 master_addr: str = "127.0.0.1", master_port: int = 29500, *,
                 options: Any = None, rpc_timeout: float = 60.0, num_worker_threads: int = 16,
                 transports: Optional[Sequence[str]] = None, beat_interval: float = 0.1,
                 join_timeout: float = 30.0, drain_timeout: float = 10.0, linger: float = 1.0,
                 member_timeout: float = 2.0, lost_after: float = 3.0,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.servers = [servers] if isinstance(servers, ExpertServer) else list(servers)
        if not self.servers:
            raise ValueError("ElasticServer needs at least one ExpertServer")
        self.name = membership.check_name(name)
        self.options = options or backend_options(master_addr, master_port,
                                                  rpc_timeout=rpc_timeout,
                                                  num_worker_threads=num_worker_threads,
                                                  transports=transports)
        self.beat_interval, self.join_timeout = beat_interval, join_timeout
        self.drain_timeout, self.linger = drain_timeout, linger
        self.member_timeout, self.lost_after = member_timeout, lost_after
        self.experts: Dict[str, str] = {n: s.backward for s in self.servers for n in s.names}
        self.rank = -1
        self.state = "created"
        self.reason = ""
        self._log = log or (lambda message: None)
        self._registry: Optional[Registry] = None
        self._halt = threading.Event()   # stops the beat thread
        self._wake = threading.Event()   # wakes serve(): stop, eviction, world lost
        self._beat_thread: Optional[threading.Thread] = None
        self._lock = threading.RLock()  # re-entrant: stop() may run in a signal handler

    def join(self) -> "ElasticServer":
        """Joins the world and publishes the experts (raises
        :class:`~moe_autograd.remote.membership.MembershipError` if it cannot)."""
        if self.state != "created":
            raise RuntimeError(f"ElasticServer {self.name!r} is {self.state}, not created")
        membership.check_support()
        self.state = "joining"
        try:
            raw = membership.connect_store(*_options_address(self.options),
                                           timeout=self.join_timeout)
            self._registry = registry = Registry(raw)
            self.rank = membership.allocate_rank(raw)
            self._beat_thread = threading.Thread(target=self._beat, daemon=True,
                                                 name=f"moe_autograd-fleet-beat-{self.name}")
            registry.beat(self.name, self.rank)  # joiners are judged by their beats
            self._beat_thread.start()
            _running.add(self)
            window = 3 * self.beat_interval
            membership.join_world(self.name, self.options, raw, self.rank,
                                  timeout=self.join_timeout,
                                  alive=lambda m: observe_alive(registry, m, window))
        except BaseException:
            self.state = "gone"
            self._halt.set()
            raise
        registry.publish(ServerRecord(self.name, self.rank, dict(self.experts), "serving",
                                      time.time()))
        self.state = "serving"
        self._log(f"joined as {self.name!r} (rank {self.rank}) serving {sorted(self.experts)}")
        return self

    def _beat(self) -> None:
        registry = self._registry
        assert registry is not None
        failing_since: Optional[float] = None
        while not self._halt.wait(self.beat_interval):
            try:
                registry.beat(self.name, self.rank)
                failing_since = None
                if self.state == "serving" and not self._wake.is_set():
                    if registry.evicted(self.name, self.rank):
                        self._signal("evicted")
                    elif registry.stop_requested():
                        self._signal("stopped by the coordinator")
            except Exception:  # noqa: BLE001 - the store (the founder) is gone?
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= self.lost_after:
                    self._signal("world ended")
                    return

    def _halt_at_exit(self) -> None:
        self._halt.set()
        thread = self._beat_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(EXIT_JOIN_S)

    def _signal(self, reason: str) -> None:
        with self._lock:
            if not self.reason:
                self.reason = reason
        self._wake.set()

    def stop(self, reason: str = "stopped") -> None:
        """Asks :meth:`serve` to leave (thread- and signal-safe)."""
        self._signal(reason)

    def serve(self, stop: Optional[threading.Event] = None) -> str:
        """Serves until asked to stop, then leaves; returns why it stopped."""
        if self.state == "created":
            self.join()
        while not self._wake.wait(0.1):
            if stop is not None and stop.is_set():
                self._signal("stopped")
        if self.reason in ("evicted", "world ended"):
            self._abandon()
        else:
            self.leave()
        return self.reason

    def _busy(self) -> Tuple[int, int]:
        in_flight = live = 0
        for server in self.servers:
            stats = server.stats()
            in_flight += int(stats.get("in_flight", 0))
            live += int(stats.get("live", 0))
        return in_flight, live

    def leave(self, drain_timeout: Optional[float] = None) -> None:
        """Leaves cleanly: unpublish, keep serving until idle (at least
        ``linger``, at most ``drain_timeout``), close the servers, leave the
        RPC world. Idempotent; safe after a failed join."""
        if self.state != "serving":
            return
        registry = self._registry
        assert registry is not None
        self.state = "draining"
        self._signal("left")
        start = time.monotonic()
        deadline = start + (self.drain_timeout if drain_timeout is None else drain_timeout)
        try:
            registry.unpublish(self.name, self.rank, "draining")
        except Exception:  # noqa: BLE001 - the store is gone: nobody resolves us anyway
            pass
        in_flight, live = self._busy()
        while time.monotonic() < deadline:
            in_flight, live = self._busy()
            if time.monotonic() - start >= self.linger and in_flight == 0 and live == 0:
                break
            time.sleep(0.02)
        self._log(f"drained in {time.monotonic() - start:.2f} s (in flight {in_flight}, "
                  f"held states {live})")
        for server in self.servers:
            server.close(timeout=max(deadline - time.monotonic(), 0.1))
        self.state = "closed"
        try:
            skipped = membership.leave_world(timeout=max(deadline - time.monotonic(), 2.0),
                                             member_timeout=self.member_timeout)
            if skipped:
                self._log(f"members {skipped} did not answer the leave (dead: reaped later)")
            registry.unpublish(self.name, self.rank, "left")
        except Exception as error:  # noqa: BLE001 - RPC is shut down locally regardless
            self._log(f"leave: {type(error).__name__}: {error}")
        finally:
            self._halt.set()
            self.state = "gone"

    def _abandon(self) -> None:
        """Evicted, or the world ended: nobody can be told; stop locally."""
        from torch.distributed import rpc

        self.state = "closed"
        for server in self.servers:
            server.close(timeout=1.0)
        try:
            rpc.shutdown(graceful=False)
        except Exception:  # noqa: BLE001
            pass
        self._halt.set()
        self.state = "gone"


def serve_joined(servers: Union[ExpertServer, Sequence[ExpertServer]], name: str,
                 options: Any, *, drain_timeout: float = 10.0, join_timeout: float = 60.0,
                 linger: float = 1.0, log: Optional[Callable[[str], None]] = None) -> int:
    """``python -m moe_autograd serve --join``: join the world of ``options``,
    serve until SIGINT/SIGTERM, the coordinator's stop or the world's end, then
    leave cleanly. Returns the exit status: 0, 2 for an unusable name, 3 if
    this server was evicted (reaped while stopped), 75 (EX_TEMPFAIL) if it
    could not join (start it again)."""
    say = log or (lambda message: None)
    try:
        elastic = ElasticServer(servers, name, options=options, drain_timeout=drain_timeout,
                                join_timeout=join_timeout, linger=linger, log=say)
    except MembershipError as error:
        say(str(error))
        for server in [servers] if isinstance(servers, ExpertServer) else servers:
            server.close(timeout=0.0)
        return 2
    previous: Dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: elastic.stop("signal received"))
    try:
        try:
            elastic.join()
        except MembershipError as error:
            say(f"could not join: {error}")
            for server in elastic.servers:
                server.close(timeout=0.0)
            return 75
        reason = elastic.serve()
        say(f"stopped ({reason})")
        return 3 if reason == "evicted" else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def default_name() -> str:
    """A worker name for a server started without ``--name``."""
    return f"expert_server_{os.getpid()}_{secrets.token_hex(2)}"
