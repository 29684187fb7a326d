"""Deadlines that always hold and clean exits (issue 10, items 8 and 9).

* A world of its own (a client child process with ``rpc_timeout=1`` s and one
  server process): Ctrl-C reaches a caller waiting on a remote forward,
  backward or ``parallel_apply`` within 0.5 s and leaks no server state; a
  call without a deadline (``None`` or ``math.inf``) to a SIGSTOPped server
  ends at the transport's own timeout.
* A script whose masked straggler is still running torch ops at exit ends with
  its own exit status, not SIGABRT (run in a subprocess).
"""
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from queue import Empty
from typing import Any, Dict

import pytest

import remote_experts as rx
from moe_autograd.remote.loopback import free_port, start_servers, stop_processes

ROOT = Path(__file__).resolve().parent.parent.parent


def _report(queue: Any, client: Any, timeout: float) -> Dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.5)
        except Empty:
            if not client.is_alive():  # died before reporting (e.g. an import error)
                return queue.get(timeout=1.0)
    raise TimeoutError(f"no report from the client within {timeout:g} s")


@pytest.mark.timeout(90)
def test_ctrl_c_and_stopped_server() -> None:
    port = free_port()
    servers = start_servers(port, 2, ["fault-srv"], "remote_experts:fault_servers")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    client = ctx.Process(target=rx.fault_client, args=(port, servers[0].pid, queue))
    client.start()
    try:
        report = _report(queue, client, 60.0)
    finally:
        if servers[0].pid is not None and servers[0].is_alive():
            os.kill(servers[0].pid, signal.SIGCONT)  # in case the client died while it was stopped
        codes = stop_processes([client, *servers], timeout=15.0)
    assert report["warm"][0] == "ok", report
    for case in ("forward", "stateful_forward", "backward", "parallel_apply"):
        kind, message, after_signal = report[case]
        assert kind == "KeyboardInterrupt", (case, report[case], report.get("diag"))
        assert after_signal < 0.5, (case, after_signal)  # the calls would take 3 s
    live, stored = report["sf_stats"]
    assert live == 0 and stored == 0, report["sf_stats"]  # the interrupted forward left nothing
    assert report["after_interrupts"][0] == "ok", report
    for case in ("stopped_none", "stopped_inf"):
        kind, message, elapsed = report[case]
        assert kind == "RemoteTimeoutError", (case, report[case])
        assert "rpc_timeout=1 s" in message and "'lin'" in message, message
        assert 0.9 < elapsed < 2.5, (case, elapsed)  # rpc_timeout=1 s, not 60 s nor at once
    assert report["resumed"][0] == "ok", report
    assert codes == [0, 0], codes


_STRAGGLER_SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    from torch import nn
    from moe_autograd.moe.layer import MixtureOfExperts

    class Busy(nn.Module):  # runs torch ops for 30 s: masked by forward_timeout
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            end = time.monotonic() + 30
            while time.monotonic() < end:
                x = torch.tanh(self.lin(x))
            return x

    moe = MixtureOfExperts([nn.Linear(4, 4), Busy()], 4, k=2, forward_timeout=0.2)
    y, aux = moe(torch.randn(8, 4))
    print("masked", moe.stats()[1]["timeouts"], flush=True)
    sys.exit(3)
""")


@pytest.mark.timeout(60)
def test_exit_with_a_straggler_running_torch_ops() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _STRAGGLER_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=45)
    elapsed = time.monotonic() - start
    assert "masked 1" in done.stdout, (done.stdout, done.stderr)
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])  # not -6 / 134 (SIGABRT)
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert elapsed < 25, elapsed  # the straggler was stopped, not waited for (it runs 30 s)
