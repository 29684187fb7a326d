"""Checkpointing with recomputation as its own autograd node.

``torch.utils.checkpoint`` recomputes inside the backward of one node, so the
recomputation can only start once the whole gradient of the output has arrived.
Here a checkpointed call is split into two nodes sharing state through
:class:`Checkpointing`:

* :class:`Checkpoint` runs the function without saving activations; in
  backward it backpropagates through the recomputed graph;
* :class:`Recompute` rebuilds that graph. It hangs off a phony forked from the
  *output*, so the engine runs it before the output gradient passes the fork,
  i.e. while the downstream lane is still busy; the runtime can also put stream
  synchronisation between the two nodes to delay only :class:`Checkpoint`.

Wiring (forward left to right; backward runs right to left, and the engine
must finish ``Recompute`` before the gradient crosses ``fork``)::

    phony(rg), inputs --> Checkpoint --+--> out[i] --> fork ----------------> join --> out[i]'
                                       |                 | phony            ^
                                       |                 +--> Recompute --+-+
                                       |                   (saved inputs) |
                                       +--> out[j] ---------------------> join --> out[j]'

``i`` is the first tensor of the output batch. The phony is joined into every
output that requires grad, so ``Recompute`` runs whichever outputs the loss
uses, and :class:`Checkpoint` (reached through ``fork``) always runs after it.

Invariants:

* Randomness: by default the call draws through a :class:`~moe_autograd.rng.
  ReplayRng`, so a checkpointed call computes exactly what the plain call
  computes: the same numbers from the same generators (the enclosing call's
  stream inside a runtime call, the default generators on an ordinary thread),
  which it leaves where the plain call would (``torch.utils.checkpoint``'s
  contract). Its forward draws from private copies of those generators and
  :class:`Recompute` replays them from the recorded states, so the
  recomputation is exact even while other threads draw random numbers. A
  :class:`~moe_autograd.rng.CallRng` passed in is used instead.
* :class:`Recompute` reruns the function on detached copies of the saved
  inputs, under the same random stream and autocast state as the forward
  (captured in forward, whatever the autocast state at backward time); it
  stores ``(output, input_leaf)`` in a one-slot deque that
  :meth:`Checkpoint.backward` pops.
* :class:`Checkpoint` takes a phony that requires grad, so parameters inside
  the function get gradients even when no input requires grad.
* Gradients reach parameters by a re-entrant ``torch.autograd.backward``, as in
  the re-entrant ``torch.utils.checkpoint``: they are accumulated into
  ``.grad`` even under ``torch.autograd.grad``.
"""
from collections import deque
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
import threading
from typing import Any, Callable, Deque, Generator, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .dependency import fork, join
from .microbatch import Batch
from .phony import get_phony
from .rng import CallRng, RandomStream, ReplayRng

__all__ = [
    "checkpoint", "Checkpointing", "Checkpoint", "Recompute", "AutocastState",
    "capture_autocast_state", "is_checkpointing", "is_recomputing",
    "enable_checkpointing", "enable_recomputing",
]

Function = Callable[..., Any]
TensorOrTensors = Union[Tensor, Tuple[Any, ...]]
Recomputed = Tuple[Any, Tuple[Any, ...]]  # (output, input_leaf)


class _ThreadFlags(threading.local):
    def __init__(self) -> None:
        self.is_checkpointing = False
        self.is_recomputing = False


_flags = _ThreadFlags()


@contextmanager
def enable_checkpointing() -> Generator[None, None, None]:
    """Makes :func:`is_checkpointing` true on this thread within the context."""
    orig = _flags.is_checkpointing
    _flags.is_checkpointing = True
    try:
        yield
    finally:
        _flags.is_checkpointing = orig


@contextmanager
def enable_recomputing() -> Generator[None, None, None]:
    """Makes :func:`is_recomputing` true on this thread within the context."""
    orig = _flags.is_recomputing
    _flags.is_recomputing = True
    try:
        yield
    finally:
        _flags.is_recomputing = orig


def is_checkpointing() -> bool:
    """Whether the current thread runs a checkpointed forward."""
    return _flags.is_checkpointing


def is_recomputing() -> bool:
    """Whether the current thread recomputes a checkpointed forward. Use it to
    skip side effects (counters, logging) that must happen once per call."""
    return _flags.is_recomputing


def _autocast_device_types() -> List[str]:
    types = ["cpu"]
    if torch.cuda.is_available():
        types.append("cuda")
    return types


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings of one thread at one moment."""

    devices: Tuple[Tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype)
    cache_enabled: bool

    @contextmanager
    def restore(self) -> Generator[None, None, None]:
        """Applies these settings on this thread within the context."""
        with ExitStack() as stack:
            for device_type, enabled, dtype in self.devices:
                stack.enter_context(torch.autocast(
                    device_type, dtype=dtype, enabled=enabled, cache_enabled=self.cache_enabled))
            yield


def capture_autocast_state() -> AutocastState:
    """Captures this thread's autocast settings for cpu (and cuda if present)."""
    return AutocastState(
        tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in _autocast_device_types()),
        torch.is_autocast_cache_enabled(),
    )


@dataclass(frozen=True)
class _CallState:
    rng: RandomStream
    autocast: AutocastState


def checkpoint(function: Function, input: Any) -> Any:
    """Checkpoints ``function(input)`` (a tensor) or ``function(*input)`` (a tuple).

    A simple interface to :class:`Checkpointing` for tests and single calls:
    returns the output as the function returned it (a tensor or a tuple).
    """
    batch = Batch(input)
    chk = Checkpointing(function, batch)
    output = chk.checkpoint()
    chk.recompute(output)
    return output.tensor if output.atomic else output.values


class Checkpointing:
    """Generates a pair of :class:`Checkpoint` and :class:`Recompute`.

    ``rng`` is the call's random stream. By default (None) :meth:`checkpoint`
    makes a :class:`~moe_autograd.rng.ReplayRng`: the call draws exactly what
    the plain call would draw (from the enclosing stream, or from the default
    generators on an ordinary thread) and its recomputation replays it. A
    runtime that wants a private stream per call passes a
    :class:`~moe_autograd.rng.CallRng` forked in a fixed order.
    """

    def __init__(self, function: Function, batch: Batch,
                 rng: Optional[Union[CallRng, ReplayRng]] = None) -> None:
        self.function = function
        self.batch = batch
        self.rng = rng
        # Shared between Checkpoint and Recompute; one slot each, mutable.
        self.recomputed: Deque[Recomputed] = deque(maxlen=1)
        self.states: Deque[_CallState] = deque(maxlen=1)

    def checkpoint(self) -> Batch:
        """Returns the output batch of :class:`Checkpoint` applied to the batch."""
        if self.rng is None:
            self.rng = ReplayRng()
        try:
            device = self.batch.get_device()
        except TypeError:
            device = torch.device("cpu")
        # A phony that requires grad keeps Checkpoint in the graph even when no
        # input requires grad, so parameters still get gradients.
        phony = get_phony(device, requires_grad=True)
        output = Checkpoint.apply(phony, self.recomputed, self.states, self.rng, self.function,
                                  self.batch.atomic, *self.batch)
        if isinstance(output, tuple):  # gradients are only for floating tensors
            output = tuple(x.detach() if isinstance(x, Tensor) and not x.is_floating_point() else x
                           for x in output)
        return Batch(output)

    def recompute(self, batch: Batch) -> None:
        """Hangs :class:`Recompute` off ``batch`` (the output batch), in place."""
        index = batch.find_tensor_idx()
        # batch[index] requires grad: it came out of Checkpoint with a phony
        # that requires grad.
        batch[index], phony = fork(batch[index])
        phony = Recompute.apply(phony, self.recomputed, self.states, self.function,
                                self.batch.atomic, *self.batch)
        # Join into every output that may get a gradient, so that Recompute
        # runs whichever outputs the loss uses (not only batch[index]).
        for i, value in enumerate(list(batch)):
            if i == index or (isinstance(value, Tensor) and value.requires_grad):
                batch[i] = join(value, phony)


def _call(function: Function, atomic: bool, inputs: Tuple[Any, ...]) -> Any:
    if atomic:
        assert len(inputs) == 1
        output = function(inputs[0])
    else:
        output = function(*inputs)
    return tuple(output) if isinstance(output, list) else output


_NON_INPUT_ARGS = 6  # phony, recomputed, states, rng, function, input_atomic


class Checkpoint(torch.autograd.Function):
    """Runs the function without saving activations; backpropagates through
    the graph that :class:`Recompute` rebuilt."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, recomputed: Deque[Recomputed],  # type: ignore[override]
                states: Deque[_CallState], rng: RandomStream, function: Function,
                input_atomic: bool, *inputs: Any) -> TensorOrTensors:
        ctx.recomputed = recomputed
        ctx.num_inputs = len(inputs)
        ctx.set_materialize_grads(False)
        state = _CallState(rng, capture_autocast_state())
        states.append(state)
        with torch.no_grad(), enable_checkpointing(), rng.activate():
            return _call(function, input_atomic, inputs)

    @staticmethod
    def backward(ctx: Any, *grad_output: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        if not ctx.recomputed:
            raise RuntimeError("Checkpoint.backward ran before its Recompute: "
                               "call Checkpointing.recompute() on the output batch")
        output, input_leaf = ctx.recomputed.pop()
        outputs = output if isinstance(output, tuple) else (output,)
        pairs = [(y, g) for y, g in zip(outputs, grad_output)
                 if isinstance(y, Tensor) and y.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        grad_input: List[Optional[Tensor]] = [None] * _NON_INPUT_ARGS
        grad_input.extend(x.grad if isinstance(x, Tensor) else None for x in input_leaf)
        return tuple(grad_input)


class Recompute(torch.autograd.Function):
    """Reruns the function with grad enabled when the output phony's gradient
    arrives, and hands ``(output, input_leaf)`` to :class:`Checkpoint`."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, recomputed: Deque[Recomputed],  # type: ignore[override]
                states: Deque[_CallState], function: Function, input_atomic: bool,
                *inputs: Any) -> Tensor:
        ctx.recomputed = recomputed
        ctx.state = states[-1]
        ctx.function = function
        ctx.input_atomic = input_atomic
        ctx.num_inputs = len(inputs)
        # Tensors go through save_for_backward (version-checked); the rest as is.
        ctx.tensor_idx = [i for i, x in enumerate(inputs) if isinstance(x, Tensor)]
        ctx.others = [None if isinstance(x, Tensor) else x for x in inputs]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_idx))
        return phony

    @staticmethod
    def backward(ctx: Any, *grad_output: Any) -> Tuple[None, ...]:
        inputs = list(ctx.others)
        for i, tensor in zip(ctx.tensor_idx, ctx.saved_tensors):
            inputs[i] = tensor
        input_leaf = tuple(x.detach().requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x
                           for x in inputs)
        state: _CallState = ctx.state
        with torch.enable_grad(), enable_recomputing(), state.rng.activate(), state.autocast.restore():
            output = _call(ctx.function, ctx.input_atomic, input_leaf)
        ctx.recomputed.append((output, input_leaf))
        return (None,) * (5 + ctx.num_inputs)
