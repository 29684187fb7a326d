"""Batching across calls: one kernel call for the pending calls of many trainers.

Why: several trainers (the data-parallel replicas of one job, or separate
jobs) calling one server each send their own forward and backward calls.
Run one by one, a small call pays the expert's fixed cost (a kernel launch, a
Python pass through the module, a device that runs one kernel at a time) for
a few rows. When the expert is *row-wise* (row ``i`` of every output depends
only on row ``i`` of the inputs: ``Linear``, MLPs, attention within a
sequence, ``LayerNorm``; NOT ``BatchNorm`` in train mode or anything that
mixes rows), the calls' inputs can be concatenated along the first dimension,
run once, and the outputs split back: each call gets the rows it would have
got alone. hivemind's servers do this with their task pools: a runtime
thread per device takes a batch from the pool whose tasks waited longest,
runs it, and takes the next one, so the calls that arrive while the device
is busy form the next batch. Here the calls of an expert also run one group
at a time, but the thread of the group's first call runs it, so no thread
is added.

How (one :class:`Gatherer` per opted-in expert)::

    caller thread (one per request)        the gatherer (under one condition)
    -------------------------------------  -----------------------------------------
    run(key, rows, payload)                appended to the queue (all keys, oldest
                                           first); waiters woken
    no group running                       this thread leads: waits up to ``window``
                                           seconds (or until ``max_rows`` rows of its
                                           key are pending), then takes its own task
                                           and the others of its key (oldest first,
                                           within max_rows)
    the leader runs the group              execute(tasks): each task gets its result
                                           or its error; then the oldest task still
                                           queued (any key) leads the next group
    a group is running                     the task waits for its result (a group of
                                           its key may take it), or to lead

A *key* (:func:`row_key`) says which calls can share a kernel call: the same
operation, the same requires-grad flags, the same types and values of the
non-tensor arguments, and tensors of the same dtype, device, layout and shape
but for the first dimension, which must be the same in every tensor of a call
(its *rows*). A call that has no such key (no tensor, a tensor of zero rows
or zero dimensions, tensors of different row counts, nested arguments) is
run alone, as without batching.

Invariants:

* A task is completed exactly once (a result or an error), whatever
  ``execute`` does: a group's tasks that ``execute`` left open get its error.
* At most one group of an expert runs at a time (as on one device; calls of
  other experts are not held back); every task either leads a group or is
  completed by one: when a group ends, the oldest queued task leads the
  next, so no task waits on a group that will not take it, and keys are
  served in the order their calls came.
* Rows are split back in the order they were concatenated (:func:`concat_rows`,
  :func:`split_rows`); :func:`split_rows` refuses outputs whose first
  dimension is not the group's total rows (an expert that is not row-wise in
  shape).
* The module imports nothing of the server's: the server decides what a
  group computes (:mod:`.server`), this module only gathers and slices.
"""
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["Gatherer", "Task", "row_key", "concat_rows", "split_rows", "NotRowWise"]

_SCALARS = (bool, int, float, str, type(None))
RECENT = 8      # a key's expected group: the largest of its last RECENT groups
_KEYS = 64      # keys whose recent groups are remembered, per expert


class NotRowWise(ValueError):
    """A group's run did not keep the rows apart (an output whose first
    dimension is not the group's rows, or random numbers drawn): its calls
    run one by one instead."""


class Task:
    """One call waiting in a :class:`Gatherer`: its ``key``, ``payload``
    (what the server needs to run it), ``rows``, whether it ``leads`` the
    next group, and, once done, its result or error."""

    __slots__ = ("key", "payload", "rows", "leads", "done", "result", "error")

    def __init__(self, key: Hashable, payload: Any, rows: int) -> None:
        self.key = key
        self.payload = payload
        self.rows = rows
        self.leads = False
        self.done = False
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self.result, self.error, self.done = result, error, True

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


def _tensor_spec(value: Tensor, flag: Any) -> Optional[Tuple[Any, ...]]:
    if value.dim() == 0 or value.layout != torch.strided or value.shape[0] == 0:
        return None
    return ("tensor", value.dtype, value.device, tuple(value.shape[1:]), flag is True)


def row_key(args: Any, flags: Any, grads: Any = None, extra: Hashable = ()
            ) -> Optional[Tuple[Hashable, int]]:
    """``(key, rows)`` of a call whose arguments (and output gradients, for a
    backward) can be concatenated with those of calls of the same key, or
    ``None`` (run it alone). See the module docstring."""
    if not isinstance(args, (list, tuple)) or not isinstance(flags, (list, tuple)) \
            or len(flags) != len(args):
        return None
    spec: List[Any] = [extra]
    rows: Optional[int] = None
    for arg, flag in zip(args, flags):
        if not isinstance(flag, bool):
            return None
        if isinstance(arg, Tensor):
            part = _tensor_spec(arg, flag)
            if part is None or (rows is not None and arg.shape[0] != rows):
                return None
            rows = int(arg.shape[0])
            spec.append(part)
        elif type(arg) in _SCALARS and not flag:
            spec.append(("value", type(arg), arg))
        else:
            return None
    if rows is None:
        return None
    if grads is not None:
        if not isinstance(grads, (list, tuple)):
            return None
        for grad in grads:
            if grad is None:
                spec.append(("no grad",))
                continue
            if not isinstance(grad, Tensor):
                return None
            part = _tensor_spec(grad, False)
            if part is None or grad.shape[0] != rows:
                return None
            spec.append(part)
    return tuple(spec), rows


def concat_rows(calls: Sequence[Sequence[Any]]) -> List[Any]:
    """The arguments of one run for ``calls`` (each a list of arguments of the
    same key): tensors concatenated along the first dimension, in order;
    other values (equal in every call, by the key) taken from the first."""
    first = calls[0]
    return [torch.cat([call[k] for call in calls]) if isinstance(value, Tensor) else value
            for k, value in enumerate(first)]


def split_rows(values: Sequence[Optional[Tensor]], rows: Sequence[int], what: str
               ) -> List[List[Optional[Tensor]]]:
    """Per call, its rows of each of ``values`` (``None`` stays ``None``);
    raises :class:`NotRowWise` for a value whose first dimension is not
    ``sum(rows)``."""
    total = sum(rows)
    parts: List[List[Optional[Tensor]]] = [[] for _ in rows]
    for k, value in enumerate(values):
        if value is None:
            for part in parts:
                part.append(None)
            continue
        if value.dim() == 0 or value.shape[0] != total:
            raise NotRowWise(f"{what} {k} has shape {list(value.shape)}, not {total} rows "
                             f"(the calls' rows {list(rows)} together)")
        for part, piece in zip(parts, value.split(list(rows))):
            part.append(piece)
    return parts


class Gatherer:
    """Gathers the pending calls of one expert and runs them a group at a
    time, each group in the thread of its first call. ``window``: seconds a
    group's leader waits for more calls (0: only those already pending);
    ``max_rows``: rows of one group at most (None: no bound; a call larger
    than it runs alone)."""

    def __init__(self, window: float = 0.0, max_rows: Optional[int] = None) -> None:
        self.window = float(window)
        self.max_rows = max_rows
        self._cond = threading.Condition()
        self._queue: List[Task] = []  # pending, oldest first, all keys
        self._busy = False  # a group is gathering or running (or its leader is named)
        self._recent: "OrderedDict[Hashable, deque[int]]" = OrderedDict()  # key -> group sizes
        #: groups of two calls or more, the calls in them, calls run alone,
        #: groups that fell back to one by one (see :class:`NotRowWise`).
        self.counts: Dict[str, int] = {"batches": 0, "batched_calls": 0, "unbatched_calls": 0,
                                       "batch_fallbacks": 0}

    def count(self, **deltas: int) -> None:
        with self._cond:
            for name, delta in deltas.items():
                self.counts[name] += delta

    def stats(self) -> Dict[str, int]:
        with self._cond:
            return dict(self.counts)

    def run(self, key: Hashable, rows: int, payload: Any,
            execute: Callable[[List[Task]], None]) -> Any:
        """Runs ``payload`` in a group of its key (``execute(tasks)`` completes
        every task of a group); returns its result or raises its error."""
        task = Task(key, payload, rows)
        cond = self._cond
        with cond:
            self._queue.append(task)
            if not self._busy:
                self._busy = task.leads = True
            else:
                cond.notify_all()  # a leader in its window counts the rows
                while not (task.done or task.leads):
                    cond.wait()
                if task.done:
                    return task.outcome()
        group: List[Task] = [task]
        try:
            group = self._take(task)
            execute(group)
        except BaseException as error:  # noqa: BLE001 - every task of the group gets an answer
            for other in group:
                if not other.done:
                    other.finish(error=error)
        finally:
            with cond:
                for other in group:
                    if not other.done:  # execute left it open: never hang its caller
                        other.finish(error=RuntimeError("a batched call was left unanswered"))
                if self._queue:  # the oldest pending call leads the next group
                    self._queue[0].leads = True
                else:
                    self._busy = False
                cond.notify_all()
        return task.outcome()

    def _take(self, own: Task) -> List[Task]:
        """The leader's group: its own task, then the others of its key
        pending (oldest first) within ``max_rows``. Before taking them it
        waits, at most ``window`` seconds: with ``max_rows``, until that many
        rows of its key are pending (a batch filled, as hivemind's pools
        wait for their batch size); without, while fewer calls of its key
        are pending than the largest of the key's last :data:`RECENT` groups
        held (forgotten when a wait runs out: fewer trainers call now): a
        lone trainer never waits, and trainers that came together wait for
        each other."""
        cond, limit = self._cond, self.max_rows
        deadline = time.monotonic() + self.window
        with cond:
            recent = self._recent.get(own.key)
            expect = max(recent) if recent else 1
            waited_out = False
            while self.window > 0:
                mine = [t for t in self._queue if t.key == own.key]
                if (len(mine) >= expect) if limit is None else (sum(t.rows for t in mine)
                                                                  >= limit):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    waited_out = True
                    break
                cond.wait(left)
            group, keep, total = [own], [], own.rows
            for other in self._queue:
                if other is own:
                    continue
                if other.key == own.key and (limit is None or total + other.rows <= limit):
                    group.append(other)
                    total += other.rows
                else:
                    keep.append(other)
            self._queue = keep
            if recent is None:
                recent = self._recent[own.key] = deque(maxlen=RECENT)
                while len(self._recent) > _KEYS:
                    self._recent.popitem(last=False)
            if waited_out:  # fewer calls come now (a trainer left): expect what came
                recent.clear()
            recent.append(len(group))
        return group
