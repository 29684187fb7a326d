"""SkipLayout routes and inspect_skip_layout over partitions."""
from typing import Any, Generator

import pytest
from torch import Tensor, nn

from moe_autograd.skip import Namespace, pop, skippable, stash
from moe_autograd.skip.layout import SkipLayout, inspect_skip_layout


@skippable(stash=["s"])
class Stash(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("s", x)
        return x


@skippable(pop=["s"])
class Pop(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        s = yield pop("s")
        return x + s


def test_requires_copy() -> None:
    ns = Namespace()
    layout = SkipLayout(3, {(None, "cross"): (0, 2), (ns, "local"): (1, 1)})
    assert layout.requires_copy(None, "cross")
    assert not layout.requires_copy(ns, "local")
    assert not layout.requires_copy(None, "local")  # other namespace: no route
    assert not layout.requires_copy(None, "unknown")


def test_copy_policy_skips_local_routes_and_is_sorted() -> None:
    ns = Namespace()
    layout = SkipLayout(
        4,
        {
            (None, "b"): (1, 3),
            (None, "a"): (1, 3),
            (ns, "a"): (0, 3),
            (None, "local"): (3, 3),
        },
    )
    assert list(layout.copy_policy(3)) == [(0, ns, "a"), (1, None, "a"), (1, None, "b")]
    for j in range(3):
        assert list(layout.copy_policy(j)) == []


def test_inspect_skip_layout_over_partitions() -> None:
    ns = Namespace()
    partitions = [
        nn.Sequential(Stash(), nn.ReLU(), Stash().isolate(ns)),
        nn.Sequential(nn.Identity(), Pop().isolate(ns)),
        nn.Sequential(Stash().isolate(ns, only=[]), nn.Identity()),
        Pop(),  # a bare module is a partition of one layer
    ]
    # Partition 2's Stash re-stashes (None, 's'); the route starts there.
    layout = inspect_skip_layout(partitions)  # type: ignore[arg-type]
    assert layout.by_ns_name == {(ns, "s"): (0, 1), (None, "s"): (2, 3)}
    assert layout.requires_copy(ns, "s") and layout.requires_copy(None, "s")
    assert list(layout.copy_policy(1)) == [(0, ns, "s")]
    assert list(layout.copy_policy(3)) == [(2, None, "s")]


def test_inspect_skip_layout_same_partition_needs_no_copy() -> None:
    layout = inspect_skip_layout([nn.Sequential(nn.Linear(2, 2)), nn.Sequential(Stash(), nn.ReLU(), Pop())])
    assert layout.by_ns_name == {(None, "s"): (1, 1)}
    assert not layout.requires_copy(None, "s")
    assert list(layout.copy_policy(1)) == []


def test_inspect_skip_layout_pop_without_stash() -> None:
    with pytest.raises(KeyError, match="partition 0 pops 's'"):
        inspect_skip_layout([nn.Sequential(Pop())])
