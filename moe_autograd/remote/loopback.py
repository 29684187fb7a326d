"""Small RPC worlds on one machine, for tests, benchmarks and examples.

Why: a remote expert needs several processes in one ``torch.distributed.rpc``
world. These helpers start expert servers in spawned processes on loopback,
exactly as ``python -m moe_autograd serve`` would on other machines. And
:class:`InProcess` needs none: a transport that hands each frame to this
process's own endpoint (servers built here answer it), the whole wire
(seal, encode, open, decode) without an engine.

Invariants:

* :func:`free_port` returns a port that was free a moment ago (bound to port
  0 and closed); rendezvous happens on it right after.
* A server process serves until every worker of the world has called
  ``rpc.shutdown()`` (the standard static-world pattern), then exits 0.
* :func:`stop_processes` leaves no process behind: join, terminate, kill.
* A process joins at most one RPC world in its life: re-initialising RPC in
  the same process after ``rpc.shutdown()`` hangs in torch's rendezvous
  (torch 2.13, seen here), so a second world needs fresh processes.
* :func:`backend_options` uses TensorPipe's ``uv`` transport: the default
  same-host ``shm`` transport busy-polls (measured: ~20-35 % of a core per
  idle process), which starves worlds of more processes than cores.
* Worlds listen on loopback only (:func:`~.rpc_bind.start_rpc`), and servers
  get the job's secret from their parent through the process's start
  pipe (never argv or the environment): ``secret`` (default: the parent's
  :func:`~.auth.job_secret`).
"""
import multiprocessing
import socket
from typing import Any, Dict, List, Optional, Sequence

from . import endpoint
from .auth import JobSecret, job_secret, set_job_secret
from .factory import load_object
from .frame import Frame
from .rpc_bind import start_rpc
from .server import ExpertServer

__all__ = ["free_port", "backend_options", "serve_in_process", "start_servers", "stop_processes",
           "InProcess", "Done"]


class Done:
    """A pending that is done already (:class:`InProcess`'s)."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame

    def done(self) -> bool:
        return True

    def result(self, timeout: Optional[float]) -> Frame:
        return self.frame

    def add_done_callback(self, fn: Any) -> None:
        fn()


class InProcess:
    """A transport that serves each frame with this process's endpoint, at
    once, as the worker it names; ``me``: this side's name."""

    name = "in-process"

    def __init__(self, me: str = "client") -> None:
        self.me = me

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Done:
        return Done(endpoint.serve(frame, worker))

    def local_name(self) -> str:
        return self.me


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def backend_options(port: int, host: str = "127.0.0.1", *, num_worker_threads: int = 16,
                    rpc_timeout: float = 60.0,
                    transports: Optional[Sequence[str]] = ("uv",),
                    channels: Optional[Sequence[str]] = ("basic",)) -> Any:
    """TensorPipe options for a world on this machine.

    TensorPipe's default same-machine transport (``shm``) busy-polls: every
    process of the world burns a fraction of a core even when idle, and when
    processes outnumber cores (tests, benchmarks) they starve each other. The
    ``uv`` transport (epoll) sleeps while idle. ``None`` keeps TensorPipe's
    defaults.
    """
    from torch.distributed import rpc

    extra: Dict[str, Any] = {}
    if transports is not None:
        extra["_transports"] = list(transports)
    if channels is not None:
        extra["_channels"] = list(channels)
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{host}:{port}",
                                           num_worker_threads=num_worker_threads,
                                           rpc_timeout=rpc_timeout, **extra)


def serve_in_process(port: int, rank: int, world_size: int, name: str, setup: str,
                     num_worker_threads: int = 16, secret: Optional[str] = None) -> None:
    """Process target: joins the world as ``name`` and serves what ``setup``
    (``module:function``) builds: a dict of experts, or ExpertServer(s).
    ``secret``: the job's secret in hex (as :func:`start_servers` passes it)."""
    import torch
    from torch.distributed import rpc

    if secret is not None:
        set_job_secret(JobSecret.from_hex(secret))
    torch.set_num_threads(1)
    built = load_object(setup)()  # before init_rpc: ready for the first request
    servers = [ExpertServer(built)] if isinstance(built, dict) else list(
        built if isinstance(built, (list, tuple)) else [built])
    start_rpc(name, rank, world_size, backend_options(port, num_worker_threads=num_worker_threads))
    try:
        rpc.shutdown(graceful=True)  # serves until every worker shuts down
    finally:
        for server in servers:
            server.close(timeout=1.0)


def start_servers(port: int, world_size: int, names: Sequence[str], setup: str,
                  first_rank: int = 1, num_worker_threads: int = 16,
                  secret: Optional[JobSecret] = None) -> List[Any]:
    """Spawns one :func:`serve_in_process` per name, ranks from ``first_rank``,
    serving the job of ``secret`` (default: this process's)."""
    key = (secret if secret is not None else job_secret()).hex()
    ctx = multiprocessing.get_context("spawn")
    processes = []
    for k, name in enumerate(names):
        process = ctx.Process(target=serve_in_process, name=f"expert-server-{name}",
                              args=(port, first_rank + k, world_size, name, setup,
                                    num_worker_threads, key), daemon=True)
        process.start()
        processes.append(process)
    return processes


def stop_processes(processes: Sequence[Any], timeout: Optional[float] = 10.0) -> List[Optional[int]]:
    """Joins each process (``timeout`` in all), then terminates, then kills."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    for process in processes:
        process.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)
    return [process.exitcode for process in processes]
