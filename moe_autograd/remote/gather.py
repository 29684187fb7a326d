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
at a time, but the thread of the group's oldest call runs it, so no thread
is added.

Why the gatherer knows its callers: trainers drift out of phase (one in
forward while the others are in backward), and a group then runs as soon
as one call is there, so the trainers keep meeting the device apart: as
many kernels as trainers for every step. With a ``window``, a group waits
for the callers (sessions: trainers) that called its key lately, unless
they wait in the queue under another key (then waiting gains nothing: that
group runs first, and its callers come back to this one); the window counts
from the later of the call's arrival and the last group's end, so callers
just served by another group can come back in time. Trainers fall into
step within a few calls (measured: ``remote/clients-*`` rows).

How (one :class:`Gatherer` per opted-in expert)::

    event                                  what happens (under one condition)
    -------------------------------------  -----------------------------------------
    run(key, rows, payload, who)           queued (all keys, oldest first); the
                                           waiting threads look again
    no group running: a key is "full"      its oldest task's thread runs the group:
    (every recent caller of it queued      every queued task of that key (oldest
    there), or past its window; else the   first, within max_rows), as one call
    oldest "stuck" key (its missing        (execute(tasks): each gets its result or
    callers queued under other keys)       error); then the threads look again
    no key can run yet                     the threads wait for a call, or for the
                                           earliest window to run out
    a window ran out on a waiting key      it runs with the callers that came; the
                                           callers that did not are no longer expected
    a group is running                     queued tasks wait (for their result, or
                                           to run the next group)

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
  other experts are not held back). Whenever no group runs and a task is
  queued, a group is chosen, or the earliest window is awaited: every
  task runs within :data:`MAX_WINDOWS` windows of idle expert plus the
  groups ahead of it, and with ``window=0`` groups run in the order of
  their oldest call, at once.
* A lone caller never waits: a key waits only for callers that called it
  in the last :data:`RECENT_S` seconds, and forgets each caller it waited a
  window for in vain.
* Rows are split back in the order they were concatenated (:func:`concat_rows`,
  :func:`split_rows`); :func:`split_rows` refuses outputs whose first
  dimension is not the group's total rows (an expert that is not row-wise in
  shape).
* The module imports nothing of the server's: the server decides what a
  group computes (:mod:`.server`), this module only gathers and slices.
"""
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["Gatherer", "Task", "row_key", "concat_rows", "split_rows", "NotRowWise"]

_SCALARS = (bool, int, float, str, type(None))
RECENT_S = 2.0  # a key's expected callers: those that called it in the last RECENT_S seconds
MAX_WINDOWS = 10  # a call waits at most this many windows for other calls
_KEYS = 64      # keys whose callers are remembered, per expert


class NotRowWise(ValueError):
    """A group's run did not keep the rows apart (an output whose first
    dimension is not the group's rows, or random numbers drawn): its calls
    run one by one instead."""


class Task:
    """One call waiting in a :class:`Gatherer`: its ``key``, ``payload``
    (what the server needs to run it), ``rows``, the caller it came from
    (``who``), when it ``arrived``, and, once done, its result or error."""

    __slots__ = ("key", "payload", "rows", "who", "arrived", "done", "result", "error")

    def __init__(self, key: Hashable, payload: Any, rows: int, who: Hashable = None) -> None:
        self.key = key
        self.who = who
        self.payload = payload
        self.rows = rows
        self.arrived = time.monotonic()
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
    time, each group in the thread of its oldest call. ``window``: seconds a
    call may wait for more calls of its key (0: only those already pending;
    see :meth:`_state`); ``max_rows``: rows of one group at most (None: no
    bound; a call larger than it runs alone)."""

    def __init__(self, window: float = 0.0, max_rows: Optional[int] = None) -> None:
        self.window = float(window)
        self.max_rows = max_rows
        self._cond = threading.Condition()
        self._queue: List[Task] = []  # pending, oldest first, all keys
        self._busy = False  # a group is running
        self._freed_at = 0.0  # when the last group ended (monotonic seconds)
        self._chosen: Optional[Task] = None  # the oldest task of the next group, woken to run it
        # key -> caller -> when it last called (monotonic seconds)
        self._recent: "OrderedDict[Hashable, Dict[Hashable, float]]" = OrderedDict()
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
            execute: Callable[[List[Task]], None], who: Hashable = None) -> Any:
        """Runs ``payload`` (from caller ``who``) in a group of its key
        (``execute(tasks)`` completes every task of a group); returns its
        result or raises its error."""
        task = Task(key, payload, rows, who)
        cond = self._cond
        group: List[Task] = []
        with cond:
            self._queue.append(task)
            cond.notify_all()  # a key may be ready now
            while not task.done:
                wake: Optional[float] = None
                if not self._busy:
                    if self._chosen is None:
                        self._chosen, wake = self._choose_locked()
                        if self._chosen is not None and self._chosen is not task:
                            cond.notify_all()  # its thread runs the group
                    if self._chosen is task:
                        group = self._take_locked(task)
                        break
                cond.wait(None if wake is None else max(0.0, wake - time.monotonic()))
            else:
                return task.outcome()
        try:
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
                self._busy, self._freed_at = False, time.monotonic()
                cond.notify_all()
        return task.outcome()

    def _state(self, tasks: List[Task]) -> str:
        """Whether the pending ``tasks`` of one key make a group now:
        ``"full"``, with ``max_rows``, when they fill it (as hivemind's pools
        wait for their batch size), without, when every caller (trainer)
        that called the key in the last :data:`RECENT_S` seconds has a call
        here; ``"stuck"`` when the callers still missing all have a call of
        another key queued (waiting for them gains nothing until that one
        ran); else ``"waiting"``. So a lone trainer never waits, trainers
        that call together wait for each other, and a trainer that left is
        waited for once (a window), then forgotten (:meth:`_take_locked`)."""
        if self.max_rows is not None:
            return "full" if sum(t.rows for t in tasks) >= self.max_rows else "waiting"
        recent = self._recent.get(tasks[0].key, {})
        since = time.monotonic() - RECENT_S
        missing = {who for who, at in recent.items() if at >= since} - {t.who for t in tasks}
        if not missing:
            return "full"
        return "stuck" if missing <= {t.who for t in self._queue} else "waiting"

    def _pending_by_key(self) -> "OrderedDict[Hashable, List[Task]]":
        by_key: "OrderedDict[Hashable, List[Task]]" = OrderedDict()  # by their oldest task
        for task in self._queue:
            by_key.setdefault(task.key, []).append(task)
        return by_key

    def _due(self, tasks: List[Task]) -> float:
        """When the window of a key's oldest task runs out: ``window``
        seconds after it came or after the last group ended, whichever is
        later (a key that waited while another group ran still gets its
        window: trainers in other phases come back then), but at most
        :data:`MAX_WINDOWS` windows after it came."""
        arrived = tasks[0].arrived
        return min(max(arrived, self._freed_at) + self.window,
                   arrived + MAX_WINDOWS * self.window)

    def _choose_locked(self) -> Tuple[Optional[Task], Optional[float]]:
        """The oldest task of the key whose group runs next, or None and when
        to look again. First the key of the oldest task among those whose
        group is full or whose window ran out; else, if every key is stuck
        or waiting, the oldest stuck one (its missing callers are queued
        under keys that wait for it in turn: one must run, and the others
        then wait for its callers to come back)."""
        now, again, stuck = time.monotonic(), None, None
        for tasks in self._pending_by_key().values():
            due = self._due(tasks)
            state = self._state(tasks)
            if state == "full" or due <= now:
                return tasks[0], None
            if state == "stuck" and stuck is None:
                stuck = tasks[0]
            again = due if again is None else min(again, due)
        return stuck, None if stuck is not None else again

    def _take_locked(self, own: Task) -> List[Task]:
        """The group led by ``own`` (the oldest of its key): the pending
        tasks of its key, oldest first, within ``max_rows``; marks the
        expert busy and records the group's callers (forgetting, when its
        window ran out, those it waited for in vain)."""
        tasks = self._pending_by_key()[own.key]
        waited_out = self._state(tasks) == "waiting"  # its window ran out first
        group: List[Task] = []
        total, limit = 0, self.max_rows
        for task in tasks:
            if not group or limit is None or total + task.rows <= limit:
                group.append(task)
                total += task.rows
        taken = set(map(id, group))
        self._queue = [t for t in self._queue if id(t) not in taken]
        self._busy, self._chosen = True, None
        recent = self._recent.pop(own.key, {})
        self._recent[own.key] = recent  # the most recently used key last
        while len(self._recent) > _KEYS:
            self._recent.popitem(last=False)
        now = time.monotonic()
        if waited_out:  # who was waited for and did not come is no longer expected
            queued = {t.who for t in self._queue}
            for who in [w for w in recent if w not in queued]:
                del recent[who]
        for task in group:
            recent[task.who] = now
        if len(recent) > 4 * len(group) + 64:  # forget the callers long gone
            for who in [w for w, at in recent.items() if at < now - RECENT_S]:
                del recent[who]
        return group
