"""Experts called by name on whichever live replica a fleet resolves.

Why a module of its own: two fleets resolve names to servers, one per
engine (:class:`~.fleet.Fleet` on torch RPC, :class:`~.ray_fleet.RayFleet`
on Ray), and the same :class:`FleetExpert` calls through either; neither
fleet needs the other, so what they share sits here, below both.

Which replica a call takes (``balance``, per fleet or per expert):
``"latency"`` (the default) asks the fleet's
:class:`~.balance.ReplicaBalancer`: two choices on each replica's measured
round trips and this client's calls in flight to it (see :mod:`.balance`);
``"order"`` takes the oldest live replica, and sticks to the one that served
the name last. Either way every attempt and every backward is measured
(:class:`_Measured`), so the balancer's view (:meth:`FleetExpert.replica_stats`)
is kept whatever the policy.

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
* A retry on another replica, and a switch away from the replica that
  served the name last when that one failed or is no longer live, are
  logged at INFO on ``moe_autograd.remote.replicas`` (at most one line per
  expert name every 10 s, with the count of those held back). Spreading
  calls over healthy replicas (``balance="latency"``) is not a switch.
* Every call counted in flight by the balancer (each attempt, each
  backward) is ended exactly once, whatever its outcome (the attempt's
  ``finally``; the backward's job settles once, on its answer, its failure
  or its abandonment).
* Every attempt is sealed with the fleet's job secret (``fleet.secret``):
  a fleet resolves only servers that proved it (see each fleet's admission).
"""
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

from torch import Tensor, nn

from ..logs import RateLimit, held_back
from .auth import JobSecret
from .balance import ReplicaBalancer, check_balance
from .batching import Job
from .client import RemoteExpert
from .compression import Compression, resolve as resolve_codec
from .durable import ExpertState
from .errors import RemoteExpertError, RemoteTimeoutError
from .mirrored import QUERY_TIMEOUT_S, OutOfSync, View, view_of
from .transport import Transport, TransportError, check_timeout

__all__ = ["FleetExpert", "FleetEvent", "NoLiveReplica", "Resolver", "caused_by_transport",
           "log_event", "WARNING_EVENTS", "FORGET_EVENTS"]

Outputs = Union[Tensor, Tuple[Tensor, ...]]
MAX_MESSAGE_CHARS = 600  # of a logged retry or switch
_log = logging.getLogger(__name__)
_limit = RateLimit()  # retries and switches, per expert name


class NoLiveReplica(RemoteExpertError):
    """No live server hosts the expert now (none joined yet, all left or died)."""


@dataclass(frozen=True)
class FleetEvent:
    """A change a fleet (:class:`~.fleet.Fleet`, :class:`~.ray_fleet.RayFleet`) observed: ``joined``, ``left`` (a clean leave
    started), ``lost`` (a call failed on the transport, or the beats went
    silent) or ``reaped`` (removed after a crash)."""

    kind: str
    worker: str
    experts: Tuple[str, ...]
    at: float          # time.monotonic() of this process
    detail: str = ""


#: Event kinds that mean calls fail or are refused (WARNING); the others are INFO.
WARNING_EVENTS = ("lost", "refused")
#: Event kinds after which a fleet's balancer forgets what it measured of the
#: server (a new incarnation, or one that is gone): it is explored afresh.
FORGET_EVENTS = ("joined", "left", "reaped", "gone")


def log_event(logger: logging.Logger, fleet: str, event: FleetEvent) -> None:
    """Logs what a fleet observed: WARNING for a server lost or refused,
    INFO for one that joined, left, was reaped or is gone. Events are rare
    (once per server and change), so they are not rate-limited."""
    level = logging.WARNING if event.kind in WARNING_EVENTS else logging.INFO
    if logger.isEnabledFor(level):
        experts = f" ({', '.join(event.experts)})" if event.experts else ""
        detail = f": {event.detail}" if event.detail else ""
        logger.log(level, "%s: server %r %s%s%s", fleet, event.worker, event.kind, experts,
                   detail)


def caused_by_transport(error: BaseException) -> bool:
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



class Resolver(Protocol):
    """What :class:`FleetExpert` needs of a fleet: :class:`~.fleet.Fleet` (torch RPC)
    or :class:`~moe_autograd.remote.ray_fleet.RayFleet` (Ray).

    Optional: ``balancer`` (a :class:`~.balance.ReplicaBalancer` that the
    fleet's experts share; without one, each expert keeps its own) and
    ``balance`` (the policy its experts default to; ``"latency"`` without one).
    """

    transport: Transport

    @property
    def secret(self) -> Optional[JobSecret]: ...

    def replicas(self, expert: str) -> List[str]: ...

    def refresh_on_miss(self) -> None: ...

    def servers(self) -> Dict[str, Tuple[str, ...]]: ...

    def suspect(self, worker: str, why: str = "") -> None: ...

    def _served(self, worker: str) -> None: ...


class _TimedJob(Job):
    """A backward's :class:`~.batching.Job` that tells the balancer when it
    ends: settled once, on its answer (:meth:`outcome`: a sample, or a
    failure for a server's error), its failure (:meth:`failure`) or its
    abandonment (a deadline, Ctrl-C)."""

    __slots__ = ("_settle",)
    _settle: Callable[[Optional[bool]], None]

    @classmethod
    def adopt(cls, job: Job, settle: Callable[[Optional[bool]], None]) -> "_TimedJob":
        timed = cls.__new__(cls)
        for slot in Job.__slots__:
            setattr(timed, slot, getattr(job, slot))
        timed._settle = settle
        abandon = job.abandon

        def abandoned() -> None:
            settle(False)
            if abandon is not None:
                abandon()
        timed.abandon = abandoned
        return timed

    def outcome(self, reply: Any) -> Any:
        try:
            value = super().outcome(reply)
        except BaseException:
            self._settle(False)
            raise
        self._settle(True)
        return value

    def failure(self, error: BaseException) -> RemoteExpertError:
        self._settle(False)
        return super().failure(error)


class _Measured(RemoteExpert):
    """One attempt's :class:`RemoteExpert`: its backward (which goes to the
    same replica) is counted in flight and timed for the balancer."""

    def __init__(self, balancer: ReplicaBalancer, worker: str, name: str, view: View,
                 fleet: "Resolver", direct: Callable[[str], RemoteExpert],
                 **options: Any) -> None:
        super().__init__(worker, name, **options)
        self.balancer, self.view, self.fleet, self.direct = balancer, view, fleet, direct

    def _forward_job(self, call: Any, args: Sequence[Any], grad: bool) -> Job:
        job = super()._forward_job(call, args, grad)
        view, worker, fleet, name = self.view, self.worker, self.fleet, self.name
        if not view.asks(worker):
            fence = view.fence()
            if fence is not None:  # run only at the version its client knows (.mirrored)
                job.message["fence"] = fence
            return job
        job.message["version"] = True  # the reply says the version it ran at: checked
        decode = job.decode

        def checked(value: Any) -> Any:
            if not (isinstance(value, list) and len(value) == 5):
                raise RemoteExpertError(f"{self._where('forward')} got a malformed reply: "
                                        f"{value!r:.200}")
            result = decode(value[:4])
            view.learn(worker, value[4], fleet.replicas(name), self.direct)
            return result
        job.decode = checked
        return job

    def _backward_job(self, call: Any, args: Optional[Sequence[Any]],
                      grads: Sequence[Optional[Tensor]]) -> Job:
        job = super()._backward_job(call, args, grads)
        view, fleet, name, direct = self.view, self.fleet, self.name, self.direct
        call_id = call.call_id
        if view.training:  # every in-sync replica applies it (.mirrored)
            job.deliver = lambda sent: view.deliver(sent, call_id, fleet.replicas(name),
                                                    fleet.suspect, direct)
        return job

    def _job(self, what: str, message: Dict[str, Any], timeout: Optional[float],
             decode: Any = None, abandon: Any = None) -> Job:
        job = super()._job(what, message, timeout, decode, abandon)
        if what != "backward":
            return job
        balancer, name, worker = self.balancer, self.name, self.worker
        balancer.begin(name, worker)
        started = balancer.clock()
        settled = threading.Lock()
        done: List[bool] = []

        def settle(ok: Optional[bool]) -> None:
            with settled:
                if done:
                    return
                done.append(True)
            balancer.end(name, worker, "backward", balancer.clock() - started, ok)
        return _TimedJob.adopt(job, settle)


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
    ``compression``: the codec of its tensors on the wire (see
    :class:`~moe_autograd.remote.RemoteExpert`); ``None``: the fleet's
    ``compression``, ``"none"``: raw whatever the fleet's.
    ``suspect_for``. ``balance``: how the replica is chosen, ``"latency"``
    (measured round trips and calls in flight, the fleet's
    :class:`~.balance.ReplicaBalancer`) or ``"order"`` (the oldest live
    replica, sticking to ``last_worker``); default: the fleet's ``balance``.
    ``last_worker`` is the replica of the latest successful forward;
    ``retries`` counts attempts after a failure.
    """

    def __init__(self, fleet: Resolver, name: str, *, forward_timeout: Optional[float] = None,
                 backward_timeout: Optional[float] = None,
                 attempt_timeout: Optional[float] = None,
                 compression: Union[None, str, Compression] = None,
                 balance: Optional[str] = None) -> None:
        super().__init__()
        self.fleet, self.name = fleet, name
        self.compression = resolve_codec(
            getattr(fleet, "compression", None) if compression is None else compression,
            f"compression of FleetExpert {name!r}")
        self.forward_timeout = check_timeout(f"forward_timeout of FleetExpert {name!r}",
                                             forward_timeout)
        self.backward_timeout = check_timeout(f"backward_timeout of FleetExpert {name!r}",
                                              backward_timeout)
        self.attempt_timeout = check_timeout(f"attempt_timeout of FleetExpert {name!r}",
                                             attempt_timeout)
        self.balance = check_balance(getattr(fleet, "balance", "latency") if balance is None
                                     else balance, f"balance of FleetExpert {name!r}")
        shared = getattr(fleet, "balancer", None)
        self.balancer: ReplicaBalancer = shared if shared is not None else ReplicaBalancer()
        self.last_worker: Optional[str] = None
        self.retries = 0

    def extra_repr(self) -> str:
        return f"name={self.name!r}, balance={self.balance!r}"

    def replicas(self) -> List[str]:
        return self.fleet.replicas(self.name)

    def _direct(self, worker: str) -> RemoteExpert:
        return RemoteExpert(worker, self.name, transport=self.fleet.transport,
                            secret=self.fleet.secret, forward_timeout=QUERY_TIMEOUT_S)

    @property
    def view(self) -> View:
        """What this process knows of the name's replicas (shared by every
        :class:`FleetExpert` of the name in the fleet: :mod:`.mirrored`)."""
        return view_of(self.fleet, self.name)

    def remote_snapshot(self) -> ExpertState:
        """The whole state of one live replica (of a training expert, one in
        sync with this client's training: :mod:`.mirrored`; else the first by
        the fleet's order): what a job checkpoint keeps (:func:`~.job.save_job`)."""
        replicas = self.view.in_sync(self.replicas(), self._direct)
        truth = self.view.truth if self.view.training else None
        if truth is not None:  # a replica known to be at the truth first
            replicas.sort(key=lambda w: self.view.known.get(w) != truth)
        if not replicas:
            raise NoLiveReplica(f"FleetExpert {self.name!r}: no live replica to take the "
                                f"state of")
        return self._direct(replicas[0]).remote_snapshot()

    def restore_remote(self, state: ExpertState) -> int:
        """Makes ``state`` the whole state of every live replica; its steps."""
        replicas = self.replicas()
        if not replicas:
            raise NoLiveReplica(f"FleetExpert {self.name!r}: no live replica to restore")
        view = self.view
        with view.lock:  # no backward of this client's between the restores
            steps = min(self._direct(worker).restore_remote(state) for worker in replicas)
            # every replica is at the state's version now: the next forwards learn it
            view.training, view.truth, view.known = None, None, {}
        return steps

    def replica_stats(self) -> Dict[str, Dict[str, Any]]:
        """The balancer's view of this name's replicas, by worker (see
        :meth:`~.balance.ReplicaBalancer.stats`)."""
        return self.balancer.stats(self.name).get(self.name, {})

    def _choose(self, candidates: List[str], preferred: Optional[str]) -> str:
        """The replica of the next attempt, counted in flight."""
        if self.balance == "latency":
            return self.balancer.choose(self.name, candidates)
        worker = preferred if preferred in candidates else candidates[0]
        self.balancer.begin(self.name, worker)
        return worker

    def forward(self, *args: Any) -> Outputs:  # type: ignore[override]
        start = time.monotonic()
        deadline = None if self.forward_timeout is None else start + self.forward_timeout
        tried: List[str] = []
        live: Optional[List[str]] = None  # the candidates of the first attempt
        # (worker, message, timed out): no exception objects are kept, since
        # their tracebacks hold frames whose locals (a later attempt's outputs,
        # hence its server-side state) only the cyclic GC would free.
        failures: List[Tuple[str, str, bool]] = []
        while True:
            candidates = [w for w in self.fleet.replicas(self.name) if w not in tried]
            if not candidates and not tried:  # none cached: one may have joined just now
                self.fleet.refresh_on_miss()
                candidates = self.fleet.replicas(self.name)
            candidates = self.view.in_sync(candidates, self._direct)  # a training name's
            if not candidates:
                raise self._no_replica(failures, start)
            if live is None:
                live = list(candidates)
            limit = self.attempt_timeout
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._no_replica(failures, start, timed_out=True)
                limit = left if limit is None else min(limit, left)
            preferred = self.last_worker
            worker = self._choose(candidates, preferred)
            tried.append(worker)
            if failures:
                self.retries += 1
                self._say(f"retrying on {worker!r}: the attempt on {failures[-1][0]!r} failed: "
                          f"{failures[-1][1]}")
            outputs, failure = self._attempt(worker, limit, args)
            if failure is None:
                assert outputs is not None
                if preferred is not None and worker != preferred and (
                        self.balance == "order" or preferred not in live
                        or any(w == preferred for w, _, _ in failures)):
                    self._say(f"now served by {worker!r} (was {preferred!r})")
                self.last_worker = worker
                self.fleet._served(worker)
                return outputs
            failures.append(failure[:3])
            if failure[3]:
                self.fleet.suspect(worker, f"a call of {self.name!r} failed on the transport")

    def _say(self, message: str) -> None:
        """INFO on ``moe_autograd.remote.replicas``, at most one line per
        expert name every :data:`~moe_autograd.logs.LOG_EVERY_S` seconds."""
        if _log.isEnabledFor(logging.INFO):
            held = _limit.allow(self.name)
            if held is not None:
                _log.info("fleet expert %r: %s%s", self.name, message[:MAX_MESSAGE_CHARS],
                          held_back(held, _limit.every))

    def _attempt(self, worker: str, limit: Optional[float], args: Tuple[Any, ...]
                 ) -> Tuple[Optional[Outputs], Optional[Tuple[str, str, bool, bool]]]:
        """One call on ``worker`` (counted in flight by :meth:`_choose`;
        ended here, measured): ``(outputs, None)`` or ``(None, (worker,
        message, timed out, transport failure))``. A helper frame of its own,
        so that an exception's traceback never holds :meth:`forward`'s frame
        (whose locals end up holding a later attempt's outputs)."""
        balancer = self.balancer
        ok: Optional[bool] = None
        try:
            expert = _Measured(balancer, worker, self.name, self.view, self.fleet, self._direct,
                               forward_timeout=limit,
                               backward_timeout=self.backward_timeout,
                               transport=self.fleet.transport, secret=self.fleet.secret,
                               compression=self.compression)
            started = balancer.clock()
            try:
                outputs = expert(*args)
            except RemoteExpertError as error:
                # an answer from another version says nothing of the replica's health (it
                # is brought into sync before its next call): no failure for the balancer
                ok = None if isinstance(error, OutOfSync) else False
                if not isinstance(error, OutOfSync):  # (asked again; one found stale is resynced)
                    expert.view.forget(worker)
                failure = (worker, str(error), isinstance(error, RemoteTimeoutError),
                           caused_by_transport(error))
                traceback.clear_frames(error.__traceback__)  # finished frames: free their locals
                return None, failure
            ok = True
            return outputs, None
        finally:
            balancer.end(self.name, worker, "forward",
                         balancer.clock() - started if ok is not None else 0.0, ok)

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
