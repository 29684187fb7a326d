"""Tensors that calls save on workers, packed by the caller's hooks in call order.

Why
---
``torch.autograd.graph.saved_tensors_hooks`` are per thread. A call that runs
on a worker must still pass what it saves for backward through the caller's
hooks (offloading with ``save_on_cpu``, memory accounting, and above all the
frames of the non-reentrant ``torch.utils.checkpoint``), or it silently keeps
what the user asked to drop. But a checkpoint frame matches the tensors packed
in forward with those packed again in its recomputation *by position*: packed
from several threads at once, their order depends on the interleaving, and the
frame hands a call another call's tensor (silently wrong gradients) or raises
``CheckpointError``.

How
---
A worker packs with :class:`CallSaves` hooks of its call, which only record
each tensor in a :class:`_Saved` slot. Once every call has been joined, the
caller replays the user's ``pack`` on the slots, call after call, in call
order (:meth:`CallSaves.replay`), exactly the order a loop would have packed
them in. Before the calls' backward starts, the node's backward (on the
engine's thread, inside the outer graph task) unpacks every slot of the calls
about to run (:meth:`CallSaves.materialize`): a checkpoint frame then
recomputes once, for the outer backward, instead of once per worker.

Slot lifecycle::

    forward (worker)       pack        value = tensor
    after join (caller)    replay      packed = user_pack(tensor); value = None
    backward (engine)      materialize value = user_unpack(packed); if it raises, the
                                       slots left get the error (``fail``)
    backward (worker)      unpack      -> value (or the materialize's error, raised)
    after the call's bwd   drop        value = None (packed kept for a retained graph)
    release                            the slots go

Invariants: with no user hooks nothing here runs (zero cost); a slot's tensor
is held by exactly one of ``value`` (forward until replay; backward) or the
user's packed object; the user's hooks run only on the caller's or the
engine's thread, never on a worker.
"""
from typing import Any, Callable, List, Optional, Tuple

from torch import Tensor

__all__ = ["CallSaves", "user_hooks"]

Hooks = Tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]]
_UNPACKED = object()


class _Saved:
    __slots__ = ("value", "version", "packed", "error")

    def __init__(self, value: Tensor) -> None:
        self.value: Optional[Tensor] = value
        self.version = value._version  # when it was saved (see CallSaves.replay)
        self.packed: Any = _UNPACKED
        #: Why the user's unpack could not give the value (see ``fail``).
        self.error: Optional[BaseException] = None


def user_hooks(hooks: Optional[Hooks]) -> bool:
    """Whether ``hooks`` are the user's own (a lossy pack, ``save_on_cpu``),
    whose ``pack`` may keep the values it is given: not a
    ``torch.utils.checkpoint`` frame's (its pack keeps a handle, and the
    frame recomputes the values) nor this runtime's."""
    if hooks is None:
        return False
    module = getattr(hooks[0], "__module__", None) or ""
    return module != "torch.utils.checkpoint" and not module.startswith("moe_autograd")


class CallSaves:
    """The saved tensors of one call, for the caller's ``hooks``."""

    __slots__ = ("hooks", "slots", "keeps_values")

    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks
        self.slots: List[_Saved] = []
        #: Whether the user's pack may keep the values it sees (see replay).
        self.keeps_values = user_hooks(hooks)

    # -- the worker's hooks --------------------------------------------------
    def pack(self, tensor: Tensor) -> _Saved:
        slot = _Saved(tensor)
        self.slots.append(slot)
        return slot

    @staticmethod
    def unpack(slot: _Saved) -> Tensor:
        value = slot.value
        if value is None and slot.error is not None:
            raise _again(slot.error)
        if value is None:
            raise RuntimeError(
                "moe_autograd: a saved tensor of a parallel call was used outside the "
                "call's backward (or after it was freed)")
        return value

    # -- the caller's side ---------------------------------------------------
    def replay(self, name: str = "call") -> None:
        """Packs every slot with the user's hook, in the order they were
        saved. A tensor modified in place since it was saved (later in its
        call) raises, naming ``name``, if the hooks are the user's own: their
        pack would see it changed where the loop's saw it as saved (a copying
        pack keeps those values), and nothing here kept them. (A checkpoint
        frame's pack keeps a handle: the frame recomputes the values.)"""
        pack = self.hooks[0]
        for slot in self.slots:
            if slot.packed is _UNPACKED:
                value = slot.value
                assert value is not None
                if value._version != slot.version and self.keeps_values:
                    raise RuntimeError(
                        f"{name}: a tensor it saved for backward was modified in place later "
                        f"in the call (version {slot.version} -> {value._version}); the "
                        "caller's saved_tensors_hooks pack it once the call has returned, the "
                        "loop's as it is saved, so they would see other values: clone it "
                        "before modifying it, or call this expert outside those hooks")
                slot.packed = pack(value)
                slot.value = None

    def materialize(self) -> None:
        """Unpacks every slot with the user's hook (before the call's backward)."""
        unpack = self.hooks[1]
        for slot in self.slots:
            if slot.packed is not _UNPACKED and slot.value is None:
                slot.value = unpack(slot.packed)

    def fail(self, error: BaseException, every: bool = False) -> None:
        """The user's unpack raised ``error`` (a frame's recomputation that
        failed, say): every slot not unpacked yet raises it when the call's
        backward needs it, as the loop's backward meets it only there.
        ``every``: every slot, packed or not (the user's pack raised)."""
        for slot in self.slots:
            if every or (slot.packed is not _UNPACKED and slot.value is None):
                slot.value = None
                slot.error = error

    def drop(self) -> None:
        """Frees the unpacked tensors after the call's backward."""
        for slot in self.slots:
            if slot.packed is not _UNPACKED:
                slot.value = None

    def release(self) -> None:
        self.slots = []


def _again(error: BaseException) -> BaseException:
    """A fresh exception like ``error`` (several calls may raise it, each
    adding its own note), caused by it."""
    try:
        again = type(error)(*error.args)
    except Exception:  # noqa: BLE001 - a type that cannot be rebuilt from its args
        again = RuntimeError(str(error))
    again.__cause__ = error
    return again
