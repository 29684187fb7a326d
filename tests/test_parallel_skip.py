"""Experts made of ``@skippable`` layers under ``parallel_apply``.

Every call runs against a tracker of its own on its worker thread (forward and
recomputation), so concurrent calls of the SAME expert module never see each
other's stashes; gradients equal the plain module's; nothing stays behind in
a tracker, and stashed tensors die with backward.
"""
import threading
import weakref
from typing import Any, Generator, List, Optional, Sequence

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import is_recomputing, parallel_apply
from moe_autograd.skip import pop, skippable, stash
from moe_autograd.skip.layout import SkipLayout
from moe_autograd.skip.tracker import (
    SkipTracker, SkipTrackerThroughPortals, current_skip_tracker, use_skip_tracker,
)
from helpers import wait_dead

D = 6
MODES = [False, True, "mixed"]
MODE_IDS = ["plain", "checkpoint", "mixed"]



def _flags(mode: Any, n: int) -> Any:
    """The ``checkpoint`` argument of a mode: a bool, or one per call."""
    return [i % 2 == 0 for i in range(n)] if mode == "mixed" else mode


def _checkpointed(mode: Any, n: int) -> List[bool]:
    flags = _flags(mode, n)
    return list(flags) if isinstance(flags, list) else [flags] * n


class Probe:
    """What the skippable layers saw, shared by every call of one test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.trackers: List[SkipTracker] = []
        self.stashed: List[weakref.ref] = []
        self.recomputing: List[bool] = []


@skippable(stash=["skip"])
class StashSkip(nn.Module):
    def __init__(self, probe: Optional[Probe] = None) -> None:
        super().__init__()
        self.probe = probe

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = x * 3  # a tensor made here, handed to the pop through the tracker
        if self.probe is not None:
            with self.probe.lock:
                self.probe.trackers.append(current_skip_tracker())
                self.probe.stashed.append(weakref.ref(skip))
                self.probe.recomputing.append(is_recomputing())
        yield stash("skip", skip)
        return x


@skippable(pop=["skip"])
class PopSkip(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return x * skip  # mul saves the popped tensor for backward


class Rendezvous(nn.Module):
    """Between stash and pop: every call's stash happens before any call pops
    (in forward and in recomputation, each with its own barrier)."""

    def __init__(self, forward_barrier: threading.Barrier,
                 recompute_barrier: threading.Barrier) -> None:
        super().__init__()
        self.forward_barrier, self.recompute_barrier = forward_barrier, recompute_barrier

    def forward(self, x: Tensor) -> Tensor:
        (self.recompute_barrier if is_recomputing() else self.forward_barrier).wait()
        return x


def _expert(probe: Optional[Probe] = None, middle: Optional[nn.Module] = None) -> nn.Sequential:
    layers: List[nn.Module] = [StashSkip(probe), nn.Linear(D, D, dtype=torch.float64), nn.Tanh()]
    if middle is not None:
        layers.append(middle)
    layers.append(PopSkip())
    return nn.Sequential(*layers)


def _inputs(n: int) -> List[Tensor]:
    return [torch.randn(4, D, dtype=torch.float64, requires_grad=True) for _ in range(n)]


def _reference(experts: Sequence[nn.Module], xs: Sequence[Tensor], leaves: Sequence[Tensor]):
    """Outputs and grads of the plain modules, one after the other."""
    with use_skip_tracker(SkipTracker()):
        outs = [e(x) for e, x in zip(experts, xs)]
    sum(((i + 1) * o).sum() for i, o in enumerate(outs)).backward()
    grads = [p.grad.clone() for p in leaves]
    for p in leaves:
        p.grad = None
    return [o.detach() for o in outs], grads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_skippable_experts_match_plain_modules(mode: Any) -> None:
    torch.manual_seed(0)
    n = 4
    experts = [_expert() for _ in range(n)]
    xs = _inputs(n)
    leaves = [p for e in experts for p in e.parameters()] + xs
    ref_outs, ref_grads = _reference(experts, xs, leaves)

    main_tracker = current_skip_tracker()
    outs = parallel_apply(experts, xs, checkpoint=_flags(mode, n))
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    sum(((i + 1) * o).sum() for i, o in enumerate(outs)).backward()
    for g, r in zip([p.grad for p in leaves], ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert current_skip_tracker() is main_tracker and not main_tracker.tensors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_calls_of_one_module_keep_their_stashes_apart(mode: Any, fresh_pool: Any) -> None:
    """Calls of one module object run their forwards in call order (its state
    evolves as in the loop); their recomputations run concurrently."""
    fresh_pool(32)
    torch.manual_seed(0)
    n = 6
    probe = Probe()
    forward_barrier = threading.Barrier(1, timeout=10)
    recomputed = sum(_checkpointed(mode, n))
    recompute_barrier = threading.Barrier(max(recomputed, 1), timeout=10)
    expert = _expert(probe, Rendezvous(forward_barrier, recompute_barrier))
    xs = _inputs(n)
    leaves = list(expert.parameters()) + xs

    # The reference runs the calls one by one: the barrier must not block it.
    plain = _expert()
    plain.load_state_dict(expert.state_dict(), strict=False)
    ref_outs, ref_grads = _reference([plain] * n, xs, list(plain.parameters()) + xs)

    outs = parallel_apply([expert] * n, xs, checkpoint=_flags(mode, n))
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o, r, rtol=0, atol=0)  # each call popped its own stash
    sum(((i + 1) * o).sum() for i, o in enumerate(outs)).backward()
    for g, r in zip([p.grad for p in leaves], ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert not forward_barrier.broken and not recompute_barrier.broken

    assert sum(probe.recomputing) == recomputed
    assert len(probe.trackers) == n + recomputed
    # One tracker per run (forward and recomputation), none of them the
    # caller's, and every one empty once its run finished.
    assert len({id(t) for t in probe.trackers}) == len(probe.trackers)
    assert all(t is not current_skip_tracker() for t in probe.trackers)
    assert all(not t.tensors for t in probe.trackers)


@pytest.mark.timeout(60)
def test_a_call_cannot_pop_what_another_call_stashed(fresh_pool: Any) -> None:
    """Call 0 only stashes, call 1 only pops, after call 0's stash: the pop
    must fail (it would succeed on a shared tracker)."""
    fresh_pool(8)
    stashed = threading.Event()

    class SignalAfter(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            stashed.set()
            return x

    class WaitBefore(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            assert stashed.wait(10)
            return x

    stash_only = nn.Sequential(StashSkip(), SignalAfter())
    pop_only = nn.Sequential(WaitBefore(), PopSkip())
    xs = _inputs(2)
    with pytest.raises(RuntimeError, match="has not been stashed"):
        parallel_apply([stash_only, pop_only], xs)


@pytest.mark.timeout(60)
def test_the_callers_portal_tracker_is_not_used_by_the_calls() -> None:
    torch.manual_seed(0)
    n = 3
    probe = Probe()
    experts = [_expert(probe) for _ in range(n)]
    xs = _inputs(n)
    portal_tracker = SkipTrackerThroughPortals(SkipLayout(1, {}))
    with use_skip_tracker(portal_tracker):
        outs = parallel_apply(experts, xs, checkpoint=True)
        sum(o.sum() for o in outs).backward()
        assert current_skip_tracker() is portal_tracker
    assert not portal_tracker.tensors and not portal_tracker.portals
    assert all(type(t) is SkipTracker and t is not portal_tracker for t in probe.trackers)
    assert all(not t.tensors for t in probe.trackers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_stashed_tensors_freed_after_backward(mode: Any) -> None:
    torch.manual_seed(0)
    n = 4
    probe = Probe()
    experts = [_expert(probe) for _ in range(n)]
    xs = _inputs(n)
    outs = parallel_apply(experts, xs, checkpoint=_flags(mode, n))
    checkpointed = _checkpointed(mode, n)
    if not any(checkpointed):
        # A plain call keeps the popped tensor for its backward (x * skip).
        assert not any(r() is None for r in probe.stashed)
    sum(o.sum() for o in outs).backward()
    # Every stashed tensor (forward and recomputation) dies with backward,
    # while the caller still holds the outputs; no tracker keeps anything.
    assert len(probe.stashed) == n + sum(checkpointed)
    assert wait_dead(probe.stashed) == [False] * len(probe.stashed)
    assert all(not t.tensors for t in probe.trackers)
    assert len(outs) == n


@pytest.mark.timeout(60)
def test_skippable_layers_used_directly_as_experts() -> None:
    """Each call is a fresh forward: a stash-and-pop layer works per call."""

    @skippable(stash=["h"], pop=[])
    class StashAndReturn(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield stash("h", x)
            return x * 2

    torch.manual_seed(0)
    experts = [nn.Sequential(StashAndReturn(), PopH()) for _ in range(3)]
    xs = _inputs(3)
    outs = parallel_apply(experts, xs, checkpoint=[True, False, True])
    for o, x in zip(outs, xs):
        torch.testing.assert_close(o, x * 2 + x, rtol=0, atol=0)
    sum(o.sum() for o in outs).backward()
    for x in xs:
        torch.testing.assert_close(x.grad, torch.full_like(x, 3.0), rtol=0, atol=0)


@skippable(pop=["h"])
class PopH(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        h = yield pop("h")
        return x + h
