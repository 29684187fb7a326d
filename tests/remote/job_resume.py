"""A trainer with a local layer and two remote experts that train on their
server (issue 44; not a test module: tests/remote/test_job_resume.py runs
it). Each run is a world of its own: this trainer and one server process,
on a free loopback port.

    python job_resume.py plain STEPS        train STEPS steps
    python job_resume.py victim DIR         train on, saving the job every 3 steps
    python job_resume.py resume DIR STEPS   restore DIR's newest checkpoint, train to STEPS

Prints ``loss STEP VALUE`` (the value's repr: bit for bit) for every step,
and ``resumed STEP`` when it restored.
"""
import sys
from typing import Any, List

import torch
from torch import nn

WIDTH = 8


def servers() -> List[Any]:
    """The server's experts: two MLPs stepping Adam after every backward."""
    from moe_autograd.remote import ExpertServer

    torch.manual_seed(5)
    experts = {f"e{i}": nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, WIDTH))
               for i in range(2)}
    return [ExpertServer(experts, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2))]


def main() -> None:
    from torch.distributed import rpc

    from moe_autograd.remote import RemoteExpert, restore_job, save_job, start_rpc
    from moe_autograd.remote.loopback import (backend_options, free_port, start_servers,
                                              stop_processes)

    mode = sys.argv[1]
    port = free_port()
    processes = start_servers(port, 2, ["jobsrv"], "job_resume:servers")
    try:
        start_rpc("trainer", 0, 2, backend_options(port, rpc_timeout=60.0))
        torch.manual_seed(0)
        local = nn.Linear(WIDTH, WIDTH)
        optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
        experts = [RemoteExpert("jobsrv", f"e{i}", forward_timeout=30, backward_timeout=30)
                   for i in range(2)]
        first, last = 0, int(sys.argv[2]) if mode == "plain" else 10 ** 6
        if mode == "resume":
            state = restore_job(sys.argv[2], modules={"local": local},
                                optimizers={"sgd": optimizer}, experts=experts)
            assert state is not None, "no checkpoint"
            first, last = state.step, int(sys.argv[3])
            print("resumed", first, flush=True)
        for step in range(first, last):
            if mode == "victim" and step % 3 == 0:
                save_job(sys.argv[2], step, modules={"local": local},
                         optimizers={"sgd": optimizer}, experts=experts)
            x = torch.randn(16, WIDTH)  # the global generator: part of the job's state
            h = local(x)
            loss = sum(e(h) for e in experts).square().mean()
            optimizer.zero_grad()
            loss.backward()  # each expert's server steps it
            optimizer.step()
            print("loss", step, repr(loss.item()), flush=True)
        rpc.shutdown()
    finally:
        stop_processes(processes, timeout=10.0)


if __name__ == "__main__":
    main()
