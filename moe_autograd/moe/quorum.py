"""When a forward has heard enough from its experts.

The layer's forward waits on its group of expert calls with three limits:

==========================  ===============================================
``forward_timeout``          hard deadline for the whole wait, from submission
quorum (``k_min``)           every token has ``k_min`` answering experts
``timeout_after_k_min``      once the quorum holds, how much longer to wait
                             for the remaining calls
==========================  ===============================================

Each limit is ``None`` or ``math.inf`` (no limit) or a positive number of
seconds; :func:`check_timeout` turns what a user passes into that form
(``ValueError`` naming the argument for ``nan``, zero or negative values) and
clamps huge values to :data:`MAX_TIMEOUT_S`, what ``threading`` waits accept.

Invariants: the wait never runs an expert on the caller's thread while a
deadline is set (a straggler cannot hold the caller), it returns by the
deadline however long a call runs, and calls that had not started by then are
cancelled. A call that finishes late is simply never looked at again. A call
interrupted (``KeyboardInterrupt``, ``SystemExit``: not an ``Exception``) is
never masked: the wait joins every running call, deadline or not, and raises
the first error in call order.
"""
import time
from typing import Any, List, Optional, Sequence

import torch
from torch import Tensor

from ..executor import MAX_TIMEOUT_S, TaskGroup, check_timeout, is_interruption

__all__ = ["gather", "check_timeout", "MAX_TIMEOUT_S"]

def gather(group: TaskGroup[Any], call_tokens: Sequence[Tensor], num_tokens: int, k_min: int,
           forward_timeout: Optional[float], timeout_after_k_min: Optional[float]) -> List[bool]:
    """Waits as the table above says; returns which calls succeeded."""
    n = len(call_tokens)
    forward_timeout = check_timeout("forward_timeout", forward_timeout)
    timeout_after_k_min = check_timeout("timeout_after_k_min", timeout_after_k_min)
    if forward_timeout is None and timeout_after_k_min is None:
        group.wait()
        _raise_interruption(group)
        return [group.succeeded(i) for i in range(n)]

    hard = None if forward_timeout is None else time.monotonic() + forward_timeout
    answers = torch.zeros(num_tokens, dtype=torch.int64)
    counted = [False] * n

    def quorum_met() -> bool:
        if group.interrupted is not None:
            return True  # stops the wait; raised below
        for i in range(n):
            if not counted[i] and group.succeeded(i):
                counted[i] = True
                answers[call_tokens[i]] += 1
        return bool((answers >= k_min).all())

    def left(deadline: Optional[float]) -> Optional[float]:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    group.wait(left(hard), help=False, until=quorum_met)
    _raise_interruption(group)
    if not group.all_done and quorum_met():
        after = hard if timeout_after_k_min is None else time.monotonic() + timeout_after_k_min
        if hard is not None and after is not None:
            after = min(after, hard)
        group.wait(left(after), help=False)
    group.cancel()
    _raise_interruption(group)
    return [group.succeeded(i) for i in range(n)]


def _raise_interruption(group: TaskGroup[Any]) -> None:
    """A call interrupted (Ctrl-C, ``SystemExit``: never masked as a failed
    expert): the group is joined (no call runs on behind the caller's back;
    its later calls were cancelled), then the first interruption in call
    order raised (the layer masks the other failures)."""
    if group.interrupted is None:
        return
    group.cancel("cancelled before it started: an earlier call was interrupted")
    group.wait(help=False)
    raise next(e for e in group.errors if is_interruption(e))  # type: ignore[misc]
