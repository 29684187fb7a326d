"""Exceptions of remote expert calls.

Why several types: callers that retry or fall back on a slow expert (a
dropped expert in a mixture, a switch to another replica) must tell a missed
deadline apart from a call that failed for good, and an operator must tell a
refusal (a wrong secret, a replay) apart from a failure, without parsing
messages.

Invariants:

* Every failure of a :class:`~moe_autograd.remote.RemoteExpert` call reaches
  the caller as a :class:`RemoteExpertError` whose message names the worker
  and the expert and, when the server raised, includes the server's error.
* :class:`RemoteTimeoutError` is both a :class:`RemoteExpertError` and a
  built-in :class:`TimeoutError`, so ``except TimeoutError`` catches it.
* :class:`RemoteAuthError` is a :class:`RemoteExpertError` too: a
  ``MixtureOfExperts`` masks a refused call like a failing one.
"""

__all__ = ["RemoteExpertError", "RemoteTimeoutError", "RemoteAuthError"]


class RemoteExpertError(RuntimeError):
    """A remote expert call failed (on the server, or in the transport)."""


class RemoteTimeoutError(RemoteExpertError, TimeoutError):
    """A remote expert call missed its deadline; a late reply is discarded."""


class RemoteAuthError(RemoteExpertError):
    """A server refused a request (it failed authentication: another job's or
    no secret, a replay, a stale clock), or a reply failed authentication."""
