"""Helpers shared by the runtime tests: user threads, freeing, small Functions."""
import gc
import threading
import time
import weakref
from typing import Any, Callable, List, Sequence

from torch import Tensor
from torch.autograd import Function


def run_threads(target: Callable[[int], None], count: int, timeout: float = 50.0) -> None:
    """Runs ``target(i)`` on ``count`` threads at once. Fails if a thread is
    still running after ``timeout`` seconds (a deadlock) and re-raises the
    first error a thread raised (assertions included)."""
    errors: List[BaseException] = []

    def run(i: int) -> None:
        try:
            target(i)
        except BaseException as error:  # noqa: B902 - re-raised on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,), name=f"user-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"{alive} still running after {timeout}s: deadlocked?"
    if errors:
        raise errors[0]


def wait_dead(refs: Sequence["weakref.ref[Any]"], timeout: float = 5.0) -> List[bool]:
    """Collects garbage until every ref is dead (a worker may still be dropping
    its last reference to a finished group); returns which are still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [r() is not None for r in refs]
        if any(alive):  # a full collection is slow: only when refcounting did not do
            gc.collect()
            alive = [r() is not None for r in refs]
        if not any(alive) or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


class Square(Function):
    """x * x, with its backward written by hand."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * g


class BackwardBarrier(Function):
    """Identity whose backward waits at ``barrier``: proves backwards overlap."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, barrier: threading.Barrier) -> Tensor:  # type: ignore[override]
        ctx.barrier = barrier
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        ctx.barrier.wait()
        return g, None
