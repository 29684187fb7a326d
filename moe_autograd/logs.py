"""What moe_autograd tells a person: loggers, their limits, and the CLI's handler.

Why a module of its own: the library reports what it absorbs (a masked
expert, a refused request, a retried call, a server that joined or left) on
the standard :mod:`logging` loggers, and some of these events repeat at the
rate of training steps. The pieces every reporter shares sit here, below
all of them: a rate limit per key, and the one handler the command line
installs.

Conventions (the README's "Logs" section is the user's view):

=======================================  ==========  ==============================
what                                     level       logger
=======================================  ==========  ==============================
an expert call masked, or its backward   WARNING     ``moe_autograd.moe.layer``
treated as a constant (expert, call,
error text)
a request refused by a server's gate,    WARNING     ``moe_autograd.remote.auth``
refusals a server reports
a fleet's server lost or refused         WARNING     ``moe_autograd.remote.fleet``,
                                                     ``moe_autograd.remote.ray_fleet``
a fleet's server joined, left, reaped,   INFO        the same
gone
a fleet expert's retry on another        INFO        ``moe_autograd.remote.replicas``
replica, and its switch of replica
what ``serve`` serves, periodically      INFO        ``moe_autograd.remote.cli``
a site's execution mode                  DEBUG       ``moe_autograd.policy``
=======================================  ==========  ==============================

Invariants:

* Every logger is ``moe_autograd.<module>`` (the module's ``__name__``; spelled
  out in a module that also runs as a script, ``python -m ...``, where
  ``__name__`` is ``__main__``), so ``logging.getLogger("moe_autograd")``
  sets the level of all of them.
* The library installs no handler (not even a ``NullHandler``): where the
  application configured none, Python's last-resort handler prints WARNING
  and above to stderr, so a masked failure is never silent by default;
  INFO needs a handler (``logging.basicConfig(level=logging.INFO)``), as the
  command line configures (:func:`configure_cli`).
* A :class:`RateLimit` lets through at most one line per key every
  ``every`` seconds, and the line that gets through says how many it held
  back; it never blocks and never drops a count.
"""
import logging
import sys
import threading
import time
from typing import Dict, Hashable, Optional, TextIO, Tuple

__all__ = ["RateLimit", "LOG_EVERY_S", "configure_cli", "held_back"]

LOG_EVERY_S = 10.0  # the default: one line per key every 10 s


class RateLimit:
    """At most one line per key every ``every`` seconds (thread-safe).

    ``allow(key)`` returns None when the line must be held back (counted),
    else how many lines of that key were held back since the last one let
    through (0 usually)."""

    def __init__(self, every: float = LOG_EVERY_S) -> None:
        self.every = every
        self._lock = threading.Lock()
        self._seen: Dict[Hashable, Tuple[float, int]] = {}  # key -> (last let through, held)

    def allow(self, key: Hashable, now: Optional[float] = None) -> Optional[int]:
        now = time.monotonic() if now is None else now
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.every:
                self._seen[key] = (seen[0], seen[1] + 1)
                return None
            self._seen[key] = (now, 0)
            return 0 if seen is None else seen[1]

    def __getstate__(self) -> Dict[str, float]:
        return {"every": self.every}  # a copy starts afresh (no lock to copy)

    def __setstate__(self, state: Dict[str, float]) -> None:
        self.__init__(state["every"])  # type: ignore[misc]


def held_back(count: int, every: float) -> str:
    """The tail of a line let through after ``count`` were held back."""
    return f" ({count} more like it not logged in the last {every:g} s)" if count else ""


class _CliFormatter(logging.Formatter):
    def __init__(self, prefix: str) -> None:
        super().__init__(f"[{prefix}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")


def configure_cli(prefix: str, level: int = logging.INFO,
                  stream: Optional[TextIO] = None) -> logging.Handler:
    """The command line's handler: one line per record on stderr, prefixed
    ``[prefix]``, for every ``moe_autograd.*`` logger at ``level`` and above.
    Installed once per process (a second call replaces the first)."""
    root = logging.getLogger("moe_autograd")
    for handler in list(root.handlers):
        if getattr(handler, "_moe_autograd_cli", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(_CliFormatter(prefix))
    setattr(handler, "_moe_autograd_cli", True)
    root.addHandler(handler)
    root.setLevel(level)
    return handler
