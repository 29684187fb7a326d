"""Each call on a CUDA stream of its own, so that small experts overlap on the GPU.

Why
---
Kernels queued on one stream run one after another, whatever thread queued
them: calls whose forwards run on different workers but on the same stream
(the caller's, or the default stream every thread starts on) never overlap on
the GPU. With ``MOE_AUTOGRAD_CUDA_STREAMS=N`` (:data:`CALL_STREAMS`), call
``k`` of a batch runs on the ``k % N``-th stream of a pool per device (CUDA
maps streams onto 8 hardware queues by default, so N > 8 only aliases). Its
backward needs nothing more: PyTorch's engine runs each backward op on the
stream of its forward op, so the backwards of different calls overlap on the
GPU too, even where one thread queues them one after another (the engine's
device thread, see :func:`moe_autograd.node._on_device_thread`).

Off by default (N = 0: every call runs on the caller's stream), for two
reasons measured on an H200 (torch 2.11, see BENCHMARKS.md and
``tools/gpu_overlap.py``):

* it is not bit-equal to the loop: in the second of two runs of
  ``tests/test_devices.py`` with it on, 3 of its 31 CUDA cases saw the
  gradient of an input shared by four float64 calls differ from the loop's
  in the last bits (at most 8.9e-16; the first run passed them all). That
  is what cuBLAS documents: it promises the same bits only while one stream
  is active ("if multiple concurrent streams are active, the library may
  optimize total performance by picking different internal
  implementations"); ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, set before the
  process starts, restores its guarantee (not verified on the device);
* it did not pay: 16 experts 1,024-1,024 x 256 tokens, and 8 experts
  1,024-4,096 x 2,048 tokens, bf16, are bound by kernel launches (the GPU is
  busy 11% of the loop's step), and the kernels of different calls
  overlapped for 0-1.4% of their time.

The stream discipline (PyTorch's rules for work that crosses streams)::

    ready   where the batch starts (its forward on the caller's thread, its
            backward on the node's), an event is recorded on the current
            stream of each device: the inputs, or the output gradients, are
            ready there (:func:`record_ready`)
    enter   call stream waits for that event (not for the caller's stream as
            it is when the call starts: by then it waits for the calls handed
            back before, and the calls would run one after another); the
            tensors it is handed are recorded as used on the call stream; the
            call stream becomes current
    body    the call's kernels (forward, recomputation or backward), and the
            tensors they allocate, are on the call stream
    hand    the caller's stream waits for the call stream; every tensor handed
    back    back is recorded as used on the caller's stream, so the caching
            allocator never gives its memory to the call stream's next work
            while the caller's work on it may still be queued

Invariants: with N = 0 or CUDA not initialised nothing here runs (no tensor can be on
a CUDA device then); a thread's current streams are restored on exit; the
caller's stream for a call is the one current on the thread that runs it,
which :mod:`moe_autograd.tls` sets to the submitting thread's.
"""
import os
import threading
from contextlib import ExitStack, contextmanager
from typing import ContextManager, Dict, Generator, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .stream import record_stream, wait_stream

__all__ = ["CALL_STREAMS", "cuda_devices", "record_ready", "call_streams", "hand_back",
           "StreamPairs", "Ready"]

def _configured() -> int:
    value = os.environ.get("MOE_AUTOGRAD_CUDA_STREAMS", "0")
    try:
        streams = int(value)
    except ValueError:
        raise ValueError(f"MOE_AUTOGRAD_CUDA_STREAMS={value!r}: expected a number of streams "
                         "per device (0: every call on the caller's stream)") from None
    if streams < 0:
        raise ValueError(f"MOE_AUTOGRAD_CUDA_STREAMS={value!r}: expected 0 or more")
    return streams


#: Streams per device that the calls of a batch are spread over (0: none,
#: every call runs on the caller's stream). Read from
#: ``MOE_AUTOGRAD_CUDA_STREAMS`` at import; may be set at run time.
CALL_STREAMS = _configured()

#: (the caller's stream, the call's stream), one pair per CUDA device.
StreamPairs = List[Tuple[torch.cuda.Stream, torch.cuda.Stream]]

#: Per device, the event of the work a batch's calls wait for (see ``ready``).
Ready = Dict[torch.device, torch.cuda.Event]

_pools: Dict[int, List[torch.cuda.Stream]] = {}
_lock = threading.Lock()


def cuda_devices(tensors: Iterable[object],
                 device: Optional[torch.device] = None) -> Tuple[torch.device, ...]:
    """The CUDA devices a call works on: ``device`` (where the call's
    module lives), if a CUDA one, then those of ``tensors`` (other objects
    are skipped), in order of first appearance; empty, at no cost, where the
    calls run on the caller's stream (:data:`CALL_STREAMS` 0) or CUDA is not
    initialised."""
    if not CALL_STREAMS or not torch.cuda.is_initialized():
        return ()
    found: List[torch.device] = []
    if device is not None and device.type == "cuda":
        found.append(device)
    for t in tensors:
        if isinstance(t, Tensor) and t.is_cuda and t.device not in found:
            found.append(t.device)
    return tuple(found)


def _stream(device: torch.device, k: int) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    size = max(1, CALL_STREAMS)
    pool = _pools.get(index)
    if pool is None or len(pool) < size:
        with _lock:
            pool = _pools.get(index)
            if pool is None or len(pool) < size:
                pool = (pool or []) + [torch.cuda.Stream(torch.device("cuda", index))
                                       for _ in range(size - len(pool or []))]
                _pools[index] = pool
    return pool[k % size]


def record_ready(devices: Iterable[torch.device]) -> Ready:
    """An event on the current stream of each of ``devices`` (see the
    module's table: ready)."""
    ready: Ready = {}
    for device in devices:
        if device not in ready:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            ready[device] = event
    return ready


def _record(tensors: Iterable[object], stream: torch.cuda.Stream) -> None:
    for t in tensors:
        if isinstance(t, Tensor) and t.is_cuda and t.device == stream.device \
                and t.layout == torch.strided and t.untyped_storage().nbytes():
            record_stream(t, stream)


class _OnCallersStreams:
    """The context of a call with no streams of its own (the default): does
    nothing, costs one attribute lookup (every call's forward and backward
    passes through here)."""

    def __enter__(self) -> StreamPairs:
        return []

    def __exit__(self, *exc: object) -> None:
        return None


_ON_CALLERS_STREAMS = _OnCallersStreams()


def call_streams(devices: Sequence[torch.device], k: int, uses: Sequence[object] = (),
                 ready: Optional[Ready] = None) -> ContextManager[StreamPairs]:
    """Runs the body on call ``k``'s streams of ``devices`` (see the module's
    table: enter), each first waiting for ``ready``'s event of its device (or,
    without one, for the current stream); ``uses`` are the tensors from the
    caller it works on. Yields the stream pairs for :func:`hand_back`; with
    no devices, on the caller's streams (an empty list)."""
    if not devices:
        return _ON_CALLERS_STREAMS
    return _on_call_streams(devices, k, uses, ready)


@contextmanager
def _on_call_streams(devices: Sequence[torch.device], k: int, uses: Sequence[object],
                     ready: Optional[Ready]) -> Generator[StreamPairs, None, None]:
    pairs: StreamPairs = []
    with ExitStack() as stack:
        for device in devices:
            caller = torch.cuda.current_stream(device)
            own = _stream(device, k)
            if own != caller:
                event = ready.get(device) if ready is not None else None
                if event is not None:
                    own.wait_event(event)
                else:
                    wait_stream(own, caller)
                _record(uses, own)
            pairs.append((caller, own))
            stack.enter_context(torch.cuda.stream(own))
        yield pairs


def hand_back(pairs: StreamPairs, tensors: Iterable[object]) -> None:
    """The caller's streams wait for the call's; ``tensors`` are recorded as
    used on the caller's (see the module's table: hand back)."""
    if not pairs:
        return
    tensors = list(tensors)
    for caller, own in pairs:
        if own != caller:
            wait_stream(caller, own)
            _record(tensors, caller)
