"""A new replica takes a live replica's state, and training goes on after
the first replica is killed with no step lost (issue 44; not a test module:
tests/remote/test_durable_fleet.py runs it).

    python peer_recovery.py

The trainer founds an elastic world; ``server_a`` (Adam, a step after every
backward) serves ``dur`` and trains 5 steps; ``server_b`` joins serving
``dur`` built from another seed, and takes ``server_a``'s state before it is
published; ``server_a`` is killed (SIGKILL); 3 more steps run on
``server_b``. Prints one JSON line: steps and whether the weights equal a
local run's at each point.
"""
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, Iterable, Tuple

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTH = 8


def experts() -> Dict[str, nn.Module]:
    """The servers' factory: ``dur``, seeded by $PEER_SEED."""
    torch.manual_seed(int(os.environ.get("PEER_SEED", "0")))
    return {"dur": nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, WIDTH))}


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1000 + step))


def trained(steps: Iterable[int]) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """``dur`` (seed 0) and its optimizer, trained locally on the batches
    numbered ``steps``, in order, as its server trains it."""
    os.environ["PEER_SEED"] = "0"
    module = experts()["dur"]
    optimizer = adam(module.parameters())
    for step in steps:
        module(batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return module, optimizer


def reference(steps: int) -> Dict[str, torch.Tensor]:
    return trained(range(steps))[0].state_dict()


def stop_all(fleet: Any, servers: Dict[str, "subprocess.Popen[str]"]) -> None:
    """Ends the world and every server process (killed if still running)."""
    fleet.shutdown(timeout=10)
    for process in servers.values():
        if process.poll() is None:
            process.kill()
        process.wait(30)


def _same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def serve(name: str, port: int, seed: int, *extra: str,
          stderr: Any = subprocess.PIPE) -> "subprocess.Popen[str]":
    """A ``serve --join`` process of ``dur`` (seeded ``seed``, Adam) in the
    world at ``port``, with ``extra`` arguments."""
    env = dict(os.environ, PEER_SEED=str(seed),
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, "-m", "moe_autograd", "serve", "--join", "--experts",
         "peer_recovery:experts", "--optimizer", "peer_recovery:adam", "--name", name,
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--transports", "uv",
         *extra], env=env, stderr=stderr, text=True)


def main() -> None:
    from moe_autograd.remote import Fleet, RemoteExpert, RpcTransport
    from moe_autograd.remote.loopback import free_port

    port = free_port()
    fleet = Fleet.start("trainer", "127.0.0.1", port)
    servers = {}
    result: Dict[str, Any] = {}
    try:
        servers["server_a"] = serve("server_a", port, 0)
        fleet.wait_for(["dur"], timeout=90)
        expert = fleet.expert("dur", forward_timeout=30, backward_timeout=30)
        for step in range(5):
            expert(batch(step)).square().mean().backward()
        a = RemoteExpert("server_a", "dur", transport=RpcTransport(), forward_timeout=30)
        servers["server_b"] = serve("server_b", port, 7)
        deadline = time.monotonic() + 90
        while "server_b" not in fleet.replicas("dur") and time.monotonic() < deadline:
            time.sleep(0.1)
            fleet.refresh()
        b = RemoteExpert("server_b", "dur", transport=RpcTransport(), forward_timeout=30)
        snap_a, snap_b = a.remote_snapshot(), b.remote_snapshot()
        result["joined"] = "server_b" in fleet.replicas("dur")
        result["steps_a"], result["steps_b"] = snap_a.steps, snap_b.steps
        result["b_equals_a"] = _same(snap_b.module, snap_a.module)
        result["b_equals_reference_5"] = _same(snap_b.module, reference(5))
        servers["server_a"].send_signal(signal.SIGKILL)
        servers["server_a"].wait(30)
        for step in range(5, 8):  # forward retried on server_b if it tries server_a first
            expert(batch(step)).square().mean().backward()
        snap_b = b.remote_snapshot()
        result["steps_b_after"] = snap_b.steps
        result["b_equals_reference_8"] = _same(snap_b.module, reference(8))
        err = servers["server_b"]
    finally:
        stop_all(fleet, servers)
    result["log_b"] = [line for line in (err.stderr.read() if err.stderr else "").splitlines()
                       if "state of peer" in line or "resumed from" in line]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
