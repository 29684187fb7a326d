"""CPU/CUDA stream helpers, so that one code path serves both.

An expert on a CUDA device runs on that device's stream; on CPU there is no
stream, and :data:`CPUStream` stands in for one. Every helper accepts either, so
the runtime never branches on the device except here.

Invariant: a tensor produced on one stream and used on another is guarded with
:func:`record_stream` and the consumer :func:`wait_stream`\\ s on the producer,
so the caching allocator never reuses its memory too early.
"""
from contextlib import contextmanager
from typing import Generator, Union, cast

import torch

__all__ = [
    "AbstractStream", "CPUStream", "new_stream", "current_stream", "default_stream",
    "use_device", "use_stream", "get_device", "wait_stream", "record_stream", "is_cuda",
]


class _CPUStreamType:
    """The stream of the CPU: work on it is always synchronous."""

    def __repr__(self) -> str:
        return "CPUStream"


CPUStream = _CPUStreamType()
AbstractStream = Union[torch.cuda.Stream, _CPUStreamType]


def is_cuda(stream: AbstractStream) -> bool:
    return stream is not CPUStream


def _as_cuda(stream: AbstractStream) -> torch.cuda.Stream:
    return cast(torch.cuda.Stream, stream)


def new_stream(device: torch.device) -> AbstractStream:
    """A new stream on ``device`` (:data:`CPUStream` on CPU)."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.current_stream(device)


def default_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.default_stream(device)


@contextmanager
def use_device(device: torch.device) -> Generator[None, None, None]:
    """Makes ``device`` current on this thread (CUDA only)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextmanager
def use_stream(stream: AbstractStream) -> Generator[None, None, None]:
    """Makes ``stream`` current on this thread (CUDA only)."""
    if not is_cuda(stream):
        yield
        return
    with torch.cuda.stream(_as_cuda(stream)):
        yield


def get_device(stream: AbstractStream) -> torch.device:
    if is_cuda(stream):
        return _as_cuda(stream).device
    return torch.device("cpu")


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """Makes ``source`` wait for the work queued on ``target`` so far."""
    if is_cuda(target):
        if is_cuda(source):
            _as_cuda(source).wait_stream(_as_cuda(target))
        else:
            _as_cuda(target).synchronize()
    # Waiting on the CPU stream is a no-op: CPU work is already done.


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Tells the caching allocator that ``stream`` uses ``tensor``'s whole
    storage block: the allocator looks the block up by the storage's pointer,
    so a view records all of it. Called directly, not through a tensor made
    with ``set_`` on the storage as torchgpipe did: ``set_`` is a mutating op,
    which PyTorch's CUDA sanitizer counts as a write on the current stream,
    racing with every later read on another stream."""
    if not is_cuda(stream):
        return
    tensor.record_stream(_as_cuda(stream))

