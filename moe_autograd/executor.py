"""The worker pool that runs expert calls, forward and backward.

Why not :class:`concurrent.futures.ThreadPoolExecutor`: a call made from inside
a worker (an expert that fans out again, a nested map) deadlocks a bounded pool
once every worker waits on work queued behind it, and a future per call costs
more than a tiny expert call itself. This pool instead works in *groups*:

* a :class:`TaskGroup` is the set of calls one map submits together;
* the submitting thread puts one *ticket* per call on the pool's queue, wakes
  (or starts, up to the bound) enough workers, then **helps**: it pops its own
  group's calls and runs them inline until none is left, and only then waits
  for the calls that workers took.

Invariants:

* A thread waits only on calls of its own group that another thread is already
  running, so nested groups always make progress, whatever the pool size.
* While the pool has free workers, every call of a group runs concurrently
  with every other (a call is never queued behind a sibling).
* A call never runs twice, and a cancelled call never starts.
* A call that raises a ``BaseException`` that is not an ``Exception``
  (Ctrl-C, ``SystemExit``: :func:`is_interruption`) is recorded like any
  failure, on whichever thread it ran, and cancels the group's pending calls
  (all later ones), as a loop stops there; a waiting caller interrupted in
  its sleep cancels them too and joins the running ones before the
  interruption leaves. A waiting caller sleeps in slices of
  :data:`WAIT_SLICE_S`: Python runs a signal handler only between bytecodes,
  and a signal that lands after the last check and before the thread blocks
  interrupts nothing (the wait goes on), so without slices Ctrl-C could wait
  for the whole batch (issue 43: the executor test that saw ``[1, 2]``).
  Either way the batch is joined before anything is
  raised, so no call of it runs on once the caller has the error, and
  :meth:`TaskGroup.raise_first_error` raises the first error in call order,
  as the loop would.
* A group submitted with ``lanes`` runs on at most that many threads, each
  taking the next call in order (``lanes=1``: the caller alone, in ``wait``).
* ``wait(help=False)`` never runs a call on the caller's thread, so a caller
  with a deadline cannot be caught inside a straggler.
* An *external* call of a group (``submit(..., external=...)``) is never run
  by the pool: something else (a remote call's reply callback, see
  :mod:`moe_autograd.collect`) ends it with :meth:`TaskGroup.complete`, once;
  until then it counts as running, so ``wait`` and ``cancel`` treat it as a
  call a worker took.

The pool is created on first use, sized by ``MOE_AUTOGRAD_WORKERS`` (default
32), made of named daemon threads, and recreated in a child after ``fork``.

Memory: glibc gives each thread that allocates a malloc *arena* of its own
(up to 8 per core), and an arena keeps what its thread's calls freed, for
that thread's next allocation. Once calls stop running on the workers (a site
that now runs within the cores allocates on the caller's arena),
:func:`release_free_memory` hands those free pages back to the system
(``malloc_trim(0)``; a no-op where the C library has none): measured on the
MoE layer at 64 SwiGLU experts, the first, fanned-out batch left 190-230 MiB
free in the workers' arenas, resident for the rest of the process.

At interpreter exit (an ``atexit`` hook) the pool stops its workers: idle ones
at once, and a straggler still running a call (one a deadline masked) at its
next Python bytecode boundary, by an asynchronous ``SystemExit`` raised in its
thread; the hook waits at most :data:`EXIT_TIMEOUT_S`. Without it, a daemon
worker inside a torch op when the interpreter finalises makes torch abort the
process ("terminate called without an active exception", exit status 134).
"""
import atexit
import ctypes
import math
import numbers
import os
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Generic, List, Optional, Sequence, Set, TypeVar

import torch

__all__ = ["TaskGroup", "WorkerPool", "get_pool", "run_all", "CallCancelled", "check_timeout",
           "MAX_TIMEOUT_S", "release_free_memory", "is_interruption", "WORKER_THREADS",
           "predecessors", "in_order"]

T = TypeVar("T")

#: The intra-op thread count (``torch.set_num_threads``) of every worker
#: between tasks: the importing thread's. OpenMP keeps the count per thread and
#: a new thread inherits its creator's, so each worker sets it as it starts; a
#: task of a caller with another count adopts the caller's and puts this one
#: back (see :mod:`moe_autograd.tls`).
WORKER_THREADS = torch.get_num_threads()
_PENDING, _RUNNING, _DONE, _CANCELLED = range(4)
_thread_role = threading.local()  # .worker is True on the pool's threads
DEFAULT_WORKERS = 32
EXIT_TIMEOUT_S = 2.0  # how long the exit hook waits for stragglers to stop
#: The longest a waiting caller sleeps before it looks at pending signals
#: again (see the module docstring).
WAIT_SLICE_S = 0.1


class _StopAtExit(SystemExit):
    """Raised asynchronously in a worker still running a call at interpreter
    exit (a ``SystemExit``, so ``except Exception`` in an expert lets it pass)."""


class CallCancelled(TimeoutError):
    """The error of a call that never started: its group was cancelled,
    because the caller's deadline passed first, or an earlier call (or the
    waiting caller) was interrupted."""


def on_worker() -> bool:
    """Whether this thread is one of the pool's workers."""
    return bool(getattr(_thread_role, "worker", False))


def is_interruption(error: Optional[BaseException]) -> bool:
    """Whether ``error`` is a ``BaseException`` that is not an ``Exception``
    (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``, a custom one):
    it stops a batch as it stops a loop, and no tolerant caller masks it."""
    return error is not None and not isinstance(error, Exception)


class TaskGroup(Generic[T]):
    """Calls submitted together; see the module docstring for the protocol."""

    def __init__(self, pool: "WorkerPool", fns: Sequence[Callable[[], T]],
                 external: Sequence[int] = ()) -> None:
        n = len(fns)
        self._fns: List[Optional[Callable[[], T]]] = list(fns)
        self._pending: Deque[int] = deque(range(n))
        self._state = [_PENDING] * n
        self._external: Set[int] = set(external)  # not completed yet
        if self._external:
            self._pending = deque(i for i in range(n) if i not in self._external)
            for i in self._external:
                self._fns[i] = None
                self._state[i] = _RUNNING
        self.results: List[Optional[T]] = [None] * n
        self.errors: List[Optional[BaseException]] = [None] * n
        self.finished_at: List[Optional[float]] = [None] * n
        self._remaining = n
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Wake a waiter only when it can act: when the last call finishes, or
        # on every completion for a waiter with an ``until`` condition. Waking
        # it at each of n completions costs n GIL hand-offs.
        self._waiters = 0
        self._watchers = 0
        self._awaited: Set[int] = set()  # calls a waiter waits for (wait_for)
        self._pool = pool
        #: The first :func:`is_interruption` error a call raised (by time), if any.
        self.interrupted: Optional[BaseException] = None

    def __len__(self) -> int:
        return len(self._fns)

    def _run_next(self) -> bool:
        """Runs one pending call on this thread; False if none was pending."""
        try:
            i = self._pending.popleft()
        except IndexError:
            return False
        fn = self._fns[i]
        self._fns[i] = None  # the closure may hold big tensors: drop it once run
        self._state[i] = _RUNNING
        try:
            self.results[i] = fn()  # type: ignore[misc]
        except BaseException as error:  # noqa: B902 - a worker must survive anything
            self.errors[i] = error
            if getattr(_thread_role, "worker", False):
                _drop_leaked_saved_tensors_hooks()
            if is_interruption(error) and self.interrupted is None:
                self.interrupted = error
            self._finish(i, _DONE)
            if is_interruption(error):
                # As in a loop, no later call starts (they are all later: calls
                # are taken in order); the group is then joined as always and the
                # first error in call order raised (see raise_first_error).
                self.cancel(f"cancelled before it started: call {i} raised "
                            f"{type(error).__name__}")
            return True
        self._finish(i, _DONE)
        return True

    def _finish(self, i: int, state: int) -> None:
        self.finished_at[i] = time.monotonic()
        with self._lock:
            self._state[i] = state
            self._remaining -= 1
            if self._watchers or (self._waiters and not self._remaining) or i in self._awaited:
                self._cond.notify_all()

    def complete(self, i: int, result: Optional[T] = None,
                 error: Optional[BaseException] = None) -> bool:
        """Ends the external call ``i`` with its result or error (from any
        thread); False, and nothing changes, if it is not an external call
        still running."""
        with self._lock:
            if i not in self._external:
                return False
            self._external.discard(i)
        self.results[i], self.errors[i] = result, error
        self._finish(i, _DONE)
        return True

    def done(self, i: int) -> bool:
        return self._state[i] in (_DONE, _CANCELLED)

    def succeeded(self, i: int) -> bool:
        return self._state[i] == _DONE and self.errors[i] is None

    @property
    def all_done(self) -> bool:
        return self._remaining == 0

    def wait(
        self,
        timeout: Optional[float] = None,
        *,
        help: bool = True,
        until: Optional[Callable[[], bool]] = None,
    ) -> bool:
        """Waits until every call is done (or ``until()`` holds, checked after
        each completion); True unless ``timeout`` seconds passed first.

        With ``help`` the caller runs its group's pending calls inline first.
        """
        if help:
            while self._run_next():
                pass
        if not self._remaining:
            return True
        try:
            with self._cond:
                watching = until is not None
                self._waiters += 1
                self._watchers += watching
                try:
                    return self._sleep_until(
                        lambda: not self._remaining or (until is not None and until()), timeout)
                finally:
                    self._waiters -= 1
                    self._watchers -= watching
        except BaseException:
            self._stop_and_join()
            raise

    def wait_for(self, i: int, timeout: Optional[float] = None, *, help: bool = True) -> bool:
        """Waits until call ``i`` is done; True unless ``timeout`` seconds
        passed first. With ``help`` the caller runs the group's pending calls
        inline, in order, until ``i`` has started (here or on a worker)."""
        if help:
            while self._state[i] == _PENDING and self._run_next():
                pass
        if self.done(i):
            return True
        try:
            with self._cond:
                self._awaited.add(i)  # woken by call i's end only, not by every call's
                try:
                    return self._sleep_until(lambda: self.done(i), timeout)
                finally:
                    self._awaited.discard(i)
        except BaseException:
            self._stop_and_join()
            raise

    def _stop_and_join(self) -> None:
        """The waiting thread was interrupted (Ctrl-C while it sleeps): no
        pending call starts, and the running ones end before the interruption
        reaches the caller, so nothing of the batch runs on behind its back.
        A second interruption while it joins ends the join."""
        self.cancel("cancelled before it started: the caller was interrupted")
        with self._cond:
            self._waiters += 1
            try:
                self._sleep_until(lambda: not self._remaining, None)
            finally:
                self._waiters -= 1

    def _sleep_until(self, ready: Callable[[], bool], timeout: Optional[float]) -> bool:
        """Under ``_cond``: sleeps until ``ready()``; False if ``timeout``
        seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            if deadline is None:
                self._cond.wait(WAIT_SLICE_S)  # a slice: pending signals are handled between
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(min(left, WAIT_SLICE_S))
        return True

    def cancel(self, why: str = "cancelled before it started: the deadline passed") -> None:
        """Calls that have not started never will (their error: a
        :class:`CallCancelled` saying ``why``); running ones finish alone."""
        while True:
            try:
                i = self._pending.popleft()
            except IndexError:
                return
            self._fns[i] = None
            self.errors[i] = CallCancelled(why)
            self._finish(i, _CANCELLED)

    def raise_first_error(self, what: Optional[str] = "call") -> None:
        """Re-raises the error of the lowest-numbered failed call, noting
        which call it was as ``<what> <i> of <n>`` (no note if ``what`` is
        None: the calls noted their errors themselves)."""
        for i, error in enumerate(self.errors):
            if error is not None:
                note = f"{what} {i} of {len(self)}"
                if what is not None and note not in getattr(error, "__notes__", ()):
                    error.add_note(note)
                raise error


class _Lane:
    """A ticket whose worker runs its group's calls until none is left."""

    __slots__ = ("group",)

    def __init__(self, group: TaskGroup[Any]) -> None:
        self.group = group


class WorkerPool:
    """A bounded pool of named daemon threads that serve :class:`TaskGroup`\\ s."""

    def __init__(self, max_workers: int) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self.max_workers = max_workers
        self._tickets: "queue.SimpleQueue[Optional[TaskGroup[Any]]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self._idle = 0  # workers blocked on (or about to block on) a ticket
        self._queued = 0  # tickets put and not yet taken
        self._running: Set[int] = set()  # idents of workers inside a call

    @property
    def threads(self) -> List[threading.Thread]:
        return list(self._threads)

    def submit(self, fns: Sequence[Callable[[], T]], lanes: Optional[int] = None, *,
               external: Sequence[int] = ()) -> TaskGroup[T]:
        """Queues the calls; they start on workers at once (while some are
        free). Call :meth:`TaskGroup.wait` to help and join.

        With ``lanes``, the calls run on at most that many threads, the
        caller's (when it helps) included: ``lanes - 1`` workers each take
        the group's next call until none is left, in order. ``lanes=1`` puts
        nothing on the queue: the caller runs every call in ``wait()``.

        The calls at the positions ``external`` are not queued (their ``fns``
        are ignored): the caller ends each with :meth:`TaskGroup.complete`.
        """
        group: TaskGroup[T] = TaskGroup(self, fns, external)
        n = len(fns) - len(group._external)
        tickets = n if lanes is None else max(0, min(lanes, n) - 1)
        if tickets == 0:
            return group
        with self._lock:
            self._queued += tickets
            free = self._idle - (self._queued - tickets)
            missing = min(tickets - free, self.max_workers - len(self._threads))
            for _ in range(max(missing, 0)):
                self._start_worker()
        ticket: Any = group if lanes is None else _Lane(group)
        for _ in range(tickets):
            self._tickets.put(ticket)
        return group

    def _start_worker(self) -> None:
        thread = threading.Thread(
            target=self._work, name=f"moe_autograd-worker-{len(self._threads)}", daemon=True
        )
        self._threads.append(thread)
        self._idle += 1
        thread.start()

    def _work(self) -> None:
        try:
            self._serve()
        except _StopAtExit:
            # The exit hook's stop reached this worker just after its call
            # ended (it saw it busy): end quietly. threading's excepthook
            # silences SystemExit itself only, not a subclass.
            pass

    def _serve(self) -> None:
        _thread_role.worker = True
        if torch.get_num_threads() != WORKER_THREADS:
            torch.set_num_threads(WORKER_THREADS)
        me = threading.get_ident()
        while True:
            group = self._tickets.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
                if group is not None:
                    self._running.add(me)
            if group is None:
                return
            if isinstance(group, _Lane):
                lane = group.group
                while lane._run_next():
                    pass
                del lane
            else:
                group._run_next()
            del group  # don't keep the last group (and its tensors) alive while idle
            with self._lock:
                self._running.discard(me)
                self._idle += 1

    def shutdown(self) -> None:
        """Stops the workers once they finish their current call."""
        with self._lock:
            threads, self._threads = self._threads, []
            self._queued += len(threads)
        for _ in threads:
            self._tickets.put(None)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()

    def _stop_at_exit(self, timeout: float) -> None:
        """Stops the workers within ``timeout`` seconds if it can: idle ones
        take a stop ticket, busy ones get one asynchronous :class:`_StopAtExit`
        (delivered at their next bytecode boundary, e.g. between two torch
        ops; a call blocked inside one long C call stops when it returns)."""
        import ctypes

        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            return
        try:
            threads, self._threads = self._threads, []
            self._queued += len(threads)
            busy = frozenset(self._running)
        finally:
            self._lock.release()
        for _ in threads:
            self._tickets.put(None)
        raise_in = ctypes.pythonapi.PyThreadState_SetAsyncExc
        raise_in.argtypes = (ctypes.c_ulong, ctypes.py_object)
        for thread in threads:
            if thread.ident in busy and thread.is_alive():
                raise_in(thread.ident, _StopAtExit)  # once: never while it holds our lock
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


_pool: Optional[WorkerPool] = None
_pool_lock = threading.Lock()


def _stop_pool_at_exit() -> None:
    pool = _pool
    if pool is not None:
        pool._stop_at_exit(EXIT_TIMEOUT_S)


atexit.register(_stop_pool_at_exit)


def _drop_leaked_saved_tensors_hooks() -> None:
    """Pops saved-tensor hooks a finished call left pushed on its worker.
    Torch 2.12 and older leave a non-reentrant ``torch.utils.checkpoint``'s
    hooks pushed on the thread when the checkpointed function raises (its
    generator stays suspended; 2.13 closes it): every later call the worker
    runs would pack its saved tensors into that dead frame. On the caller's
    thread a loop lives with torch's behaviour; a worker serves everyone's
    calls, so it drops them after a call that raised (the caller's thread,
    running calls inline, keeps torch's behaviour, as a loop's does)."""
    autograd = torch._C._autograd
    while autograd._top_saved_tensors_default_hooks(True) is not None:
        autograd._pop_saved_tensors_default_hooks()


def _workers_from_env() -> int:
    raw = os.environ.get("MOE_AUTOGRAD_WORKERS", "")
    if not raw:
        return DEFAULT_WORKERS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"MOE_AUTOGRAD_WORKERS must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"MOE_AUTOGRAD_WORKERS must be a positive integer, got {raw!r}")
    return value


def get_pool() -> WorkerPool:
    """The process-wide pool, created on first use."""
    global _pool
    pool = _pool
    if pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = WorkerPool(_workers_from_env())
            pool = _pool
    return pool


def _malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim``, or None (another C library, not Linux)."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (AttributeError, OSError, TypeError):
        return None


_trim = _malloc_trim()


def release_free_memory() -> bool:
    """Returns the free memory of every malloc arena (the workers' ones, the
    caller's) to the system; whether there was a way to. Costs a walk of the
    arenas (~9 ms after the MoE layer's first batch at 64 experts, ~1 ms when
    there is little to give back); safe at any time, from any thread (glibc
    locks each arena while it trims it), and what is in use stays."""
    if _trim is None:
        return False
    _trim(0)
    return True


def _forget_pool_after_fork() -> None:
    # The parent's worker threads do not exist in the child; its locks may be held.
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


#: The longest wait the executor's deadlines accept: ``now + this`` still waits.
MAX_TIMEOUT_S = float(threading.TIMEOUT_MAX) / 2


def check_timeout(name: str, value: Any, limit: float = MAX_TIMEOUT_S) -> Optional[float]:
    """The deadline a user's ``value`` means: ``None`` and ``math.inf`` give
    ``None`` (no deadline), a positive finite number of seconds is kept
    (clamped to ``limit``); ``nan``, zero, negative values and non-numbers
    raise (``ValueError`` / ``TypeError``) naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be None, math.inf or a positive number of seconds, "
                        f"got {type(value).__name__} {value!r:.40}")
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be None, math.inf or a positive number of seconds, "
                         f"got {value!r}")
    return None if math.isinf(seconds) else min(seconds, limit)


def run_all(fns: Sequence[Callable[[], T]], what: Optional[str] = "call", *,
            lanes: Optional[int] = None) -> List[T]:
    """Runs the calls, joins all of them, then raises the first failure
    (noted ``<what> <i> of <n>`` unless ``what`` is None) or returns the
    results in order.

    By default every call may run on a worker of its own; with ``lanes``, on
    at most that many threads (``1``: all on the caller, in order; see
    :meth:`WorkerPool.submit`).
    """
    if len(fns) == 1:
        try:
            return [fns[0]()]
        except BaseException as error:
            if what is not None:
                error.add_note(f"{what} 0 of 1")
            raise
    group = get_pool().submit(fns, lanes)
    group.wait()
    group.raise_first_error(what)
    return group.results  # type: ignore[return-value]


def predecessors(keys: Sequence[Sequence[int]]) -> List[List[int]]:
    """For each task (in the order they start), the earlier tasks it must
    wait for: per key it shares, the last earlier task with that key (tasks
    that share a key then run one after another, in order). Used for calls
    that reach one stateful module (forward, :mod:`moe_autograd.parallel`)
    and for backwards that reach one hooked module (:mod:`moe_autograd.node`)."""
    last: Dict[int, int] = {}
    waits: List[List[int]] = []
    for i, task_keys in enumerate(keys):
        before: List[int] = []
        for key in task_keys:
            j = last.get(key)
            if j is not None and j not in before:
                before.append(j)
            last[key] = i
        waits.append(before)
    return waits


def in_order(tasks: List[Callable[[], T]], waits: List[List[int]],
             check: Optional[Callable[[int], None]] = None,
             failed: Optional[Callable[[int, BaseException], None]] = None
             ) -> List[Callable[[], T]]:
    """``tasks`` (in the order they start), task ``k`` starting only once the
    tasks ``waits[k]`` (:func:`predecessors`) have ended. ``check(k)`` runs
    after the wait and may raise to keep task ``k`` from running;
    ``failed(k, error)`` sees what task ``k`` (or its check) raised. A task
    no other waits for and that waits for none is returned as it is. A
    waiting task blocks its thread, which cannot deadlock: tasks start in
    order, so the ones it waits for have started."""
    if not any(waits):
        return tasks
    done = {j: threading.Event() for before in waits for j in before}

    def ordered(k: int, task: Callable[[], T]) -> Callable[[], T]:
        before, mine = [done[j] for j in waits[k]], done.get(k)

        def run() -> T:
            try:
                for event in before:
                    event.wait()
                if check is not None:
                    check(k)
                return task()
            except BaseException as error:
                if failed is not None:
                    failed(k, error)
                raise
            finally:
                if mine is not None:
                    mine.set()
        return run
    return [ordered(k, t) if waits[k] or k in done else t for k, t in enumerate(tasks)]
