"""The README's remote recipes, run as written on this machine with
authentication on: the static world, the elastic fleet and the Ray cluster.

Each test runs the README's commands (the command lines are checked to be
the README's own, so that the README cannot drift from what runs) in a
temporary directory of its own, on loopback and free ports, with a job
secret made by ``python -m moe_autograd secret``; the training scripts are
the README's, shortened to a few steps (the elastic fleet's is extracted
from the README and run as written, on a free port, for 3 steps). Every process started here is
stopped here (the Ray cluster by its own ``ray start --block`` process)."""
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, List

import pytest

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FACTORY = '''
import torch.nn as nn
def make():
    return {f"ffn{i}": nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
            for i in range(4)}
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def readme_block(containing: str) -> str:
    """The README's fenced code block that contains ``containing``."""
    blocks = [b for b in re.findall(r"^```[a-z]*\n(.*?)^```", README, flags=re.S | re.M)
              if containing in b]
    assert len(blocks) == 1, f"{len(blocks)} README blocks contain {containing!r}"
    return blocks[0]


def in_readme(*lines: str) -> None:
    """Each command line of a recipe, as the README writes it (continuations
    joined)."""
    flat = re.sub(r"\\\n\s*", "", README)
    for line in lines:
        assert line in flat, f"the README no longer says: {line}"


@pytest.fixture
def job(tmp_path: Path) -> Dict[str, str]:
    """A directory with the recipes' experts factory and a job secret made by
    the CLI, and the environment of the job's processes."""
    (tmp_path / "my_experts.py").write_text(FACTORY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_AUTOGRAD")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    done = subprocess.run([sys.executable, "-m", "moe_autograd", "secret", "--out", "job.secret"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert oct((tmp_path / "job.secret").stat().st_mode & 0o777) == "0o600"
    env["MOE_AUTOGRAD_SECRET_FILE"] = "job.secret"
    return env


def stop(process: "subprocess.Popen[str]", sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    if process.poll() is None:
        process.send_signal(sig)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(10)


def test_static_world_recipe(job: Dict[str, str], tmp_path: Path) -> None:
    in_readme("python -m moe_autograd secret --out job.secret",
              "MOE_AUTOGRAD_SECRET_FILE=job.secret MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 "
              "python -m moe_autograd serve --experts my_experts:make --name server-b --rank 1 "
              "--world-size 2")
    port = free_port()
    env = dict(job, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    server = subprocess.Popen(
        [sys.executable, "-m", "moe_autograd", "serve", "--experts", "my_experts:make",
         "--name", "server-b", "--rank", "1", "--world-size", "2"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    trainer = textwrap.dedent(f"""
        import torch
        import torch.distributed.rpc as rpc
        from moe_autograd import parallel_apply
        from moe_autograd.remote import RemoteExpert, start_rpc
        from moe_autograd.remote.rpc_bind import backend_options

        start_rpc("trainer", 0, 2, backend_options("127.0.0.1", {port}))
        experts = [RemoteExpert("server-b", f"ffn{{i}}", forward_timeout=30, backward_timeout=30)
                   for i in range(4)]
        for step in range(3):
            for e in experts:
                e.zero_grad()
            xs = [torch.randn(64, 512, requires_grad=True) for _ in experts]
            outs = parallel_apply(experts, xs)
            sum(o.square().mean() for o in outs).backward()
        print("trained", all(x.grad is not None for x in xs))
        rpc.shutdown()
    """)
    try:
        done = subprocess.run([sys.executable, "-c", trainer], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0 and "trained True" in done.stdout, done.stderr[-2000:]
        assert server.wait(60) == 0
    finally:
        stop(server)
    log = server.stdout.read() if server.stdout else ""
    assert "serves" in log, log


def test_elastic_fleet_recipe(job: Dict[str, str], tmp_path: Path) -> None:
    in_readme('fleet = Fleet.start("trainer", "127.0.0.1", 29500)',
              "MOE_AUTOGRAD_SECRET_FILE=job.secret python -m moe_autograd serve --join "
              "--experts my_experts:make --name server_b --master-addr 127.0.0.1 "
              "--master-port 29500 --optimizer torch.optim:SGD")
    port = free_port()
    # The README's trainer itself, on a free port and for 3 steps instead of 1,000.
    trainer = readme_block('fleet = Fleet.start("trainer", "127.0.0.1", 29500)')
    assert trainer.count("29500") == 2 and trainer.count("range(1000)") == 1, trainer
    trainer = trainer.replace("29500", str(port)).replace("range(1000)", "range(3)")
    trainer += '\nprint("trained", [s["calls"] for s in moe.stats()], flush=True)\n'
    founder = subprocess.Popen([sys.executable, "-c", trainer], cwd=tmp_path, env=job,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = None
    try:
        time.sleep(3.0)  # the founder's store first (a joiner waits for it anyway)
        server = subprocess.Popen(
            [sys.executable, "-m", "moe_autograd", "serve", "--join", "--experts",
             "my_experts:make", "--name", "server_b", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--optimizer", "torch.optim:SGD"],
            cwd=tmp_path, env=job, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, err = founder.communicate(timeout=200)
        assert founder.returncode == 0 and "trained" in out, err[-2000:]
        assert server.wait(60) == 0  # the founder's shutdown asked it to leave
        # What the recipe's logging shows: the server's join, then progress.
        assert "fleet 'trainer': server 'server_b' joined (ffn0, ffn1, ffn2, ffn3)" in err, err
        assert "INFO:root:step 0: loss " in err, err[-2000:]
    finally:
        stop(founder)
        if server is not None:
            stop(server)


def _ray_processes(marker: str) -> List[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def test_ray_cluster_recipe(job: Dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    in_readme("export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/cluster.token "
              "MOE_AUTOGRAD_SECRET_FILE=$HOME/job.secret",
              '(umask 077; python -c "import secrets; print(secrets.token_hex(32))" > '
              '$HOME/cluster.token)',
              "python -m moe_autograd serve --engine ray --address 10.0.0.1:6379 "
              "--experts my_experts:make --name server-b --backward stateful "
              "--resources '{\"experts\": 1}'")
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="moe-rh-", dir="/tmp"))  # short: Ray's sockets
    token = home / "cluster.token"
    subprocess.run(["bash", "-c", "(umask 077; python -c \"import secrets; "
                    "print(secrets.token_hex(32))\" > $HOME/cluster.token)"],
                   env=dict(job, HOME=str(home)), check=True, timeout=30)
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    port = free_port()
    env = dict(job, HOME=str(home), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
               MOE_AUTOGRAD_SECRET_FILE=str(tmp_path / "job.secret"))
    env.pop("RAY_ADDRESS", None)
    ray_bin = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2",
                             "--resources", '{"experts": 4}', "--node-ip-address=127.0.0.1",
                             "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={home}", "--block"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    server = None
    try:
        address = f"127.0.0.1:{port}"
        server = subprocess.Popen(
            [sys.executable, "-m", "moe_autograd", "serve", "--engine", "ray", "--address",
             address, "--experts", "my_experts:make", "--name", "server-b", "--backward",
             "stateful", "--resources", '{"experts": 1}'],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        trainer = textwrap.dedent(f"""
            import time, torch, ray
            from moe_autograd import parallel_apply
            from moe_autograd.remote import RemoteExpert, RayFleet

            ray.init(address="{address}", namespace="moe_autograd", log_to_driver=False)
            fleet = RayFleet()
            fleet.wait_for(["ffn0"], timeout=120)
            experts = [RemoteExpert("server-b", f"ffn{{i}}", forward_timeout=30,
                                    backward_timeout=30) for i in range(4)]
            xs = [torch.randn(8, 512, requires_grad=True) for _ in experts]
            outs = parallel_apply(experts, xs)
            sum(o.square().mean() for o in outs).backward()
            print("trained", all(x.grad is not None for x in xs), flush=True)
            fleet.shutdown()
        """)
        done = subprocess.run([sys.executable, "-c", trainer], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=200)
        assert done.returncode == 0 and "trained True" in done.stdout, \
            (done.stdout[-1000:], done.stderr[-3000:])
        assert stop(server, signal.SIGTERM, 60) == 0
        # a driver without the cluster's token is refused at connect
        stranger = dict(env, RAY_AUTH_MODE="disabled",
                        RAY_gcs_server_port_wait_time_s="2")  # 2 connect retries, not 20
        stranger.pop("RAY_AUTH_TOKEN_PATH")
        refused = subprocess.run(
            [sys.executable, "-c", f"import ray\ntry:\n    ray.init(address='{address}')\n"
             "except Exception as e:\n    print('REFUSED', type(e).__name__)\n"],
            cwd=tmp_path, env=stranger, capture_output=True, text=True, timeout=120)
        assert "REFUSED" in refused.stdout, refused.stderr[-1000:]
    finally:
        if server is not None:
            stop(server)
        stop(head, signal.SIGTERM, 60)  # --block: stops the cluster it started
        for pid in _ray_processes(str(home)):  # anything of ours still there
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        import shutil

        shutil.rmtree(home, ignore_errors=True)
