"""Skip trackers are per thread; worker threads with fresh trackers never mix."""
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generator, List, Optional

import pytest
import torch
from torch import Tensor, nn

from moe_autograd.microbatch import Batch
from moe_autograd.skip import pop, skippable, stash
from moe_autograd.skip.layout import SkipLayout
from moe_autograd.skip.tracker import (
    SkipTracker, SkipTrackerThroughPortals, current_skip_tracker, use_skip_tracker,
)


def test_use_skip_tracker_nests_and_restores() -> None:
    outer, inner = SkipTracker(), SkipTracker()
    default = current_skip_tracker()
    assert current_skip_tracker() is default  # created once, then reused
    with use_skip_tracker(outer):
        assert current_skip_tracker() is outer
        with use_skip_tracker(inner):
            assert current_skip_tracker() is inner
        assert current_skip_tracker() is outer
    assert current_skip_tracker() is default


def test_use_skip_tracker_restores_on_error() -> None:
    before = current_skip_tracker()
    with pytest.raises(ValueError):
        with use_skip_tracker(SkipTracker()):
            raise ValueError
    assert current_skip_tracker() is before


def test_load_unknown_is_key_error() -> None:
    with pytest.raises(KeyError):
        SkipTracker().load(Batch(torch.zeros(1)), None, "missing")


@pytest.mark.timeout(60)
def test_new_thread_gets_its_own_plain_tracker() -> None:
    portal_tracker = SkipTrackerThroughPortals(SkipLayout(1, {}))
    seen: List[Optional[SkipTracker]] = [None, None]

    def worker(i: int) -> None:
        first = current_skip_tracker()
        assert current_skip_tracker() is first
        seen[i] = first

    with use_skip_tracker(portal_tracker):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert current_skip_tracker() is portal_tracker

    a, b = seen
    assert type(a) is SkipTracker and type(b) is SkipTracker
    assert a is not b and a is not portal_tracker


@skippable(stash=["skip"])
class Stash(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("skip", x)
        return x * 2


@skippable(pop=["skip"])
class Pop(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return x + skip


class Rendezvous(nn.Module):
    """Holds every worker between its stash and its pop."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier

    def forward(self, x: Tensor) -> Tensor:
        self.barrier.wait(timeout=30)
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fresh_tracker", [True, False], ids=["fresh", "thread-default"])
def test_concurrent_workers_stay_isolated(fresh_tracker: bool) -> None:
    workers = 8
    barrier = threading.Barrier(workers)
    model = nn.Sequential(Stash(), Rendezvous(barrier), Pop())
    trackers: List[SkipTracker] = []
    lock = threading.Lock()

    def expert(i: int) -> Tensor:
        x = torch.full((4,), float(i), requires_grad=True)
        if fresh_tracker:
            tracker = SkipTracker()
            with use_skip_tracker(tracker):
                y = model(x)
        else:
            tracker = current_skip_tracker()
            y = model(x)
        y.sum().backward()
        with lock:
            trackers.append(tracker)
        torch.testing.assert_close(x.grad, torch.full((4,), 3.0))
        return y.detach()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        outs = list(pool.map(expert, range(workers)))

    for i, out in enumerate(outs):
        torch.testing.assert_close(out, torch.full((4,), 3.0 * i))
    assert len({id(t) for t in trackers}) == workers
    assert all(t.tensors == {} for t in trackers)  # nothing leaks
