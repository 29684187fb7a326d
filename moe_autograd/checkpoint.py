"""Checkpointing with recomputation as its own autograd node (stub: being written)."""
import threading
from contextlib import contextmanager
from typing import Generator

__all__ = ["is_checkpointing", "is_recomputing", "enable_checkpointing", "enable_recomputing"]


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
    """Whether the current thread recomputes a checkpointed forward."""
    return _flags.is_recomputing
