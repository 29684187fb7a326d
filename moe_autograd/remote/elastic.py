"""The server's side of an elastic fleet: join, publish, beat, drain, leave.

Why a module of its own: a server's lifecycle (this process joining a
running world and leaving it) is not the trainer's (:mod:`.fleet`, which
finds and admits servers); each side has its own threads and states.
:class:`ElasticServer` is also ``python -m moe_autograd serve --join``.

Lifecycle of a server (one incarnation = one process = one rank)::

    state     entered when                          what clients see
    --------  ------------------------------------  ------------------------------------
    created   ElasticServer(...) (experts are       nothing
              registered in the process)
    joining   join(): rank from the store counter,  nothing
              beats start, waits until no listed
              member looks dead, init_rpc (on the
              interface facing the store); then
              each expert a live published server
              also serves takes that replica's
              state (weights, optimizer state,
              steps) over the sealed wire
    serving   its record and roster entry are       resolvable once a fleet's challenge
              published, signed with the job's      got its sealed answer (within a
              secret (a name a live incarnation     poll or two, 20 ms each)
              holds is refused)
    draining  leave(), SIGTERM/SIGINT, or the       unpublished: not chosen for new calls;
              coordinator's (signed) stop:          calls in flight, pending backwards
              unpublished, serves until idle        and stale callers are still served
              (>= linger, <= drain_timeout)
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
              finds its (signed) eviction mark
              and exits
    deaf      its TensorPipe listener was closed    as draining, then closed: a clean
              (below): it leaves cleanly, and       leave; then as a new server
              ``serve`` starts again as a new
              process (a new rank)

Invariants:

* A server that leaves through :meth:`ElasticServer.leave` fails no call that
  reached it or that it holds state for (within ``drain_timeout``).
* Its beat thread stops at :meth:`ElasticServer.leave`, or at interpreter
  exit (:mod:`.stopping`); every wait is bounded.
* What it publishes is signed with the job's secret (the first secret of its
  first :class:`~.server.ExpertServer` unless ``secret=`` says otherwise).
* A replacement or a new replica of a training expert never starts from
  fresh weights while a live replica serves that expert: before it is
  published (so before any call can reach it) it takes that replica's state
  (``recover=True``, the default; logged at INFO with the peer, the step,
  the bytes and the time). With no live replica it keeps what it has (its
  snapshot, :mod:`.durable`, or its factory's weights: a WARNING names the
  expert when the fleet already had servers).
* A member does not keep the world from growing. torch's TensorPipe agent
  stops accepting for good after one failed accept (a TCP connect that
  closes before TensorPipe's handshake: a port scan, a load balancer's
  health check; torch 2.13), and every later join waits on that member
  until it times out. The beat thread reads this process's listening
  sockets from ``/proc`` every :data:`LISTENER_CHECK_S` seconds (never by
  connecting); when one that ``init_rpc`` opened is gone, it logs an ERROR
  and, where leaving loses nothing (every training expert it serves has a
  snapshot directory or another live replica), leaves cleanly with reason
  :data:`LISTENER_CLOSED`; ``serve --join`` then starts again in the same
  process id (``exec``), resuming from its snapshot or a peer. Where leaving
  would lose a training expert's state it stays and says so (the world
  cannot grow until it is restarted).
"""
import logging
import os
import secrets
import signal
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from . import endpoint, membership, rpc_bind, stopping
from .auth import JobSecret
from .client import RemoteExpert
from .rpc_engine import RpcTransport
from .registry import RECORD_TTL_S, NameTaken, Registry, ServerRecord, observe_alive
from .server import ExpertServer, set_host_info

__all__ = ["ElasticServer", "serve_joined", "default_name", "LISTENER_CLOSED",
           "LISTENER_CHECK_S", "EXIT_REJOIN"]

_log = logging.getLogger(__name__)

MembershipError = membership.MembershipError

LISTENER_CLOSED = "listener closed"  # why a server whose listener was closed left
LISTENER_CHECK_S = 1.0  # how often the beat thread reads this process's listening sockets
EXIT_REJOIN = 76  # serve_joined: it left because its listener was closed; start again now


def _options_address(options: Any) -> Tuple[str, int]:
    return membership.store_address(options.init_method)


class ElasticServer:
    """Serves ``servers`` (:class:`ExpertServer`\\ s built in this process) in
    the dynamic world at ``master_addr:master_port`` as ``name``.

    :meth:`join` joins and publishes; :meth:`serve` blocks until ``stop`` is
    set, the coordinator asks servers to stop, this server is evicted, or the
    world ends, and then leaves (:meth:`leave`: drain, close, RPC leave).
    ``linger``: seconds a draining server keeps serving at least (callers with
    a stale cache, stateless backwards of recent forwards); ``drain_timeout``:
    at most. ``secret``: what it signs its publication with (default: the
    job secret of its first server). See the module docstring for the
    lifecycle.
    """

    def __init__(self, servers: Union[ExpertServer, Sequence[ExpertServer]], name: str,
                 master_addr: str = "127.0.0.1", master_port: int = 29500, *,
                 options: Any = None, rpc_timeout: float = 60.0, num_worker_threads: int = 16,
                 transports: Optional[Sequence[str]] = None, beat_interval: float = 0.1,
                 join_timeout: float = 30.0, drain_timeout: float = 10.0, linger: float = 1.0,
                 member_timeout: float = 2.0, lost_after: float = 3.0,
                 log: Optional[Callable[[str], None]] = None,
                 secret: Optional[JobSecret] = None, recover: bool = True) -> None:
        self.servers = [servers] if isinstance(servers, ExpertServer) else list(servers)
        if not self.servers:
            raise ValueError("ElasticServer needs at least one ExpertServer")
        self.name = membership.check_name(name)
        self.secret = secret if secret is not None else self.servers[0].secrets[0]
        self.options = options or rpc_bind.backend_options(
            master_addr, master_port, rpc_timeout=rpc_timeout,
            num_worker_threads=num_worker_threads, transports=transports)
        self.beat_interval, self.join_timeout = beat_interval, join_timeout
        self.drain_timeout, self.linger = drain_timeout, linger
        self.member_timeout, self.lost_after = member_timeout, lost_after
        self.experts: Dict[str, str] = {n: s.backward for s in self.servers for n in s.names}
        self.recover = recover
        #: expert -> where its state came from at join ("peer NAME", or "" if it kept its own)
        self.recovered: Dict[str, str] = {}
        self.rank = -1
        self.state = "created"
        self.reason = ""
        self._log = log or (lambda message: None)
        self._registry: Optional[Registry] = None
        self._halt = threading.Event()   # stops the beat thread
        self._wake = threading.Event()   # wakes serve(): stop, eviction, world lost
        self._beat_thread: Optional[threading.Thread] = None
        self._record: Optional[ServerRecord] = None  # as published (renewed by the beats)
        self._listeners: Set[str] = set()  # the sockets init_rpc opened (address:port)
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
            self._registry = registry = Registry(raw, self.secret)
            self.rank = membership.allocate_rank(raw)
            self._beat_thread = threading.Thread(target=self._beat, daemon=True,
                                                 name=f"moe_autograd-fleet-beat-{self.name}")
            registry.beat(self.name, self.rank)  # joiners are judged by their beats
            self._beat_thread.start()
            stopping.track(self)
            window = 3 * self.beat_interval
            before = set(rpc_bind.listening())
            membership.join_world(self.name, self.options, raw, self.rank,
                                  timeout=self.join_timeout,
                                  alive=lambda m: observe_alive(registry, m, window))
            self._listeners = set(rpc_bind.listening()) - before
        except BaseException:
            self.state = "gone"
            self._halt.set()
            raise
        if self.recover:
            self._recover(registry)
        set_host_info(rank=self.rank, name=self.name, state="serving")
        try:
            self._record = ServerRecord(self.name, self.rank, dict(self.experts), "serving",
                                        time.time(), endpoint.gate().boot.hex())
            registry.publish(self._record,
                             live=lambda n, r: n in membership.members(registry.raw)
                             and membership.members(registry.raw)[n] == r)
        except NameTaken as error:
            self._halt.set()
            self.state = "gone"
            raise MembershipError(str(error)) from error
        self.state = "serving"
        self._log(f"joined as {self.name!r} (rank {self.rank}) serving {sorted(self.experts)}")
        return self

    def _recover(self, registry: Registry) -> None:
        """Each expert takes the state of a live published replica, if any
        (see the module docstring's last invariant)."""
        roster = {n: r for n, r in registry.roster().items() if n != self.name}
        records = registry.records(list(roster))
        alive = set(observe_alive(registry, roster, 3 * self.beat_interval)) if roster else set()
        for server in self.servers:
            for expert in server.names:
                peers = sorted(n for n, record in records.items() if n in alive
                               and record.state == "serving" and expert in record.experts)
                self.recovered[expert] = ""
                for peer in peers:
                    started = time.monotonic()
                    try:
                        state = RemoteExpert(peer, expert, transport=RpcTransport(),
                                             secret=self.secret, forward_timeout=60.0
                                             ).remote_snapshot()
                        steps = server.restore(expert, state, f"peer {peer}")
                    except Exception as error:  # noqa: BLE001 - try the next replica
                        _log.warning("expert %r: could not take the state of peer %r: %s: %s",
                                     expert, peer, type(error).__name__, error)
                        continue
                    took = time.monotonic() - started
                    size = sum(t.numel() * t.element_size() for t in state.module.values())
                    self._log(f"expert {expert!r} took the state of peer {peer!r} (step "
                              f"{steps}, {size / 1e6:.2f} MB of weights in {took:.3f} s)")
                    self.recovered[expert] = f"peer {peer}"
                    break
                if not self.recovered[expert]:
                    self._fresh(server, expert, records, alive)

    def _fresh(self, server: ExpertServer, expert: str, records: Dict[str, Any],
               alive: Any) -> None:
        """Says that ``expert`` starts from its own state (no live replica
        gave it one): a WARNING when a server that served it is gone (this
        one replaces it) and the state is the factory's, else INFO."""
        resumed = server.resumed.get(expert, "")
        gone = sorted(n for n, record in records.items()
                      if n not in alive and expert in record.experts)
        if gone and not resumed:
            _log.warning("expert %r starts from its factory's fresh weights: no live replica "
                         "holds its state and it has no snapshot (it replaces %s); what it "
                         "learned there is lost", expert, ", ".join(map(repr, gone)))
        else:
            self._log(f"expert {expert!r}: no live replica to take the state of; it starts "
                      f"from {resumed or 'its factory'}")

    def _beat(self) -> None:
        registry = self._registry
        assert registry is not None
        failing_since: Optional[float] = None
        renewed = checked = time.monotonic()
        while not self._halt.wait(self.beat_interval):
            try:
                registry.beat(self.name, self.rank)
                failing_since = None
                if self.state == "serving" and self._listeners \
                        and time.monotonic() - checked >= LISTENER_CHECK_S:
                    checked = time.monotonic()
                    self._check_listeners(registry)
                if self.state == "serving" and self._record is not None \
                        and time.monotonic() - renewed > RECORD_TTL_S / 4:
                    registry.renew(self._record)  # signed records expire
                    renewed = time.monotonic()
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

    def _check_listeners(self, registry: Registry) -> None:
        """See the module docstring's last invariant."""
        lost = sorted(self._listeners - set(rpc_bind.listening()))
        if not lost:
            return
        self._listeners = set()  # said once
        kept = self._would_lose(registry)
        what = (f"this server's TensorPipe listener ({', '.join(lost)}) was closed: a "
                f"connection that did not speak TensorPipe (a port scan, a health check) "
                f"makes torch's RPC agent stop accepting, and no server can join the "
                f"world while this one is a member")
        if kept:
            _log.error("%s; it stays, because leaving would lose the state of training "
                       "expert(s) %s (no snapshot directory, no other live replica): "
                       "restart it with a state directory to let the fleet grow", what,
                       ", ".join(map(repr, kept)))
            return
        _log.error("%s; it leaves the world and starts again", what)
        self._signal(LISTENER_CLOSED)

    def _would_lose(self, registry: Registry) -> List[str]:
        """The training experts that leaving now would lose the state of."""
        try:
            roster = {n: r for n, r in registry.roster().items() if n != self.name}
            records = registry.records(list(roster))
            alive = set(observe_alive(registry, roster, 3 * self.beat_interval)) \
                if roster else set()
        except Exception:  # noqa: BLE001 - the store is gone: count no peer
            records, alive = {}, set()
        lost = []
        for server in self.servers:
            for expert in server.names:
                if server.version(expert) is None or server.snapshots is not None:
                    continue
                if not any(n in alive and r.state == "serving" and expert in r.experts
                           for n, r in records.items()):
                    lost.append(expert)
        return sorted(lost)

    def _halt_at_exit(self) -> None:
        self._halt.set()
        thread = self._beat_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(stopping.EXIT_JOIN_S)

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
        self._hand_over(registry)
        self.state = "draining"
        set_host_info(state="draining")
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

    def _hand_over(self, registry: Registry) -> None:
        """A clean leave loses no step: each training expert's live published
        replicas that are behind this server's state (one that joined a few
        steps ago, and that no trainer has brought into sync yet) take it
        before this server stops serving. Best effort: a failure is logged."""
        try:
            roster = {n: r for n, r in registry.roster().items() if n != self.name}
            records = registry.records(list(roster))
        except Exception as error:  # noqa: BLE001 - the store is gone: nobody to hand to
            self._log(f"leave: no hand-over ({type(error).__name__}: {error})")
            return
        for server in self.servers:
            for expert in server.names:
                mine = server.version(expert)
                if mine is None:
                    continue
                for peer in sorted(n for n, r in records.items()
                                   if r.state == "serving" and expert in r.experts):
                    try:
                        remote = RemoteExpert(peer, expert, transport=RpcTransport(),
                                              secret=self.secret, forward_timeout=30.0)
                        training, count, _ = remote._control("version")
                        if training and count < mine[0]:
                            remote.restore_remote(server.snapshot(expert))
                            self._log(f"expert {expert!r}: handed its state (step "
                                      f"{mine[0]}) to {peer!r}, which was at {count}")
                    except Exception as error:  # noqa: BLE001 - logged, the leave goes on
                        _log.warning("expert %r: could not hand its state to %r on leaving: "
                                     "%s: %s", expert, peer, type(error).__name__, error)

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
                 linger: float = 1.0, log: Optional[Callable[[str], None]] = None,
                 recover: bool = True) -> int:
    """``python -m moe_autograd serve --join``: join the world of ``options``,
    serve until SIGINT/SIGTERM, the coordinator's stop or the world's end, then
    leave cleanly. Returns the exit status: 0, 2 for an unusable name, 3 if
    this server was evicted (reaped while stopped), 75 (EX_TEMPFAIL) if it
    could not join (start it again), :data:`EXIT_REJOIN` if it left because
    its listener was closed (``serve`` starts again at once)."""
    say = log or (lambda message: None)
    try:
        elastic = ElasticServer(servers, name, options=options, drain_timeout=drain_timeout,
                                join_timeout=join_timeout, linger=linger, log=say,
                                recover=recover)
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
        return {"evicted": 3, LISTENER_CLOSED: EXIT_REJOIN}.get(reason, 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def default_name() -> str:
    """A worker name for a server started without ``--name``."""
    return f"expert_server_{os.getpid()}_{secrets.token_hex(2)}"
