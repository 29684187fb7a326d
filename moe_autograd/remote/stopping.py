"""Background threads of fleets and servers, stopped before the interpreter finalises.

Why: a daemon thread inside a store or RPC call when the interpreter
finalises makes torch abort the process ("terminate called ..."). A
:class:`~.fleet.Fleet` or :class:`~.elastic.ElasticServer` never shut down
must therefore stop its threads at exit by itself, so that a script may
simply exit.

Invariants:

* :func:`track` registers an owner (weakly: a collected one needs nothing);
  the exit hook calls each live owner's ``_halt_at_exit()``, which must stop
  its threads within about :data:`EXIT_JOIN_S`.
* The hook is registered when this module is first imported, after the
  client's releaser's and the RPC engine's hooks, so it runs before them
  (``atexit`` runs last registered first).
"""
import atexit
import weakref
from typing import Any

__all__ = ["track", "untrack", "EXIT_JOIN_S"]

EXIT_JOIN_S = 1.0  # at exit, how long the hook waits for each fleet's or server's threads
_running: "weakref.WeakSet[Any]" = weakref.WeakSet()


def track(owner: Any) -> None:
    """Stops ``owner``'s threads at exit (``owner._halt_at_exit()``)."""
    _running.add(owner)


def untrack(owner: Any) -> None:
    _running.discard(owner)


def _stop_threads_at_exit() -> None:
    for owner in list(_running):
        owner._halt_at_exit()


atexit.register(_stop_threads_at_exit)
