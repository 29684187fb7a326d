"""Portal lives, gradients through portals, and freeing of portal tensors."""
import gc
import weakref
from typing import Any, Generator, List, Tuple

import pytest
import torch
from torch import Tensor, nn

from moe_autograd.checkpoint import enable_checkpointing, enable_recomputing
from moe_autograd.dependency import fork, join
from moe_autograd.microbatch import Batch
from moe_autograd.skip import pop, skippable, stash
from moe_autograd.skip.layout import SkipLayout, inspect_skip_layout
from moe_autograd.skip import portal as portal_module
from moe_autograd.skip.portal import Portal
from moe_autograd.skip.tracker import (
    SkipTracker, SkipTrackerThroughPortals, SkipTrackerThroughPotals, use_skip_tracker,
)
from moe_autograd.stream import CPUStream

KEY = (None, "skip")


def test_portal_life_2_dropped_after_orange_forward() -> None:
    t = torch.rand(3, requires_grad=True) * 2
    portal = Portal(t, 2)
    assert (portal.tensor, portal.tensor_life) == (t, 2)

    portal.blue()
    assert portal.tensor is t and portal.tensor_life == 1

    _, phony = fork(torch.rand(1, requires_grad=True))
    out = portal.orange(phony)
    assert portal.tensor is None and portal.tensor_life == 0
    assert out is not None and torch.equal(out, t)

    with pytest.raises(RuntimeError, match="has been dropped"):
        portal.orange(phony)
    with pytest.raises(RuntimeError, match="has been dropped"):
        portal.blue()
    with pytest.raises(RuntimeError, match="has been dropped"):
        portal.use_tensor()


def test_put_tensor_life_zero_keeps_nothing() -> None:
    portal = Portal(torch.ones(1), 0)
    assert portal.tensor is None
    portal.put_tensor(torch.ones(1), 1)
    assert portal.tensor_life == 1
    assert portal.use_tensor() is not None
    assert portal.tensor is None


def test_gradient_flows_through_portal() -> None:
    a = torch.rand(3, requires_grad=True)
    b = torch.rand(3, requires_grad=True)
    portal = Portal(a * 2, 2)

    main = join(b * 1, portal.blue())
    main, phony = fork(main)
    skip = portal.orange(phony)
    assert skip is not None
    (main * skip).sum().backward()

    torch.testing.assert_close(a.grad, 2 * b.detach())
    torch.testing.assert_close(b.grad, 2 * a.detach())
    assert portal.grad is None  # taken by PortalBlue.backward


def test_portal_copy_moves_tensor_and_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    moves: List[str] = []
    original = portal_module._move

    def spy(tensor: Tensor, src: Any, dst: Any) -> Tensor:
        moves.append("grad" if tensor is portal.grad else "tensor")
        return original(tensor, src, dst)

    monkeypatch.setattr(portal_module, "_move", spy)
    a = torch.rand(3, requires_grad=True)
    b = torch.rand(3, requires_grad=True)
    portal = Portal(a * 3, 2)

    main = join(b * 1, portal.blue())
    main, phony = fork(main)
    main = join(main, portal.copy(CPUStream, CPUStream, phony))
    main, phony = fork(main)
    skip = portal.orange(phony)
    assert moves == ["tensor"]
    (main + skip).sum().backward()
    assert moves == ["tensor", "grad"]  # PortalCopy.backward ran after PortalOrange.backward
    torch.testing.assert_close(a.grad, torch.full((3,), 3.0))
    torch.testing.assert_close(b.grad, torch.ones(3))


def test_portal_tensor_freed_after_backward() -> None:
    a = torch.rand(1000, requires_grad=True)
    b = torch.rand(1000, requires_grad=True)
    t = a * 2
    ref = weakref.ref(t)
    portal = Portal(t, 2)
    del t

    main = join(b * 1, portal.blue())
    main, phony = fork(main)
    skip = portal.orange(phony)
    assert portal.tensor is None  # dropped at PortalOrange.forward
    loss = (main * skip).sum()
    del main, skip, phony
    loss.backward()
    del loss
    gc.collect()
    assert ref() is None
    assert portal.tensor is None and portal.grad is None


def _tracker(route: Tuple[int, int] = (0, 1)) -> SkipTrackerThroughPortals:
    return SkipTrackerThroughPortals(SkipLayout(2, {KEY: route}))


def _batch() -> Batch:
    return Batch(torch.rand(2, requires_grad=True))


def test_historical_alias() -> None:
    assert SkipTrackerThroughPotals is SkipTrackerThroughPortals


def test_tracker_life_2_without_checkpointing() -> None:
    tracker = _tracker()
    t = torch.rand(2)
    batch = _batch()
    tracker.save(batch, None, "skip", t)
    portal = tracker.portals[KEY]
    assert portal.tensor is t and portal.tensor_life == 1  # 2, minus blue()
    assert batch.tensor.grad_fn is not None  # joined with the portal

    out = tracker.load(_batch(), None, "skip")
    assert out is not None and torch.equal(out, t)
    assert portal.tensor is None and portal.tensor_life == 0
    assert tracker.tensors == {}
    with pytest.raises(RuntimeError, match="has been dropped"):
        tracker.load(_batch(), None, "skip")


def test_tracker_lives_under_checkpointing_and_recomputation(monkeypatch: pytest.MonkeyPatch) -> None:
    tracker = _tracker()
    t = torch.rand(2)
    with enable_checkpointing(), torch.no_grad():
        tracker.save(_batch(), None, "skip", t)
    portal = tracker.portals[KEY]
    assert portal.tensor_life == 2  # 3, minus blue()

    with enable_checkpointing(), torch.no_grad():
        tracker.load(_batch(), None, "skip")
    assert portal.tensor is t and portal.tensor_life == 1  # kept for the recomputed pop

    with enable_recomputing():
        out = tracker.load(_batch(), None, "skip")
    assert out is not None and torch.equal(out, t)
    assert portal.tensor is None and portal.tensor_life == 0

    puts: List[int] = []
    original = Portal.put_tensor

    def spy(self: Portal, tensor: Any, tensor_life: int) -> None:
        puts.append(tensor_life)
        original(self, tensor, tensor_life)

    monkeypatch.setattr(Portal, "put_tensor", spy)
    t2 = torch.rand(2, requires_grad=True)
    with enable_recomputing():
        tracker.save(_batch(), None, "skip", t2)
    assert puts == [1]  # reset to 1 ...
    assert tracker.portals[KEY] is portal
    assert portal.tensor is None and portal.tensor_life == 0  # ... spent by the recomputed blue()
    with pytest.raises(RuntimeError, match="has been dropped"):
        with enable_recomputing():
            tracker.load(_batch(), None, "skip")


def test_route_without_copy_creates_no_portal() -> None:
    tracker = _tracker(route=(1, 1))
    t = torch.rand(2)
    batch = _batch()
    before = batch.tensor
    tracker.save(batch, None, "skip", t)
    assert tracker.portals == {}
    assert batch.tensor is before
    assert tracker.tensors == {KEY: t}
    assert tracker.load(_batch(), None, "skip") is t
    assert tracker.tensors == {}
    with pytest.raises(ValueError, match="nothing to copy"):
        tracker.copy(_batch(), CPUStream, CPUStream, None, "skip")


def test_plain_tracker_cannot_copy() -> None:
    with pytest.raises(TypeError, match="not supported"):
        SkipTracker().copy(_batch(), CPUStream, CPUStream, None, "skip")


@skippable(stash=["skip"])
class StashLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("skip", x * 2)
        return self.linear(x)


@skippable(pop=["skip"])
class PopMul(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return x * skip


def test_two_partitions_through_portals_match_plain_sequential() -> None:
    torch.manual_seed(0)
    partitions = [nn.Sequential(StashLinear(), nn.Tanh()), nn.Sequential(nn.Linear(4, 4), PopMul())]
    layout = inspect_skip_layout(partitions)
    assert layout.requires_copy(None, "skip")

    x = torch.randn(3, 4, requires_grad=True)
    tracker = SkipTrackerThroughPortals(layout)
    with use_skip_tracker(tracker):
        h = partitions[0](x)
    batch = Batch(h)
    for prev_j, ns, name in layout.copy_policy(1):
        assert prev_j == 0
        tracker.copy(batch, CPUStream, CPUStream, ns, name)
    with use_skip_tracker(tracker):
        y = partitions[1](batch.tensor)
    portal = tracker.portals[KEY]
    assert portal.tensor is None and tracker.tensors == {}
    y.pow(2).sum().backward()
    assert portal.grad is None

    params = [p for part in partitions for p in part.parameters()]
    got = [x.grad] + [p.grad for p in params]
    x2 = x.detach().requires_grad_()
    with use_skip_tracker(SkipTracker()):
        expected = nn.Sequential(*partitions[0], *partitions[1])(x2).pow(2).sum()
    want = torch.autograd.grad(expected, [x2] + params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
