"""The first MixtureOfExperts steps of a fresh process must not be eaten by
one-time lazy imports: healthy experts may not miss a forward/backward deadline
that is generous for their work (0.5 s for a 6x7x5 MLP).

Found: the first ``torch.autograd.grad`` with ``grad_outputs`` (each call's
backward, on a worker) imports torch.fx.experimental.symbolic_shapes (sympy),
and a checkpointed call's first op under the CallRng dispatch mode imports
torch._dynamo: 0.5-3 s, inside the deadline, so every expert of the first step
times out (NotEnoughExperts). Importing both up front makes it pass.
"""
import os
import subprocess
import sys
import textwrap

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_FIRST_STEPS = """
    import time, torch
    from torch import nn
    import moe_autograd
    from moe_autograd.moe import MixtureOfExperts

    failures = []
    for checkpoint in (False, True):  # plain first: its step must not warm the other
        torch.manual_seed(0)
        experts = [nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5)) for _ in range(4)]
        moe = MixtureOfExperts(experts, 6, k=2, checkpoint=checkpoint,
                               forward_timeout=0.5, backward_timeout=0.5)
        x = torch.randn(2, 8, 6, requires_grad=True)
        started = time.monotonic()
        try:
            y, aux = moe(x)
            forward_s = time.monotonic() - started
            started = time.monotonic()
            (y.square().mean() + 0.01 * aux).backward()
            outcome = "forward %.2fs backward %.2fs" % (forward_s, time.monotonic() - started)
        except Exception as error:
            outcome = "%s after %.2fs: %s" % (type(error).__name__, time.monotonic() - started,
                                               str(error)[:200])
        stats = moe.stats()
        late = [(s["timeouts"], s["backward_timeouts"]) for s in stats]
        print("checkpoint=%s: %s; (timeouts, backward_timeouts) per expert: %s"
              % (checkpoint, outcome, late))
        if any(s["timeouts"] or s["backward_timeouts"] for s in stats):
            failures.append(checkpoint)
    assert not failures, "healthy experts missed the deadline in the first step"
"""


@pytest.mark.timeout(120)
def test_first_steps_of_a_fresh_process_meet_their_deadlines():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FIRST_STEPS)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, (
        "the first steps of a fresh process missed their deadlines (one-time lazy imports "
        f"on a worker, inside the deadline):\n{proc.stdout}\n{proc.stderr[-1500:]}")
