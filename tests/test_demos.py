"""``python -m moe_autograd demo`` (``make demo``) and ``demo --elastic`` (torch
RPC) run as the README tells, at their smallest, in fresh interpreters of a
session of their own: they tell their story, log what they mask, and leave
no process behind. (``demo --elastic --engine ray``:
tests/remote/test_ray_demo.py.) About 10 and 17 s on 2 cores; the selected
demos start together, with the module's first test (15 s for both; see
:mod:`started`), and each test reads its own."""
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from started import Started, selected

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _live_in_session(sid: int) -> List[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...
            if fields[0] != "Z" and int(fields[3]) == sid:
                found.append(entry)
    return found


#: Each test's demo: its arguments and its time limit (s).
_DEMOS = {
    # every call of the flaky expert fails, none stalls, and the deadline is
    # far above a loaded machine's noise: the masked failure is the error, not
    # a timeout (a 0.1 s deadline at load 10 masked every remote call)
    "test_demo_small": (["demo", "--steps", "4", "--servers", "1", "--quiet",
                         "--fail-rate", "1", "--slow-rate", "0", "--forward-timeout", "30"],
                        150.0),
    "test_elastic_demo_small": (["demo", "--elastic", "--steps", "12", "--quiet",
                                 "--target", "0"], 210.0),
}
#: The running demos, by test.
_RUNS: Dict[str, Started] = {}


@pytest.fixture(scope="module", autouse=True)
def _demos(request: pytest.FixtureRequest) -> Iterator[None]:
    """Starts the demo of every selected test, each in a session of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_AUTOGRAD")}
    for name in selected(request):
        if name in _DEMOS:
            args, timeout = _DEMOS[name]
            _RUNS[name] = Started([sys.executable, "-m", "moe_autograd", *args], timeout,
                                  session=True, cwd=ROOT, env=env, stderr=subprocess.STDOUT)
    yield
    for run in _RUNS.values():
        run.kill()
    _RUNS.clear()


def _run(test: str) -> str:
    """The output of ``test``'s demo, once it exited 0 and left no process."""
    run = _RUNS.pop(test)
    out, _, late = run.finish()
    sid = run.process.pid
    deadline = time.monotonic() + 20
    while _live_in_session(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not late, f"the demo ran past {run.timeout:g} s:\n{out[-3000:]}"
    assert _live_in_session(sid) == [], out[-3000:]
    assert run.process.returncode == 0, out[-3000:]
    return out


@pytest.mark.timeout(180)
def test_demo_small() -> None:
    out = _run("test_demo_small")
    assert "accuracy      mixture" in out and "absorbed      " in out, out
    # the flaky remote expert fails every call: masked, and logged with its error
    assert ("WARNING MixtureOfExperts: expert 4 (RemoteExpert(worker='server0', "
            "name='expert0')): forward call 1 masked: RemoteExpertError: ") in out, out
    assert "RuntimeError: injected failure" in out, out


@pytest.mark.timeout(240)
def test_elastic_demo_small() -> None:
    out = _run("test_elastic_demo_small")
    for line in ("kill server_b (SIGKILL)", "start server_c", "churn events",
                 "masked expert calls per phase", "training never stopped (12 steps)"):
        assert line in out, out
