"""A training expert's only server is killed with SIGKILL at a random
instant of a pass; its replacement resumes from the state directory, and the
trainer goes on from it (issue 44; not a test module:
tests/remote/test_mirrored.py runs it).

    python snapshot_recovery.py STATE_DIR [SEED]

The trainer founds an elastic world; ``server_a`` (Adam, a step after every
backward, a snapshot every 3 steps) serves ``dur``; the trainer runs 7
steps, then ``server_a`` is killed during the 8th; ``server_b`` starts on the
same directory, and the trainer, with no replica at its version left, goes
on from ``server_b``'s (steps lost: at most the save interval). Prints one
JSON line: the step it resumed at, whether its weights then equal a local
run's at that step, and the steps after 3 more.
"""
import json
import random
import signal
import subprocess
import sys
import threading
from typing import Any, Dict

import torch

from mirror_fleet import _wait_replicas
from peer_recovery import _same, batch, serve, stop_all, trained

SAVE_EVERY = 3


def reference(steps: Any) -> Dict[str, torch.Tensor]:
    """The weights after training on the batches numbered ``steps``, in order."""
    return trained(steps)[0].state_dict()


def main() -> None:
    from moe_autograd.remote import Fleet, RemoteExpert, RemoteExpertError, RpcTransport
    from moe_autograd.remote.loopback import free_port

    state_dir = sys.argv[1]
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    port = free_port()
    fleet = Fleet.start("trainer", "127.0.0.1", port)
    servers: Dict[str, Any] = {}
    result: Dict[str, Any] = {}
    options = ("--state-dir", state_dir, "--save-every", str(SAVE_EVERY))
    try:
        servers["server_a"] = serve("server_a", port, 0, *options, stderr=subprocess.DEVNULL)
        fleet.wait_for(["dur"], timeout=90)
        expert = fleet.expert("dur", forward_timeout=60, backward_timeout=60)
        for step in range(7):
            expert(batch(step)).square().mean().backward()
        threading.Timer(rng.uniform(0.0, 0.01),
                        lambda: servers["server_a"].send_signal(signal.SIGKILL)).start()
        try:  # the 8th step: killed at some point of it (or just after)
            expert(batch(7)).square().mean().backward()
        except RemoteExpertError:
            pass
        servers["server_a"].wait(30)
        servers["server_b"] = serve("server_b", port, 5, *options, stderr=subprocess.DEVNULL)
        _wait_replicas(fleet, ["server_b"])
        resumed = RemoteExpert("server_b", "dur", transport=RpcTransport(),
                               forward_timeout=30).remote_snapshot()
        result["resumed_at"] = resumed.steps
        result["equal_at_resume"] = _same(resumed.module, reference(range(resumed.steps)))
        for step in range(8, 11):  # through the same FleetExpert: it goes on from server_b
            expert(batch(step)).square().mean().backward()
        after = RemoteExpert("server_b", "dur", transport=RpcTransport(),
                             forward_timeout=30).remote_snapshot()
        result["steps_after"] = after.steps
        result["equal_after"] = _same(after.module,
                                      reference([*range(resumed.steps), 8, 9, 10]))
        result["adopted"] = expert.view.adopted
    finally:
        stop_all(fleet, servers)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
