"""``RemoteExpert``: a module whose call runs on an :class:`ExpertServer`.

Why a custom autograd Function (:class:`RemoteCall`): the remote call must
take part in the caller's autograd graph like a local module when it is made
alone. Inside a pass (:func:`moe_autograd.parallel_apply`,
:func:`moe_autograd.map_with_parallel_backward` with :class:`RemoteCall`, a
``MixtureOfExperts``), the calls are instead gathered by the runtime's
collector hook and sent as one request per server, forward and backward, with
no thread waiting per call (:mod:`.batching`); per call, everything below
holds the same way.

Per call, the client draws a seed with :meth:`CallRng.fork` (inside a
checkpointed parent, from the parent's stream, so the recomputation sends the
same seed) and a call id of 128 random bits (:func:`secrets.token_hex`: other
clients cannot guess it). Every message is sealed with the job's secret
(``secret=``, default :func:`~.auth.job_secret`) by this process's session,
which the server records as the call's owner (:mod:`.auth`). What the client
keeps until backward depends on the server's strategy, which the forward
reply names:

* ``stateless``: the inputs (saved for backward, version-checked) and seed;
  backward sends them with the output gradients.
* ``stateful``: only the call id; a finalizer on the call record sends a
  release when the graph dies without a backward (batched, off the GC thread).
* ``none``: nothing (no output needs a gradient).

Invariants:

* Arguments travel as wire values (:mod:`.wire`: tensors, numbers, strings,
  bools, None, and lists, tuples and str-keyed dicts of them); anything else
  raises ``TypeError`` naming the call and the argument before anything is sent.
* Every failure raises :class:`RemoteExpertError` naming worker and expert
  (:class:`~.errors.RemoteAuthError` when the server refused the request or
  its reply failed authentication);
  a missed ``forward_timeout``/``backward_timeout`` raises
  :class:`RemoteTimeoutError` (a :class:`TimeoutError`) within the deadline
  plus a small grace period; a late reply is dropped.
* Timeouts are ``None`` or ``math.inf`` (no deadline of the call's own: the
  transport's timeout, ``rpc_timeout``, still ends it) or positive seconds
  (clamped to what the transport supports); anything else raises
  ``ValueError``/``TypeError`` naming the argument when it is set.
* A caller waiting on a call (forward, backward, control) gets Ctrl-C within
  the transport's wait slice (0.1 s); an interrupted stateful forward releases
  its state on the server like a timed-out one.
* An optimizer step the server skipped for non-finite gradients (see
  :class:`ExpertServer`'s ``non_finite_grads``) warns (``RuntimeWarning``)
  and counts in :attr:`RemoteExpert.skipped_steps`.
* Tensors travel as CPU tensors; outputs come back on the device of the first
  tensor argument, input gradients on each input's device.
* Parameter gradients live on the server (``.grad`` of the hosted module):
  a local optimizer never sees them. Train remote experts with the server's
  optimizer: ``expert.zero_grad()``, ``loss.backward()``, ``expert.step()``
  (parent modules' ``zero_grad`` does not reach remote experts), or let the
  server step after every backward (``ExpertServer(..., auto_step=True)``).
"""
import atexit
import collections
import os
import secrets
import threading
import warnings
import weakref
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..phony import get_phony
from ..rng import CallRng
from . import wire
from .auth import JobSecret, resolve_secret
from .compression import Compressed, Compression, resolve as resolve_codec
from .batching import COLLECTOR, GRACE_S, Job, RemoteModuleCall, run_sync
from .channel import request as send_request
from .durable import ExpertState, open_state, state_bytes
from .errors import RemoteExpertError
from .transport import Transport, check_timeout, get_transport

__all__ = ["RemoteExpert", "RemoteCall", "flush_releases", "GRACE_S"]

Outputs = Union[Tensor, Tuple[Tensor, ...]]
_Target = Tuple[Transport, str, Optional[JobSecret]]  # where a release goes


class _Releaser:
    """Sends releases of abandoned stateful calls, batched per server.

    Finalizers only append to a deque (no locks, no I/O on the GC's thread);
    a daemon thread flushes it every ``interval`` seconds. At interpreter
    exit the thread is stopped (a daemon thread inside the transport's C++
    send when the interpreter finalises would abort the process) and what is
    pending is sent once more (the RPC engine's own exit hook, which runs
    after this one, lets those requests end).
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.pending: Deque[Tuple[Transport, str, Optional[JobSecret], str]] = collections.deque()
        self.interval = interval
        self._started = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        with self._lock:
            if not self._started and not self._stop.is_set():
                self._started = True
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="moe_autograd-remote-releaser")
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def stop_at_exit(self, timeout: float = 1.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.flush()

    def flush(self) -> int:
        batches: Dict[Tuple[int, str, int], Tuple[_Target, List[str]]] = {}
        while self.pending:
            transport, worker, secret, call_id = self.pending.popleft()
            key = (id(transport), worker, id(secret))
            batches.setdefault(key, ((transport, worker, secret), []))[1].append(call_id)
        for (transport, worker, secret), ids in batches.values():
            try:  # fire and forget
                send_request(transport, worker, {"op": "release", "calls": ids}, 30.0,
                             secret=secret, label="release")
            except Exception:  # noqa: BLE001 - peer gone, transport shut down, no secret
                pass
        return sum(len(ids) for _, ids in batches.values())

    def add(self, transport: Transport, worker: str, secret: Optional[JobSecret],
            call_id: str) -> None:
        self.start()
        self.pending.append((transport, worker, secret, call_id))


_releaser = _Releaser()
atexit.register(_releaser.stop_at_exit)  # runs before the RPC engine's hook (registered first)


def _after_fork_in_child() -> None:  # the parent's flusher thread does not exist here
    _releaser._started = False
    _releaser._lock = threading.Lock()
    _releaser._stop = threading.Event()
    _releaser._thread = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def flush_releases() -> int:
    """Sends pending releases now; returns how many call ids were sent."""
    return _releaser.flush()


class _Call:
    """The record of one remote call, kept by the autograd node."""

    __slots__ = ("expert", "seed", "call_id", "single", "mode", "flags", "finalizer",
                 "__weakref__")

    def __init__(self, expert: "RemoteExpert", seed: int) -> None:
        self.expert, self.seed = expert, seed
        self.call_id = secrets.token_hex(16)  # 128 random bits: unguessable, unique across forks
        self.single, self.mode = True, "none"
        self.flags: List[bool] = []
        self.finalizer: Optional[weakref.finalize] = None

    def arm(self) -> None:
        """Releases the server's state if this record dies without backward."""
        _releaser.start()
        e = self.expert
        self.finalizer = weakref.finalize(self, _releaser.pending.append,
                                          (e.transport, e.worker, e.secret, self.call_id))
        self.finalizer.atexit = False


class RemoteCall(torch.autograd.Function):
    """The autograd node of one remote call: ``apply(call, phony, *args)``.

    Use :meth:`RemoteExpert.function_args` to build the arguments, e.g. for
    :func:`moe_autograd.map_with_parallel_backward` (whose calls of this
    Function are coalesced: ``moe_collector``).
    """

    moe_collector = COLLECTOR

    @staticmethod
    def forward(ctx: Any, call: _Call, phony: Tensor, *args: Any) -> Tuple[Tensor, ...]:  # type: ignore[override]
        outputs, diff = run_sync(RemoteCall._forward_job((call, phony, *args)))
        RemoteCall._fill_ctx(ctx, call, args, outputs, diff)
        return tuple(outputs)

    @staticmethod
    def _forward_job(function_args: Sequence[Any]) -> Job:
        call = function_args[0]
        return call.expert._forward_job(call, function_args[2:], grad=True)

    @staticmethod
    def _fill_ctx(ctx: Any, call: _Call, args: Sequence[Any], outputs: Sequence[Tensor],
                  diff: Sequence[bool]) -> None:
        """What the node keeps of a forward (the real ctx, or a map's emulated one)."""
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.devices = [a.device if isinstance(a, Tensor) else None for a in args]
        if call.mode == "stateless":
            ctx.tensor_idx = [k for k, a in enumerate(args) if isinstance(a, Tensor)]
            ctx.others = [None if isinstance(a, Tensor) else a for a in args]
            ctx.save_for_backward(*(args[k] for k in ctx.tensor_idx))
        nondiff = [o for o, d in zip(outputs, diff) if not d]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)

    @staticmethod
    def _backward_job(ctx: Any, grads: Sequence[Optional[Tensor]]
                      ) -> Union[Job, Tuple[Optional[Tensor], ...]]:
        """The backward's job, or its result when there is nothing to send;
        the job's result is what :meth:`backward` returns."""
        call: _Call = ctx.call
        devices = ctx.devices
        if call.mode == "none":
            return (None, None, *[None] * len(devices))
        args: Optional[List[Any]] = None
        if call.mode == "stateless":
            args = list(ctx.others)
            for k, tensor in zip(ctx.tensor_idx, ctx.saved_tensors):
                args[k] = tensor
        job = call.expert._backward_job(call, args, grads)
        decode = job.decode

        def on_devices(value: Any) -> Tuple[Optional[Tensor], ...]:
            input_grads = decode(value)
            return (None, None, *[g.to(d) if g is not None and d is not None else None
                                  for g, d in zip(input_grads, devices)])
        job.decode = on_devices
        return job

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        job = RemoteCall._backward_job(ctx, grads)
        return run_sync(job) if isinstance(job, Job) else job


def _wire(value: Any) -> Any:
    """``value`` as it travels: a tensor detached on the CPU. A meta tensor
    stays as it is (nothing to copy: :func:`wire.check_value` refuses it
    by name, before any allocation of its declared size)."""
    if isinstance(value, Tensor) and not value.is_meta:
        return value.detach().cpu()
    return value


def _same(value: Any) -> Any:
    return value


class RemoteExpert(nn.Module):
    """Calls the expert ``name`` served by the worker ``worker``.

    ``expert(*args)`` sends the arguments (tensors, or picklable values) and
    returns what the expert returned (a tensor or a tuple of tensors), wired
    into autograd. ``forward_timeout``/``backward_timeout`` (seconds) bound each
    pass (control calls such as :meth:`step` use ``forward_timeout``);
    ``None`` or ``math.inf`` set no deadline of the call's own, so the
    transport's timeout applies (``rpc_timeout`` of the RPC backend options,
    60 s by default). Huge values are clamped to what the transport supports
    (about 24 days for TensorPipe); ``nan``, zero or negative values raise
    ``ValueError``, here and when assigned later.

    ``secret``: the job's :class:`~moe_autograd.remote.JobSecret` its
    messages are sealed with (default: the process's, see
    :func:`~moe_autograd.remote.set_job_secret` and ``MOE_AUTOGRAD_SECRET_FILE``).

    ``skipped_steps`` counts the server's optimizer steps that this client's
    backwards (or :meth:`step` calls) reported as skipped for non-finite
    gradients (each also warns).

    ``compression``: ``None`` (default: raw, gradients bit-equal to local
    calls), ``"fp16"``, ``"bf16"`` or ``"int8"`` (or a
    :class:`~moe_autograd.remote.Compression`): the floating tensor arguments
    and output gradients travel in that codec, and the server answers the
    outputs and input gradients in it too (:mod:`.compression`: what is
    compressed, the error bounds). Settable later (``expert.compression = ...``).
    """

    #: The record of this expert's calls in a pass (see moe_autograd.collect).
    moe_call_type = RemoteModuleCall

    def __init__(self, worker: str, name: str, *, forward_timeout: Optional[float] = None,
                 backward_timeout: Optional[float] = None,
                 transport: Optional[Transport] = None,
                 secret: Optional[JobSecret] = None,
                 compression: Union[None, str, Compression] = None) -> None:
        super().__init__()
        if secret is not None and not isinstance(secret, JobSecret):
            raise TypeError(f"secret of RemoteExpert {name!r} must be a JobSecret or None, got "
                            f"{type(secret).__name__}")
        self.worker, self.name = worker, name
        self.compression = compression
        self.secret = secret
        self.forward_timeout, self.backward_timeout = forward_timeout, backward_timeout
        self.transport: Transport = transport or get_transport()
        self.skipped_steps = 0

    @property
    def forward_timeout(self) -> Optional[float]:
        """Seconds a forward (or control call) may take; ``None``: the transport's timeout."""
        return self._forward_timeout

    @forward_timeout.setter
    def forward_timeout(self, value: Optional[float]) -> None:
        self._forward_timeout = check_timeout(f"forward_timeout of RemoteExpert {self.name!r}",
                                              value)

    @property
    def compression(self) -> Optional[str]:
        """The codec of this expert's tensors on the wire (``None``: raw)."""
        return self._compression

    @compression.setter
    def compression(self, value: Union[None, str, Compression]) -> None:
        self._compression = resolve_codec(value, f"compression of RemoteExpert {self.name!r}")

    @property
    def backward_timeout(self) -> Optional[float]:
        """Seconds a backward may take; ``None``: the transport's timeout."""
        return self._backward_timeout

    @backward_timeout.setter
    def backward_timeout(self, value: Optional[float]) -> None:
        self._backward_timeout = check_timeout(f"backward_timeout of RemoteExpert {self.name!r}",
                                               value)

    def extra_repr(self) -> str:
        codec = f", compression={self._compression!r}" if self._compression else ""
        return f"worker={self.worker!r}, name={self.name!r}{codec}"

    # -- calls --------------------------------------------------------------
    def forward(self, *args: Any) -> Outputs:  # type: ignore[override]
        if not args:
            raise TypeError(f"remote expert {self.name!r} needs at least one argument")
        call = _Call(self, CallRng.fork().seed)
        if torch.is_grad_enabled():
            outputs: Sequence[Tensor] = RemoteCall.apply(*self._function_args(call, args))
        else:
            outputs, _ = self._forward(call, args, grad=False)
        return outputs[0] if call.single else tuple(outputs)

    def function_args(self, *args: Any) -> Tuple[Any, ...]:
        """``(call, phony, *args)`` for ``RemoteCall.apply`` or as one call's
        arguments of :func:`moe_autograd.map_with_parallel_backward`."""
        return self._function_args(_Call(self, CallRng.fork().seed), args)

    @staticmethod
    def _function_args(call: _Call, args: Sequence[Any]) -> Tuple[Any, ...]:
        return (call, get_phony(torch.device("cpu"), requires_grad=True), *args)

    def _where(self, what: str) -> str:
        return f"{what} of expert {self.name!r} on worker {self.worker!r}"

    def _transport_limit(self) -> str:
        hint = getattr(self.transport, "timeout_hint", None)
        if hint is not None:
            return str(hint())
        seconds = getattr(self.transport, "default_timeout", lambda: None)()
        limit = f"{seconds:g} s" if seconds is not None else "its default"
        return (f"the transport's own timeout ({limit}; or give the expert a "
                "forward_timeout/backward_timeout)")

    def _job(self, what: str, message: Dict[str, Any], timeout: Optional[float],
             decode: Any = None, abandon: Any = None) -> Job:
        return Job(self.transport, self.worker, message, timeout,
                   lambda: self._where(what), self._transport_limit,
                   decode if decode is not None else _same, abandon, self.secret)

    def _wire_args(self, what: str, args: Sequence[Any]) -> List[Any]:
        """``args`` as they travel: tensors detached on the CPU; raises
        ``TypeError`` naming the call for what cannot travel."""
        where = f"the arguments of {self._where(what)}: argument list"
        wire.check_value(list(args), where)  # before any copy: a meta tensor allocates nothing
        sent = []
        for k, a in enumerate(args):
            try:
                sent.append(_wire(a))
            except (RuntimeError, NotImplementedError) as error:  # a device with no CPU copy
                raise wire.WireTypeError(f"{where}[{k}] cannot be copied to the CPU to travel: "
                                         f"{type(error).__name__}: {error}") from error
        return self._packed(sent)

    def _packed(self, tensors: List[Any]) -> List[Any]:
        """``tensors`` with the floating ones marked for this expert's codec."""
        codec = self._compression
        if codec is None:
            return tensors
        return [Compressed(t, codec) if isinstance(t, Tensor) and t.is_floating_point() else t
                for t in tensors]

    def _codec_field(self, message: Dict[str, Any]) -> Dict[str, Any]:
        if self._compression is not None:  # (absent: raw; older servers never see the key)
            message["compression"] = self._compression
        return message

    def _new_call(self, seed: int) -> _Call:
        return _Call(self, seed)

    def _forward_job(self, call: _Call, args: Sequence[Any], grad: bool) -> Job:
        """The forward of ``call``; its result is ``(outputs, differentiable)``
        (outputs on the device of the first tensor argument), and ``call``
        learns the server's strategy from the reply."""
        flags = [bool(grad and isinstance(a, Tensor) and a.requires_grad) for a in args]
        message = {"op": "forward", "expert": self.name, "call": call.call_id,
                   "seed": call.seed, "grad": bool(grad), "flags": flags,
                   "args": self._wire_args("forward", args)}
        device = next((a.device for a in args if isinstance(a, Tensor)), torch.device("cpu"))

        def decode(value: Any) -> Tuple[List[Tensor], List[bool]]:
            if not (isinstance(value, list) and len(value) == 4 and isinstance(value[0], list)
                    and all(isinstance(o, Tensor) for o in value[0])
                    and isinstance(value[2], list) and len(value[2]) == len(value[0])
                    and value[3] in ("none", "stateless", "stateful")):
                raise RemoteExpertError(f"{self._where('forward')} got a malformed reply: "
                                        f"{value!r:.200}")
            outputs, single, diff, mode = value
            call.single, call.mode, call.flags = single, mode, flags
            if mode == "stateful":
                call.arm()
            return [o.to(device) for o in outputs], diff

        def abandon() -> None:  # the server may still store a state for it: release it
            _releaser.add(self.transport, self.worker, self.secret, call.call_id)
        self._codec_field(message)
        return self._job("forward", message, self.forward_timeout, decode,
                         abandon if grad else None)

    def _forward(self, call: _Call, args: Sequence[Any], grad: bool) -> Tuple[List[Tensor], List[bool]]:
        return run_sync(self._forward_job(call, args, grad))  # type: ignore[no-any-return]

    def _backward_job(self, call: _Call, args: Optional[Sequence[Any]],
                      grads: Sequence[Optional[Tensor]]) -> Job:
        """The backward of ``call`` (``args`` None: stateful); its result is
        one gradient per argument (None where none flows)."""
        message = {"op": "backward", "expert": self.name, "call": call.call_id,
                   "seed": call.seed, "flags": call.flags,
                   "args": None if args is None else self._wire_args("backward", args),
                   "grads": self._packed([_wire(g) for g in grads])}
        self._codec_field(message)

        def decode(reply: Any) -> List[Optional[Tensor]]:
            if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[0], list)
                    and all(g is None or isinstance(g, Tensor) for g in reply[0])):
                raise RemoteExpertError(f"{self._where('backward')} got a malformed reply: "
                                        f"{reply!r:.200}")
            input_grads, note = reply
            if call.finalizer is not None:
                call.finalizer.detach()  # the server freed the state itself
            self._note_skipped(note)
            return input_grads
        return self._job("backward", message, self.backward_timeout, decode)

    def _backward(self, call: _Call, args: Optional[Sequence[Any]],
                  grads: Sequence[Optional[Tensor]]) -> List[Optional[Tensor]]:
        return run_sync(self._backward_job(call, args, grads))  # type: ignore[no-any-return]

    def _note_skipped(self, note: Any) -> None:
        if note:
            self.skipped_steps += 1  # (a count under the GIL; the server's stats are exact)
            warnings.warn(f"remote expert {self.name!r} on worker {self.worker!r}: {note}",
                          RuntimeWarning, stacklevel=3)

    # -- the server-side module ------------------------------------------------
    def _control(self, what: str, payload: Any = None) -> Any:
        wire.check_value(payload, f"the payload of {self._where(what)}")
        message = {"op": "control", "expert": self.name, "what": what, "payload": payload}
        return run_sync(self._job(what, message, self.forward_timeout))

    def step(self) -> None:
        """Runs the server-side optimizer's ``step()`` for this expert (skipped,
        with a ``RuntimeWarning``, if a gradient is non-finite; see
        :class:`ExpertServer`'s ``non_finite_grads``)."""
        self._note_skipped(self._control("step"))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradients of the hosted module on the server."""
        self._control("zero_grad", set_to_none)

    def remote_grads(self) -> Dict[str, Optional[Tensor]]:
        """The hosted module's parameter gradients, by parameter name."""
        return self._control("grads")

    def remote_state_dict(self) -> Dict[str, Tensor]:
        """A copy of the hosted module's ``state_dict()``."""
        return self._control("state_dict")

    def load_remote_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Loads ``state_dict`` into the hosted module: all of it or, on any
        error (keys, shapes, types), nothing."""
        self._control("load_state_dict", {k: _wire(v) for k, v in dict(state_dict).items()})

    def remote_snapshot(self) -> ExpertState:
        """The hosted expert's whole state (weights, optimizer state, steps),
        sealed by the server for this job and checked here
        (:mod:`~moe_autograd.remote.durable`): what a job checkpoint keeps
        and a new replica starts from."""
        sealed = self._control("snapshot")
        if not isinstance(sealed, Tensor):
            raise RemoteExpertError(f"{self._where('snapshot')}: the reply is not a snapshot")
        _, state = open_state(sealed.numpy(), resolve_secret(self.secret),
                              f"the state of {self._where('snapshot')}")
        return state

    def restore_remote(self, state: ExpertState) -> int:
        """Makes ``state`` (a :meth:`remote_snapshot` of this expert or of a
        replica) the hosted expert's whole state, or changes nothing; returns
        its steps."""
        return int(self._control("restore", state_bytes(self.name, state,
                                                        resolve_secret(self.secret))))

    def remote_stats(self) -> Dict[str, Any]:
        """The server's counters (``live``: stateful states held now;
        ``skipped_steps``: optimizer steps skipped for non-finite gradients)."""
        return self._control("stats")
