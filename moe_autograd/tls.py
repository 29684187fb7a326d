"""The thread-local state that a call carries from its caller to a worker.

PyTorch keeps autocast, inference mode, saved-tensor hooks, the current
CUDA streams and (OpenMP) the intra-op thread count per thread. A call that runs on a worker must see the same state
as if it ran on the caller, otherwise an expert would silently compute in
another precision (autocast), escape the user's saved-tensor hooks
(offloading, memory accounting, non-reentrant checkpoint frames), queue its
kernels on a stream that does not wait for the caller's work (the caller's
``torch.cuda.stream``, or the stream the engine runs a node's backward on), or
split its CPU kernels over another number of threads than the caller's
``torch.set_num_threads`` (other bits: a reduction's partial sums follow the
thread count; and bits that depend on which worker ran the call).
The autograd engine does the same for its own threads.

Invariants:

* :meth:`CallerState.applied` restores the worker's previous state on exit,
  so a worker that serves several callers never mixes their states.
* Python dispatch modes of the caller never apply to a task, on whichever
  thread it runs (a worker never has them; the caller, helping, hides them).
* The user's saved-tensor hooks never run on a worker: a call's forward packs
  into its own :class:`~moe_autograd.saved.CallSaves`, which the caller
  replays through the user's hooks in call order (see :mod:`.saved`); other
  tasks (backward, recomputation) run without them, as their graphs are used
  at once.
"""
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Generator, List, Optional, Tuple, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .executor import WORKER_THREADS
from .saved import CallSaves

__all__ = ["CallerState", "capture", "bind", "autocast_enabled"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_enabled() -> bool:
    """Whether autocast is on in this thread, for any device."""
    return any(torch.is_autocast_enabled(device) for device in _AUTOCAST_DEVICES)


def capture() -> Optional["CallerState"]:
    """The caller's state, or None when it is the default state that every
    worker already has (the common case costs nothing then)."""
    state = CallerState()
    return None if state.is_default else state


class CallerState:
    """A snapshot of the caller thread's state, taken at submission."""

    __slots__ = ("autocast", "cache_enabled", "inference_mode", "saved_tensor_hooks",
                 "dispatch_modes", "cuda_streams", "num_threads")

    def __init__(self) -> None:
        self.autocast: List[Tuple[str, bool, torch.dtype]] = [
            (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
        ]
        self.cache_enabled = torch.is_autocast_cache_enabled()
        self.inference_mode = torch.is_inference_mode_enabled()
        self.saved_tensor_hooks: Optional[Tuple[Any, Any]] = (
            torch._C._autograd._top_saved_tensors_default_hooks(False)
        )
        # Python dispatch modes (selective checkpointing's caches, say) are the
        # caller's own: a task that the caller runs itself must not see them,
        # or what they record depends on which calls the caller happened to run.
        self.dispatch_modes = torch._C._len_torch_dispatch_stack() > 0
        #: The current streams of the CUDA devices where it is not the default.
        self.cuda_streams = _current_cuda_streams()
        #: The intra-op thread count (``torch.set_num_threads``), per thread in
        #: OpenMP: CPU kernels split their work by it, so it decides the bits.
        self.num_threads = torch.get_num_threads()

    @classmethod
    def plain(cls) -> "CallerState":
        """The default state (no autocast, no hooks), to apply where the
        current thread's state must not leak in (a recomputation run on a
        thread inside ``torch.autocast``)."""
        state = cls.__new__(cls)
        state.autocast = [(device, False, torch.get_autocast_dtype(device))
                          for device in _AUTOCAST_DEVICES]
        state.cache_enabled = True
        state.inference_mode = False
        state.saved_tensor_hooks = None
        state.dispatch_modes = False
        state.cuda_streams = ()
        state.num_threads = WORKER_THREADS
        return state

    @property
    def is_default(self) -> bool:
        return not (self.inference_mode or self.saved_tensor_hooks is not None
                    or self.dispatch_modes or self.cuda_streams
                    or self.num_threads != WORKER_THREADS
                    or any(enabled for _, enabled, _ in self.autocast))

    def saves(self) -> Optional[CallSaves]:
        """A fresh record for one call's saved tensors, if the caller has hooks."""
        hooks = self.saved_tensor_hooks
        return None if hooks is None else CallSaves(hooks)

    @contextmanager
    def applied(self, saves: Optional[CallSaves] = None) -> Generator[None, None, None]:
        """Runs the body with this state on the current thread; the body's
        saved tensors go to ``saves`` (see :mod:`.saved`)."""
        with ExitStack() as stack:
            if self.dispatch_modes and torch._C._len_torch_dispatch_stack() > 0:
                stack.enter_context(_disable_current_modes())
            for stream in self.cuda_streams:
                stack.enter_context(torch.cuda.stream(stream))
            if self.num_threads != torch.get_num_threads():
                stack.enter_context(_intra_op_threads(self.num_threads))
            if self.inference_mode and not torch.is_inference_mode_enabled():
                stack.enter_context(torch.inference_mode())
            for device, enabled, dtype in self.autocast:
                if enabled != torch.is_autocast_enabled(device) or (
                    enabled and dtype != torch.get_autocast_dtype(device)
                ):
                    stack.enter_context(_autocast_flags(device, enabled, dtype,
                                                        self.cache_enabled))
            if saves is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(saves.pack, saves.unpack))
            elif self.saved_tensor_hooks is not None:
                # The caller's own thread may run this task (it helps): keep
                # the user's hooks out there too.
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_identity, _identity))
            yield



@contextmanager
def _intra_op_threads(n: int) -> Generator[None, None, None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _current_cuda_streams() -> Tuple[torch.cuda.Stream, ...]:
    if not torch.cuda.is_initialized():
        return ()
    streams = []
    for index in range(torch.cuda.device_count()):
        stream = torch.cuda.current_stream(index)
        if stream != torch.cuda.default_stream(index):
            streams.append(stream)
    return tuple(streams)


def _identity(x: Any) -> Any:
    return x


@contextmanager
def _autocast_flags(device: str, enabled: bool, dtype: torch.dtype,
                    cache_enabled: bool) -> Generator[None, None, None]:
    """The caller's autocast state on this thread, set and restored as flags.

    Not ``torch.autocast``: leaving the outermost ``torch.autocast`` of a
    thread clears autocast's weight cache, which is one for all threads, so
    a worker would empty the caller's cache in the middle of the caller's
    autocast region (the caller's later uses of a weight would cast it again,
    and its gradient would no longer be summed in the low precision first,
    as the loop sums it)."""
    saved = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
             torch.is_autocast_cache_enabled())
    torch.set_autocast_enabled(device, enabled)
    torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_cache_enabled(cache_enabled)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, saved[0])
        torch.set_autocast_dtype(device, saved[1])
        torch.set_autocast_cache_enabled(saved[2])


T = TypeVar("T")


def bind(state: Optional[CallerState], fn: Callable[[], T],
         saves: Optional[CallSaves] = None) -> Callable[[], T]:
    """``fn`` run under ``state`` (``fn`` itself for the default state), its
    saved tensors recorded in ``saves``."""
    if state is None:
        return fn

    def run() -> T:
        with state.applied(saves):
            return fn()
    return run
