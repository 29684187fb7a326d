"""``ExpertServer``: makes modules callable by name by the members of a job.

Why: experts that do not fit on (or are owned by) the training process live in
other processes or machines. A server registers its experts in this process;
clients (:class:`~moe_autograd.remote.RemoteExpert`) reach them through the
process's endpoint (:mod:`.endpoint`), which hands each authenticated request
to the operations registered here: ``forward``, ``backward``, ``control``,
``release`` and ``info`` (and :mod:`.batch_server`'s ``batch`` and
``collect``, which run the same forward and backward jobs).

Backward strategies (chosen per server):

* ``stateless`` (default): nothing is kept between forward and backward; the
  client sends the inputs back with the output gradients and the server
  recomputes the forward under the same seed (dropout masks replayed).
* ``stateful``: the forward's graph is kept under the client's call id in a
  :class:`~moe_autograd.remote.state.StateStore` (see its lifecycle table:
  states are owned by the client that created them, bounded per client and in
  all), freed at backward, on release by the owner, past ``state_ttl``, or
  when evicted by the quota policy.

Compression: a job whose request names a codec (``"compression"``, set by
the client's ``RemoteExpert(..., compression=...)``) gets its outputs (forward)
and input gradients (backward) back in that codec (:mod:`.compression`);
what arrived compressed was decoded by :mod:`.wire` before any handler here
runs, so the limits below count tensors at their decoded size.
(Before it is decoded, a request is bounded by :func:`_job_budget`: see
:mod:`.endpoint`; its compressed tensors, decoded, fit the job's budget.)

Who may do what: a server serves the jobs whose secrets it was given
(``secret=``, default the job's: :func:`~.auth.job_secret`); a request sealed
with another secret is refused by the gate before it is read, and a member of
one job cannot reach the experts of another job served in the same process.
A call's owner is the authenticated session that made it (its job and 128
random bits, :class:`~.auth.Caller`), never a name the client declares:
only that session can run the call's backward or release its state, and
stateful call ids are 128 more random bits.

Invariants:

* A handler here never raises: every error (unknown expert, malformed
  request, wrong shapes or dtypes, an expert that raises) becomes an
  ``["error", text]`` reply naming the expert, so one bad request never harms
  the server or another client's states.
* A request's tensors are measured before anything runs, by the bytes the
  server will materialise (``numel * element_size``: a stride-0 expanded
  tensor counts at full size; :mod:`.sizes`): above ``max_request_bytes`` it
  is refused. The limit bounds a whole request: the jobs of a coalesced one
  (:mod:`.batch_server`) are counted each on its own (a tensor two jobs share
  counts twice, as both materialise it) and admitted in order while they fit
  (:func:`admit_request`). A stateful state counts the same way (inputs and
  outputs) against ``max_state_bytes``.
* A backward is validated completely (owner, expert, gradient count, shapes
  and dtypes) before its state is taken: a refused backward leaves the state
  usable by its owner.
* Parameters change only by a complete operation of a member of the job:
  ``load_state_dict`` checks keys, types and shapes first and restores the old
  values if loading still fails; an optimizer step whose gradients are not
  all finite is skipped (``non_finite_grads="skip"``, reported in the reply and
  ``stats()``) or refused with an error (``"raise"``); the gradients are
  zeroed either way under ``auto_step``.
* Requests overlap freely (one transport thread each); only an expert with an
  optimizer in ``auto_step`` mode serialises its backward+step (a stateless
  backward recomputes under the same lock, so no step lands between its
  recomputation and its backward), and an expert that batches across calls
  runs one group of calls at a time (:mod:`.gather`).
* Batching across calls (``batch_across_calls``, opted in per expert, which
  must be row-wise) changes how calls run, never what a call can see or
  what it is answered: each call is checked in its own request's thread
  exactly as alone (job, owner, ids, byte limits) before it joins a group;
  a group runs only calls of one key (:func:`~.gather.row_key`) of one
  expert, whichever jobs and sessions they come from, and each call gets
  its own rows back; a group whose run fails, draws random numbers or
  returns outputs that are not row-wise in shape runs again one call at a
  time, so each call gets the answer (or error) it would get alone (after
  the latter two, the expert's calls are not batched again), and a
  parameter gradient is accumulated only by a run that succeeded. Only
  forwards that keep no graph and stateless backwards without
  ``auto_step`` are batched.
* After :meth:`ExpertServer.close` returns, its experts are unknown here, its
  states are freed, and its secrets no longer open requests (unless another
  server of this process has them).
"""
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn

from ..rng import CallRng
from . import endpoint
from . import execution as ex
from .compression import CODECS, Compressed
from .durable import ExpertState, SnapshotError, Snapshots, open_state, state_bytes
from .lineage import Version, after, check_fence, root
from .auth import Caller, JobSecret, refuse, resolve_secret, security_stats
from .endpoint import Reply, error_text
from .gather import Gatherer, NotRowWise, Task, concat_rows, row_key, split_rows
from .sizes import Tally, materialised_bytes
from .state import CallState, StateStore
from .transport import Transport, get_transport

__all__ = ["ExpertServer", "run_job", "admit_request", "set_host_info", "host_info", "JOB_OPS",
           "BACKWARDS", "NON_FINITE_POLICIES"]

OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
Secrets = Union[None, JobSecret, Sequence[JobSecret]]
BatchChoice = Union[bool, Sequence[str]]
BACKWARDS = ("stateless", "stateful")
NON_FINITE_POLICIES = ("skip", "raise")
JOB_OPS = ("forward", "backward")
MiB = 1 << 20
_MAX_ID_CHARS = 256     # call ids and names longer than this are refused
_MAX_RELEASE_IDS = 1 << 16  # call ids in one release request
_CONTROL = ("step", "zero_grad", "grads", "state_dict", "load_state_dict", "stats", "snapshot",
            "restore", "version")
#: How long a fenced call waits for its expert to reach the version it
#: names (a mirrored backward still on its way) before it is refused.
FENCE_WAIT_S = 5.0
_FORWARD_TRIES = 3  # a fenced forward that a step overtook runs again, this often
_log = logging.getLogger(__name__)


@dataclass
class _Hosted:
    name: str
    module: nn.Module
    server: "ExpertServer"
    optimizer: Optional[torch.optim.Optimizer]
    lock: threading.Lock = field(default_factory=threading.Lock)
    skipped_steps: int = 0  # steps skipped for non-finite gradients (under ``lock``)
    steps: int = 0  # optimizer steps applied (under ``lock``; kept in snapshots)
    gather: Optional[Gatherer] = None  # batching across calls (opted in), see .gather
    alone: Optional[str] = None  # why its calls no longer join batches (set once)
    digest: str = ""  # its history (.lineage); "" until first needed (under ``lock``)
    changed: threading.Condition = field(init=False)  # on ``lock``: its version moved

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    @property
    def training(self) -> bool:
        """Whether every backward changes it (an optimizer under ``auto_step``)."""
        return self.optimizer is not None and self.server.auto_step

    def version(self) -> Version:
        """``(count, digest)`` of its state (:mod:`.lineage`). Needs ``lock``."""
        if not self.digest:
            self.digest = root(self.module.state_dict(), self.optimizer.state_dict()
                               if self.optimizer is not None else None)
        return self.steps + self.skipped_steps, self.digest

    def advanced(self, change: str) -> None:
        """Its version after a backward (or a step) applied. Needs ``lock``."""
        if self.digest:
            self.digest = after(self.digest, change)
        self.changed.notify_all()


_experts: Dict[str, _Hosted] = {}
_registry_lock = threading.Lock()
_host: Dict[str, Any] = {"state": "serving"}  # what info() says of this process


def set_host_info(**fields: Any) -> None:
    """What this process's ``info`` operation reports besides its experts
    (``state``: ``"serving"`` or ``"draining"``; a host adds e.g. its node)."""
    with _registry_lock:
        _host.update(fields)


def host_info() -> Dict[str, Any]:
    with _registry_lock:
        return dict(_host)


def _positive_bytes(name: str, value: Optional[int]) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive number of bytes or None, got {value!r}")
    return value


def _batched_names(choice: BatchChoice, experts: Mapping[str, nn.Module]) -> Set[str]:
    """The experts ``batch_across_calls`` opts in: all (True), none (False),
    or those named (each must be one of ``experts``)."""
    if isinstance(choice, bool):
        return set(experts) if choice else set()
    if isinstance(choice, str) or not all(isinstance(n, str) for n in choice):
        raise TypeError("batch_across_calls must be a bool or a list of expert names, got "
                        f"{choice!r:.80}")
    unknown = sorted(set(choice) - set(experts))
    if unknown:
        raise ValueError(f"batch_across_calls names experts {unknown} that this server does "
                         f"not serve ({sorted(experts)})")
    return set(choice)


def _secrets(secret: Secrets) -> List[JobSecret]:
    if secret is None or isinstance(secret, JobSecret):
        return [resolve_secret(secret)]
    found = [resolve_secret(s) for s in secret]
    if not found:
        raise ValueError("secret must be a JobSecret, a non-empty list of them, or None")
    return found


class ExpertServer:
    """Serves ``experts`` (name -> module) to the members of a job until :meth:`close`.

    Construct it before or after the engine starts (before: the experts are
    there from the first request a peer can send). ``secret``: the job's
    :class:`~moe_autograd.remote.JobSecret` (default: the process's, from
    ``MOE_AUTOGRAD_SECRET_FILE``), or several, to serve several jobs (each
    job's clients own their calls; all may call every expert here).
    ``optimizer`` is a factory ``params -> Optimizer`` (one optimizer per
    expert); with ``auto_step`` the server steps and zeroes the gradients
    after every backward (hivemind style, asynchronous SGD); without it
    clients call :meth:`RemoteExpert.step` / :meth:`RemoteExpert.zero_grad`.
    Without an optimizer, parameter gradients accumulate into ``.grad`` as
    local autograd would, before the client's backward returns.

    Limits (``None`` disables one):

    * ``max_request_bytes`` (256 MiB): the tensors of one request (a
      coalesced request of many calls counts as one, each call's tensors
      counted for it), as the server will materialise them (stride-0
      tensors at full size), wherever they are nested in the arguments;
    * ``max_states`` (1024) and ``max_state_bytes`` (1 GiB): what a
      ``stateful`` server holds in all (a state counts its inputs and outputs
      at materialised size), and ``max_states_per_client`` (default
      ``max_states``) what one client holds. A client past its own quota
      loses its own oldest state; a full server evicts the oldest state of
      the client holding the most (the newcomer itself on a tie), so one
      client's volume never pushes out the states of a client that holds no
      more than it does.

    ``non_finite_grads`` (``"skip"`` or ``"raise"``): what an optimizer step
    does when a parameter gradient is NaN or infinite: skip the step (the
    reply says so and the client warns; ``stats()["skipped_steps"]`` counts
    it) or fail the request. The parameters are left untouched either way.

    Durable state (:mod:`.durable`): with ``state_dir``, each expert resumes
    from its newest complete snapshot there (weights, optimizer state, steps)
    before the first request can reach it, and its state is saved every
    ``save_every`` optimizer steps and/or every ``save_interval`` seconds
    (checked at each step), and when the server closes. One live server
    owns an expert's snapshots in a directory: a second is refused.
    """

    def __init__(self, experts: Mapping[str, nn.Module], *, backward: str = "stateless",
                 optimizer: Optional[OptimizerFactory] = None, auto_step: bool = True,
                 state_ttl: float = 60.0, max_states: int = 1024,
                 max_states_per_client: Optional[int] = None,
                 max_request_bytes: Optional[int] = 256 * MiB,
                 max_state_bytes: Optional[int] = 1024 * MiB,
                 non_finite_grads: str = "skip", secret: Secrets = None,
                 batch_across_calls: BatchChoice = False, batch_window: float = 0.0,
                 max_batch_rows: Optional[int] = None,
                 transport: Optional[Transport] = None, state_dir: Optional[str] = None,
                 save_every: Optional[int] = None,
                 save_interval: Optional[float] = None) -> None:
        if backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
        if non_finite_grads not in NON_FINITE_POLICIES:
            raise ValueError(f"non_finite_grads must be one of {NON_FINITE_POLICIES}, "
                             f"got {non_finite_grads!r}")
        for name, module in experts.items():
            if not isinstance(name, str) or not isinstance(module, nn.Module):
                raise TypeError(f"experts must map str to nn.Module, got {name!r}: {type(module)}")
        batched = _batched_names(batch_across_calls, experts)
        if not (isinstance(batch_window, (int, float)) and not isinstance(batch_window, bool)
                and 0 <= batch_window <= 60.0):  # also refuses nan
            raise ValueError(f"batch_window must be seconds in [0, 60], got {batch_window!r}")
        if max_batch_rows is not None and (isinstance(max_batch_rows, bool) or not isinstance(
                max_batch_rows, int) or max_batch_rows < 1):
            raise ValueError(f"max_batch_rows must be a positive int or None, got "
                             f"{max_batch_rows!r}")
        self.secrets = _secrets(secret)
        self.jobs: Set[bytes] = {s.key_id for s in self.secrets}
        self.max_request_bytes = _positive_bytes("max_request_bytes", max_request_bytes)
        self.non_finite_grads = non_finite_grads
        self.store = StateStore(state_ttl, max_states, max_states_per_client=max_states_per_client,
                                max_bytes=_positive_bytes("max_state_bytes", max_state_bytes)
                                ) if backward == "stateful" else None
        self._transport = transport or get_transport()
        ex.warm_up()
        self.backward, self.auto_step = backward, auto_step and optimizer is not None
        self._closed = threading.Event()
        self._busy = 0
        self._idle = threading.Condition()
        self._served = {"forward": 0, "backward": 0, "failed": 0}  # under _idle
        hosted = {name: _Hosted(name, module, self,
                                optimizer(module.parameters()) if optimizer else None,
                                gather=Gatherer(float(batch_window), max_batch_rows)
                                if name in batched else None)
                  for name, module in experts.items()}
        self.batched: List[str] = [name for name in experts if name in batched]
        self.batch_window, self.max_batch_rows = float(batch_window), max_batch_rows
        self.snapshots: Optional[Snapshots] = None
        #: Where each expert's state came from, if not from its factory
        #: (``"snapshot PATH (step N)"``, ``"peer W (step N)"``), and its step then.
        self.resumed: Dict[str, str] = {}
        self.resumed_steps: Dict[str, int] = {}
        if state_dir is not None:  # resumed before any request can reach them
            self.snapshots = Snapshots(state_dir, list(hosted), self.secrets[0],
                                       save_every=save_every, save_interval=save_interval)
            try:
                for h in hosted.values():
                    _resume(h, self.snapshots)
            except BaseException:
                self.snapshots.close()
                raise
        elif save_every is not None or save_interval is not None:
            raise ValueError("save_every and save_interval need a state_dir")
        for h in hosted.values():  # the root of its history, before any step
            if h.training:
                with h.lock:
                    h.version()
        with _registry_lock:
            taken = sorted(set(hosted) & set(_experts))
            if not taken:
                _experts.update(hosted)
        if taken:
            if self.snapshots is not None:
                self.snapshots.close()  # (nothing was saved: their folders are free again)
            raise ValueError(f"experts {taken} are already served in this process")
        endpoint.gate().admit(self.secrets)
        self._hosted = list(hosted.values())
        self.names: List[str] = list(hosted)
        if self.store is not None:
            interval = min(max(self.store.ttl / 4, 0.05), 1.0)
            threading.Thread(target=self._sweep, args=(interval,), daemon=True,
                             name="moe_autograd-state-sweeper").start()

    @property
    def worker(self) -> str:
        """This process's worker name (``"?"`` before the engine starts)."""
        try:
            return self._transport.local_name()
        except Exception:  # noqa: BLE001
            return "?"

    def _sweep(self, interval: float) -> None:
        while not self._closed.wait(interval):
            assert self.store is not None
            self.store.sweep()

    def _enter(self) -> None:
        with self._idle:
            if self._closed.is_set():
                raise RuntimeError("the expert server is closed")
            self._busy += 1

    def _exit(self) -> None:
        with self._idle:
            self._busy -= 1
            if self._closed.is_set():  # only close() waits for the requests in flight
                self._idle.notify_all()

    def _count(self, op: str, ok: bool) -> None:
        with self._idle:
            self._served[op if ok else "failed"] += 1

    def served(self) -> Dict[str, int]:
        """Forward and backward calls answered so far, and calls that failed
        (an error reply: the expert raised, a bad or refused request)."""
        with self._idle:
            return dict(self._served)

    def stats(self) -> Dict[str, Any]:
        """Live states and counters (``live`` is 0 for a stateless server);
        ``served``: :meth:`served`;
        ``skipped_steps``: optimizer steps skipped for non-finite gradients;
        ``auth_refused``: requests this process refused (by reason, see
        :func:`~moe_autograd.remote.security_stats`; a stateful server's
        ``refused`` counts its state store's refusals)."""
        base: Dict[str, Any] = {"worker": self.worker, "backward": self.backward,
                                "in_flight": self._busy, "experts": list(self.names),
                                "skipped_steps": sum(h.skipped_steps for h in self._hosted),
                                "non_finite_grads": self.non_finite_grads,
                                "auth_refused": security_stats()["refused"],
                                "served": self.served(), "batch_across_calls": list(self.batched)}
        base.update(self.batch_stats())
        base.update(self.store.stats() if self.store is not None else {"live": 0})
        return base

    def batch_stats(self) -> Dict[str, int]:
        """Batching across calls, summed over this server's experts (zeros
        when none opted in): ``batches``, kernel runs that served two calls
        or more; ``batched_calls``, the calls they served; ``unbatched_calls``,
        calls of opted-in experts that ran alone (nothing else pending of their
        key, no key: see :func:`~.gather.row_key`, or not batched at all:
        stateful, auto_step backwards); every call of an opted-in expert that
        ran counts once, in one of the two; ``batch_fallbacks``,
        groups that ran one by one after all (an error in the batch, outputs
        not row-wise, random numbers drawn)."""
        total = {"batches": 0, "batched_calls": 0, "unbatched_calls": 0, "batch_fallbacks": 0}
        for hosted in self._hosted:
            if hosted.gather is not None:
                for key, value in hosted.gather.stats().items():
                    total[key] += value
        return total

    def restore(self, name: str, state: ExpertState, source: str) -> int:
        """Makes ``state`` expert ``name``'s whole state (weights, optimizer
        state, steps) or changes nothing, logs where it came from (``source``,
        e.g. ``"peer server_b"``) and saves it when this server keeps
        snapshots; returns its steps."""
        hosted = self._hosted_named(name)
        with hosted.lock:
            _apply_state(hosted, state, f"the state of {source}")
            if self.snapshots is not None:
                self.snapshots.save(name, _captured(hosted))
            steps = hosted.steps
        self.resumed[name] = f"{source} (step {steps})"
        self.resumed_steps[name] = steps
        _log.info("expert %r resumed from %s (step %d)", name, source, steps)
        return steps

    def _hosted_named(self, name: str) -> _Hosted:
        hosted = next((h for h in self._hosted if h.name == name), None)
        if hosted is None:
            raise LookupError(f"this server does not serve expert {name!r} ({self.names})")
        return hosted

    def version(self, name: str) -> Optional[Tuple[int, str]]:
        """Expert ``name``'s version (:mod:`.lineage`), or None if it does
        not train (no optimizer under ``auto_step``)."""
        hosted = self._hosted_named(name)
        if not hosted.training:
            return None
        with hosted.lock:
            return hosted.version()

    def snapshot(self, name: str) -> ExpertState:
        """A copy of expert ``name``'s whole state (what a peer transfer sends)."""
        hosted = self._hosted_named(name)
        with hosted.lock:
            state = _captured(hosted)
            return ExpertState(_copied(state.module), _copied(state.optimizer), state.steps,
                               state.skipped_steps, lineage=state.lineage)

    def close(self, timeout: float = 10.0) -> None:
        """Stops serving: new requests fail at once, requests in flight get up
        to ``timeout`` seconds to finish, states are freed. Idempotent."""
        with _registry_lock:
            for name in self.names:
                if _experts.get(name) is not None and _experts[name].server is self:
                    del _experts[name]
        with self._idle:
            first = not self._closed.is_set()
            self._closed.set()
            self._idle.wait_for(lambda: self._busy == 0, timeout)
        if first:
            endpoint.gate().dismiss(self.secrets)
            if self.snapshots is not None:  # a clean leave: every expert's last state
                for h in self._hosted:
                    with h.lock:
                        self.snapshots.save(h.name, _captured(h))
                self.snapshots.close()
        if self.store is not None:
            self.store.clear()

    def __enter__(self) -> "ExpertServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- requests ------------------------------------------------------------------------------
def _lookup(caller: Caller, name: Any) -> _Hosted:
    if not isinstance(name, str):
        raise TypeError(f"expert name must be a str, got {type(name).__name__}")
    with _registry_lock:
        hosted = _experts.get(name)
    if hosted is None or caller.key_id not in hosted.server.jobs:
        with _registry_lock:
            mine = sorted(n for n, h in _experts.items() if caller.key_id in h.server.jobs)
        if hosted is not None:  # another job's expert: as unknown, and counted
            endpoint.gate().refuse("unknown job", f"job {caller.job} asked for expert "
                                                  f"{name!r} of another job")
        raise LookupError(f"unknown expert {name!r}; this worker serves "
                          f"{mine or 'no experts'} to this job")
    return hosted


def _guarded(caller: Caller, name: Any, fn: Callable[[_Hosted], Any]) -> Reply:
    try:
        hosted = _lookup(caller, name)
        server = hosted.server
        server._enter()
        try:
            return ["ok", fn(hosted)]
        finally:
            server._exit()
    except Exception as error:  # noqa: BLE001 - a request must never harm the server
        return ["error", error_text(error, tail=True)]


def _ident(what: str, value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_ID_CHARS:
        raise TypeError(f"{what} must be a non-empty str of at most {_MAX_ID_CHARS} "
                        f"characters, got {value!r:.80}")
    return value


def _field(job: Dict[str, Any], key: str, kinds: Any, what: str) -> Any:
    value = job.get(key)
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in (
            kinds if isinstance(kinds, tuple) else (kinds,)):
        raise TypeError(f"{what}: field {key!r} must be {getattr(kinds, '__name__', kinds)}, "
                        f"got {type(value).__name__}")
    return value


def _check_request_size(hosted: _Hosted, what: str, *parts: Any) -> None:
    limit = hosted.server.max_request_bytes
    if limit is None:
        return
    size = materialised_bytes(*parts)
    if size > limit:
        raise MemoryError(f"{what} request of expert {hosted.name!r} carries tensors of "
                          f"{size} bytes once materialised, more than max_request_bytes="
                          f"{limit} of this server (expanded/stride-0 tensors count at "
                          "their full size, nested ones too)")


def _job_budget(caller: Caller) -> Optional[int]:
    """What one request of the caller's job may declare here before it is
    decoded (:func:`.endpoint.request_limits`): the sum of ``max_request_bytes``
    of this process's servers of the job (:func:`admit_request` admits no more),
    ``None`` where one of them has none (or none serves the job)."""
    with _registry_lock:
        servers = {id(h.server): h.server for h in _experts.values()
                   if caller.key_id in h.server.jobs}
    limits = [server.max_request_bytes for server in servers.values()]
    return None if not limits or None in limits else sum(x for x in limits if x is not None)


def _job_tensors(job: Any) -> List[Any]:
    """What a job's call materialises: its arguments and output gradients."""
    if not isinstance(job, dict):
        return []
    return [job.get("args"), job.get("grads")]


def admit_request(caller: Caller, jobs: Sequence[Any]) -> List[Optional[str]]:
    """The byte limit of a coalesced request, applied to the whole of it:
    ``jobs`` are its job dicts in request order; returns, per job, ``None``
    (admitted) or the error text of a job that would take the bytes its
    server's jobs in this request materialise past its ``max_request_bytes``.
    Each job is counted on its own (every tensor its arguments and gradients
    reach, once; a tensor two jobs share counts for both), the jobs of each
    :class:`ExpertServer` added up in order while they fit; a job that does
    not fit is refused alone (a later, smaller one may still fit). Unknown
    experts are left to fail on their own. Runs nothing."""
    totals: Dict[int, int] = {}
    verdicts: List[Optional[str]] = []
    for job in jobs:
        name = job.get("expert") if isinstance(job, dict) else None
        op = job.get("op") if isinstance(job, dict) else None
        with _registry_lock:
            hosted = _experts.get(name) if isinstance(name, str) else None
        if hosted is None or caller.key_id not in hosted.server.jobs:
            verdicts.append(None)
            continue
        limit = hosted.server.max_request_bytes
        tally = Tally()
        try:
            tally.add(*_job_tensors(job))
        except ValueError as error:
            verdicts.append(f"ValueError: {op} request of expert {hosted.name!r}: {error}")
            continue
        before = totals.get(id(hosted.server), 0)
        if limit is not None and before + tally.total > limit:
            verdicts.append(
                f"MemoryError: {op} request of expert {hosted.name!r} carries {tally.total} "
                f"bytes of tensors once materialised; with the {before} bytes of the calls "
                f"admitted before it in the same request, more than max_request_bytes={limit} "
                "of this server (the limit bounds a whole request; expanded/stride-0 tensors "
                "count at their full size, and a tensor several calls share counts for each)")
            continue
        totals[id(hosted.server)] = before + tally.total
        verdicts.append(None)
    return verdicts


def _codec(job: Dict[str, Any], where: str) -> Optional[str]:
    """The codec a job's reply travels in (its ``compression`` field; absent: raw)."""
    codec = job.get("compression")
    if codec is not None and codec not in CODECS:
        raise ValueError(f"{where}: unknown compression {codec!r:.40}; one of {CODECS}")
    return codec  # type: ignore[no-any-return]


def _packed(values: Sequence[Optional[Tensor]], codec: Optional[str]) -> List[Any]:
    """Tensors of a reply, marked for ``codec`` (:mod:`.compression`)."""
    out = [ex.to_wire(v) for v in values]
    if codec is None:
        return out
    return [Compressed(v, codec) if v is not None and v.is_floating_point() else v for v in out]


def _call_fields(hosted: _Hosted, job: Dict[str, Any]) -> Tuple[str, str, int, List[Any]]:
    """What every call's job names: ``(where, call id, seed, flags)``."""
    where = f"{job.get('op')} of expert {hosted.name!r}"
    return (where, _ident("call id", job.get("call")), _field(job, "seed", int, where),
            _field(job, "flags", list, where))


def _forward(hosted: _Hosted, caller: Caller, job: Dict[str, Any]) -> List[Any]:
    """A forward; fenced (``fence``: run only at that version, or past it)
    and/or asked to report the version it ran at (``version``: the reply
    gets ``[training, count, digest]`` appended, see :mod:`.mirrored`)."""
    where = f"forward of expert {hosted.name!r}"
    fence = check_fence(job.get("fence"), where)
    report = job.get("version") is True
    if fence is None and not report:
        return _forward_once(hosted, caller, job)
    if not hosted.training:
        return [*_forward_once(hosted, caller, job), [False, 0, ""]]
    if job.get("grad") is True and hosted.server.store is not None:  # keeps a graph: once
        with hosted.lock:
            if fence is not None:
                _wait_for(hosted, fence, where, exact=False)
            count, digest = hosted.version()
            reply = _forward_once(hosted, caller, job)
        return [*reply, [True, count, digest]] if report else reply
    for _ in range(_FORWARD_TRIES):  # no lock held while it runs (forwards overlap)
        with hosted.lock:
            if fence is not None:
                _wait_for(hosted, fence, where, exact=False)
            count, digest = hosted.version()
        reply = _forward_once(hosted, caller, job)
        with hosted.lock:
            if hosted.version()[0] == count:  # no step overtook it: it saw one whole state
                return [*reply, [True, count, digest]] if report else reply
    raise _StaleReplica(f"{where}: steps kept overtaking it ({_FORWARD_TRIES} tries)")


def _forward_once(hosted: _Hosted, caller: Caller, job: Dict[str, Any]) -> List[Any]:
    where, call_id, seed, flags = _call_fields(hosted, job)
    grad = _field(job, "grad", bool, where)
    args = _field(job, "args", list, where)
    codec = _codec(job, where)
    store = hosted.server.store
    owner = caller.owner
    _check_request_size(hosted, "forward", args)
    keep = grad and store is not None
    if keep:
        assert store is not None
        store.check_new(owner, call_id, hosted.name)  # a duplicate is refused before running
        if hosted.gather is not None:  # a held graph is one call's
            hosted.gather.count(unbatched_calls=1)
    elif hosted.gather is not None:
        found = None if hosted.alone else row_key(args, flags, extra=("forward", grad))
        if found is not None:  # each call's reply in its own request's codec
            outputs, *rest = hosted.gather.run(found[0], found[1], (args, flags, seed, grad),
                                               lambda tasks: _forwards(hosted, tasks), owner)
            return [_packed(outputs, codec), *rest]
        hosted.gather.count(unbatched_calls=1)
    leaves, outputs, single, diff = ex.run_forward(hosted.module, args, flags, seed,
                                                   grad=grad, keep_graph=keep)
    mode = "none" if not any(diff) else "stateful" if keep else "stateless"
    if mode == "stateful":
        assert store is not None
        nbytes = materialised_bytes(leaves, outputs)
        store.put(call_id, CallState(hosted.name, owner, leaves, outputs, nbytes))
    return [_packed(outputs, codec), single, diff, mode]


def _step(hosted: _Hosted, change: str) -> Optional[str]:
    """Steps the optimizer unless a gradient is non-finite; returns a note when
    the step was skipped (``skip``), raises with ``raise``. Either way the
    expert's version moves past ``change`` (a backward's call id) before a
    snapshot is due or the reply goes. Needs ``hosted.lock``."""
    assert hosted.optimizer is not None
    bad = [n for n, p in hosted.module.named_parameters()
           if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if not bad:
        hosted.optimizer.step()
        hosted.steps += 1
        hosted.advanced(change)
        snapshots = hosted.server.snapshots
        if snapshots is not None and snapshots.due(hosted.name, hosted.steps):
            snapshots.save(hosted.name, _captured(hosted))  # whole steps, on disk before the reply
        return None
    hosted.skipped_steps += 1
    hosted.advanced(change)
    shown = ", ".join(bad[:4]) + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else "")
    note = (f"optimizer step of expert {hosted.name!r} skipped: non-finite gradients in "
            f"{shown}; its parameters are unchanged")
    if hosted.server.non_finite_grads == "raise":
        raise FloatingPointError(note + " (non_finite_grads='raise')")
    return note


def _copied(value: Any) -> Any:
    """``value`` with every tensor cloned (an optimizer's state_dict holds its
    live tensors)."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def _captured(hosted: _Hosted) -> ExpertState:
    """What a snapshot keeps of ``hosted``: its live tensors, not copies (the
    caller holds ``hosted.lock`` until it has written or sealed them: no step
    changes them meanwhile)."""
    module = {k: v.detach() for k, v in hosted.module.state_dict().items()}
    optimizer = hosted.optimizer.state_dict() if hosted.optimizer is not None else None
    return ExpertState(module, optimizer, hosted.steps, hosted.skipped_steps,
                       lineage=hosted.version()[1])


def _resume(hosted: _Hosted, snapshots: Snapshots) -> None:
    """Loads ``hosted``'s newest snapshot, if any, and says where it came from."""
    found = snapshots.load(hosted.name)
    if found is None:
        _log.info("expert %r starts from its factory's state: no snapshot in %s", hosted.name,
                  snapshots.directory)
        return
    path, state = found
    with hosted.lock:
        _apply_state(hosted, state, f"snapshot {path}")
    hosted.server.resumed[hosted.name] = f"snapshot {path} (step {state.steps})"
    hosted.server.resumed_steps[hosted.name] = state.steps
    _log.info("expert %r resumed from snapshot %s (step %d)", hosted.name, path, state.steps)


def _backward(hosted: _Hosted, caller: Caller, job: Dict[str, Any]) -> List[Any]:
    where, call_id, seed, flags = _call_fields(hosted, job)
    grads = _field(job, "grads", list, where)
    codec = _codec(job, where)
    args = job.get("args")
    if args is not None and not isinstance(args, list):
        raise TypeError(f"{where}: field 'args' must be a list or None")
    store = hosted.server.store
    _check_request_size(hosted, "backward", args, grads)
    if args is None:  # stateful
        if store is None:
            raise RuntimeError(f"a stateful backward of expert {hosted.name!r} reached a "
                               "stateless server")
        state = store.take(caller.owner, call_id, hosted.name,
                           lambda s: ex.check_grads(s.outputs, grads))
        leaves, outputs = state.leaves, state.outputs
        if hosted.gather is not None:
            hosted.gather.count(unbatched_calls=1)
    else:
        if hosted.gather is not None:
            # Under auto_step every backward is one optimizer step: never batched.
            found = None if hosted.alone or hosted.server.auto_step \
                or ex.has_grad_hooks(hosted.module) \
                else row_key(args, flags, grads, extra=("backward",))
            if found is not None:  # each call's reply in its own request's codec
                return [_packed(hosted.gather.run(found[0], found[1], (args, flags, seed, grads),
                                                  lambda tasks: _backwards(hosted, tasks),
                                                  caller.owner), codec), None]
            hosted.gather.count(unbatched_calls=1)
        if not hosted.server.auto_step:
            leaves, outputs = ex.recompute(hosted.module, args, flags, seed)
    if not hosted.server.auto_step:
        return [_packed(ex.run_backward(leaves, outputs, grads), codec), None]
    assert hosted.optimizer is not None
    fence = check_fence(job.get("fence"), where)
    with hosted.lock:
        if fence is not None:
            _wait_for(hosted, fence, where, exact=True)
        try:
            if args is not None:  # recomputed under the lock: no step between it and backward
                leaves, outputs = ex.recompute(hosted.module, args, flags, seed)
            result = ex.run_backward(leaves, outputs, grads)
            note = _step(hosted, call_id)
        finally:
            hosted.optimizer.zero_grad()
    return [_packed(result, codec), note]


def _wait_for(hosted: _Hosted, fence: Version, where: str, exact: bool) -> None:
    """Waits (up to :data:`FENCE_WAIT_S`) until ``hosted`` reaches the
    version ``fence`` names, then raises unless it is at that version
    (``exact``: a backward, applied only to the state its client expects)
    or, for a forward, at it or past it. Needs ``hosted.lock``."""
    count, digest = fence
    hosted.changed.wait_for(lambda: hosted.version()[0] >= count, FENCE_WAIT_S)
    have, have_digest = hosted.version()
    if have < count or (have == count and have_digest != digest) or (exact and have != count):
        raise _StaleReplica(f"{where}: stale replica: this server's expert is at version "
                            f"{have} ({have_digest[:12]}), the call expects {count} "
                            f"({digest[:12]}); nothing was changed")


class _StaleReplica(RuntimeError):
    """A fenced call reached a replica whose state is not the one its client
    expects (:mod:`.lineage`): refused, nothing changed."""


# -- batching across calls (see .gather) ---------------------------------------------------
# A group's tasks carry (args, flags, seed, grad) for a forward, (args, flags,
# seed, grads) for a stateless backward: the fields its single-call request
# had, already checked (ids, types, byte limits) in that call's own thread.
def _forward_alone(hosted: _Hosted, task: Task) -> List[Any]:
    args, flags, seed, grad = task.payload
    _, outputs, single, diff = ex.run_forward(hosted.module, args, flags, seed, grad=grad,
                                              keep_graph=False)
    mode = "none" if not any(diff) else "stateless"
    return [[ex.to_wire(o) for o in outputs], single, diff, mode]


def _backward_alone(hosted: _Hosted, task: Task) -> Any:
    args, flags, seed, grads = task.payload
    leaves, outputs = ex.recompute(hosted.module, args, flags, seed)
    return ex.run_backward(leaves, outputs, grads)


def _one_by_one(hosted: _Hosted, tasks: List[Task], alone: Callable[[_Hosted, Task], Any],
                fallback: bool) -> None:
    """Each task as its single-call request would run it: its own result or
    error, whatever the others' (a failing job never fails another's call)."""
    assert hosted.gather is not None
    hosted.gather.count(unbatched_calls=len(tasks), batch_fallbacks=int(fallback))
    for task in tasks:
        try:
            task.finish(alone(hosted, task))
        except Exception as error:  # noqa: BLE001 - this call's own error reply
            task.finish(error=error)


def _no_more_batches(hosted: _Hosted, why: str) -> None:
    """The expert's calls run alone from now on (logged once): a batch of it
    could not stand for its calls, and would fail the same way again."""
    if hosted.alone is None:
        hosted.alone = why
        _log.warning("expert %r: its calls are no longer batched across calls: %s",
                     hosted.name, why)


def _rows_apart(hosted: _Hosted, rng: CallRng, outputs: Sequence[Optional[Tensor]],
                rows: Sequence[int]) -> List[List[Optional[Tensor]]]:
    """Each call's rows of a batch's ``outputs``; raises :class:`NotRowWise`
    (and stops batching the expert) if the batch drew random numbers (each
    call has its own random stream) or an output is not one row per row."""
    if rng.drew:
        _no_more_batches(hosted, "it draws random numbers (each call has its own random "
                                 "stream)")
        raise NotRowWise(f"expert {hosted.name!r} draws random numbers")
    try:
        return split_rows(outputs, rows, "output")
    except NotRowWise as error:
        _no_more_batches(hosted, f"its outputs are not row-wise ({error})")
        raise


def _forwards(hosted: _Hosted, tasks: List[Task]) -> None:
    """Runs a group of forwards (same key) as one forward of their rows."""
    if len(tasks) == 1:
        return _one_by_one(hosted, tasks, _forward_alone, False)
    _, flags, seed, grad = tasks[0].payload
    rows = [t.rows for t in tasks]
    try:
        rng = CallRng(seed)
        _, outputs, single, diff = ex.run_forward(
            hosted.module, concat_rows([t.payload[0] for t in tasks]), flags, seed, grad=grad,
            keep_graph=False, rng=rng)
        parts = _rows_apart(hosted, rng, [ex.to_wire(o) for o in outputs], rows)
    except Exception:  # noqa: BLE001 - one call may be the cause: each runs alone
        return _one_by_one(hosted, tasks, _forward_alone, True)
    hosted.gather.count(batches=1, batched_calls=len(tasks))  # type: ignore[union-attr]
    mode = "none" if not any(diff) else "stateless"
    for task, part in zip(tasks, parts):
        task.finish([part, single, diff, mode])


def _backwards(hosted: _Hosted, tasks: List[Task]) -> None:
    """Runs a group of stateless backwards (same key) as one recomputation
    and one backward of their rows; parameter gradients accumulate once, as
    the sum of the calls', once the group's gradients are all computed (see
    :func:`~.execution.batch_grads`)."""
    if len(tasks) == 1:
        return _one_by_one(hosted, tasks, _backward_alone, False)
    _, flags, seed, _ = tasks[0].payload
    rows = [t.rows for t in tasks]
    try:
        rng = CallRng(seed)
        leaves, outputs = ex.recompute(hosted.module, concat_rows([t.payload[0] for t in tasks]),
                                       flags, seed, rng=rng)
        _rows_apart(hosted, rng, outputs, rows)  # before any gradient is computed
        grads = concat_rows([t.payload[3] for t in tasks])
        found, reached = ex.batch_grads(hosted.module, leaves, outputs, grads)
        parts = split_rows(found, rows, "input gradient")
    except Exception:  # noqa: BLE001 - nothing accumulated yet: each runs alone
        return _one_by_one(hosted, tasks, _backward_alone, True)
    ex.accumulate(reached)  # the sum of the calls' parameter gradients, once
    hosted.gather.count(batches=1, batched_calls=len(tasks))  # type: ignore[union-attr]
    for task, part in zip(tasks, parts):
        task.finish(part)


def _check_state_dict(hosted: _Hosted, payload: Any, where: str) -> None:
    """Raises, naming what differs, unless ``payload`` has exactly the keys of
    ``hosted``'s state dict, tensors where it has tensors, of its shapes."""
    module = hosted.module
    if not isinstance(payload, dict):
        raise TypeError(f"{where}: expected a dict, got {type(payload).__name__}")
    current = module.state_dict()
    missing = sorted(set(current) - set(payload))
    unexpected = sorted(str(k) for k in set(payload) - set(current))
    if missing or unexpected:
        raise KeyError(f"{where}: missing keys {missing[:8]}, unexpected keys "
                       f"{unexpected[:8]}; nothing was changed")
    for key, have in current.items():
        value = payload[key]
        if isinstance(have, Tensor):
            if not isinstance(value, Tensor):
                raise TypeError(f"{where}: {key!r} is a {type(value).__name__}, not a tensor; "
                                "nothing was changed")
            if value.shape != have.shape:
                raise ValueError(f"{where}: {key!r} has shape {list(value.shape)}, the "
                                 f"expert's has {list(have.shape)}; nothing was changed")


def _load_state_dict(hosted: _Hosted, payload: Any) -> None:
    """Loads all of ``payload`` or nothing: checks first, restores on failure."""
    module = hosted.module
    _check_state_dict(hosted, payload, f"load_state_dict of expert {hosted.name!r}")
    current = module.state_dict()
    with hosted.lock, torch.no_grad():
        backup = {k: v.clone() for k, v in current.items() if isinstance(v, Tensor)}
        try:
            module.load_state_dict(payload)
        except BaseException:
            for key, saved in backup.items():
                current[key].copy_(saved)  # state_dict() tensors alias the module's
            raise
        hosted.digest = ""  # a new history: the root of the loaded state


def _apply_state(hosted: _Hosted, state: ExpertState, where: str) -> None:
    """Makes ``state`` (a snapshot's or a peer's) ``hosted``'s whole state:
    weights, optimizer state and steps, or nothing of it. Needs ``hosted.lock``."""
    _check_state_dict(hosted, state.module, where)
    module, optimizer = hosted.module, hosted.optimizer
    current = module.state_dict()
    backup = {k: v.clone() for k, v in current.items() if isinstance(v, Tensor)}
    kept = _copied(optimizer.state_dict()) if optimizer is not None else None
    try:
        with torch.no_grad():
            module.load_state_dict(state.module)
        if optimizer is not None and state.optimizer is not None:
            optimizer.load_state_dict(state.optimizer)
    except BaseException:
        with torch.no_grad():
            for key, saved in backup.items():
                current[key].copy_(saved)
        if optimizer is not None and kept is not None:
            optimizer.load_state_dict(kept)
        raise
    hosted.digest = state.lineage  # "" (unknown): its root, when first needed
    hosted.changed.notify_all()
    if state.optimizer is not None and optimizer is None:
        _log.warning("expert %r: %s holds optimizer state, but this server has no optimizer: "
                     "its weights alone are taken", hosted.name, where)
    hosted.steps, hosted.skipped_steps = state.steps, state.skipped_steps


def _job_secret(hosted: _Hosted, caller: Optional[Caller]) -> JobSecret:
    """The secret of the caller's job among the server's (its first without a caller)."""
    secrets = hosted.server.secrets
    if caller is None:
        return secrets[0]
    return next(s for s in secrets if s.key_id == caller.key_id)


def _snapshot_op(hosted: _Hosted, caller: Optional[Caller]) -> Tensor:
    """The expert's whole state, sealed for the caller's job (a peer transfer)."""
    with hosted.lock:  # sealed from the live tensors: no step until it is done
        return state_bytes(hosted.name, _captured(hosted), _job_secret(hosted, caller))


def _restore_op(hosted: _Hosted, caller: Optional[Caller], payload: Any) -> int:
    """Makes a sealed state (:func:`_snapshot_op` of a replica, or a job
    checkpoint's) the expert's; its steps."""
    where = f"a state sent to restore expert {hosted.name!r}"
    if not isinstance(payload, Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise TypeError(f"{where}: expected a 1-D uint8 tensor (a sealed snapshot)")
    try:
        name, state = open_state(payload.contiguous().numpy(), _job_secret(hosted, caller), where)
    except SnapshotError as error:
        raise refuse(error.kind, str(error)) from None
    if name != hosted.name:
        raise ValueError(f"{where}: it holds the state of expert {name!r}; nothing was changed")
    with hosted.lock:
        _apply_state(hosted, state, where)
        steps = hosted.steps
    _log.info("expert %r restored from %s (step %d)", hosted.name, "a sent state", steps)
    return steps


def _control(hosted: _Hosted, what: Any, payload: Any, caller: Optional[Caller] = None) -> Any:
    module = hosted.module
    if what == "step":
        if hosted.optimizer is None:
            raise RuntimeError(f"expert {hosted.name!r} has no optimizer: pass optimizer=... "
                               "to ExpertServer")
        with hosted.lock:
            return _step(hosted, "step")
    if what == "zero_grad":
        with hosted.lock:
            module.zero_grad(set_to_none=bool(payload))
        return None
    if what == "grads":
        return {n: ex.to_wire(p.grad.clone()) if p.grad is not None else None
                for n, p in module.named_parameters()}
    if what == "state_dict":
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    if what == "load_state_dict":
        _load_state_dict(hosted, payload)
        return None
    if what == "snapshot":
        return _snapshot_op(hosted, caller)
    if what == "restore":
        return _restore_op(hosted, caller, payload)
    if what == "version":  # what a replica's client compares (.lineage, .mirrored)
        if not hosted.training:
            return [False, 0, ""]
        with hosted.lock:
            count, digest = hosted.version()
        return [True, count, digest]
    if what == "stats":
        return dict(hosted.server.stats(), expert=hosted.name,
                    optimizer=hosted.optimizer is not None, auto_step=hosted.server.auto_step,
                    expert_skipped_steps=hosted.skipped_steps, expert_steps=hosted.steps,
                    expert_resumed_steps=hosted.server.resumed_steps.get(hosted.name),
                    expert_batches=hosted.gather.stats() if hosted.gather is not None else None,
                    expert_batched_no_more=hosted.alone)
    raise ValueError(f"unknown control operation {what!r:.40} for expert {hosted.name!r}; "
                     f"one of {_CONTROL}")


# -- the operations this module registers -------------------------------------------------
def run_job(caller: Caller, job: Any) -> Reply:
    """One forward or backward call (a single request, or a job of a
    coalesced one): its reply, never an exception."""
    if not isinstance(job, dict) or job.get("op") not in JOB_OPS:
        return ["error", f"TypeError: a job is a dict whose op is one of {JOB_OPS}"]
    op = job["op"]
    run = _forward if op == "forward" else _backward

    def counted(hosted: _Hosted) -> List[Any]:
        try:
            result = run(hosted, caller, job)
        except BaseException:
            hosted.server._count(op, False)
            raise
        hosted.server._count(op, True)
        return result
    return _guarded(caller, job.get("expert"), counted)


def _control_op(caller: Caller, request: Dict[str, Any]) -> Reply:
    return _guarded(caller, request.get("expert"),
                    lambda h: _control(h, request.get("what"), request.get("payload"), caller))


def _release_op(caller: Caller, request: Dict[str, Any]) -> Reply:
    """Frees the caller's states among ``calls`` in every stateful server of
    this process that serves its job (states of other sessions are left alone)."""
    try:
        calls = request.get("calls")
        if not isinstance(calls, list) or len(calls) > _MAX_RELEASE_IDS:
            raise TypeError(f"calls must be a list of at most {_MAX_RELEASE_IDS} ids, "
                            f"got {type(calls).__name__}")
        ids = [_ident("call id", c) for c in calls]
        with _registry_lock:
            stores = {id(h.server): h.server.store for h in _experts.values()
                      if caller.key_id in h.server.jobs}
        return ["ok", sum(s.release(caller.owner, ids) for s in stores.values() if s is not None)]
    except Exception as error:  # noqa: BLE001
        return ["error", error_text(error)]


def _info_op(caller: Caller, request: Dict[str, Any]) -> Reply:
    """What this process serves to the caller's job (a fleet's challenge),
    and the calls its servers of that job have served (``served``)."""
    with _registry_lock:
        mine = [h for h in _experts.values() if caller.key_id in h.server.jobs]
        experts = {h.name: h.server.backward for h in mine}
        info = dict(_host)
    served: Dict[str, int] = {}
    for server in {id(h.server): h.server for h in mine}.values():
        for key, value in server.served().items():
            served[key] = served.get(key, 0) + value
    info.update(pid=os.getpid(), experts=experts, served=served)
    return ["ok", info]


endpoint.register("forward", run_job)
endpoint.register("backward", run_job)
endpoint.register("control", _control_op)
endpoint.register("release", _release_op)
endpoint.register("info", _info_op)
endpoint.set_request_budget(_job_budget)
