"""What a request or a held state costs a server, in bytes.

Why a module of its own: a server's limits (``max_request_bytes``,
``max_state_bytes``) are only as good as the count behind them. Arguments
arrive as arbitrary picklable objects, so a tensor can hide anywhere in them:
in a list in a dict, five levels down, in a ``SimpleNamespace``, a dataclass
or any object's ``__dict__`` or ``__slots__``. A count that looks only at
the top levels lets such a tensor bypass every limit.

Invariants:

* :func:`materialised_bytes` (and a running :class:`Tally`, for the calls of
  one request) counts every tensor reachable from its arguments
  through containers (lists, tuples, sets, deques, any mapping's keys and
  values) and objects (``__dict__`` and ``__slots__`` attributes), however
  deep, each tensor object once (pickling keeps identity: a tensor referenced
  twice travels once; a :class:`Tally` counts it once over all it is given),
  at the size the server materialises: ``numel *
  element_size``, so a stride-0 ``expand``ed tensor counts in full.
* The walk is iterative (no recursion limit) and bounded: past
  :data:`MAX_OBJECTS` objects it raises :class:`ValueError` (the request is
  refused) instead of spending unbounded time on a crafted structure.
* It never runs user code except attribute reads of ``__slots__`` members
  (a failing read counts nothing).
"""
from collections import deque
from collections.abc import Mapping
from typing import Any, List, Optional, Set

from torch import Tensor

__all__ = ["materialised_bytes", "Tally", "MAX_OBJECTS"]

MAX_OBJECTS = 1 << 20  # objects one count may visit before it refuses
_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), memoryview, range)


def _slot_values(value: Any) -> List[Any]:
    found: List[Any] = []
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                found.append(object.__getattribute__(value, name))
            except Exception:  # noqa: BLE001 - an unset slot, or a descriptor that fails
                continue
    return found


class Tally:
    """A running count of the bytes of the tensors given to :meth:`add`, each
    tensor object once over every call (see the module docstring)."""

    __slots__ = ("total", "_seen")

    def __init__(self) -> None:
        self.total = 0
        self._seen: Set[int] = set()

    def add(self, *values: Any, limit: Optional[int] = None) -> Optional[int]:
        """Bytes of the tensors reachable from ``values`` not counted before,
        added to :attr:`total`; with ``limit``, only if the new total stays
        within it (else ``None``, and the tally is left as it was). Raises
        :class:`ValueError` past :data:`MAX_OBJECTS` objects in all (the
        tally is then left as it was too)."""
        new = 0
        seen = self._seen
        mine: List[int] = []  # ids first seen here: forgotten again if refused
        stack: List[Any] = list(values)
        while stack:
            value = stack.pop()
            if isinstance(value, _ATOMS) or isinstance(value, type):
                continue
            key = id(value)
            if key in seen:
                continue
            seen.add(key)
            mine.append(key)
            if len(seen) > MAX_OBJECTS:
                seen.difference_update(mine)
                raise ValueError(f"the arguments hold more than {MAX_OBJECTS} objects: too "
                                 "many to account for their tensors")
            if isinstance(value, Tensor):
                new += value.numel() * value.element_size()
                continue
            if isinstance(value, dict) or isinstance(value, Mapping):
                stack.extend(value.keys())
                stack.extend(value.values())
                continue
            if isinstance(value, (list, tuple, set, frozenset, deque)):
                stack.extend(value)
                continue
            try:
                attributes = object.__getattribute__(value, "__dict__")
            except Exception:  # noqa: BLE001 - no __dict__
                attributes = None
            if isinstance(attributes, dict):
                stack.extend(attributes.values())
            stack.extend(_slot_values(value))
        if limit is not None and self.total + new > limit:
            seen.difference_update(mine)
            return None
        self.total += new
        return new


def materialised_bytes(*values: Any) -> int:
    """Bytes the tensors reachable from ``values`` take once materialised
    (see the module docstring); raises :class:`ValueError` past
    :data:`MAX_OBJECTS` objects."""
    tally = Tally()
    tally.add(*values)
    return tally.total
