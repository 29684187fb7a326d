"""Skippable layers under moe_autograd.checkpoint: plain trackers and portals."""
import gc
import threading
import weakref
from typing import Any, Callable, Generator, List

import pytest
import torch
from torch import Tensor, nn

from moe_autograd.checkpoint import checkpoint
from moe_autograd.microbatch import Batch
from moe_autograd.skip import pop, skippable, stash
from moe_autograd.skip.layout import inspect_skip_layout
from moe_autograd.skip.tracker import (
    SkipTracker, SkipTrackerThroughPortals, current_skip_tracker, use_skip_tracker,
)
from moe_autograd.stream import CPUStream

KEY = (None, "skip")


@skippable(stash=["skip"])
class StashLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.stashed: List["weakref.ref[Tensor]"] = []

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = torch.tanh(x) * 2
        self.stashed.append(weakref.ref(skip))
        yield stash("skip", skip)
        return self.linear(x)


@skippable(pop=["skip"])
class PopMul(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return x * skip


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(StashLinear(), nn.ReLU(), nn.Linear(4, 4), PopMul())


def _grads(model: nn.Module, x: Tensor) -> List[Tensor]:
    return [g for g in [x.grad] + [p.grad for p in model.parameters()] if g is not None]


def _reference(model: nn.Sequential, x: Tensor, seed: int) -> List[Tensor]:
    x = x.detach().requires_grad_()
    model.zero_grad()
    torch.manual_seed(seed)
    with use_skip_tracker(SkipTracker()):
        model(x).pow(2).sum().backward()
    grads = [g.clone() for g in _grads(model, x)]
    model.zero_grad()
    return grads


def test_skippable_under_checkpoint_matches_plain() -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    want = _reference(model, x, seed=5)

    tracker = SkipTracker()
    with use_skip_tracker(tracker):
        torch.manual_seed(5)
        y = checkpoint(model, x)
        assert tracker.tensors == {}
        y.pow(2).sum().backward()  # recomputes on this thread, same tracker
    assert tracker.tensors == {}
    got = _grads(model, x)
    assert len(got) == len(want) == 1 + len(list(model.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.timeout(60)
def test_worker_forward_main_thread_backward_leaves_nothing() -> None:
    model = _model()
    x = torch.randn(3, 4, requires_grad=True)
    want = _reference(model, x, seed=7)
    out: List[Tensor] = []
    worker_tracker = SkipTracker()

    def expert() -> None:
        with use_skip_tracker(worker_tracker):
            torch.manual_seed(7)
            out.append(checkpoint(model, x))

    thread = threading.Thread(target=expert)
    thread.start()
    thread.join(timeout=30)
    assert out and worker_tracker.tensors == {}

    main_tracker = SkipTracker()
    with use_skip_tracker(main_tracker):
        out[0].pow(2).sum().backward()
    assert main_tracker.tensors == {}
    for g, w in zip(_grads(model, x), want):
        torch.testing.assert_close(g, w)


def _run_partition(partition: nn.Module, tracker: SkipTracker) -> Callable[[Tensor], Tensor]:
    def function(input: Tensor) -> Tensor:
        # The pipeline's way: the function carries its tracker, so the
        # recomputation (in backward, maybe on another thread) finds it.
        with use_skip_tracker(tracker):
            return partition(input)

    return function


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_portal_route_across_checkpointed_partitions(checkpointed: bool) -> None:
    model = _model()
    stasher = model[0].module
    partitions = [nn.Sequential(model[0], model[1]), nn.Sequential(model[2], model[3])]
    layout = inspect_skip_layout(partitions)
    x = torch.randn(3, 4, requires_grad=True)
    want = _reference(model, x, seed=11)
    stasher.stashed.clear()

    tracker = SkipTrackerThroughPortals(layout)
    torch.manual_seed(11)
    h: Tensor = x
    for j, partition in enumerate(partitions):
        if j > 0:
            batch = Batch(h)
            for _, ns, name in layout.copy_policy(j):
                tracker.copy(batch, CPUStream, CPUStream, ns, name)
            h = batch.tensor
        function = _run_partition(partition, tracker)
        h = checkpoint(function, h) if checkpointed else function(h)

    portal = tracker.portals[KEY]
    if checkpointed:
        # 3 lives: blue() and PortalOrange.forward spent two; the tensor
        # waits for the recomputed pop.
        assert portal.tensor_life == 1 and portal.tensor is not None
    else:
        assert portal.tensor_life == 0 and portal.tensor is None

    h.pow(2).sum().backward()
    assert portal.tensor_life == 0 and portal.tensor is None and portal.grad is None
    assert tracker.tensors == {}
    assert current_skip_tracker().tensors == {}
    for g, w in zip(_grads(model, x), want):
        torch.testing.assert_close(g, w)

    del h
    gc.collect()
    assert len(stasher.stashed) == (2 if checkpointed else 1)  # forward (+ recomputation)
    assert all(ref() is None for ref in stasher.stashed)
