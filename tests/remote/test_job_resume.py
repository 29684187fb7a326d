"""A trainer killed with kill -9 resumes its whole job from its last job
checkpoint (save_job / restore_job, issue 44): its own layer, optimizer and
random state, and the state of each remote expert, put back into a fresh
server; its losses from there equal an uninterrupted run's bit for bit.
Runs tests/remote/job_resume.py (each run a trainer and a server process
of their own world)."""
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="loopback world")


def _losses(out: str) -> Dict[int, str]:
    return {int(line.split()[1]): line.split()[2] for line in out.splitlines()
            if line.startswith("loss ")}


@pytest.mark.timeout(300)
def test_a_trainer_killed_with_kill_9_resumes_its_whole_job(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE),
                                                       os.environ.get("PYTHONPATH", "")]))
    script = [sys.executable, str(HERE / "job_resume.py")]
    victim = subprocess.Popen(script + ["victim", str(tmp_path / "job")], env=env,
                              cwd=str(ROOT), stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # its server dies with its group
    seen = -1
    try:
        assert victim.stdout is not None
        for line in victim.stdout:
            if line.startswith("loss "):
                seen = int(line.split()[1])
                if seen >= 7:
                    break
    finally:
        os.killpg(victim.pid, signal.SIGKILL)  # the trainer and its server, without a word
        victim.wait(30)
    assert seen >= 7
    resumed = subprocess.run(script + ["resume", str(tmp_path / "job"), "12"], env=env,
                             cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = int(resumed.stdout.split("resumed ")[1].split()[0])
    assert first % 3 == 0 and 6 <= first <= seen, (first, seen)
    plain = subprocess.run(script + ["plain", "12"], env=env, cwd=str(ROOT),
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-3000:]
    expected, got = _losses(plain.stdout), _losses(resumed.stdout)
    assert sorted(got) == list(range(first, 12))
    assert {s: expected[s] for s in got} == got
