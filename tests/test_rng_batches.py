"""Random streams of a batch of calls (:mod:`moe_autograd.rng`) where the
runtime really runs calls at once: ``parallel``, and ``lanes`` with more than
one lane (the ``several_lanes`` fixture; a 2-core machine otherwise gets one
lane, a plain loop). Issue 34: survivors of a mutation run.

* The rewind of the global generator after a batch that raised
  (:func:`~moe_autograd.rng.rewind_unrun_draws`): only when the loop would
  not have drawn, i.e. never when the failing call is itself the first that
  drew.
* A ``torch.Generator`` shared by calls that run at once raises.
"""
from typing import List

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import parallel_apply

CONCURRENT = ["lanes", "parallel"]


class Draws(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + torch.randn_like(x)


class DrawsThenFails(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        torch.randn_like(x)
        raise ValueError("boom after drawing")


class Fails(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise ValueError("boom before drawing")


class Quiet(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 2


class OwnNoise(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.gen = gen

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.randn(x.shape, generator=self.gen)


def _raises_and_moves_the_generator(modules: List[nn.Module], mode: str) -> bool:
    torch.manual_seed(1234)
    xs = [torch.randn(2, 3) for _ in modules]
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match="boom"):
        parallel_apply(modules, xs, mode=mode)
    return not torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("mode", ["inline"] + CONCURRENT)
@pytest.mark.parametrize("before", [0, 1], ids=["first-call", "after-a-quiet-call"])
def test_a_failing_call_that_drew_first_leaves_the_global_generator_moved(
        mode: str, before: int, several_lanes: int) -> None:
    # The loop ran the failing call, which drew: the generator moved, so
    # the runtime must not rewind it (the failing call is the first that drew).
    modules: List[nn.Module] = [Quiet()] * before + [DrawsThenFails(), Draws(), Draws()]
    assert _raises_and_moves_the_generator(modules, mode)


@pytest.mark.parametrize("mode", ["inline"] + CONCURRENT)
def test_a_batch_failing_before_any_drawing_call_leaves_the_global_generator_alone(
        mode: str, several_lanes: int) -> None:
    # The loop stopped at call 1, before the drawing calls 2 and 3: whatever
    # they drew concurrently is rewound.
    assert not _raises_and_moves_the_generator([Quiet(), Fails(), Draws(), Draws()], mode)


@pytest.mark.parametrize("mode", CONCURRENT)
def test_a_generator_shared_by_calls_running_at_once_raises(mode: str, several_lanes: int) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"draw from the same torch.Generator"):
        parallel_apply([OwnNoise(gen) for _ in range(3)], [x, x, x], mode=mode)


@pytest.mark.parametrize("mode", CONCURRENT)
def test_own_generators_of_calls_running_at_once_draw_as_the_loop(
        mode: str, several_lanes: int) -> None:
    def run(modules: List[nn.Module], x: Tensor, ours: bool) -> List[Tensor]:
        if ours:
            return parallel_apply(modules, [x] * len(modules), mode=mode)
        return [m(x) for m in modules]
    x = torch.randn(3, 4)
    got = run([OwnNoise(torch.Generator().manual_seed(k)) for k in range(4)], x, True)
    want = run([OwnNoise(torch.Generator().manual_seed(k)) for k in range(4)], x, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_several_lanes_really_run_in_lanes(several_lanes: int) -> None:
    from moe_autograd import policy
    decision = policy.choose(("test_rng_batches", 0), 4, mode="lanes")
    assert decision.mode == "lanes" and decision.lanes == several_lanes
