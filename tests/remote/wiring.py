"""Test wiring for remote experts (not a test module): the job's secret of the
test worlds, an in-process transport, raw requests, and a counting transport.

* :data:`SECRET`: the job secret every remote test world uses. The first
  process that imports this module makes it and puts it in
  ``MOE_AUTOGRAD_SECRET``, so that every process it starts afterwards (test
  clients, servers, CLI runs) reads the same one as its default; Ray actors
  get it from a private file (:class:`~moe_autograd.remote.RayExpertServer`).
* :class:`InProcess` (:mod:`moe_autograd.remote.loopback`'s, imported here):
  a transport that hands each frame to this process's own endpoint,
  synchronously (servers built in this process answer it): the whole wire
  (seal, encode, open, decode) without an engine.
* :func:`ask`: a raw request (a message dict) to a worker: its reply pair.
* :class:`Counting`: a transport that records the operation of each message
  it carries (``"batch"``, ``"collect"``, ``"forward"``, ``"backward"``, ...).
* :func:`init_local_ray` / :func:`shutdown_local_ray` / :func:`ray_token_env`: a
  Ray of this process's own, with token authentication on (the benches'
  ``local_ray``: nothing in the user's home or ``/tmp/ray`` is read or written).
"""
import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from moe_autograd.remote import JobSecret, RemoteExpert, call_operation
from moe_autograd.remote.auth import ENV_SECRET, Caller
from moe_autograd.remote.channel import request
from moe_autograd.remote.frame import Frame
from moe_autograd.remote.loopback import Done, InProcess  # noqa: F401 - the tests import them here
from moe_autograd.remote.transport import Transport, get_transport

SECRET = JobSecret.from_hex(os.environ[ENV_SECRET]) if os.environ.get(ENV_SECRET) \
    else JobSecret.generate()
os.environ[ENV_SECRET] = SECRET.hex()
_ray: List[Any] = []  # [the ExitStack of the Ray this process started, its LocalRay]

#: How long a test gives a Ray actor (a worker process importing torch) to
#: start: about 5 s on a quiet machine, past 60 s on 2 cores at load 6
#: (issue 43's runs under load). Tests that start actors add it to their limit.
RAY_START_S = 240.0


def init_local_ray(python_path: Tuple[str, ...] = (), **options: Any) -> Any:
    """A new local Ray of this process's own, connected until
    :func:`shutdown_local_ray` (moe_autograd.bench.ray_remote.local_ray: token
    authentication on, its token and every file of Ray's in a private
    directory, nodes on loopback; nothing in /tmp/ray or ~/.ray)."""
    from moe_autograd.bench.ray_remote import local_ray

    stack = contextlib.ExitStack()
    here = stack.enter_context(local_ray(python_path=python_path, **options))
    _ray[:] = [stack, here]
    return here


def shutdown_local_ray() -> None:
    """Shuts the Ray of :func:`init_local_ray` down and removes its files."""
    if _ray:
        stack = _ray[0]
        _ray.clear()
        stack.close()


def ray_token_env() -> Dict[str, str]:
    """The environment a process needs to join the Ray this process started."""
    here = _ray[1]
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": os.path.join(here.dir, "auth_token")}


def caller(session: bytes = b"s" * 16, secret: JobSecret = SECRET) -> Caller:
    """An authenticated caller as a handler sees it (unit tests of handlers)."""
    return Caller(secret.key_id, session, 1)


def ask(worker: str, message: Dict[str, Any], transport: Optional[Transport] = None,
        timeout: float = 20.0, secret: Optional[JobSecret] = None) -> List[Any]:
    """The reply pair (``["ok", value]`` / ``["error", text]``) of a raw request."""
    return request(transport or get_transport(), worker, message, timeout,
                   secret=secret).result(timeout)


class Counting:
    """``inner`` (default: the current transport), recording each message as
    ``(worker, operation)`` (the operation of a batch or a collect, not its
    phase)."""

    name = "counting"

    def __init__(self, inner: Optional[Transport] = None) -> None:
        self.inner: Transport = get_transport() if inner is None else inner
        self.sent: List[Tuple[str, str]] = []
        self._lock = threading.Lock()

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Any:
        op = frame.label.partition(":")[0]
        if op in ("batch", "collect", "forward", "backward"):
            with self._lock:
                self.sent.append((worker, op))
        return self.inner.call(worker, frame, timeout)

    def local_name(self) -> str:
        return self.inner.local_name()

    def default_timeout(self) -> Optional[float]:
        return self.inner.default_timeout()  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> Any:  # the rest of the engine's transport
        return getattr(self.inner, name)

    def take(self) -> Dict[str, List[str]]:
        with self._lock:
            sent, self.sent = self.sent, []
        by_worker: Dict[str, List[str]] = {}
        for worker, op in sent:
            by_worker.setdefault(worker, []).append(op)
        return by_worker


@dataclass
class Backend:
    """One engine with the shared servers behind it (the conftest's
    ``backend`` fixture: ``srv-a`` and ``srv-b`` on torch RPC or on Ray)."""

    name: str
    transport: Transport
    servers: Tuple[Any, ...]

    def run(self, worker: str, name: str, *args: Any, timeout: float = 20.0) -> Any:
        """The test operation ``name`` (``remote_experts``) on ``worker``."""
        return call_operation(worker, name, *args, timeout=timeout, transport=self.transport)

    def ask(self, worker: str, message: Dict[str, Any]) -> Any:
        """The reply pair of a raw request."""
        return ask(worker, message, self.transport)

    def expert(self, worker: str, name: str, **options: Any) -> RemoteExpert:
        options.setdefault("transport", self.transport)
        return RemoteExpert(worker, name, **options)
