"""Skip layout: which partition stashes and which pops each skip tensor.

Why: a pipeline must know, before running, which skip tensors cross a
partition boundary. Those need a portal and a copy at every boundary they
cross; the others stay in one partition and live in a plain dict.

A *route* maps ``(ns, name)`` to ``(prev_j, next_j)``: the partition that
stashes it and the partition that pops it.

Invariants:

* ``prev_j <= next_j`` for every route built by :func:`inspect_skip_layout`
  (a pop always follows its stash).
* A name without a route needs no copy (it never crosses a boundary).
* :meth:`SkipLayout.copy_policy` yields routes sorted by source partition,
  then name, then namespace, so every run copies in the same order.
"""
from typing import Dict, Iterable, List, Tuple

from torch import nn

from .namespace import Namespace, sort_key

__all__ = ["SkipLayout", "inspect_skip_layout"]

SkipKey = Tuple[Namespace, str]
Route = Tuple[int, int]


class SkipLayout:
    """The routes of all skip tensors over ``num_partitions`` partitions."""

    #: ``{(ns, name): (prev_j, next_j)}``
    by_ns_name: Dict[SkipKey, Route]
    #: ``by_partition[next_j] == [(prev_j, ns, name), ...]``
    by_partition: List[List[Tuple[int, Namespace, str]]]

    def __init__(self, num_partitions: int, skip_routes: Dict[SkipKey, Route]) -> None:
        self.num_partitions = num_partitions
        self.by_ns_name = dict(skip_routes)
        self.by_partition = [[] for _ in range(num_partitions)]
        for (ns, name), (prev_j, next_j) in self.by_ns_name.items():
            self.by_partition[next_j].append((prev_j, ns, name))
        for routes in self.by_partition:
            routes.sort(key=lambda r: (r[0], r[2], sort_key(r[1])))

    def __repr__(self) -> str:
        return f"SkipLayout(num_partitions={self.num_partitions}, skip_routes={self.by_ns_name!r})"

    def copy_policy(self, next_j: int) -> Iterable[Tuple[int, Namespace, str]]:
        """The routes to copy into partition ``next_j``: ``(prev_j, ns, name)``.

        Routes that stash and pop in ``next_j`` itself are left out.
        """
        for prev_j, ns, name in self.by_partition[next_j]:
            if prev_j != next_j:
                yield (prev_j, ns, name)

    def requires_copy(self, ns: Namespace, name: str) -> bool:
        """Whether ``(ns, name)`` crosses a partition boundary."""
        prev_j, next_j = self.by_ns_name.get((ns, name), (-1, -1))
        return prev_j != next_j


def inspect_skip_layout(partitions: List[nn.Sequential]) -> SkipLayout:
    """Builds the layout of the skippable layers found in ``partitions``.

    Each partition is an ``nn.Sequential`` whose direct children are scanned,
    or a single module. Raises KeyError naming a skip that is popped before
    any partition stashed it (run :func:`verify_skippables` first for a full
    report).
    """
    # Imported here: skippable imports the tracker, which imports this module.
    from .skippable import Skippable

    skip_routes: Dict[SkipKey, Route] = {}
    stashed_at: Dict[SkipKey, int] = {}

    for j, partition in enumerate(partitions):
        layers = list(partition) if isinstance(partition, nn.Sequential) else [partition]
        for layer in layers:
            if not isinstance(layer, Skippable):
                continue
            for ns, name in layer.stashable():
                stashed_at[(ns, name)] = j
            for ns, name in layer.poppable():
                try:
                    prev_j = stashed_at.pop((ns, name))
                except KeyError:
                    raise KeyError(f"partition {j} pops {name!r} ({ns!r}) but no earlier layer stashed it") from None
                skip_routes[(ns, name)] = (prev_j, j)

    return SkipLayout(len(partitions), skip_routes)
