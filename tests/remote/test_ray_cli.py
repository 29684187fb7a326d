"""``python -m moe_autograd serve --engine ray``: a server process that joins a
running Ray cluster (the shared local instance, by its address), serves its
experts as a named actor, drains on SIGTERM and takes its actor along when
killed; a server process without the cluster's token cannot join it."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from moe_autograd.remote import RemoteExpert, RemoteExpertError
from wiring import RAY_START_S, ray_token_env

pytestmark = pytest.mark.timeout(90 + 2 * RAY_START_S)  # serve processes start actors
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _serve(name: str, address: str, log: Path) -> subprocess.Popen:
    # the cluster's token (a driver without it is refused at connect); the job's
    # secret comes from MOE_AUTOGRAD_SECRET, which wiring exported
    env = dict(os.environ, **ray_token_env(),
               PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "moe_autograd", "serve", "--engine", "ray", "--address", address,
           "--experts", "remote_experts:cli_experts", "--name", name, "--drain-timeout", "1",
           "--backward", "stateful"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_until_serving(process: subprocess.Popen, log: Path,
                        timeout: float = RAY_START_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}: " \
            f"{log.read_text()}"
        if " serves " in log.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"not serving after {timeout} s: {log.read_text()}")


def test_serve_engine_ray_sigterm_and_kill(ray_world: Dict[str, Any], tmp_path: Path) -> None:
    import ray

    transport = ray_world["transport"]
    address = ray.get_runtime_context().gcs_address
    names = ("cli-t", "cli-k", "cli-d")
    servers = [_serve(n, address, tmp_path / f"{n}.log") for n in names]
    try:
        for name, process in zip(names, servers):
            _wait_until_serving(process, tmp_path / f"{name}.log")
        # (issue 45) its actor killed under it: serve notices, says so, exits 1
        ray.kill(ray.get_actor("cli-d", namespace=transport.namespace))
        assert servers[2].wait(timeout=60) == 1
        said = (tmp_path / "cli-d.log").read_text()
        assert "ERROR" in said and "the Ray actor 'cli-d' died" in said, said
        x = torch.randn(2, 4, requires_grad=True)
        for name in ("cli-t", "cli-k"):
            expert = RemoteExpert(name, "lin", transport=transport, forward_timeout=10.0)
            expert(x).sum().backward()
            assert expert.remote_stats()["backward"] == "stateful"
        servers[0].send_signal(signal.SIGTERM)
        assert servers[0].wait(timeout=30) == 0
        servers[1].kill()  # kill -9: Ray ends the actor its owner held
        servers[1].wait(timeout=10)
        for name in ("cli-t", "cli-k"):
            started = time.monotonic()
            deadline = started + 30.0
            while True:  # Ray notices the owner's death within seconds
                try:
                    RemoteExpert(name, "lin", transport=transport, forward_timeout=3.0)(x)
                except RemoteExpertError as error:
                    assert repr(name) in str(error)
                    break
                assert time.monotonic() < deadline, f"{name} still serves"
                time.sleep(0.2)
    finally:
        for process in servers:
            if process.poll() is None:
                process.kill()
            process.wait(10)
    log = (tmp_path / "cli-t.log").read_text()
    assert "signal received, draining" in log and "stopped" in log, log


def test_serve_engine_ray_without_the_clusters_token(ray_world: Dict[str, Any],
                                                    tmp_path: Path) -> None:
    """A server process without the cluster's token cannot join it: it exits
    75 (start it again) saying which variables to set."""
    import ray

    address = ray.get_runtime_context().gcs_address
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.pop("RAY_AUTH_TOKEN", None)
    env["RAY_AUTH_MODE"] = "token"  # token mode, but not the cluster's token: none at all
    env["HOME"] = str(tmp_path)  # nor ~/.ray/auth_token
    log = tmp_path / "cli-x.log"
    cmd = [sys.executable, "-m", "moe_autograd", "serve", "--engine", "ray", "--address", address,
           "--experts", "remote_experts:cli_experts", "--name", "cli-x"]
    status = subprocess.run(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            timeout=60).returncode
    text = log.read_text()
    assert status == 75, text
    assert "cannot connect to the Ray cluster" in text, text
    assert "the cluster requires its token: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH" \
        in text, text
