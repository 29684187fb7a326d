"""What an expert module's forward changes on itself, seen by its call.

Why
---
A forward may leave results on its module as well as return them: an aux loss
stored as ``self.aux``, the last input kept for logging, ``spectral_norm``'s
recomputed ``weight``, BatchNorm's running statistics and counter. In a plain
loop those are part of the caller's world. A call of the runtime runs on an
isolated graph, so a tensor it leaves on its module belongs to that graph, and
a checkpointed call runs its forward twice. This module records, per call,
what changed, so that :class:`~moe_autograd.module_call.ModuleCall` can

* carry every tensor attribute the forward set through the node, as a hidden
  output, and rebind the attribute to the caller's tensor (the loop's
  ``expert.aux`` then equals ours, gradients included);
* recompute a checkpointed call from the module state its forward saw, and
  leave the module as the forward left it (running statistics advance once,
  ``spectral_norm`` iterates once, attributes keep the forward's values).

Lifecycle of one call's :class:`ModuleState`::

    taken      before the forward: each submodule's attribute dict (shallow)
               and, for a checkpointed call, copies of its buffers
    compared   after the forward: tensor attributes set (carried as outputs)
    replayed   around the recomputation: the forward's starting state swapped
               in (buffers as fresh copies, attributes as they were: those it
               set or deleted back, those it created gone), then
               everything the recomputation changed put back

Invariants:

* Only tensor-valued plain attributes are carried (not parameters, buffers,
  submodules, or tensors inside containers); they are found by identity: an
  attribute holding the same tensor object before and after is unchanged.
* A recomputation swaps objects in the module's dicts; it never writes into a
  tensor the user can hold, so no version counter of theirs moves.
* A recomputation holds the lock of every module of its state (taken in one
  order: by id) for as long as it runs: shared if it finds the state as its
  forward did, exclusive if it swaps it. So a recomputation that swaps a
  module's state (a shared expert's call of an earlier batch, whose
  forward saw other attributes) overlaps no other of that module's, and none
  reads another's replayed state or sees it put back midway (found by
  ``make fuzz`` seed 1796696589, issue 46); those that swap nothing still
  run together, and those of distinct modules never wait on each other.
"""
import threading
import weakref
from contextlib import contextmanager
from operator import is_
from typing import Any, Dict, Generator, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn

__all__ = ["ModuleState", "submodules", "may_change"]

_MISSING = object()
class _ReplayLock:
    """A module's lock for recomputations: shared by those that find it as
    their forward did, exclusive for one that swaps its state (re-entrant on
    a thread that holds it; readers are never held back by a waiting
    writer, so a nested recomputation cannot deadlock)."""

    __slots__ = ("_cond", "_readers", "_writer", "_depth")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers: Dict[int, int] = {}  # thread -> how many times it reads
        self._writer: Optional[int] = None
        self._depth = 0

    def acquire(self, exclusive: bool) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._depth += 1
                return
            if exclusive:
                while self._writer is not None or any(t != me for t in self._readers):
                    self._cond.wait()
                self._writer, self._depth = me, 1
            else:
                while self._writer is not None:
                    self._cond.wait()
                self._readers[me] = self._readers.get(me, 0) + 1

    def release(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._depth -= 1
                if self._depth == 0:
                    self._writer = None
                    self._cond.notify_all()
                return
            count = self._readers[me] - 1
            if count:
                self._readers[me] = count
            else:
                del self._readers[me]
                self._cond.notify_all()


_LOCKS: "weakref.WeakKeyDictionary[nn.Module, _ReplayLock]" = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _locks_of(modules: List[nn.Module]) -> List[_ReplayLock]:
    """The recomputation locks of ``modules``, in one global order (by id)."""
    with _LOCKS_LOCK:
        found = []
        for m in sorted({id(m): m for m in modules}.values(), key=id):
            lock = _LOCKS.get(m)
            if lock is None:
                lock = _LOCKS[m] = _ReplayLock()
            found.append(lock)
        return found


def _submodules(module: nn.Module, out: List[nn.Module], seen: Set[int]) -> List[nn.Module]:
    """``list(module.modules())``, at a fraction of its cost (this runs on
    every call)."""
    if id(module) not in seen:
        seen.add(id(module))
        out.append(module)
        for child in module._modules.values():
            if child is not None:
                _submodules(child, out, seen)
    return out


def submodules(module: nn.Module) -> List[nn.Module]:
    """``list(module.modules())``: the module tree a call reaches."""
    return _submodules(module, [], set())


_TORCH_NN = "torch.nn.modules."


def may_change(module: nn.Module) -> bool:
    """Whether a forward through ``module`` may change its state: it has
    buffers (BatchNorm's running statistics), hooks, or a class of its own
    (whose forward may set anything); the ``torch.nn`` modules without
    buffers (Linear, LayerNorm, Embedding, ...) only compute."""
    return bool(module._buffers or module._forward_hooks or module._forward_pre_hooks
                or not type(module).__module__.startswith(_TORCH_NN))


def _same(now: Dict[str, Any], before: Dict[str, Any]) -> bool:
    """Whether an attribute dict holds the same objects as its copy (a
    reassigned key keeps its place, a new key adds one): a C-speed test for
    the common case, a forward that set nothing."""
    return len(now) == len(before) and all(map(is_, now.values(), before.values()))


class ModuleState:
    """One call's view of its module's state (see the module docstring)."""

    __slots__ = ("_modules", "_dicts", "_buffers", "set_attrs")

    def __init__(self, module: nn.Module, checkpoint: bool,
                 modules: Optional[List[nn.Module]] = None) -> None:
        #: ``submodules(module)``, walked here unless the caller did.
        self._modules: List[nn.Module] = modules if modules is not None else submodules(module)
        self._dicts: List[Dict[str, Any]] = [dict(m.__dict__) for m in self._modules]
        #: The buffers' values before the forward (checkpointed calls only:
        #: kernels such as batch norm's update running statistics in place
        #: without moving a version counter, so every buffer is kept).
        self._buffers: Optional[List[Dict[str, Tensor]]] = None
        if checkpoint and any(m._buffers for m in self._modules):
            self._buffers = [{k: b.clone() for k, b in m._buffers.items() if b is not None}
                             for m in self._modules]
        #: ``(module, name)`` of every tensor attribute the forward set.
        self.set_attrs: List[Tuple[nn.Module, str]] = []

    def compare(self) -> List[Tensor]:
        """After the forward: the tensors it left in plain attributes (listed
        in :attr:`set_attrs`)."""
        found: List[Tensor] = []
        for m, before in zip(self._modules, self._dicts):
            if _same(m.__dict__, before):
                continue
            for name, value in m.__dict__.items():
                if isinstance(value, Tensor) and before.get(name) is not value:
                    self.set_attrs.append((m, name))
                    found.append(value)
        return found

    @property
    def changes(self) -> bool:
        """Whether a recomputation must replay a state other than the current."""
        return self._buffers is not None or not all(
            _same(m.__dict__, before) for m, before in zip(self._modules, self._dicts))

    def attrs(self) -> List[Tensor]:
        """The current values of :attr:`set_attrs` (a recomputation's)."""
        return [m.__dict__[name] for m, name in self.set_attrs]

    def rebind(self, raw: List[Tensor], outer: List[Tensor]) -> None:
        """Points each attribute the forward set at the caller's tensor,
        unless something set it again since (the loop's last writer wins)."""
        for (m, name), r, o in zip(self.set_attrs, raw, outer):
            if m.__dict__.get(name) is r:
                m.__dict__[name] = o

    @contextmanager
    def replayed(self) -> Generator[None, None, None]:
        """The module as the forward found it, for a recomputation; as it is
        now again afterwards."""
        locks = _locks_of(self._modules)
        for lock in locks:  # shared: others that find the state as it is may run
            lock.acquire(exclusive=False)
        if self.changes:  # exclusive: this one swaps the state
            for lock in reversed(locks):
                lock.release()
            for lock in locks:
                lock.acquire(exclusive=True)
        try:
            if not self.changes:
                yield
                return
            now = [dict(m.__dict__) for m in self._modules]
            now_buffers = [dict(m._buffers) for m in self._modules]
            try:
                for m, before in zip(self._modules, self._dicts):
                    # Every attribute as the forward found it: those it set
                    # or deleted back, those it created gone (issue 34). Key
                    # by key, never cleared: another thread may read the
                    # module meanwhile (its _buffers, _parameters...).
                    d = m.__dict__
                    for k in [k for k in d if k not in before]:
                        del d[k]
                    for k, v in before.items():
                        if d.get(k, _MISSING) is not v:
                            d[k] = v
                for m, values in zip(self._modules, self._buffers or ()):
                    for name, value in values.items():
                        m._buffers[name] = value.clone()
                yield
            finally:
                for m, current, buffers in zip(self._modules, now, now_buffers):
                    m.__dict__.clear()
                    m.__dict__.update(current)
                    m._buffers.clear()
                    m._buffers.update(buffers)
        finally:
            for lock in reversed(locks):
                lock.release()
