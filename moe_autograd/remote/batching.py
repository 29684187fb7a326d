"""Coalesced, asynchronous remote calls: one request per server per pass.

Why: a remote call mostly waits. Sent one by one from pool workers, every call
of a pass costs a Python RPC of its own (about a millisecond of CPU over both
ends on loopback) and parks a worker thread that must be woken, take the GIL
and hand back. Here the calls of one pass (a ``parallel_apply``, a
``map_with_parallel_backward``, a ``MixtureOfExperts`` step; forward, and
again backward) are gathered by the runtime's collector hook (see
:mod:`moe_autograd.collect`), grouped by server into ONE request each
(:mod:`.batch_server` runs its calls concurrently there), sealed and sent
asynchronously through :mod:`.channel` and the transport seam, and completed
from the transport's callbacks: no thread waits per call, the caller alone
waits on its batch. Everything here sits above
:class:`~moe_autograd.remote.transport.Transport` (``call`` plus the
optional ``add_done_callback``), so another engine plugs in unchanged, and
imports nothing of the server's side.

Pieces:

* :class:`Job`: one call's part of a request (the single-call request it
  stands for, its deadline, how to read its answer). :class:`RemoteExpert`
  builds them; :func:`run_sync` runs one alone (a call outside a pass).
* :func:`send`: groups jobs by (transport, worker, secret) into :class:`_Request` s.
* the deadline watcher: ONE daemon thread ends every job whose deadline
  passes (``forward_timeout``/``backward_timeout``, or the transport's own
  timeout for a job without one).
* :class:`RemoteModuleCall`: the call record of a ``RemoteExpert`` in a pass,
  and :data:`COLLECTOR`, the runtime's collector for remote records and
  ``RemoteCall`` maps.

Lifecycle of one job in a request::

    state   event                                     what happens
    ------  ----------------------------------------  -----------------------------------
    open    its answer arrives (in a reply or in a    decoded -> completed with the result,
            collect's reply) before its deadline      or with the server's error
    open    its deadline passes (the watcher), or     abandoned (a stateful forward's state
            its answer arrives after it               released) -> RemoteTimeoutError
    open    the message cannot be sent / fails        RemoteExpertError (RemoteTimeoutError
            (peer dead, timeout, malformed reply,     for a timeout, which also abandons;
            refused, a reply failing authentication)  RemoteAuthError for a refusal)
    open    a reply says the server dropped the       as its deadline passing (the server
            batch (``more`` false, no answer)         does so only once every job's passed)
    ended   anything                                  ignored: a late answer is dropped
    (request) a reply says ``more`` and a job is      one ``collect`` for the rest
              open

A job's deadline is when its caller stops waiting for it: its own
``forward_timeout``/``backward_timeout``, or its pass's (a
``MixtureOfExperts``' ``forward_timeout`` or ``backward_timeout``, given to
the collector) if that comes first (``Job.answer_by``), else the transport's
own timeout. Nothing is kept open past it: a call that a layer masked ends
with the layer's wait, and its request's messages end one
:data:`GRACE_S` later at the latest (the server answers a collect only with
a new answer, or once every deadline of the request has passed, so a
collect loop never spins; issue 18).

Invariants:

* Per call, everything of a single-call request holds: the server runs each
  job as it runs a single ``forward``/``backward`` request (owner, 128-bit
  id, byte caps, quotas, validation before a state is taken), every error names the
  call's worker and expert, each call keeps its own deadline (a ready answer
  is not held back by a slower sibling, see :mod:`.batch_server`), and a
  failing call fails only itself. Byte limits are the exception: they bound
  the whole request (see :func:`~moe_autograd.remote.server.admit_request`).
* Deadlines are the client's, at the clock's resolution: a reply that
  arrives after its call's deadline is dropped, whatever the transport's
  own resolution (TensorPipe's is a millisecond).
* Each job is completed exactly once; completions run on the transport's
  threads (or the watcher's) and never block.
* Seeds are drawn as a call on a worker draws them (from the call's own
  random stream, forked on the caller in call order), so results do not
  depend on coalescing.
"""
import logging
import secrets
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..autograd import EmulatedAutogradContext
from ..module_call import ModuleCall
from ..rng import CallRng
from .auth import JobSecret
from .channel import request as send_request
from .deadlines import DeadlineWatch, per_process
from .errors import RemoteAuthError, RemoteExpertError, RemoteTimeoutError
from .transport import (Transport, TransportError, TransportSendError, TransportTimeout,
                        when_done)

__all__ = ["Job", "run_sync", "send", "RemoteModuleCall", "COLLECTOR", "GRACE_S"]

GRACE_S = 0.2  # how long a message outlives its last open job's deadline (its timeout)
Done = Callable[[int, Any, Optional[BaseException]], None]
_log = logging.getLogger(__name__)


class Job:
    """One call's part of a request: the message ``message`` (a dict whose
    ``"op"`` names the server's operation) to ``worker``, sealed with
    ``secret`` (None: the job's default).

    ``timeout`` is the call's own deadline in seconds (None: the transport's
    timeout); ``where()`` names the call in errors (``forward of expert 'e' on
    worker 'w'``) and ``limit()`` the transport's timeout; ``decode(value)``
    turns the server's ``["ok", value]`` into the call's result (raising
    :class:`RemoteExpertError` if malformed); ``abandon()``, if set, runs when
    the caller gives up on the call (deadline, Ctrl-C). ``deliver(job)``, if
    set, obtains the reply by the caller's own means instead of sending
    ``message`` to ``worker`` (a fleet's backward of a training expert goes to
    every replica: :mod:`.mirrored`); it raises as a sent request would."""

    __slots__ = ("transport", "worker", "message", "timeout", "where", "limit", "decode",
                 "abandon", "answer_by", "secret", "deliver")

    def __init__(self, transport: Transport, worker: str, message: Dict[str, Any],
                 timeout: Optional[float], where: Callable[[], str], limit: Callable[[], str],
                 decode: Callable[[Any], Any], abandon: Optional[Callable[[], None]] = None,
                 secret: Optional[JobSecret] = None) -> None:
        self.transport, self.worker, self.message = transport, worker, message
        self.timeout, self.where, self.limit = timeout, where, limit
        self.decode, self.abandon, self.secret = decode, abandon, secret
        #: When the caller needs the answer (its deadline, or the pass's if
        #: sooner): the server holds no ready answer back past it.
        self.answer_by = timeout
        self.deliver: Optional[Callable[["Job"], Any]] = None

    @property
    def op(self) -> str:
        return str(self.message.get("op", ""))

    def _deadline_text(self) -> str:
        return f"its {self.timeout:g} s deadline" if self.timeout is not None else self.limit()

    def failure(self, error: BaseException) -> RemoteExpertError:
        """The error of this call when its message failed with ``error``."""
        where = self.where()
        if isinstance(error, RemoteAuthError):
            return RemoteAuthError(f"{where} was refused: {error}")
        if isinstance(error, RemoteExpertError):
            return error
        if isinstance(error, TransportSendError):
            return RemoteExpertError(f"{where} could not be sent: {error}")
        if isinstance(error, TransportTimeout):
            return RemoteTimeoutError(f"{where} missed {self._deadline_text()} ({error})")
        return RemoteExpertError(f"{where} failed (is the worker alive and reachable?): {error}")

    def outcome(self, reply: Any) -> Any:
        """The call's result from its ``Reply``; raises its error."""
        if not (isinstance(reply, list) and len(reply) == 2):
            raise RemoteExpertError(f"{self.where()} got a malformed reply: {reply!r:.200}")
        status, value = reply
        if status != "ok":
            raise RemoteExpertError(f"{self.where()} failed on the server: {value}")
        return self.decode(value)


def run_sync(job: Job) -> Any:
    """Runs ``job`` alone and waits for it (Ctrl-C-able, see the transport).
    The deadline is the client's: the wait ends at it, and a reply that
    comes after it is dropped (the transport may round the deadline to its
    resolution, e.g. whole milliseconds for TensorPipe)."""
    start = time.monotonic()
    try:
        if job.deliver is not None:
            reply = job.deliver(job)  # (given the job, so it need not hold it: no cycle)
        else:
            pending = send_request(job.transport, job.worker, job.message, job.timeout,
                                   secret=job.secret, label=job.op)
            reply = pending.result(None if job.timeout is None
                                   else max(0.0, start + job.timeout - time.monotonic()))
        if job.timeout is not None and time.monotonic() - start > job.timeout:
            raise TransportTimeout(f"the reply came after {time.monotonic() - start:.6f} s "
                                   "and was dropped")
    except (TransportError, RemoteAuthError) as error:
        failure = job.failure(error)
        if isinstance(failure, RemoteTimeoutError) and job.abandon is not None:
            job.abandon()
        raise failure from error
    except (KeyboardInterrupt, SystemExit):
        if job.abandon is not None:
            job.abandon()
        raise
    return job.outcome(reply)


# -- the deadline watcher ----------------------------------------------------------
def _expire_jobs(request: "_Request", ks: Tuple[int, ...]) -> None:
    for k in ks:
        request.expire(k)


def _jobs_open(request: "_Request", ks: Tuple[int, ...]) -> bool:
    return any(request.open[k] for k in ks)


#: A request is held while it has open jobs (whatever the transport keeps of
#: it, its deadlines fire) and let go when its last job ends.
_watch = per_process(lambda: DeadlineWatch("moe_autograd-remote-deadlines", _expire_jobs,
                                           _jobs_open))


# -- requests -------------------------------------------------------------------------
def _default_timeout(transport: Transport) -> Optional[float]:
    get = getattr(transport, "default_timeout", None)
    return get() if get is not None else None


class _Request:
    """The jobs of one pass for one (transport, worker): see the module's
    lifecycle table."""

    __slots__ = ("jobs", "slots", "done", "transport", "worker", "batch_id", "open", "left",
                 "deadlines", "_lock", "__weakref__")

    def __init__(self, jobs: List[Job], slots: List[int], done: Done) -> None:
        self.jobs, self.slots, self.done = jobs, slots, done
        self.transport, self.worker = jobs[0].transport, jobs[0].worker
        self.batch_id = secrets.token_hex(16) if len(jobs) > 1 else None
        self.open = [True] * len(jobs)
        self.left = len(jobs)  # open jobs
        self.deadlines: List[Optional[float]] = []
        self._lock = threading.Lock()

    def send(self) -> None:
        _watch().hold(self)
        now = time.monotonic()
        default = None
        if any(job.answer_by is None for job in self.jobs):
            default = _default_timeout(self.transport)
        due: Dict[float, List[int]] = {}  # deadline -> the jobs it ends (one watcher entry each)
        for k, job in enumerate(self.jobs):
            # When the caller stops waiting: the call's own deadline, or its
            # pass's if sooner (answer_by); nothing is kept open past it.
            limit = job.answer_by if job.answer_by is not None else default
            deadline = None if limit is None else now + limit
            self.deadlines.append(deadline)
            if deadline is not None:
                due.setdefault(deadline, []).append(k)
        for deadline, ks in due.items():
            _watch().add(deadline, self, tuple(ks))
        if self.batch_id is None:
            self._call(self.jobs[0].message)
        else:
            self._call({"op": "batch", "batch": self.batch_id,
                        "jobs": [dict(job.message, answer_by=job.answer_by)
                                 for job in self.jobs]})

    def _timeout(self) -> Optional[float]:
        """The message's own timeout: until the last open job's deadline
        (plus grace: the watcher ends each job at its own), None if an open
        job has none."""
        deadlines = [d for d, o in zip(self.deadlines, self.open) if o]
        if any(d is None for d in deadlines):
            return None
        return max(0.001, max(deadlines) - time.monotonic() + GRACE_S)  # type: ignore[type-var, operator]

    def _call(self, message: Dict[str, Any]) -> None:
        timeout = self._timeout()
        first = self.jobs[0]
        op = message["op"]
        try:
            pending = send_request(self.transport, self.worker, message, timeout,
                                   secret=first.secret,
                                   label=op if op == first.op else f"{op}:{first.op}")
        except Exception as error:  # noqa: BLE001 - the calls fail, the caller goes on
            self._fail(error if isinstance(error, (TransportError, RemoteExpertError))
                       else TransportSendError(f"{type(error).__name__}: {error}"))
            return
        when_done(pending, self._on_reply, None if timeout is None else timeout + GRACE_S)

    def _end(self, k: int) -> bool:
        with self._lock:
            if not self.open[k]:
                return False
            self.open[k] = False
            self.left -= 1
            last = not self.left
        if last:
            _watch().let_go(self)
        return True

    def _deliver(self, k: int, value: Any, error: Optional[BaseException]) -> None:
        try:
            self.done(self.slots[k], value, error)
        except Exception:  # noqa: BLE001 - a completion must not kill the transport's thread
            _log.exception("completing a remote call failed")

    def _answer(self, k: int, reply: Any) -> None:
        deadline = self.deadlines[k]
        if deadline is not None and time.monotonic() > deadline:
            self.expire(k)  # late (the watcher has not run yet): dropped, a timeout
            return
        if not self._end(k):
            return  # late: the call timed out already
        try:
            value = self.jobs[k].outcome(reply)
        except Exception as error:  # noqa: BLE001 - this call's own error
            self._deliver(k, None, error)
            return
        self._deliver(k, value, None)

    def _fail(self, error: BaseException, only: Optional[Sequence[int]] = None) -> None:
        for k in (range(len(self.jobs)) if only is None else only):
            if not self._end(k):
                continue
            job = self.jobs[k]
            failure = job.failure(error)
            if isinstance(failure, RemoteTimeoutError) and job.abandon is not None:
                job.abandon()
            self._deliver(k, None, failure)

    def _fail_each(self, text: Callable[[Job], str]) -> None:
        for k, job in enumerate(self.jobs):
            if self._end(k):
                self._deliver(k, None, RemoteExpertError(text(job)))

    def _on_reply(self, reply: Any, error: Optional[BaseException]) -> None:
        if error is not None:
            self._fail(error)
            return
        if self.batch_id is None:
            self._answer(0, reply)
            return
        n = len(self.jobs)
        if not (isinstance(reply, list) and len(reply) == 2):
            self._fail_each(lambda job: f"{job.where()} got a malformed reply: {reply!r:.200}")
            return
        status, value = reply
        if status != "ok":
            self._fail_each(lambda job: f"{job.where()} failed on the server: {value}")
            return
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], list)
                and len(value[0]) == n):
            self._fail_each(lambda job: f"{job.where()} got a malformed reply: {value!r:.200}")
            return
        answers, more = value
        for k, answer in enumerate(answers):
            if answer is not None:
                self._answer(k, answer)
        if not any(self.open):
            return
        if more:
            self._call({"op": "collect", "batch": self.batch_id})
            return
        # The server dropped the batch: every open job's answer_by passed there.
        for k in range(n):
            if self.open[k]:
                self.expire(k)

    def expire(self, k: int) -> None:
        """The watcher: job ``k``'s deadline passed (or its late answer came)."""
        if not self._end(k):
            return
        job = self.jobs[k]
        if job.abandon is not None:
            job.abandon()
        if job.answer_by is not None and (job.timeout is None or job.answer_by < job.timeout):
            error = RemoteTimeoutError(
                f"{job.where()} was given up after {job.answer_by:g} s: its pass (e.g. a "
                "MixtureOfExperts' forward_timeout or backward_timeout) stopped waiting "
                "before the call's own deadline")
        else:
            seconds = job.timeout if job.timeout is not None else _default_timeout(self.transport)
            waited = f"no reply within {seconds:g} s" if seconds is not None else "no reply"
            error = RemoteTimeoutError(f"{job.where()} missed {job._deadline_text()} ({waited})")
        self._deliver(k, None, error)


def send(jobs: Sequence[Job], done: Done, deadline: Optional[float] = None) -> None:
    """Sends ``jobs`` as one request per (transport, worker, secret); ``done(i, value,
    error)`` completes ``jobs[i]``, once, from the transport's or the
    watcher's thread (or from here, for a request that cannot be sent).
    ``deadline``: when the caller stops waiting for all of them."""
    groups: Dict[Tuple[int, str, int], List[int]] = {}
    for i, job in enumerate(jobs):
        if deadline is not None and (job.answer_by is None or deadline < job.answer_by):
            job.answer_by = deadline
        groups.setdefault((id(job.transport), job.worker, id(job.secret)), []).append(i)
    for slots in groups.values():
        _Request([jobs[i] for i in slots], slots, done).send()


# -- the records of a pass, and the runtime's collector -------------------------------
def _peer(expert: Any) -> Tuple[int, str, int]:
    return id(expert.transport), expert.worker, id(expert.secret)


def _pipelined(n: int, peer: Callable[[int], Any], make: Callable[[int], Any], finish: Done,
               deadline: Optional[float]) -> None:
    """Builds the jobs of calls ``0..n-1`` and sends them one peer at a time,
    so that a server's request leaves while the next one is built.
    ``make(k)`` returns call ``k``'s :class:`Job`, or its result when there
    is nothing to send; ``finish(k, value, error)`` ends call ``k``."""
    by_peer: Dict[Any, List[int]] = {}
    for k in range(n):
        try:
            key = peer(k)
        except Exception:  # noqa: BLE001 - make(k) reports what is wrong with it
            key = None
        by_peer.setdefault(key, []).append(k)
    for ks in by_peer.values():
        jobs: List[Job] = []
        mine: List[int] = []
        for k in ks:
            try:
                job = make(k)
            except Exception as error:  # noqa: BLE001 - this call's own failure
                finish(k, None, error)
                continue
            if isinstance(job, Job):
                jobs.append(job)
                mine.append(k)
            else:
                finish(k, job, None)
        if jobs:
            def done(j: int, value: Any, error: Optional[BaseException],
                     mine: List[int] = mine) -> None:
                finish(mine[j], value, error)
            send(jobs, done, deadline)


class _Collector:
    """Starts remote calls of a pass as coalesced requests (the runtime's
    :class:`~moe_autograd.collect.Collector`)."""

    def start_calls(self, calls: Sequence[Any], complete: Callable[..., None],
                    deadline: Optional[float] = None) -> None:
        def finish(k: int, value: Any, error: Optional[BaseException]) -> None:
            call = calls[k]
            if error is None:
                try:
                    call._complete_forward(value)
                except Exception as failure:  # noqa: BLE001 - e.g. the caller's validate
                    error = failure
            complete(k, call if error is None else None, error)
        _pipelined(len(calls), lambda k: _peer(calls[k].module),
                   lambda k: calls[k]._forward_job(), finish, deadline)

    def start_applies(self, func: Any, args: Sequence[Tuple[Any, ...]],
                      complete: Callable[..., None]) -> None:
        def finish(k: int, value: Any, error: Optional[BaseException]) -> None:
            if error is None:
                try:
                    a = args[k]
                    ctx = EmulatedAutogradContext(
                        tuple([isinstance(x, Tensor) and x.requires_grad for x in a]))
                    detached = [x.detach().requires_grad_(x.requires_grad)
                                if isinstance(x, Tensor) else x for x in a]
                    outputs, diff = value
                    func._fill_ctx(ctx, detached[0], detached[2:], outputs, diff)
                    # what run_isolated_forward leaves on a map's context
                    ctx._inputs = detached  # type: ignore[attr-defined]
                    ctx._seal()
                    complete(k, (ctx, tuple(outputs)), None)
                    return
                except Exception as failure:  # noqa: BLE001
                    error = failure
            complete(k, None, error)
        _pipelined(len(args), lambda k: _peer(args[k][0].expert),
                   lambda k: func._forward_job(args[k]), finish, None)

    def start_backwards(self, calls: Sequence[Any], grads: Sequence[Any],
                        complete: Callable[..., None], deadline: Optional[float] = None) -> None:
        def expert(k: int) -> Any:
            call = calls[k]
            return call.module if isinstance(call, RemoteModuleCall) else call.ctx.call.expert

        def make(k: int) -> Any:
            call = calls[k]
            if isinstance(call, RemoteModuleCall):
                return call._backward_job(grads[k])
            # a map's record of RemoteCall: its emulated ctx (a Job, or the
            # result itself when no output needed a gradient)
            if call.ctx is None:
                raise RuntimeError(f"{call.func.__name__}: backward after its state was freed")
            return call.func._backward_job(call.ctx, grads[k])
        _pipelined(len(calls), lambda k: _peer(expert(k)), make, complete, deadline)


#: The collector of remote records (``RemoteModuleCall.collector``) and of
#: ``RemoteCall`` maps (``RemoteCall.moe_collector``).
COLLECTOR = _Collector()


_specs: dict = {}


def _output_spec(n: int) -> Any:
    """The pytree spec of a lone tensor (``n = -1``) or of a tuple of ``n``."""
    spec = _specs.get(n)
    if spec is None:
        dummy = torch.empty(0)
        spec = _specs[n] = tree_flatten(dummy if n < 0 else (dummy,) * n)[1]
    return spec


class RemoteModuleCall(ModuleCall):
    """The record of one ``RemoteExpert`` call in a pass (the expert's
    ``moe_call_type``): started by :data:`COLLECTOR`, with no local graph.

    Its ``inputs`` are the caller's tensors that require grad (the expert's
    parameters live on the server); its ``outputs`` the reply's tensors;
    ``backward`` sends the output gradients (the stateless inputs too) and
    returns the input gradients. A call the collector cannot carry exactly
    (keyword arguments, tensors nested in an argument that require grad) has
    ``collector`` None and runs as a plain :class:`ModuleCall` on a worker,
    as does a record that the runtime runs on a worker (``forward()``).
    """

    collector: Any = COLLECTOR

    def __init__(self, module: Any, args: Tuple[Any, ...], kwargs: Any, **options: Any) -> None:
        super().__init__(module, args, kwargs, **options)
        self._grad = torch.is_grad_enabled()
        self._remote: Any = None  # the client's _Call once sent
        self._diff: List[bool] = []
        self._single = True  # the expert returned one tensor (not a tuple)
        self._positions = [k for k, a in enumerate(args)
                           if isinstance(a, Tensor) and a.requires_grad]
        # Arguments that are all leaves of their own (tensors, scalars): the
        # detached leaves are the arguments, in order (no pytree on the way).
        # (Not a count: ``[x]`` is one argument of one leaf, but a list.)
        self._flat = all(child.is_leaf() for child in self._in_spec.child(0).children())
        if kwargs or self.checkpoint or len(self._positions) != len(self.inputs):
            self.collector = None

    # -- run on a worker (not collected) ------------------------------------------------
    def forward(self) -> "ModuleCall":
        self.collector = None  # its backward runs on a worker too, through its graph
        return super().forward()

    # -- collected ------------------------------------------------------------------------
    def _args(self) -> List[Any]:
        assert self._leaves is not None
        if self._flat:
            return list(self._leaves)
        args, _ = tree_unflatten(self._leaves, self._in_spec)
        return list(args)

    def _forward_job(self) -> Job:
        with self.rng.activate():  # the seed a call on a worker draws (RemoteExpert.forward)
            seed = CallRng.fork().seed
        expert: Any = self.module  # a RemoteExpert (this record is its moe_call_type)
        call = expert._new_call(seed)
        job: Job = expert._forward_job(call, self._args(), self._grad)
        self._remote = call
        return job

    def _complete_forward(self, value: Tuple[List[Tensor], List[bool]]) -> None:
        outputs, diff = value
        self._diff = list(diff)
        self.outputs = outputs
        self.non_differentiable = [o for o, d in zip(outputs, diff) if not d]
        self._out_leaves = outputs
        self._single = self._remote.single
        self._out_spec = _output_spec(-1 if self._single else len(outputs))
        if self.validate is not None:
            self.validate(self)

    def rebuild(self, outer_outputs: Sequence[Tensor]) -> Any:
        if self.collector is None:
            return super().rebuild(outer_outputs)
        return outer_outputs[0] if self._single else tuple(outer_outputs)

    @property
    def needs_grad(self) -> bool:
        if self.collector is None:
            return super().needs_grad
        return torch.is_grad_enabled() and any(self._diff)

    def prepare(self) -> None:
        if self.collector is None:
            super().prepare()  # the parameters its graph reaches (none: the server has them)

    def _backward_job(self, grads: Sequence[Optional[Tensor]]) -> Job:
        call = self._remote
        if call is None or self._leaves is None:
            raise RuntimeError(f"{self.name}: backward after its graph was freed")
        args = None if call.mode == "stateful" else self._args()
        expert: Any = self.module
        job: Job = expert._backward_job(call, args, grads)
        return job

    def backward(self, grad_outputs: Any) -> Any:
        if self.collector is None:
            return super().backward(grad_outputs)
        return run_sync(self._backward_job(grad_outputs))

    def input_grads(self, raw: Any) -> List[Optional[Tensor]]:
        if self.collector is None:
            return raw  # type: ignore[no-any-return]
        grads: List[Optional[Tensor]] = []
        for k, inp in zip(self._positions, self.inputs):
            g = raw[k] if k < len(raw) else None
            grads.append(None if g is None else g.to(inp.device))
        if self.check_finite_grads:
            for g in grads:
                if g is not None and not bool(torch.isfinite(g).all()):
                    raise FloatingPointError(f"{self.name}: non-finite gradient")
        return grads

    def release(self) -> None:
        super().release()
        self._remote = None  # an unused stateful call's finalizer releases its state
