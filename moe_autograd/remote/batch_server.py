"""``batch`` / ``collect``: the calls of one client's pass in one request.

Why: a pass of ``parallel_apply``, ``map_with_parallel_backward`` or a
``MixtureOfExperts`` sends all its calls to one server as ONE request (see
:mod:`.batching`, the client side): per-message costs (a Python RPC costs
about a millisecond of CPU over both ends on loopback) are paid once per
server and pass instead of once per call.

What a request holds (``{"op": "batch", "batch": id, "jobs": [...]}``):
``jobs``, each the dict a single ``forward`` or ``backward`` request would be
(:func:`~moe_autograd.remote.server.run_job`) plus ``answer_by``, the
seconds after which the client no longer waits for the call (its own
deadline, or its pass's if sooner, e.g. a ``MixtureOfExperts``'
``forward_timeout``; ``None``: none). Each job runs as that single-call
request would, through the same function: the same checks (owner and 128-bit
call id, quotas, backward validated before its state is taken), the same
errors naming the expert, the same state rules. The owner of a batch and of
its calls is the authenticated session that sent it (:class:`~.auth.Caller`).
A failing job fails only itself. The byte limit bounds the whole request,
before any job is queued: a server's jobs are admitted in order while their
tensors together fit its ``max_request_bytes`` (see
:func:`~moe_autograd.remote.server.admit_request`), and a job that does not
fit is answered with its error at once, so what one request makes a server
materialise stays bounded however many calls it carries.

The jobs of a request run concurrently (one pool worker each, see
:mod:`moe_autograd.executor`) and are answered together, except that an
answer is not held back for a slower sibling for long: once some answers are
ready, the request waits at most ``max(LINGER_MIN_S, LINGER_SHARE x`` the
time the first of them took``)`` more, and never past a ready job's
``answer_by`` (less :data:`MARGIN_S`, for the way back); then it replies with
the ready answers, keeps the batch, and the client asks for the rest with
``collect``, which waits the same way. So a fast call keeps its own
deadline (and its place in a ``MixtureOfExperts`` quorum) whatever its
siblings do, and a request with no straggler costs one message each way.

Lifecycle of a batch::

    event                                 what happens
    ------------------------------------  --------------------------------------------
    batch (owner, batch id, jobs)         validated (a malformed request is refused as
                                          a whole); jobs past the byte limit answered with
                                          their error; the others queued on the pool
    all jobs answered                     one reply with every answer; batch forgotten
    linger over, some jobs still running  reply with the ready answers, ``more=True``;
                                          batch kept (by owner and id) for collection
    collect from its owner                waits as above for the remaining answers: it
                                          replies only with a new answer, or at give-up
    every job's answer_by passed (give-   reply with what is ready, ``more=False``: batch
    up): the client waits for none        dropped (answers finishing later are discarded)
    collect from another session,         ["error", ...]: unknown batch; nothing changes
    or for an unknown / dropped batch
    kept, no collect by the give-up (or   dropped at the next request or count (the
    for BATCH_TTL_S, if a job has none)   client gave up on its calls)
    owner keeps > MAX_KEPT_PER_OWNER      the owner's oldest kept batch is dropped

Invariants:

* ``batch`` / ``collect`` never raise: an error is an ``["error", text]``
  reply; each job's answer is the reply its single-call request would get.
* What one client keeps here is bounded (:data:`MAX_KEPT_PER_OWNER` batches,
  each at most :data:`MAX_JOBS` answers, for at most :data:`BATCH_TTL_S`
  after its last reply, and never past the give-up: a client whose calls
  all ended, e.g. while this server was frozen, sends no collect); no
  client can collect or drop another's batch.
* Every job of a request is answered in at most one reply; a reply carries at
  least one new answer or ends the batch (``more=False``), so a request of
  ``n`` jobs costs at most ``n + 1`` replies, whatever the client does: no
  collect loop can spin (issue 18).
"""
import math
import numbers
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..executor import get_pool
from . import endpoint
from .auth import Caller
from .endpoint import Reply, error_text
from .server import admit_request, run_job

__all__ = ["kept_batches", "MAX_JOBS", "LINGER_MIN_S", "LINGER_SHARE", "MARGIN_S",
           "BATCH_TTL_S", "MAX_KEPT_PER_OWNER"]

MAX_JOBS = 4096          # calls in one request
LINGER_MIN_S = 0.01      # an answer waits at least this long for its siblings...
LINGER_SHARE = 1.0       # ...or this share of the time it took, whichever is longer
MARGIN_S = 0.005         # a ready answer leaves this long before its call's deadline
BATCH_TTL_S = 60.0       # a partly answered batch waits this long for a collect
MAX_KEPT_PER_OWNER = 64  # partly answered batches kept per client
_MAX_ID_CHARS = 256


def _ident(what: str, value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_ID_CHARS:
        raise TypeError(f"{what} must be a non-empty str of at most {_MAX_ID_CHARS} "
                        f"characters, got {value!r:.80}")
    return value


def _answer_by(value: Any) -> Optional[float]:
    if value is None:
        return None
    seconds = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) \
        else math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise TypeError(f"a job's answer_by must be None or positive seconds, got {value!r:.40}")
    return seconds


class _Batch:
    """The answers of one request, as the jobs finish (thread-safe)."""

    def __init__(self, answer_by: List[Optional[float]]) -> None:
        n = len(answer_by)
        self.start = time.monotonic()
        self.answer_by = answer_by
        self.answers: List[Optional[Reply]] = [None] * n
        self.ready_at = [0.0] * n
        self.sent = [False] * n
        self.unsent = n
        self.done = 0  # answers ready so far
        self.waiting = 0  # ready answers not sent yet
        self.wake_at = math.inf  # when the waiting request wakes by itself
        # Past every job's deadline the client has given up on all of them.
        limits = [a for a in answer_by if a is not None]
        self.give_up = self.start + max(limits) if len(limits) == n else None
        self.expires = math.inf
        self.cond = threading.Condition()

    def finish(self, i: int, reply: Reply) -> None:
        with self.cond:
            self.answers[i] = reply
            self.ready_at[i] = time.monotonic()
            self.done += 1
            self.waiting += 1
            # The waiter acts on the first answer of a round (it sets the
            # linger), on the last one, and on one that must leave before it
            # would wake; waking it for the others would only cost a GIL hand-off.
            limit = self.answer_by[i]
            if self.waiting == 1 or self.done == len(self.answers) or (
                    limit is not None and self.start + limit - MARGIN_S < self.wake_at):
                self.cond.notify_all()

    def _flush_at(self, ready: List[int]) -> float:
        first = min(self.ready_at[i] for i in ready)
        at = first + max(LINGER_MIN_S, LINGER_SHARE * (first - self.start))
        for i in ready:
            limit = self.answer_by[i]
            if limit is not None:
                at = min(at, self.start + limit - MARGIN_S)
        return at

    def reply(self) -> Tuple[List[Optional[Reply]], bool]:
        """Waits as the module docstring says; the answers not sent before
        (None for those still running) and whether the client should collect
        the rest: never an empty reply while some job may still answer in
        time, so a client's collect loop cannot spin."""
        with self.cond:
            while True:
                ready = [i for i, a in enumerate(self.answers) if a is not None and not self.sent[i]]
                if len(ready) == self.unsent:
                    break
                now = time.monotonic()
                if self.give_up is not None and now >= self.give_up:
                    break  # the client gave up on every job: send what is ready, drop the rest
                until = self._flush_at(ready) if ready else self.give_up
                if until is not None and now >= until:
                    break
                # Slices: a request never sleeps past a server's close for long.
                pause = 1.0 if until is None else min(1.0, until - now)
                self.wake_at = now + pause
                self.cond.wait(pause)
            self.wake_at = math.inf
            out: List[Optional[Reply]] = [None] * len(self.answers)
            for i in ready:
                out[i] = self.answers[i]
                self.answers[i] = None  # the tensors go with the reply
                self.sent[i] = True
            self.unsent -= len(ready)
            self.waiting -= len(ready)
            more = self.unsent > 0 and not (self.give_up is not None
                                            and time.monotonic() >= self.give_up)
            return out, more


_kept: "OrderedDict[Tuple[str, str], _Batch]" = OrderedDict()  # oldest kept first
_kept_lock = threading.Lock()


def _sweep_locked(now: float) -> None:
    for key in [key for key, batch in _kept.items() if batch.expires <= now]:
        del _kept[key]


def _keep(owner: str, batch_id: str, batch: _Batch) -> None:
    now = time.monotonic()
    # Past every job's answer_by the client collects nothing more: drop it then.
    batch.expires = now + BATCH_TTL_S if batch.give_up is None \
        else min(now + BATCH_TTL_S, batch.give_up)
    with _kept_lock:
        _sweep_locked(now)
        _kept[(owner, batch_id)] = batch
        _kept.move_to_end((owner, batch_id))
        mine = [key for key in _kept if key[0] == owner]
        for key in mine[:max(0, len(mine) - MAX_KEPT_PER_OWNER)]:
            del _kept[key]


def _answer(owner: str, batch_id: str, batch: _Batch) -> Reply:
    answers, more = batch.reply()
    if more:
        _keep(owner, batch_id, batch)
    return ["ok", [answers, more]]


def _batch_op(caller: Caller, request: Dict[str, Any]) -> Reply:
    """``["ok", [answers, more]]``: one reply per job (None for a job still
    running: collect it with ``collect``), ``more`` if any is."""
    owner = caller.owner
    try:
        batch_id = _ident("batch id", request.get("batch"))
        jobs = request.get("jobs")
        if not isinstance(jobs, list) or not 0 < len(jobs) <= MAX_JOBS:
            raise TypeError(f"jobs must be a list of 1 to {MAX_JOBS} jobs, got "
                            f"{type(jobs).__name__}")
        limits = []
        for job in jobs:
            if not isinstance(job, dict):
                raise TypeError(f"a job must be a dict, got {type(job).__name__}")
            limits.append(_answer_by(job.get("answer_by")))
        with _kept_lock:
            _sweep_locked(time.monotonic())
            if (owner, batch_id) in _kept:
                raise ValueError(f"batch id {batch_id!r} is in use: batch ids must be unique")
    except Exception as error:  # noqa: BLE001 - a request must never harm the server
        return ["error", error_text(error)]
    batch = _Batch(limits)
    # The byte limit bounds the whole request: what does not fit is refused
    # before anything runs (see server.admit_request).
    refused = admit_request(caller, jobs)

    def task(i: int, job: Any) -> Callable[[], None]:
        return lambda: batch.finish(i, run_job(caller, job))
    for i, text in enumerate(refused):
        if text is not None:
            batch.finish(i, ["error", text])
    tasks = [task(i, job) for i, job in enumerate(jobs) if refused[i] is None]
    if tasks:
        get_pool().submit(tasks)
    return _answer(owner, batch_id, batch)


def _collect_op(caller: Caller, request: Dict[str, Any]) -> Reply:
    """The answers of a batch that ``batch`` (or an earlier collect) left
    running, as ``batch`` replies."""
    owner = caller.owner
    try:
        batch_id = _ident("batch id", request.get("batch"))
        with _kept_lock:
            _sweep_locked(time.monotonic())
            batch = _kept.pop((owner, batch_id), None)
        if batch is None:
            raise LookupError(f"unknown batch {batch_id!r} of this client (answered "
                              f"already, or dropped after {BATCH_TTL_S:g} s without a collect)")
    except Exception as error:  # noqa: BLE001
        return ["error", error_text(error)]
    return _answer(owner, batch_id, batch)


def kept_batches() -> int:
    """How many partly answered batches this process keeps (tests, stats)."""
    with _kept_lock:
        _sweep_locked(time.monotonic())
        return len(_kept)


endpoint.register("batch", _batch_op)
endpoint.register("collect", _collect_op)
