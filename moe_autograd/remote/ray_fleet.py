"""The elastic fleet on Ray's own membership: :class:`RayFleet`.

Why: the RPC fleet (:mod:`.fleet`) builds membership itself (a store, beats,
a reaper, RPC's private dynamic-membership internals). A Ray cluster already
has it: nodes join (``ray start --address=...``) and leave or die (heartbeats),
and expert servers are named actors (:class:`~.ray_server.RayExpertServer`)
that Ray ends when their node or owner dies. A :class:`RayFleet` only reads
that: the named actors of its namespace, and what each serves, which it asks
each with a sealed ``info`` request (:mod:`.channel`): only a server that
answers with a reply sealed with the job's secret is admitted (another
job's servers in the namespace, or actors that are no expert servers, are
never chosen). And it asks only actors it has identified first: Ray
deserialises a reply before any check of ours, so an actor whose name has
no identity record signed with the job's secret for its actor ID (an
impostor that took a dead server's name, another job's actor) is never
called (:meth:`~.ray_engine.RayTransport.call`; event "refused", once). The same :class:`~.replicas.FleetExpert` calls experts by
name over it (forward retried on
another replica, backward to the replica that ran the forward, a name with
no replica masked at once), so a ``MixtureOfExperts`` of fleet experts runs on
either engine.

Lifecycle of a server as a RayFleet sees it (``events``: what is recorded, and logged:
``lost`` and ``refused`` as WARNING, the others INFO)::

    state     entered when                               chosen for new calls?
    --------  -----------------------------------------  ----------------------------------
    unseen    the actor starts (its name is registered;  no
              its info() waits for its __init__)
    serving   a poll finds it and its sealed info()      yes (as the experts' ``balance``
              answers, sealed (event "joined")           picks; listed oldest first)
    refused   its answer fails authentication (another   no; not asked again until its
              job's server, or an impostor; event        name leaves the cluster
              "refused")
    draining  RayExpertServer.leave() / SIGTERM of a     no; calls in flight and held states
              'serve --engine ray' process (event        are still served (up to its drain
              "left")                                    timeout)
    silent    its info() has not answered for            no; back to serving if it answers
              info_timeout (event "lost": a node that    later (event "joined")
              died keeps its actors' names until Ray's
              health check declares it dead)
    gone      the actor ended, crashed or its node was   no; calls to it fail at once
              declared dead (Ray removes its name), or   (ActorDiedError) and are retried
              info() raised (event "gone")               or masked; forgotten
    suspect   a call to it failed on the transport       no, for ``suspect_for`` seconds
              (event "lost", once per incarnation)

Invariants:

* Only public Ray API: ``ray.util.list_named_actors``, ``ray.get_actor``;
  no store, no beats, no reaper here.
* A poll never waits on a server it asked before: each server has at most
  one ``info()`` in flight, sent by one poll and collected by whichever
  poll finds it answered; a poll waits only for what it sent itself, at
  most :data:`POLL_WAIT_S` (a live server answers in milliseconds; a later
  answer is collected by the next poll). So a server that does not answer
  (a dead node's actor, one still starting) delays nobody: it keeps its
  last record until its pending ``info()`` is ``info_timeout`` old, then
  is left out (silent), and a server that joined meanwhile is seen at the
  next poll.
* The watch thread stops at :meth:`shutdown` or at interpreter exit, before
  Ray's own exit hook shuts Ray down.
* Polls are serialised (one lock); :meth:`replicas` never blocks on one,
  and :meth:`refresh_on_miss` (a call that found no replica; it asks only
  servers not in the roster) skips its poll while another one runs: the
  caller waits at most one name listing and :data:`POLL_WAIT_S`.
  The watch thread is a daemon stopped by :meth:`shutdown` (every wait
  bounded).
* An incarnation is a name and the time a poll first saw it serve:
  :meth:`first_served` and the "lost" event are per incarnation, so a
  replacement started under a dead server's name counts as new, and so
  does an actor that Ray restarted (``RayExpertServer(...,
  max_restarts=N)``: same name and handle; "gone" or "lost" when the
  process dies, and "joined" again once the restarted actor, resumed from
  its state directory before it can answer, does).
"""
import atexit
import logging
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from .auth import JobSecret, resolve_secret
from .compression import Compression, resolve as resolve_codec
from .balance import ReplicaBalancer, check_balance
from .channel import Opened, request
from .errors import RemoteAuthError
from .ray_engine import NAMESPACE, RayTransport, Unidentified, _ray, short
from .replicas import FORGET_EVENTS, FleetEvent, FleetExpert, log_event
from .transport import Transport, check_timeout

__all__ = ["RayFleet", "POLL_WAIT_S"]

POLL_WAIT_S = 0.05  # how long a poll waits for the answers to the info() it sent
_log = logging.getLogger(__name__)
_fleets: "weakref.WeakSet[RayFleet]" = weakref.WeakSet()
_hooked: List[bool] = []


def _stop_at_exit() -> None:
    """Stops every fleet's watch thread before Ray shuts down at exit (this
    hook is registered after ``ray.init``'s, so it runs first): a thread still
    inside a Ray call when Ray's core worker is gone makes Ray end the
    process before the script's own exit status."""
    for fleet in list(_fleets):
        fleet.shutdown(timeout=1.0)


class RayFleet:
    """The expert servers (named actors) of ``namespace`` in the Ray cluster
    this process is connected to, refreshed every ``poll`` seconds.

    ``fleet.expert("ffn0", forward_timeout=..., backward_timeout=...)`` is a
    :class:`~.replicas.FleetExpert` over it. ``transport``: the
    :class:`~.ray_engine.RayTransport` its calls use (default: one of this
    namespace). ``secret``: the job's :class:`~moe_autograd.remote.JobSecret`
    (default: the process's). ``info_timeout``: seconds a server may leave
    its ``info()`` unanswered before it is left out (silent). ``events``: the
    :class:`~.replicas.FleetEvent` s seen, oldest first (``joined``, ``left``,
    ``lost``, ``gone``, ``refused``; see the module's table). ``compression``:
    the codec its experts' tensors travel in (``None``: raw; ``"fp16"``,
    ``"bf16"``, ``"int8"``; one expert may say otherwise).
    ``lost``, ``gone``, ``refused``; see the module's table). ``balance`` and
    ``balancer``: how its experts choose among serving replicas, as
    :class:`~.fleet.Fleet`'s (``"latency"`` by default, or ``"order"``);
    :meth:`replica_stats` is the balancer's view.
    """

    def __init__(self, namespace: str = NAMESPACE, *, poll: float = 0.5,
                 suspect_for: float = 2.0, info_timeout: float = 5.0,
                 transport: Optional[Transport] = None,
                 secret: Optional[JobSecret] = None,
                 compression: Union[None, str, Compression] = None, balance: str = "latency",
                 balancer: Optional[ReplicaBalancer] = None) -> None:
        ray = _ray()
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised in this process: call "
                               "ray.init(address=...) before creating a RayFleet")
        self.namespace = namespace
        self.secret = resolve_secret(secret)
        self.compression = resolve_codec(compression, "compression of RayFleet")
        self.balance = check_balance(balance, "balance of RayFleet")
        self.balancer = balancer if balancer is not None else ReplicaBalancer()
        self.poll = check_timeout("poll of RayFleet", poll) or 0.5
        self.suspect_for = check_timeout("suspect_for of RayFleet", suspect_for) or 0.0
        self.info_timeout = check_timeout("info_timeout of RayFleet", info_timeout) or 5.0
        self.transport: Transport = transport or RayTransport(namespace)
        self._lock = threading.Lock()       # the roster (records, suspects, events)
        self._poll_lock = threading.Lock()  # one poll at a time (handles, pending)
        self._handles: Dict[str, Any] = {}
        self._pending: Dict[str, Tuple[Opened, float]] = {}  # name -> (info() sent, sent at)
        self._refused: Set[str] = set()  # names whose answer failed authentication
        self._unidentified: Set[str] = set()  # names without a signed identity (not called)
        # name -> (first seen serving, experts -> strategy, state)
        self._records: Dict[str, Tuple[float, Dict[str, str], str]] = {}
        self._suspects: Dict[str, float] = {}
        self._lost: Set[Tuple[str, float]] = set()
        self._first_served: Dict[Tuple[str, float], float] = {}
        self._last_miss_refresh = 0.0
        self.events: List[FleetEvent] = []
        self._stop = threading.Event()
        self._poll_once(self.info_timeout)  # the servers up now are known on return
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="moe_autograd-ray-fleet")
        self._thread.start()
        _fleets.add(self)
        if not _hooked:
            _hooked.append(True)
            atexit.register(_stop_at_exit)

    # -- the roster ---------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self._poll_once(min(POLL_WAIT_S, self.info_timeout))
            except Exception:  # noqa: BLE001 - the cluster is busy or gone: the cache stands
                pass

    def _poll_once(self, wait: float, lock_timeout: float = -1, known_too: bool = True) -> bool:
        """One poll: lists the names, sends a sealed ``info()`` to every
        server without one in flight (``known_too=False``: only to servers not
        in the roster), waits up to ``wait`` seconds for the answers to what
        it sent, collects every answer that came (older ones included), and
        updates the roster. Returns False if another poll held the lock for
        ``lock_timeout`` seconds (``-1``: waits for it)."""
        if not self._poll_lock.acquire(timeout=lock_timeout):
            return False
        try:
            self._poll_locked(wait, known_too)
        finally:
            self._poll_lock.release()
        return True

    def _poll_locked(self, wait: float, known_too: bool) -> None:
        ray = _ray()
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a.get("namespace") == self.namespace)
        listed = set(names)
        for name in set(self._handles) - listed:  # ended: Ray removed its name
            self._handles.pop(name, None)
            self._pending.pop(name, None)
            self._refused.discard(name)
        with self._lock:
            known = set(self._records)
        now = time.monotonic()
        sent: List[Opened] = []
        arrived = threading.Event()
        for name in names:
            if name in self._pending or (not known_too and name in known):
                continue
            try:
                handle = self._handles.get(name) or ray.get_actor(name, namespace=self.namespace)
            except Exception:  # noqa: BLE001 - gone meanwhile
                self._handles.pop(name, None)
                continue
            if name in self._refused:
                continue  # answered without the secret: not asked again while it lives
            self._handles[name] = handle
            use = getattr(self.transport, "use_handle", None)
            if use is not None:
                use(name, handle)
            try:
                opened = request(self.transport, name, {"op": "info"}, self.info_timeout,
                                 secret=self.secret, label="info")
            except Unidentified as error:  # never called: asked again (a starting server
                if name not in self._unidentified:  # publishes its identity as it starts)
                    self._unidentified.add(name)
                    self._emit(FleetEvent("refused", name, (), now, str(error)))
                continue
            except Exception:  # noqa: BLE001 - not an expert server (no handle method)
                continue
            self._unidentified.discard(name)
            self._pending[name] = (opened, now)
            sent.append(opened)
        if sent:  # only what this poll sent is waited for: a silent server delays nobody
            left = [len(sent)]
            lock = threading.Lock()

            def one_done() -> None:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        arrived.set()
            for opened in sent:
                add = getattr(opened, "add_done_callback", None)
                if add is None:
                    one_done()
                else:
                    add(one_done)
            arrived.wait(max(0.0, wait))
        answers: Dict[str, Dict[str, Any]] = {}
        dead: Dict[str, str] = {}  # name -> why its info() failed
        refused: Dict[str, str] = {}
        for name, (opened, _) in list(self._pending.items()):
            if not opened.done():
                continue
            del self._pending[name]
            try:
                status, info = opened.result(0)
            except RemoteAuthError as error:
                refused[name] = str(error)
                self._refused.add(name)
                continue
            except Exception as error:  # noqa: BLE001 - died: Ray fails its calls
                self._handles.pop(name, None)
                dead[name] = short(error)
                continue
            if status == "ok" and isinstance(info, dict):
                answers[name] = info
        self._apply(names, answers, dead, refused)

    def _apply(self, names: Sequence[str], answers: Dict[str, Dict[str, Any]],
               dead: Dict[str, str], refused: Dict[str, str]) -> None:
        now = time.monotonic()
        with self._lock:
            old = self._records
            records: Dict[str, Tuple[float, Dict[str, str], str]] = {}
            for name in names:
                if name in dead or name in refused:
                    continue
                info = answers.get(name)
                if info is not None:
                    known = old.get(name)
                    first = known[0] if known is not None else now
                    experts = info.get("experts", {})
                    records[name] = (first, dict(experts) if isinstance(experts, dict) else {},
                                     str(info.get("state", "serving")))
                elif name in old and (name not in self._pending or
                                      now - self._pending[name][1] < self.info_timeout):
                    records[name] = old[name]  # not asked this time, or the answer is on its way
            for name, why in refused.items():
                self._emit(FleetEvent("refused", name, (), now, why))
            for name, (first, experts, state) in old.items():
                new = records.get(name)
                if new is None:
                    gone = name in dead or name not in names
                    detail = (f"info() failed: {dead[name]}" if name in dead else
                              "its actor ended" if gone else
                              "its answer failed authentication" if name in refused else
                              f"no answer for {self.info_timeout:g} s")
                    if gone or (name, first) not in self._lost:
                        self._emit(FleetEvent("gone" if gone else "lost", name,
                                              tuple(experts), now, detail))
                    self._lost.discard((name, first))
                elif state == "serving" and new[2] != "serving":
                    self._emit(FleetEvent("left", name, tuple(experts), now, new[2]))
            for name, (first, experts, state) in records.items():
                if state == "serving" and (name not in old or old[name][2] != "serving"):
                    self._emit(FleetEvent("joined", name, tuple(experts), now, ""))
                    self._suspects.pop(name, None)
            self._records = records

    def _emit(self, event: FleetEvent) -> None:
        """Records ``event`` in ``events`` and logs it (``lost`` and
        ``refused`` as WARNING, the others INFO, on
        ``moe_autograd.remote.ray_fleet``)."""
        self.events.append(event)
        if event.kind in FORGET_EVENTS:
            self.balancer.forget(event.worker)
        log_event(_log, f"Ray fleet {self.namespace!r}", event)

    def refresh(self) -> None:
        """Reads the cluster now (the watch thread does so every ``poll``),
        waiting up to ``info_timeout`` for the servers' answers."""
        self._poll_once(self.info_timeout)

    def refresh_on_miss(self) -> None:
        """A quick poll, at most every ``poll / 4`` seconds: a name with no
        replica cached may have one that started since the last poll. It asks
        only servers not in the roster, waits :data:`POLL_WAIT_S` at most for
        their answers, and is skipped while another poll runs."""
        now = time.monotonic()
        if now - self._last_miss_refresh < self.poll / 4:
            return
        self._last_miss_refresh = now
        try:
            self._poll_once(min(POLL_WAIT_S, self.info_timeout), lock_timeout=0,
                            known_too=False)
        except Exception:  # noqa: BLE001
            pass

    def replicas(self, expert: str) -> List[str]:
        """Serving servers hosting ``expert`` now, oldest first."""
        now = time.monotonic()
        with self._lock:
            found = [(first, name) for name, (first, experts, state) in self._records.items()
                     if expert in experts and state == "serving"
                     and self._suspects.get(name, 0.0) <= now]
        return [name for _, name in sorted(found)]

    def servers(self) -> Dict[str, Tuple[str, ...]]:
        """Serving servers and the experts each hosts."""
        with self._lock:
            return {name: tuple(experts) for name, (_, experts, state) in
                    sorted(self._records.items(), key=lambda item: item[1][0])
                    if state == "serving"}

    def suspect(self, worker: str, why: str = "") -> None:
        """Skips ``worker`` for ``suspect_for`` seconds (a call failed on the
        transport); the first time per incarnation, records a "lost" event."""
        now = time.monotonic()
        with self._lock:
            self._suspects[worker] = now + self.suspect_for
            record = self._records.get(worker)
            if record is not None and (worker, record[0]) not in self._lost:
                self._lost.add((worker, record[0]))
                self._emit(FleetEvent("lost", worker, tuple(record[1]), now,
                                      why or "a call failed on the transport"))

    def _served(self, worker: str) -> None:
        now = time.monotonic()
        with self._lock:
            record = self._records.get(worker)
            if record is not None:
                self._first_served.setdefault((worker, record[0]), now)

    def first_served(self, worker: str) -> Optional[float]:
        """When (``time.monotonic()``) the current incarnation of ``worker``
        first served a call of this fleet."""
        with self._lock:
            record = self._records.get(worker)
            return None if record is None else self._first_served.get((worker, record[0]))

    # -- experts --------------------------------------------------------------------------
    def expert(self, name: str, *, forward_timeout: Optional[float] = None,
               backward_timeout: Optional[float] = None,
               attempt_timeout: Optional[float] = None,
               compression: Union[None, str, Compression] = None,
               balance: Optional[str] = None) -> FleetExpert:
        """A module that calls the expert ``name`` on a serving replica.
        ``compression``: its codec on the wire (``None``: the fleet's);
        ``balance``: this expert's policy (default: the fleet's)."""
        return FleetExpert(self, name, forward_timeout=forward_timeout,
                           backward_timeout=backward_timeout, attempt_timeout=attempt_timeout,
                           compression=compression, balance=balance)

    def experts(self, names: Sequence[str], **options: Any) -> List[FleetExpert]:
        return [self.expert(name, **options) for name in names]

    def replica_stats(self) -> Dict[str, Dict[str, Dict[str, Any]]]:
        """What the balancer measured, by expert and worker (see
        :meth:`~moe_autograd.remote.ReplicaBalancer.stats`)."""
        return self.balancer.stats()

    def wait_for(self, experts: Sequence[str], timeout: float = 30.0,
                 replicas: int = 1) -> None:
        """Blocks until every name in ``experts`` has ``replicas`` serving replicas."""
        deadline = time.monotonic() + timeout
        while True:
            missing = [e for e in experts if len(self.replicas(e)) < replicas]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {replicas} serving server(s) host {missing} "
                                   f"after {timeout:g} s; serving: {self.servers()}")
            time.sleep(min(self.poll / 2, 0.1))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the watch thread. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> "RayFleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
