"""The runtime's collector hook (moe_autograd.collect), without RPC: an expert
whose calls a collector starts together and completes from its own thread."""
import threading
from typing import Any, Callable, List, Optional, Sequence

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import parallel_apply
from moe_autograd.executor import get_pool
from moe_autograd.parallel import start_calls
from helpers import COLLECTOR, Scaled

pytestmark = pytest.mark.timeout(30)


def test_collected_calls_forward_and_backward_beside_local_ones() -> None:
    COLLECTOR.starts.clear()
    local = nn.Linear(3, 3)
    experts: List[Any] = [Scaled(2.0), local, Scaled(3.0)]
    xs = [torch.randn(4, 3, requires_grad=True) for _ in experts]
    outs = parallel_apply(experts, xs, mode="parallel")
    assert COLLECTOR.starts == ["forward"]  # both collected calls, one start
    torch.testing.assert_close(outs[0], xs[0] * 2)
    torch.testing.assert_close(outs[2], xs[2] * 3)
    sum(o.sum() for o in outs).backward()
    assert COLLECTOR.starts == ["forward", "backward"]
    torch.testing.assert_close(xs[0].grad, torch.full((4, 3), 2.0))
    torch.testing.assert_close(xs[2].grad, torch.full((4, 3), 3.0))
    assert local.weight.grad is not None and xs[1].grad is not None


def test_a_collected_call_fails_alone_and_the_deadline_reaches_the_collector() -> None:
    COLLECTOR.deadlines.clear()
    xs = [torch.randn(2, 3), torch.full((2, 3), float("nan")), torch.randn(2, 3)]
    calls, group = start_calls([Scaled(1.0)] * 3, xs, deadline=2.5)
    group.wait()
    assert COLLECTOR.deadlines == [2.5]
    assert group.succeeded(0) and group.succeeded(2)
    assert isinstance(group.errors[1], ValueError) and "call 1 of 3" in str(group.errors[1])
    with pytest.raises(ValueError, match="non-finite input") as info:
        parallel_apply([Scaled(1.0)] * 3, xs, mode="parallel")
    assert "parallel_apply: call 1 of 3" in getattr(info.value, "__notes__", [])


def test_a_collector_that_raises_fails_its_calls_not_the_others() -> None:
    COLLECTOR.fail_start = True
    try:
        calls, group = start_calls([Scaled(1.0), nn.Identity()], [torch.randn(2), torch.randn(2)])
        group.wait()
    finally:
        COLLECTOR.fail_start = False
    assert isinstance(group.errors[0], RuntimeError) and group.succeeded(1)


def test_external_entries_of_a_group() -> None:
    ran: List[int] = []
    group = get_pool().submit([lambda: ran.append(0), lambda: ran.append(1),
                               lambda: ran.append(2)], external=[1])
    assert not group.wait(0.2, help=True)  # the external entry is still running
    assert sorted(ran) == [0, 2] and not group.done(1)
    assert group.complete(1, "answer") and not group.complete(1, "again")
    assert not group.complete(0, "not external")
    assert group.wait(1.0) and group.results[1] == "answer" and group.succeeded(1)
    group.cancel()  # a completed group: nothing changes
    assert group.results[1] == "answer"
