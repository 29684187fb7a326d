"""Test wiring for remote experts (not a test module): the job's secret of the
test worlds, an in-process transport, raw requests, and a counting transport.

* :data:`SECRET`: the job secret every remote test world uses. The first
  process that imports this module makes it and puts it in
  ``MOE_AUTOGRAD_SECRET``, so that every process it starts afterwards (test
  clients, servers, CLI runs) reads the same one as its default; Ray actors
  get it from a private file (:class:`~moe_autograd.remote.RayExpertServer`).
* :class:`InProcess`: a transport that hands each frame to this process's
  own endpoint, synchronously (servers built in this process answer it):
  the whole wire (seal, encode, open, decode) without an engine.
* :func:`ask`: a raw request (a message dict) to a worker: its reply pair.
* :class:`Counting`: a transport that records the operation of each message
  it carries (``"batch"``, ``"collect"``, ``"forward"``, ``"backward"``, ...).
* :func:`ray_token_env` / :func:`init_local_ray`: a Ray of this test's own, with
  token authentication on (a token file in a private directory: nothing in
  the user's home or ``/tmp/ray`` is read or written).
"""
import os
import secrets
import shutil
import tempfile
import threading
from typing import Any, Dict, List, Optional, Tuple

from moe_autograd.remote import JobSecret, endpoint
from moe_autograd.remote.auth import ENV_SECRET, Caller
from moe_autograd.remote.channel import request
from moe_autograd.remote.frame import Frame
from moe_autograd.remote.transport import Transport, get_transport

SECRET = JobSecret.from_hex(os.environ[ENV_SECRET]) if os.environ.get(ENV_SECRET) \
    else JobSecret.generate()
os.environ[ENV_SECRET] = SECRET.hex()
_ray_dirs: List[str] = []


def ray_token_env() -> Dict[str, str]:
    """The environment of a Ray with token authentication whose token lives
    in a private directory (made once per process; Ray's temporary files go
    there too: :func:`ray_temp_dir`)."""
    if not _ray_dirs:
        _ray_dirs.append(tempfile.mkdtemp(prefix="moe-ray-", dir="/tmp"))  # short: unix sockets
    token = os.path.join(_ray_dirs[0], "auth_token")
    if not os.path.exists(token):
        with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token}


def ray_temp_dir() -> str:
    ray_token_env()
    return _ray_dirs[0]


def remove_ray_dirs() -> None:
    for path in _ray_dirs:
        shutil.rmtree(path, ignore_errors=True)
    _ray_dirs.clear()


def init_local_ray(**options: Any) -> None:
    """``ray.init`` of a new local instance (never a cluster found through
    RAY_ADDRESS or /tmp/ray), with token authentication on: the environment
    of :func:`ray_token_env` is set in this process (its workers inherit it)."""
    os.environ.update(ray_token_env())
    import ray
    from ray._raylet import AuthenticationTokenLoader, Config

    # Ray reads the mode and the token once per process: read them again
    # (this process may have imported Ray before the environment was set).
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    options.setdefault("include_dashboard", False)
    options.setdefault("log_to_driver", False)
    options.setdefault("configure_logging", False)
    ray.init(address="local", _temp_dir=ray_temp_dir(), **options)


class _Done:
    """A pending that is done already."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame

    def done(self) -> bool:
        return True

    def result(self, timeout: Optional[float]) -> Frame:
        return self.frame

    def add_done_callback(self, fn: Any) -> None:
        fn()


class InProcess:
    """Serves frames with this process's endpoint, as the named worker."""

    name = "in-process"

    def __init__(self, me: str = "client") -> None:
        self.me = me

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> _Done:
        return _Done(endpoint.serve(frame, worker))

    def local_name(self) -> str:
        return self.me


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
