"""Three replicas of a training expert under ``balance="latency"`` stay one
expert over 100 steps, with one killed (SIGKILL, at a random point of a
pass) and replaced in between (issue 44; not a test module:
tests/remote/test_mirrored.py runs it).

    python mirror_fleet.py [SEED]

The trainer founds an elastic world; ``server_a`` (Adam, a step after every
backward) serves ``dur``; ``server_b`` and ``server_c`` join serving ``dur``
built from other seeds (they take a live replica's state before they are
published). The trainer runs 100 steps through one :class:`FleetExpert`;
during step 40 one replica is killed at a random instant, and ``server_d``
joins while the training goes on, with its own fresh weights
(``--no-recover``): the trainer brings it into sync before calling it. Prints one JSON line: each live replica's
steps and whether its whole state (weights and optimizer state) equals a
local run's after 100 steps.
"""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List

import torch

from peer_recovery import _same, batch, serve, stop_all, trained

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, KILL_AT, JOIN_AT = 100, 40, 45


def reference(steps: int) -> Dict[str, Any]:
    module, optimizer = trained(range(steps))
    return {"module": module.state_dict(), "optimizer": optimizer.state_dict()["state"]}


def _optimizer_equal(a: Dict[Any, Any], b: Dict[Any, Any]) -> bool:
    if sorted(a) != sorted(b):
        return False
    for key in a:
        for field in a[key]:
            x, y = a[key][field], b[key][field]
            if not (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y):
                return False
    return True


def _wait_replicas(fleet: Any, names: List[str], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not set(names) <= set(fleet.replicas("dur")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas {names} did not all join: {fleet.replicas('dur')}")
        time.sleep(0.1)
        fleet.refresh()


def main() -> None:
    from moe_autograd.remote import Fleet, RemoteExpert, RpcTransport
    from moe_autograd.remote.loopback import free_port

    rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    port = free_port()
    fleet = Fleet.start("trainer", "127.0.0.1", port)
    servers: Dict[str, "subprocess.Popen[str]"] = {}
    result: Dict[str, Any] = {}
    try:
        servers["server_a"] = serve("server_a", port, seed=0, stderr=subprocess.DEVNULL)
        fleet.wait_for(["dur"], timeout=90)
        for name, seed in (("server_b", 7), ("server_c", 8)):
            servers[name] = serve(name, port, seed=seed, stderr=subprocess.DEVNULL)
            _wait_replicas(fleet, [name])
        expert = fleet.expert("dur", forward_timeout=60, backward_timeout=60,
                              balance="latency")
        victim = rng.choice(["server_a", "server_b", "server_c"])
        result["victim"] = victim
        served: Dict[str, int] = {}
        for step in range(STEPS):
            if step == KILL_AT:  # at a random instant of this step's pass
                threading.Timer(rng.uniform(0.0, 0.02),
                                lambda: servers[victim].send_signal(signal.SIGKILL)).start()
            if step == JOIN_AT:  # joins (takes a live state) while the training goes on
                servers["server_d"] = serve("server_d", port, 9, "--no-recover",
                                            stderr=subprocess.DEVNULL)
            expert(batch(step)).square().mean().backward()
            if expert.last_worker is not None:
                served[expert.last_worker] = served.get(expert.last_worker, 0) + 1
            if step > JOIN_AT:
                fleet.refresh()
        _wait_replicas(fleet, ["server_d"])
        expert(batch(0))  # (no backward) brings server_d into sync if it joined late
        expert(batch(0))  # (a second one: server_d, found stale by the first, is resynced)
        servers[victim].wait(30)
        want = reference(STEPS)
        live = [w for w in ("server_a", "server_b", "server_c", "server_d") if w != victim]
        result["served"] = served
        result["resyncs"] = expert.view.resyncs
        for worker in live:
            snap = RemoteExpert(worker, "dur", transport=RpcTransport(),
                                forward_timeout=30).remote_snapshot()
            result[worker] = {"steps": snap.steps,
                              "equal": _same(snap.module, want["module"])
                              and snap.optimizer is not None
                              and _optimizer_equal(snap.optimizer["state"], want["optimizer"])}
    finally:
        stop_all(fleet, servers)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
