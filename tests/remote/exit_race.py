"""The exit race of issue 43 (not a test module: tests/remote/test_exit_race.py
runs it). A client script whose masked remote calls get their replies while
it exits (``sys.exit`` with no ``rpc.shutdown``) must keep its exit status:
a reply that completes its future on TensorPipe's thread after the
interpreter began to finalise aborts the process ("terminate called ...",
status -6).

    python exit_race.py RUNS REQUESTS

Imports torch once, then forks each run's two processes from this one (a
server and a client in a world of two, on a free loopback port; nothing
started before the fork) so that a run costs its RPC start, not an
interpreter's; four runs at a time. Prints one line per run's client exit
status, then ``statuses {status: count}``.
"""
import os
import random
import secrets
import signal
import sys
import time
from typing import Dict, List, Tuple

import torch
from torch import nn

from moe_autograd.remote import ExpertServer, RemoteExpert, start_rpc
from moe_autograd.remote.loopback import backend_options, free_port
from moe_autograd.remote.rpc_engine import RpcTransport

STATUS = 7  # the client's own exit status


class Jitter(nn.Module):
    """Answers after 0-4 ms: replies of masked calls land around the exit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(random.random() * 0.004)
        return x * 2


def _server(port: int) -> None:
    ExpertServer({"j": Jitter()})  # serving before the client can call
    start_rpc("exitsrv", 0, 2, backend_options(port, rpc_timeout=30.0))
    signal.pause()  # killed by the parent once the client ended


def _client(port: int, requests: int) -> None:
    # Every request gets one more done callback that takes a while (as a
    # coalesced call's completion may): it widens the window in which a
    # reply's callbacks still run on TensorPipe's thread after the request
    # left the list the exit hook waits on (what aborted, issue 43).
    call = RpcTransport.call

    def call_with_a_slow_callback(self, worker, frame, timeout):  # type: ignore[no-untyped-def]
        pending = call(self, worker, frame, timeout)
        pending.add_done_callback(lambda: time.sleep(0.01))
        return pending

    RpcTransport.call = call_with_a_slow_callback  # type: ignore[method-assign]
    start_rpc("exitcli", 1, 2, backend_options(port, rpc_timeout=30.0))
    x = torch.randn(4, 4)
    RemoteExpert("exitsrv", "j")(x)  # warm-up
    for _ in range(requests):
        try:
            RemoteExpert("exitsrv", "j", forward_timeout=0.001)(x)
        except Exception:  # noqa: BLE001 - masked: its reply comes later
            pass
    sys.exit(STATUS)  # no rpc.shutdown: replies are still on their way


def _fork(target, *args) -> int:  # type: ignore[no-untyped-def]
    pid = os.fork()
    if pid == 0:
        try:
            target(*args)
        except SystemExit:
            raise
        except BaseException:  # noqa: BLE001 - a child never returns into the parent's loop
            os._exit(99)
        os._exit(0)
    return pid


def _status(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -999  # hung


def main(runs: int, requests: int) -> None:
    os.environ["MOE_AUTOGRAD_SECRET"] = secrets.token_hex(32)  # this script's own job
    counts: Dict[int, int] = {}
    left = runs
    while left:
        batch: List[Tuple[int, int]] = []
        for _ in range(min(4, left)):
            port = free_port()
            batch.append((_fork(_server, port), _fork(_client, port, requests)))
        for server, client in batch:
            status = _status(client, 60.0)
            os.kill(server, signal.SIGKILL)
            os.waitpid(server, 0)
            counts[status] = counts.get(status, 0) + 1
            print("client exit", status, flush=True)
        left -= len(batch)
    print("statuses", dict(sorted(counts.items())), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
