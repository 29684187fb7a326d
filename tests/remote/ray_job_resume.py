"""A trainer on Ray with a local layer and two remote experts that train on
their server (issue 44; not a test module: tests/remote/test_ray_job_resume.py
runs it, and its actor imports :func:`servers`). The trainer is a Ray
driver of its own that joins the tests' local Ray (by its address, with the
cluster's token in its environment) and calls a RayExpertServer that the
test started, so the server outlives the trainer.

    python ray_job_resume.py ADDRESS SERVER PREFIX plain STEPS
        train STEPS steps from the start
    python ray_job_resume.py ADDRESS SERVER PREFIX victim DIR
        train on, saving the job every 3 steps; waits to be killed at step 10
    python ray_job_resume.py ADDRESS SERVER PREFIX resume DIR STEPS
        restore DIR's newest checkpoint (the experts' state back into SERVER), train to STEPS

The experts are ``PREFIX0`` and ``PREFIX1`` of SERVER. Prints ``loss STEP
VALUE`` (the value's repr: bit for bit) for every step; on resume, first
``before STEPS`` (the server's steps before the restore) and ``resumed STEP
EXPERT_STEPS``.
"""
import sys
import time
from typing import Any, List

import torch
from torch import nn

WIDTH = 8
PREFIXES = ("v", "p")  # the victim's (then the resumed run's) experts, the plain run's


def servers() -> List[Any]:
    """The actor's experts: for each prefix, two MLPs (the same weights for
    every prefix) stepping Adam after every backward."""
    from moe_autograd.remote import ExpertServer

    hosted = []
    for prefix in PREFIXES:
        torch.manual_seed(5)
        experts = {f"{prefix}{i}": nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(),
                                                 nn.Linear(16, WIDTH)) for i in range(2)}
        hosted.append(ExpertServer(experts, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2)))
    return hosted


def main() -> None:
    import ray

    from moe_autograd.remote import RayTransport, RemoteExpert, restore_job, save_job

    address, server, prefix, mode = sys.argv[1:5]
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    transport = RayTransport(timeout=60.0)
    torch.manual_seed(0)
    local = nn.Linear(WIDTH, WIDTH)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
    experts = [RemoteExpert(server, f"{prefix}{i}", transport=transport, forward_timeout=30,
                            backward_timeout=30) for i in range(2)]
    first, last = 0, int(sys.argv[5]) if mode == "plain" else 10 ** 6
    if mode == "resume":
        print("before", *(e.remote_snapshot().steps for e in experts), flush=True)
        state = restore_job(sys.argv[5], modules={"local": local},
                            optimizers={"sgd": optimizer}, experts=experts)
        assert state is not None, "no checkpoint"
        first, last = state.step, int(sys.argv[6])
        print("resumed", first, *(state.expert_steps[e.name] for e in experts), flush=True)
    for step in range(first, last):
        if mode == "victim":
            if step % 3 == 0:
                save_job(sys.argv[5], step, modules={"local": local},
                         optimizers={"sgd": optimizer}, experts=experts)
            if step == 10:
                time.sleep(3600)  # killed by now: the test sees step 7 first
        x = torch.randn(16, WIDTH)  # the global generator: part of the job's state
        h = local(x)
        loss = sum(e(h) for e in experts).square().mean()
        if mode == "victim":
            time.sleep(0.02)  # a pass in flight (forwards done, backwards owed) when killed
        optimizer.zero_grad()
        loss.backward()  # the server steps each expert
        optimizer.step()
        print("loss", step, repr(loss.item()), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
