"""Calls that a batch hands to a *collector* instead of the worker pool.

Why
---
A remote expert's call spends its time waiting for a reply. Run on a worker,
each such call parks a pool thread for the whole wait and sends a message of
its own. A *collector* instead takes every call of one batch that it knows,
sends them as it sees fit (:mod:`moe_autograd.remote.batching`: one request
per server), and completes each call from a callback. The batch's
:class:`~moe_autograd.executor.TaskGroup` holds them as *external* entries
(running, never queued), so every wait, deadline, cancellation and error
report of the entry points works unchanged, and the batch's other calls still
run on workers.

Hooks (nothing in the runtime knows what a collector does):

==============================================  =======================================
where                                           what the runtime does with it
==============================================  =======================================
``moe_call_type`` on an expert's class          ``parallel_apply`` / ``start_calls``
(a :class:`~moe_autograd.module_call.           build that record for the expert's
ModuleCall` subclass)                           calls (not for checkpointed ones)
``collector`` on a call record                  its forward (module calls) and its
(:class:`~moe_autograd.node.IsolatedCall`)      backward (every record) are started by
                                                the collector, with the batch's other
                                                records of the same collector
``moe_collector`` on an autograd Function       ``map_with_parallel_backward`` starts
                                                the forwards of its calls through it
==============================================  =======================================

A record's ``collector`` may be None on some instances of such a type: those
calls run on workers as before (the record decides, e.g. for arguments its
collector cannot carry). ``deadline`` (seconds from the start, or None), given
to the ``start_*`` methods, is when the caller stops waiting for the batch
(a ``MixtureOfExperts``' ``forward_timeout``, a tolerant backward's timeout):
a collector that holds answers back to send them together must not hold one
past it.

Invariants:

* Every collected call is completed exactly once, with its result or its
  error: repeats are ignored (:meth:`TaskGroup.complete`), and a collector
  that raises while starting fails the calls it was given that it had not
  completed (a ``KeyboardInterrupt`` is then raised again).
* A completion may come from any thread (a transport's), even before
  ``start_*`` returns.
* A collected call's measured wall time (for :mod:`moe_autograd.policy`) runs
  from its start to its completion; it has no CPU time of its own, so the
  policy sees a waiting call and keeps the batch fanned out.
"""
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, TypeVar

from .executor import TaskGroup, get_pool, run_all
from .policy import Measure

__all__ = ["Collector", "Complete", "Finish", "call_type", "function_collector", "submit",
           "run", "run_applies", "submit_backwards", "run_backwards"]

T = TypeVar("T")
#: ``complete(k, value, error)``: the ``k``-th call given to ``start_*`` ended.
Complete = Callable[[int, Any, Optional[BaseException]], None]
#: ``finish(k, value, error) -> (value, error)``: the caller's last word on a
#: completion (checks, notes), run where the completion runs.
Finish = Callable[[int, Any, Optional[BaseException]], Tuple[Any, Optional[BaseException]]]


class Collector(Protocol):
    """Starts calls without a worker each and completes them by callback."""

    def start_calls(self, calls: Sequence[Any], complete: Complete,
                    deadline: Optional[float] = None) -> None:
        """Forwards of module call records: fill each record as its own
        ``forward()`` would, then ``complete(k, record, None)``."""
        ...

    def start_applies(self, func: Any, args: Sequence[Tuple[Any, ...]],
                      complete: Complete) -> None:
        """Forwards of a map's calls of the Function ``func``: ``complete(k,
        (ctx, outputs), None)`` as ``run_isolated_forward`` returns them."""
        ...

    def start_backwards(self, calls: Sequence[Any], grads: Sequence[Any],
                        complete: Complete, deadline: Optional[float] = None) -> None:
        """Backwards of records: ``complete(k, raw, None)`` with what
        ``calls[k].backward(grads[k])`` would return."""
        ...


def call_type(module: Any) -> Optional[type]:
    """The record type an expert asks for (``moe_call_type``), or None."""
    return getattr(type(module), "moe_call_type", None)


def function_collector(func: Any) -> Optional[Collector]:
    """The collector of an autograd Function's map calls, or None."""
    return getattr(func, "moe_collector", None)


def _by_collector(calls: Sequence[Any]) -> List[Tuple[Collector, List[int]]]:
    groups: Dict[int, Tuple[Collector, List[int]]] = {}
    for i, call in enumerate(calls):
        collector = getattr(call, "collector", None)
        if collector is not None:
            groups.setdefault(id(collector), (collector, []))[1].append(i)
    return list(groups.values())


def _launch(group: TaskGroup[Any], positions: Sequence[int],
            start: Callable[[Complete], None], measure: Optional[Measure] = None,
            finish: Optional[Finish] = None) -> None:
    """Runs ``start(complete)``; ``complete(k, ...)`` ends the group's entry
    ``positions[k]``."""
    started = time.perf_counter()
    walls = measure.walls if measure is not None else None

    def complete(k: int, value: Any, error: Optional[BaseException]) -> None:
        i = positions[k]
        if group.done(i):
            return
        if finish is not None:
            try:
                value, error = finish(k, value, error)
            except Exception as failure:  # noqa: BLE001 - the call's own error
                value, error = None, failure
        if walls is not None:
            walls[i] = time.perf_counter() - started
        group.complete(i, value, error)

    try:
        start(complete)
    except BaseException as error:  # noqa: B902 - no call may be left running
        for k in range(len(positions)):
            complete(k, None, error)
        if not isinstance(error, Exception):
            raise


def submit(calls: Sequence[Any], tasks: Sequence[Callable[[], T]], lanes: Optional[int] = None,
           measure: Optional[Measure] = None,
           groups: Optional[List[Tuple[Collector, List[int]]]] = None,
           deadline: Optional[float] = None) -> TaskGroup[T]:
    """The forwards of module call records: ``tasks[i]`` (each record's
    ``forward`` on a worker, or on ``lanes`` threads) for records without a
    collector, their collector for the others; one group for all."""
    if groups is None:
        groups = _by_collector(calls)
    if not groups:
        return get_pool().submit(tasks, lanes)
    external = [i for _, positions in groups for i in positions]
    group: TaskGroup[T] = get_pool().submit(tasks, lanes, external=external)
    for collector, positions in groups:
        def start(complete: Complete, c: Collector = collector,
                  mine: List[Any] = [calls[i] for i in positions]) -> None:
            c.start_calls(mine, complete, deadline)
        _launch(group, positions, start, measure)
    return group


def run(calls: Sequence[Any], tasks: Sequence[Callable[[], T]], what: Optional[str] = "call", *,
        lanes: Optional[int] = None, measure: Optional[Measure] = None) -> List[T]:
    """:func:`submit`, joined: :func:`~moe_autograd.executor.run_all` for
    batches with collected calls."""
    groups = _by_collector(calls)
    if not groups:
        return run_all(tasks, what, lanes=lanes)
    group = submit(calls, tasks, lanes, measure, groups)
    group.wait()
    group.raise_first_error(what)
    return group.results  # type: ignore[return-value]


def run_applies(func: Any, collector: Collector, args: Sequence[Tuple[Any, ...]],
                what: Optional[str] = "call", measure: Optional[Measure] = None) -> List[Any]:
    """The forwards of a map's calls, all started by ``collector``; joined."""
    n = len(args)
    group: TaskGroup[Any] = get_pool().submit([_never] * n, external=range(n))
    _launch(group, range(n), lambda complete: collector.start_applies(func, args, complete),
            measure)
    group.wait()
    group.raise_first_error(what)
    return group.results


def _never() -> None:  # the placeholder task of an external entry (never run)
    raise AssertionError("an external call ran on the pool")


def submit_backwards(calls: Sequence[Any], grads: Sequence[Any], tasks: Sequence[Callable[[], T]],
                     lanes: Optional[int] = None, finish: Optional[Finish] = None,
                     groups: Optional[List[Tuple[Collector, List[int]]]] = None,
                     deadline: Optional[float] = None) -> TaskGroup[T]:
    """The backwards of ``calls`` (with their output ``grads``): ``tasks[k]``
    on workers for records without a collector, their collector for the
    others, ``finish`` applied to each collected completion."""
    if groups is None:
        groups = _by_collector(calls)
    if not groups:
        return get_pool().submit(tasks, lanes)
    external = [k for _, positions in groups for k in positions]
    group: TaskGroup[T] = get_pool().submit(tasks, lanes, external=external)
    for collector, positions in groups:
        mine, their = [calls[k] for k in positions], [grads[k] for k in positions]

        def start(complete: Complete, c: Collector = collector, mine: List[Any] = mine,
                  their: List[Any] = their) -> None:
            c.start_backwards(mine, their, complete, deadline)

        def local(k: int, value: Any, error: Optional[BaseException],
                  positions: List[int] = positions) -> Tuple[Any, Optional[BaseException]]:
            return finish(positions[k], value, error) if finish is not None else (value, error)
        _launch(group, positions, start, finish=local)
    return group


def run_backwards(calls: Sequence[Any], grads: Sequence[Any], tasks: Sequence[Callable[[], T]],
                  lanes: Optional[int] = None, finish: Optional[Finish] = None) -> List[T]:
    """:func:`submit_backwards`, joined; raises the first failure as it is
    (the tasks and ``finish`` note their errors themselves)."""
    groups = _by_collector(calls)
    if not groups:
        return run_all(tasks, None, lanes=lanes)
    group = submit_backwards(calls, grads, tasks, lanes, finish, groups)
    group.wait()
    group.raise_first_error(None)
    return group.results  # type: ignore[return-value]
