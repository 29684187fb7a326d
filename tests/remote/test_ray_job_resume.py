"""On Ray, a trainer killed with kill -9 resumes its whole job from its last
job checkpoint (save_job / restore_job, issue 44): its own layer, optimizer
and random state here, and each remote expert's state (weights, Adam's
state, steps) put back into the server, which outlived the trainer and had
trained on past the checkpoint; its losses from there equal an
uninterrupted run's bit for bit, and so do the experts' final states.

Each trainer (tests/remote/ray_job_resume.py) is a Ray driver of its own
that joins the shared local Ray (``ray_world``: its address and token) and
calls one RayExpertServer started here: the victim's experts and, beside
them, those of the uninterrupted run (same weights, other names), so that
one actor start serves all three runs.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from moe_autograd.remote import RemoteExpert
from moe_autograd.remote.ray_server import RayExpertServer
from wiring import RAY_START_S, ray_token_env

pytestmark = pytest.mark.timeout(180 + RAY_START_S)  # one actor started here, three drivers
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS = 12


def _losses(out: str) -> Dict[int, str]:
    return {int(line.split()[1]): line.split()[2] for line in out.splitlines()
            if line.startswith("loss ")}


def _same(a: Any, b: Any) -> bool:
    """Bit for bit: tensors by torch.equal, containers item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and \
            all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and \
            len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_a_ray_trainer_killed_with_kill_9_resumes_its_whole_job(
        ray_world: Dict[str, Any], tmp_path: Path) -> None:
    import ray

    env = dict(os.environ, **ray_token_env(), PYTHONPATH=os.pathsep.join(
        [str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))  # the job's secret: wiring's
    script = [sys.executable, str(HERE / "ray_job_resume.py"),
              ray.get_runtime_context().gcs_address, "job-srv"]
    job = str(tmp_path / "job")
    started = time.monotonic()
    server = RayExpertServer("job-srv", "ray_job_resume:servers", ready_timeout=RAY_START_S)
    processes: List["subprocess.Popen[str]"] = []
    try:
        print(f"actor started in {time.monotonic() - started:.1f} s")
        started = time.monotonic()
        # the uninterrupted run (experts p0, p1) beside the victim (v0, v1)
        plain_log = tmp_path / "plain.err"
        with plain_log.open("w") as errors:  # (a file: not read while the victim runs)
            plain = subprocess.Popen(script + ["p", "plain", str(STEPS)], env=env,
                                     cwd=str(ROOT), stdout=subprocess.PIPE, stderr=errors,
                                     text=True)
        processes.append(plain)
        victim = subprocess.Popen(script + ["v", "victim", job], env=env, cwd=str(ROOT),
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        processes.append(victim)
        seen = -1
        assert victim.stdout is not None
        for line in victim.stdout:
            if line.startswith("loss "):
                seen = int(line.split()[1])
                if seen >= 7:
                    break
        os.killpg(victim.pid, signal.SIGKILL)  # the trainer, without a word, mid-pass
        rest, _ = victim.communicate(timeout=30)
        assert seen >= 7, f"the victim died at step {seen} ({victim.returncode})"
        printed = max([seen, *_losses(rest)])
        print(f"victim killed after step {printed} ({time.monotonic() - started:.1f} s)")
        # the server outlived it and trained on past its last checkpoint

        resumed = subprocess.run(script + ["v", "resume", job, str(STEPS)], env=env,
                                 cwd=str(ROOT), capture_output=True, text=True, timeout=180)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        out, _ = plain.communicate(timeout=180)
        assert plain.returncode == 0, plain_log.read_text()[-3000:]
        print(f"resumed and plain runs done ({time.monotonic() - started:.1f} s)")

        before = [int(s) for s in resumed.stdout.split("before ")[1].splitlines()[0].split()]
        first, *expert_steps = (int(s) for s in
                                resumed.stdout.split("resumed ")[1].splitlines()[0].split())
        assert first in (6, 9) and first <= printed + 1, (first, printed)
        assert expert_steps == [first, first], expert_steps  # each expert stepped once a step
        # the server had applied every step the victim printed (seen + 1 of them, past
        # the checkpoint when first is 6): restore_job rolled it back to first
        assert all(b >= max(first, seen + 1) for b in before), (before, seen, first)
        expected, got = _losses(out), _losses(resumed.stdout)
        assert sorted(expected) == list(range(STEPS))
        assert sorted(got) == list(range(first, STEPS))
        assert {s: expected[s] for s in got} == got
        # the experts ended as the uninterrupted run's, bit for bit (weights and Adam's state)
        transport = ray_world["transport"]
        for i in range(2):
            a, b = (RemoteExpert("job-srv", f"{p}{i}", transport=transport,
                                 forward_timeout=20.0).remote_snapshot() for p in "vp")
            assert a.steps == b.steps == STEPS, (a.steps, b.steps)
            assert _same(a.module, b.module), f"{i}: weights differ"
            assert a.optimizer is not None and _same(a.optimizer, b.optimizer), \
                f"{i}: Adam's states differ"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(10)
        server.kill()
