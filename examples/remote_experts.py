"""Train through experts served by another process (the README's two-machine
recipe, on one machine over loopback).

Two processes form a ``torch.distributed.rpc`` world of size 2:

* rank 1, the server, is started here exactly as on machine B of the recipe:
  ``python -m moe_autograd serve --experts remote_experts:make ...`` (this
  file is its experts factory, and ``make_optimizer`` its optimizer factory,
  so the server steps each expert after every backward);
* rank 0, this process, trains a ``MixtureOfExperts`` whose experts are
  ``RemoteExpert``\\ s: their forwards and backwards run on the server,
  overlapping, while the gate trains here.

Both processes serve one job: this one makes its secret
(``JobSecret.generate()``, as ``python -m moe_autograd secret`` would) and
hands it to the server as a file only its owner can read, named by
``MOE_AUTOGRAD_SECRET_FILE`` in the server's environment (never its
command line); every message between them is sealed with it. The world
listens on loopback only (``start_rpc``).

On two machines, copy the secret file to B, run the server command there
with ``MASTER_ADDR`` set to A's address, and this file's ``train`` on A.

    python examples/remote_experts.py           # 4 experts, 30 steps
    python examples/remote_experts.py --small   # what the tests run
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Dict, Iterable

import torch
from torch import nn

WIDTH, LR = 16, 0.5
# torch's own RPC start-up warns about an internal deprecated call: not ours.
GLOO_WARNING = "You are using a Backend"


def make() -> Dict[str, nn.Module]:
    """The server's experts, by name (``--experts remote_experts:make``)."""
    torch.manual_seed(0)
    return {f"ffn{i}": nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                     nn.Linear(4 * WIDTH, WIDTH)) for i in range(4)}


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """One optimizer per expert, on the server (``--optimizer``)."""
    return torch.optim.SGD(params, lr=LR)


def start_server(port: int, secret_file: str) -> "subprocess.Popen[bytes]":
    """Machine B's command, as a child process of this one; ``secret_file``:
    the job's secret (mode 600), named in its environment."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               MOE_AUTOGRAD_SECRET_FILE=secret_file,
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS=f"ignore:{GLOO_WARNING}")
    env.pop("MOE_AUTOGRAD_SECRET", None)  # the file is the job's secret
    return subprocess.Popen(
        [sys.executable, "-m", "moe_autograd", "serve", "--experts", "remote_experts:make",
         "--optimizer", "remote_experts:make_optimizer", "--name", "server",
         "--rank", "1", "--world-size", "2",
         "--transports", "uv"],  # TensorPipe's shm transport busy-polls: uv on small machines
        env=env)


def train(steps: int, port: int) -> None:
    """Machine A: rank 0 of the world (its store on ``127.0.0.1:port``),
    trains through the remote experts."""
    import torch.distributed.rpc as rpc

    from moe_autograd import MixtureOfExperts, RemoteExpert
    from moe_autograd.remote import start_rpc
    from moe_autograd.remote.rpc_bind import backend_options

    warnings.filterwarnings("ignore", message=GLOO_WARNING)
    # the store and RPC listen on 127.0.0.1 only; TensorPipe's uv transport
    start_rpc("trainer", 0, 2, backend_options("127.0.0.1", port, transports=["uv"]))
    try:
        experts = [RemoteExpert("server", f"ffn{i}", forward_timeout=30, backward_timeout=30)
                   for i in range(4)]
        moe = MixtureOfExperts(experts, in_features=WIDTH, k=2)
        gate_optimizer = torch.optim.SGD(moe.gate.parameters(), lr=LR)
        torch.manual_seed(1)
        target = nn.Linear(WIDTH, WIDTH)  # a task to learn: y = target(x)
        for step in range(steps):
            x = torch.randn(64, WIDTH)
            with torch.no_grad():
                y_true = target(x)
            start = time.perf_counter()
            y, aux_loss = moe(x)
            loss = (y - y_true).square().mean()
            (loss + 0.01 * aux_loss).backward()  # the experts' backwards run on the server
            gate_optimizer.step()
            gate_optimizer.zero_grad()
            print(f"step {step:2d}  loss {loss.item():.4f}  "
                  f"({(time.perf_counter() - start) * 1e3:.0f} ms)")
        print("calls per expert:", [s["calls"] for s in moe.stats()])
    finally:
        rpc.shutdown()  # the server exits once every worker has shut down


def main() -> None:
    from moe_autograd.remote import JobSecret, set_job_secret

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="3 steps")
    args = parser.parse_args()
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    secret = JobSecret.generate()  # the job's: this process and its server
    set_job_secret(secret)
    private = tempfile.mkdtemp(prefix="moe-job-")  # mode 700: the secret file's home
    try:
        server = start_server(port, secret.save(os.path.join(private, "job.secret")))
        try:
            train(3 if args.small else 30, port)
            server.wait(timeout=60)
        finally:
            if server.poll() is None:  # this process failed: do not leave the server behind
                server.kill()
                server.wait()
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if server.returncode != 0:
        raise SystemExit(f"the server exited with status {server.returncode}")


if __name__ == "__main__":
    main()
