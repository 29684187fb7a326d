"""Replicas of a training expert that stay one expert: every replica applies
every backward, in one order, fenced by the expert's version.

Why this module exists: a fleet may serve a name on several servers. While
the expert only answers (no optimizer), any replica will do. A training
expert (``optimizer=``, ``auto_step``) changes at every backward; were each
backward applied only by the replica that ran its forward, the replicas
would drift apart, and a call would see whichever copy it reached. The
consistency model (measured in BENCHMARKS.md, ``durable/replica-drift``):

* **Every live replica applies every backward** of this client, in the
  order this client issues them: a :class:`~.replicas.FleetExpert`'s
  backward of a training name goes to each in-sync replica at once (its
  forward's replica first), fenced by the version the client expects
  (:mod:`.lineage`). A replica applies it only at exactly that version, so
  the replicas of a name stay bit-equal; the call's input gradients come
  from the first replica that answered (all answer the same).
* **Forwards go to any in-sync replica** (``balance="latency"`` spreads
  them): each is fenced too, and runs only on a replica at the version the
  client knows (or past it), so every replica answers a call the same. A
  replica the client has not seen yet is asked, in the forward's own reply,
  which version it ran at (no extra round trip): an answer from another
  version is not used (:class:`OutOfSync`) and the call is retried on
  another replica.
* **A replica that is not in sync is brought back before it is used.** A
  replica of a training name that the client has not seen yet is asked its
  version before the name's next call (one ``version`` call). A replica
  found at another version (a new one that joined with its own state, or
  took a peer's a few steps ago; one that missed a backward; one that
  refused a fenced backward another replica applied) gets its state from an
  in-sync replica: its
  client copies that replica's whole state to it (``snapshot``/``restore``,
  sealed with the job's secret), logged at INFO. A replica found *past* the
  client's version means another client trains the name too (or a backward
  this client saw fail was applied): logged at WARNING, and the most
  advanced state becomes the truth. One trainer per training name is the
  supported use (two are detected, not arbitrated).
* **When no replica at the client's version lives** (the only one died,
  and its replacement resumed from a snapshot, which is behind), the
  client goes on from the most advanced live replica, with a WARNING that
  names the steps lost (at most the snapshots' ``save_every``): the
  expert is never masked for want of a state it can no longer have.
* **Nothing is lost while one replica lives.** A replica killed at any
  point of a pass costs no step: the others applied every backward it did,
  a forward it would have run is retried on another (see
  :class:`~.replicas.FleetExpert`), and a backward is answered by any
  replica (a stateless backward carries its inputs and seed).

What it costs: each backward runs on every replica (replicas add
availability to a training expert, not throughput), and a backward waits
for the slowest in-sync replica up to :data:`MIRROR_GRACE_S` after the
first answer. Backwards of one name from one client are sent one at a time.

Invariants:

* A backward of a training name is sent only under its view's lock, with
  the fence of the view's truth, to the replicas in sync or not seen yet;
  the truth moves (to :func:`~.lineage.after` the call id) only when a
  replica applied it, and every replica that answered without applying it
  is then brought to the new truth before the backward returns.
* Stateful backwards (``ExpertServer(backward="stateful")``) of a training
  name with more than one in-sync replica are refused with an error naming
  the expert: only the forward's replica holds their graph.
"""
import logging
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, MutableMapping, Optional, Sequence

from .batching import Job
from .channel import request as send_request
from .client import RemoteExpert
from .errors import RemoteAuthError, RemoteExpertError
from .lineage import Version, after
from .transport import TransportError, TransportTimeout, when_done

__all__ = ["View", "OutOfSync", "view_of", "MIRROR_GRACE_S", "QUERY_TIMEOUT_S", "ASK_TIMEOUT_S"]

#: How long a backward waits for the other replicas once one answered.
MIRROR_GRACE_S = 2.0
#: The deadline of a resync's transfer.
QUERY_TIMEOUT_S = 30.0
#: The deadline of a version question (asked under the name's lock).
ASK_TIMEOUT_S = 5.0
_log = logging.getLogger(__name__)
Direct = Callable[[str], RemoteExpert]  # a replica's expert, by worker


class OutOfSync(RemoteExpertError):
    """A replica answered from a state that is not the one this client
    trains (its answer is not used; it is brought back before its next call)."""


class View:
    """What one client knows of one name's replicas: whether the expert
    trains, the version it should be at (``truth``) and the version each
    replica was last seen at (``known``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.training: Optional[bool] = None  # None: not asked yet
        self.truth: Optional[Version] = None
        self.known: Dict[str, Version] = {}
        self.resyncs = 0  # replicas brought back into sync
        self.adopted = 0  # times no replica at the truth lived, and the best left was taken

    def fence(self) -> Optional[List[Any]]:
        """The ``fence`` field of a forward (None: the name does not train)."""
        truth = self.truth
        return None if not self.training or truth is None else [truth[0], truth[1]]

    def asks(self, worker: str) -> bool:
        """Whether a forward to ``worker`` asks for the version it ran at
        (the view does not know the replica's: its answer is checked)."""
        return self.training is not False and worker not in self.known

    def in_sync(self, candidates: List[str], direct: Direct) -> List[str]:
        """The candidates a call may go to: all of them for an expert that
        does not train (or not known to yet: their forwards ask); else those
        at the truth or not seen yet, after bringing those seen elsewhere to
        the truth (copying an in-sync replica's state)."""
        if not self.training:
            return candidates
        with self.lock:
            assert self.truth is not None
            for worker in candidates:  # a replica not seen yet (one that joined): asked now,
                if worker not in self.known:  # while an in-sync one lives to copy from
                    self._ask(worker, direct)
            good = [w for w in candidates if self.known.get(w) == self.truth]
            seen = [w for w in candidates if w in self.known]
            if seen and not good:  # the truth died with its replicas: go on from the best left
                best = max(seen, key=lambda w: self.known[w][0])
                lost = self.truth[0] - self.known[best][0]
                _log.warning("expert %r: no live replica is at this client's version %d; it "
                             "goes on from replica %r at version %d (%s)", self.name,
                             self.truth[0], best, self.known[best][0],
                             f"{lost} step(s) lost" if lost >= 0 else "another history")
                self.truth = self.known[best]
                self.adopted += 1
                good = [w for w in candidates if self.known.get(w) == self.truth]
            for worker in [w for w in candidates if w in self.known and w not in good]:
                if good:
                    self._resync(worker, good[0], direct)
            return [w for w in candidates if w not in self.known
                    or self.known.get(w) == self.truth]

    def learn(self, worker: str, info: Any, live: Sequence[str] = (),
              direct: Optional[Direct] = None) -> None:
        """What a forward that asked (:meth:`asks`) found: ``[training,
        count, digest]`` of the state it ran at. Raises
        :class:`RemoteExpertError` when that is not the truth: the answer is
        not this expert's, and the replica is brought back before its next
        call."""
        if not (isinstance(info, list) and len(info) == 3 and isinstance(info[0], bool)
                and isinstance(info[1], int) and isinstance(info[2], str)):
            raise RemoteExpertError(f"replica {worker!r} of expert {self.name!r} answered a "
                                    f"malformed version: {info!r:.120}")
        training, count, digest = info
        with self.lock:
            if self.training is None:
                self.training = training
            if not training:
                return
            self.known[worker] = (count, digest)
            if self.truth is None and direct is not None:
                # The first answer of a training name: the truth is the most
                # advanced live replica's (a trainer that restarted may meet a
                # replica that resumed from an older snapshot first), so ask
                # the others once before taking this one's.
                for other in live:
                    if other != worker and other not in self.known:
                        self._ask(other, direct)
                best = max((w for w in live if w in self.known), default=worker,
                           key=lambda w: self.known[w][0])
                self.truth = self.known[best] if self.known[best][0] > count else (count, digest)
            if self.truth is None or count > self.truth[0]:
                if self.truth is not None:
                    _log.warning("replica %r of expert %r is at version %d, past this "
                                 "client's %d: another client trains it too, or a backward "
                                 "this client saw fail was applied", worker, self.name, count,
                                 self.truth[0])
                self.truth = (count, digest)
            if self.known[worker] != self.truth and not any(
                    self.known.get(w) == self.truth for w in live if w != worker):
                best = max((w for w in live if w in self.known), default=worker,
                           key=lambda w: self.known[w][0])
                if self.known[best] == self.known[worker]:  # none at the truth lives: go on
                    lost = self.truth[0] - count           # from this one (see in_sync)
                    _log.warning("expert %r: no live replica is at this client's version "
                                 "%d; it goes on from replica %r at version %d (%s)",
                                 self.name, self.truth[0], worker, count,
                                 f"{lost} step(s) lost" if lost >= 0 else "another history")
                    self.truth = self.known[worker]
                    self.adopted += 1
                    return
            if self.known[worker] != self.truth:
                raise OutOfSync(
                    f"replica {worker!r} of expert {self.name!r} is out of sync (version "
                    f"{count}, this client's {self.truth[0]}): its answer is not used, and it "
                    f"takes an in-sync replica's state before its next call")

    def _ask(self, worker: str, direct: Direct) -> None:
        """Asks ``worker`` its version (a ``version`` control call); on a
        failure it stays unknown (its forwards ask again)."""
        try:
            expert = direct(worker)
            expert.forward_timeout = ASK_TIMEOUT_S  # (a hung replica holds the name this long)
            training, count, digest = expert._control("version")
        except (RemoteExpertError, ValueError, TypeError) as error:
            _log.info("replica %r of expert %r did not say its version: %s", worker, self.name,
                      error)
            return
        if training:
            self.known[worker] = (int(count), str(digest))

    def _resync(self, worker: str, source: str, direct: Direct) -> None:
        assert self.truth is not None
        have = self.known.pop(worker, (-1, ""))
        try:
            state = direct(source).remote_snapshot()
            direct(worker).restore_remote(state)
        except RemoteExpertError as error:
            _log.warning("replica %r of expert %r is out of sync (version %d, the truth %d) and "
                         "could not take %r's state: %s; it gets no calls", worker, self.name,
                         have[0], self.truth[0], source, error)
            if have[0] >= 0:
                self.known[worker] = have
            return
        self.known[worker] = (state.steps + state.skipped_steps, state.lineage)
        self.resyncs += 1
        ahead = have[0] > self.known[worker][0]  # its own steps past the truth are dropped
        _log.log(logging.WARNING if ahead else logging.INFO,
                 "replica %r of expert %r was at version %d; it took %r's state (version %d)%s",
                 worker, self.name, have[0], source, self.known[worker][0],
                 ": its later steps are dropped" if ahead else "")

    def forget(self, worker: str) -> None:
        """A fenced call of ``worker`` failed: ask its version again before the next."""
        with self.lock:
            self.known.pop(worker, None)

    def deliver(self, job: Job, call_id: str, live: List[str],
                suspect: Callable[[str, str], None], direct: Direct) -> Any:
        """Sends the backward ``job`` (to its forward's replica) to every
        live replica in sync or not seen yet, fenced; returns the first
        answer (the forward's replica's, if it answered in time) or raises
        as a lone request would. A replica that did not apply it while
        another did is brought to the new truth at once."""
        with self.lock:
            truth = self.truth
            if not self.training or truth is None:  # (a forward made before the view knew)
                return _one(job)
            targets = [job.worker] + [w for w in live if w != job.worker
                                      and self.known.get(w, truth) == truth]
            if job.message.get("args") is None and len(targets) > 1:
                raise RemoteExpertError(
                    f"expert {self.name!r} trains on {len(targets)} replicas, and its backward "
                    f"is stateful: replicas of a training expert stay one expert only with "
                    f"ExpertServer(backward='stateless') (the default)")
            message = dict(job.message, fence=[truth[0], truth[1]])
            answers = _fan_out(job, message, targets)
            new = (truth[0] + 1, after(truth[1], call_id))
            applied = [w for w in targets if w in answers and _ok(answers[w])]
            for worker in targets:
                self.known.pop(worker, None)
                answer = answers.get(worker)
                if worker in applied:
                    self.known[worker] = new
                elif isinstance(answer, TransportError):
                    suspect(worker, f"a mirrored backward of {self.name!r} failed on the "
                                    f"transport")
            if not applied:  # each is asked its version at its next forward
                first = answers.get(job.worker)
                if isinstance(first, BaseException):
                    raise first
                if first is None:
                    raise TransportTimeout(f"no replica of {self.name!r} answered its "
                                           f"backward in time ({len(targets)} tried)")
                return first
            self.truth = new
            for worker in targets:  # answered, but did not apply it: out of sync
                if worker not in applied and isinstance(answers.get(worker), list):
                    self._resync(worker, applied[0], direct)
            return answers[job.worker] if job.worker in applied else answers[applied[0]]


def _ok(answer: Any) -> bool:
    return isinstance(answer, list) and len(answer) == 2 and answer[0] == "ok"


def _one(job: Job) -> Any:
    return send_request(job.transport, job.worker, job.message, job.timeout, secret=job.secret,
                        label=job.op).result(job.timeout)


def _fan_out(job: Job, message: Dict[str, Any], targets: List[str]) -> Dict[str, Any]:
    """``message`` sent to each target at once: each one's reply, or its
    error (absent: no answer in time). Waits for all, up to the job's
    timeout, and at most :data:`MIRROR_GRACE_S` after the first good reply."""
    answers: Dict[str, Any] = {}
    arrived = threading.Condition()
    for worker in targets:
        try:
            pending = send_request(job.transport, worker, message, job.timeout,
                                   secret=job.secret, label="backward")
        except (TransportError, RemoteAuthError) as error:
            answers[worker] = error
            continue

        def done(reply: Any, error: Optional[BaseException], worker: str = worker) -> None:
            with arrived:
                answers[worker] = error if error is not None else reply
                arrived.notify_all()
        when_done(pending, done, job.timeout)
    start = time.monotonic()
    end = None if job.timeout is None else start + job.timeout
    grace_end: Optional[float] = None
    with arrived:
        while len(answers) < len(targets):
            now = time.monotonic()
            if grace_end is None and any(_ok(a) for a in answers.values()):
                grace_end = now + MIRROR_GRACE_S
            stops = [t for t in (end, grace_end) if t is not None]
            stop = min(stops) if stops else None
            if stop is not None and now >= stop:
                break
            arrived.wait(0.1 if stop is None else min(stop - now, 0.1))  # sliced: Ctrl-C
        return dict(answers)


_views: "weakref.WeakKeyDictionary[Any, Dict[str, View]]" = weakref.WeakKeyDictionary()
_views_lock = threading.Lock()


def view_of(fleet: Any, name: str) -> View:
    """The one view of ``name`` in ``fleet`` in this process (every
    :class:`~.replicas.FleetExpert` of the name shares it)."""
    with _views_lock:
        views: MutableMapping[str, View] = _views.setdefault(fleet, {})
        view = views.get(name)
        if view is None:
            view = views[name] = View(name)
        return view
