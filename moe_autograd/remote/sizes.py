"""What a request or a held state costs a server, in bytes.

Why a module of its own: a server's limits (``max_request_bytes``,
``max_state_bytes``) are only as good as the count behind them. A request
arrives as wire values (:mod:`.wire`: lists, tuples, dicts, numbers,
strings, tensors), and what matters is what the server will *materialise*:
a stride-0 tensor that arrived as one element becomes a full tensor as soon
as an expert computes with it, and a tensor that several jobs of one request
share is materialised by each of them.

Invariants:

* :func:`materialised_bytes` (and a running :class:`Tally`) counts every
  tensor reachable from its arguments through lists, tuples and dicts,
  however deep, at ``numel * element_size`` (an ``expand``\\ ed tensor in
  full), each tensor object once per tally.
* A request's jobs are counted with one tally each
  (:func:`~moe_autograd.remote.server.admit_request`): a tensor that two
  jobs use counts twice, as the server materialises it twice.
* The walk is iterative and bounded: past :data:`MAX_OBJECTS` objects it
  raises :class:`ValueError` (the request is refused) instead of spending
  unbounded time on a crafted structure. It runs no code of the values.
"""
from typing import Any, List, Optional, Set

from torch import Tensor

__all__ = ["materialised_bytes", "Tally", "MAX_OBJECTS"]

MAX_OBJECTS = 1 << 20  # objects one count may visit before it refuses


class Tally:
    """A running count of the bytes of the tensors given to :meth:`add`, each
    tensor object once over every call (see the module docstring)."""

    __slots__ = ("total", "_seen", "_visited")

    def __init__(self) -> None:
        self.total = 0
        self._seen: Set[int] = set()
        self._visited = 0

    def add(self, *values: Any, limit: Optional[int] = None) -> Optional[int]:
        """Bytes of the tensors reachable from ``values`` not counted before,
        added to :attr:`total`; with ``limit``, only if the new total stays
        within it (else ``None``, and the tally is left as it was). Raises
        :class:`ValueError` past :data:`MAX_OBJECTS` objects in all (the
        tally is then left as it was too)."""
        new = 0
        seen = self._seen
        mine: List[int] = []  # tensors first seen here: forgotten again if refused
        visited = self._visited
        stack: List[Any] = list(values)
        while stack:
            value = stack.pop()
            visited += 1
            if visited > MAX_OBJECTS:
                seen.difference_update(mine)
                raise ValueError(f"the arguments hold more than {MAX_OBJECTS} objects: too "
                                 "many to account for their tensors")
            if isinstance(value, Tensor):
                key = id(value)
                if key not in seen:
                    seen.add(key)
                    mine.append(key)
                    new += value.numel() * value.element_size()
            elif isinstance(value, (list, tuple)):
                stack.extend(value)
            elif isinstance(value, dict):
                stack.extend(value.values())
        if limit is not None and self.total + new > limit:
            seen.difference_update(mine)
            return None
        self.total += new
        self._visited = visited
        return new


def materialised_bytes(*values: Any) -> int:
    """Bytes the tensors reachable from ``values`` take once materialised
    (see the module docstring); raises :class:`ValueError` past
    :data:`MAX_OBJECTS` objects."""
    tally = Tally()
    tally.add(*values)
    return tally.total
