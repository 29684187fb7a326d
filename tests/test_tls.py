"""The caller's thread state on workers: the intra-op thread count
(``torch.set_num_threads``, kept per thread by OpenMP), issue 30 item 4.
(Autocast, inference mode, saved-tensor hooks and CUDA streams: see
test_parallel.py and test_call_streams.py.)"""
import threading
from typing import Iterator, List

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import parallel_apply
from moe_autograd.executor import WORKER_THREADS

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_thread() -> Iterator[int]:
    """The caller at one intra-op thread (the demo's setting), then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if WORKER_THREADS != 1 else 2)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


class Sees(nn.Module):
    """Records the intra-op thread count of its forward and its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 64)
        self.forward_saw: List[int] = []
        self.backward_saw: List[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.forward_saw.append(torch.get_num_threads())
        y = self.fc(x)
        if y.requires_grad:
            y.register_hook(lambda g: self.backward_saw.append(torch.get_num_threads()))
        return y


@pytest.mark.parametrize("mode", ["lanes", "parallel", "auto"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_calls_run_at_the_callers_thread_count(one_thread: int, mode: str,
                                               checkpoint: bool) -> None:
    """Forward, recomputation and backward of every call, on every thread,
    at the caller's count; the workers are back at theirs afterwards."""
    experts = [Sees() for _ in range(4)]
    xs = [torch.randn(16, 32) for _ in experts]
    for _ in range(2):  # auto: the site's own mode on the second batch
        outs = parallel_apply(experts, xs, mode=mode, checkpoint=checkpoint)
        sum(o.sum() for o in outs).backward()
    seen = {n for e in experts for n in e.forward_saw + e.backward_saw}
    assert seen == {one_thread}
    assert all(e.backward_saw for e in experts)

    counts: List[int] = []
    barrier = threading.Barrier(4, timeout=20)

    def default_state(x: Tensor) -> Tensor:
        barrier.wait()  # on four threads: the workers' own count between tasks
        counts.append(torch.get_num_threads())
        return x

    torch.set_num_threads(WORKER_THREADS)
    parallel_apply([default_state] * 4, [torch.ones(1)] * 4, mode="parallel")
    assert counts == [WORKER_THREADS] * 4


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_results_are_the_loops_bits_at_the_callers_thread_count(one_thread: int,
                                                                mode: str) -> None:
    """Reductions split by thread count: a Linear's outputs and gradients
    at the caller's count are the loop's bits (53-115 of 200 outputs
    differed in the last bit before)."""
    torch.manual_seed(0)
    experts = [nn.Linear(256, 20) for _ in range(4)]
    xs = [torch.randn(64, 256, requires_grad=True) for _ in experts]
    want = [e(x) for e, x in zip(experts, xs)]
    want_grads = torch.autograd.grad(sum(o.square().sum() for o in want), xs)
    got = parallel_apply(experts, xs, mode=mode)
    got_grads = torch.autograd.grad(sum(o.square().sum() for o in got), xs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
