"""Skip trackers: where stashed tensors wait for their pop, one per thread.

Why: a ``@skippable`` layer does not know whether it runs plainly, inside an
``nn.Sequential``, in a pipeline partition or on an expert worker thread. It
asks :func:`current_skip_tracker` to ``save`` what it stashes and to ``load``
what it pops; whoever runs it decides which tracker that is with
:func:`use_skip_tracker`.

* :class:`SkipTracker` keeps tensors in a dict; ``load`` removes them. Good
  whenever stash and pop run in the same graph on the same device.
* :class:`SkipTrackerThroughPortals` hides tensors whose route crosses
  partitions (``skip_layout.requires_copy``) in :class:`~moe_autograd.skip.
  portal.Portal`\\ s and ties them to the micro-batch with ``fork``/``join``;
  other routes fall back to the dict.

Invariants:

* The tracker is thread-local. A thread that never called
  :func:`use_skip_tracker` gets its own plain :class:`SkipTracker`, so worker
  threads never see each other's tensors.
* After a balanced forward (every stash popped) a plain tracker holds nothing.
  A portal tracker keeps its portals (recomputation needs them), but each
  portal drops its tensor once its lives are spent (see the table in
  :mod:`moe_autograd.skip.portal`).
* ``save``/``load``/``copy`` may replace a tensor of ``batch`` in place by a
  forked/joined alias; the caller reads the batch back afterwards.
"""
import threading
from contextlib import contextmanager
from typing import Dict, Generator, Optional, Tuple

from torch import Tensor

from ..checkpoint import is_checkpointing, is_recomputing
from ..dependency import fork, join
from ..microbatch import Batch
from ..stream import AbstractStream
from .layout import SkipLayout
from .namespace import Namespace
from .portal import Portal

__all__ = [
    "SkipTracker", "SkipTrackerThroughPortals", "SkipTrackerThroughPotals",
    "use_skip_tracker", "current_skip_tracker",
]

SkipKey = Tuple[Namespace, str]


class SkipTracker:
    """Keeps stashed tensors until they are popped (``load`` removes them)."""

    def __init__(self) -> None:
        self.tensors: Dict[SkipKey, Optional[Tensor]] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        """Removes and returns the tensor; KeyError if it was never stashed."""
        return self.tensors.pop((ns, name))

    def copy(
        self,
        batch: Batch,
        prev_stream: AbstractStream,
        next_stream: AbstractStream,
        ns: Namespace,
        name: str,
    ) -> None:
        raise TypeError("copy is not supported by a plain SkipTracker: use SkipTrackerThroughPortals")


class SkipTrackerThroughPortals(SkipTracker):
    """Hides tensors of cross-partition routes in portals (one per route).

    Use one per micro-batch per iteration; ``.portals`` maps ``(ns, name)`` to
    the :class:`Portal` of that route.
    """

    def __init__(self, skip_layout: SkipLayout) -> None:
        super().__init__()
        self.skip_layout = skip_layout
        self.portals: Dict[SkipKey, Portal] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        """Puts the tensor in the route's portal and joins the portal into ``batch``.

        Lives (events of the table in :mod:`moe_autograd.skip.portal`): 2 in a
        plain forward (dropped at 6. PortalOrange.forward); 3 in a
        checkpointed forward (dropped at 8. the recomputed PortalOrange.forward);
        1 on the recomputed stash (dropped at 11. the recomputed blue()).
        """
        if not self.skip_layout.requires_copy(ns, name):
            super().save(batch, ns, name, tensor)
            return

        key = (ns, name)
        portal = self.portals.get(key)
        if portal is not None and is_recomputing():
            portal.put_tensor(tensor, 1)
        else:
            portal = Portal(tensor, 3 if is_checkpointing() else 2)
            self.portals[key] = portal

        phony = portal.blue()
        idx = batch.find_tensor_idx()
        batch[idx] = join(batch[idx], phony)

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        """Takes the tensor out of the route's portal, ordered after ``batch``."""
        if not self.skip_layout.requires_copy(ns, name):
            return super().load(batch, ns, name)

        portal = self.portals[(ns, name)]
        idx = batch.find_tensor_idx()
        batch[idx], phony = fork(batch[idx])
        return portal.orange(phony)

    def copy(
        self,
        batch: Batch,
        prev_stream: AbstractStream,
        next_stream: AbstractStream,
        ns: Namespace,
        name: str,
    ) -> None:
        """Moves the route's tensor one hop, tied to ``batch`` by fork/join."""
        if not self.skip_layout.requires_copy(ns, name):
            raise ValueError(f"skip {name!r} in {ns!r} stays in one partition: nothing to copy")

        portal = self.portals[(ns, name)]
        idx = batch.find_tensor_idx()
        batch[idx], phony = fork(batch[idx])
        phony = portal.copy(prev_stream, next_stream, phony)
        batch[idx] = join(batch[idx], phony)


#: The pipeline library's historical spelling.
SkipTrackerThroughPotals = SkipTrackerThroughPortals


class _ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.skip_tracker: Optional[SkipTracker] = None


_thread_local = _ThreadLocal()


@contextmanager
def use_skip_tracker(skip_tracker: SkipTracker) -> Generator[None, None, None]:
    """Makes ``skip_tracker`` current on this thread within the context."""
    orig = _thread_local.skip_tracker
    _thread_local.skip_tracker = skip_tracker
    try:
        yield
    finally:
        _thread_local.skip_tracker = orig


def current_skip_tracker() -> SkipTracker:
    """The tracker of this thread; a plain one is created on first use."""
    skip_tracker = _thread_local.skip_tracker
    if skip_tracker is None:
        skip_tracker = SkipTracker()
        _thread_local.skip_tracker = skip_tracker
    return skip_tracker
