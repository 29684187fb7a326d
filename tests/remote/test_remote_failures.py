"""A world of its own: CLI servers, one killed mid-call, one stopped by SIGTERM.

The client runs in a child process (this process may be in the shared world).
The servers read the job's secret from a file (``--secret-file``, mode 600),
as a deployment would, not from the environment; the client has it from
``MOE_AUTOGRAD_SECRET`` (``wiring.SECRET``, the same secret).
"""
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import remote_experts as rx
from moe_autograd.remote.auth import ENV_SECRET, ENV_SECRET_FILE
from moe_autograd.remote.loopback import free_port, stop_processes
from wiring import SECRET

pytestmark = pytest.mark.timeout(90)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _start_cli(name: str, rank: int, port: int, log: Path, secret_file: Path
               ) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SECRET, ENV_SECRET_FILE)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "moe_autograd.remote.cli", "serve",
           "--experts", "remote_experts:cli_experts", "--name", name, "--rank", str(rank),
           "--world-size", "3", "--drain-timeout", "1", "--secret-file", str(secret_file)]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def test_killed_and_terminated_servers(tmp_path: Path) -> None:
    port = free_port()
    secret_file = Path(SECRET.save(tmp_path / "job.secret"))
    servers = [_start_cli(n, r, port, tmp_path / f"{n}.log", secret_file)
               for r, n in ((1, "srv-k"), (2, "srv-t"))]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    client = ctx.Process(target=rx.failure_client, args=(port, servers[0].pid, servers[1].pid, queue))
    client.start()
    try:
        report = queue.get(timeout=60)
        term_status = servers[1].wait(timeout=15)
    finally:
        stop_processes([client], timeout=10.0)
        for server in servers:
            if server.poll() is None:
                server.kill()
            server.wait(5)
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    assert report["before"][0] == "ok", report
    kind, message, elapsed = report["killed_mid_call"]
    assert kind == "RemoteExpertError", report
    assert "'slow'" in message and "'srv-k'" in message
    assert elapsed < 5.0, elapsed  # the connection drop is seen long before the 10 s deadline
    kind, message, elapsed = report["dead"]
    assert kind in ("RemoteExpertError", "RemoteTimeoutError") and "'srv-k'" in message, report
    assert elapsed < 3.0 + 0.5
    assert report["term_before"][0] == "ok", report
    kind, message, elapsed = report["term_after"]
    assert kind in ("RemoteExpertError", "RemoteTimeoutError") and "'srv-t'" in message, report
    assert term_status == 0, logs
    assert "signal received" in logs["srv-t.log"] and "stopped" in logs["srv-t.log"], logs
    assert servers[0].returncode == -signal.SIGKILL
