"""Exceptions of remote expert calls.

Why two types: callers that retry or fall back on a slow expert (a dropped
expert in a mixture, a switch to another replica) must tell a missed deadline
apart from a call that failed for good, without parsing messages.

Invariants:

* Every failure of a :class:`~moe_autograd.remote.RemoteExpert` call reaches
  the caller as a :class:`RemoteExpertError` whose message names the worker
  and the expert and, when the server raised, includes the server's error.
* :class:`RemoteTimeoutError` is both a :class:`RemoteExpertError` and a
  built-in :class:`TimeoutError`, so ``except TimeoutError`` catches it.
"""

__all__ = ["RemoteExpertError", "RemoteTimeoutError"]


class RemoteExpertError(RuntimeError):
    """A remote expert call failed (on the server, or in the transport)."""


class RemoteTimeoutError(RemoteExpertError, TimeoutError):
    """A remote expert call missed its deadline; a late reply is discarded."""
