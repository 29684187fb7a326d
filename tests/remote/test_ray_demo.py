"""``python -m moe_autograd demo --elastic --engine ray`` tells its whole story,
small: a local Ray cluster of real nodes, a node killed mid-training (its
experts masked), a node joining with a replacement and a replica, a server
leaving with drain and its node leaving; the report shows it, and no Ray
process outlives the demo.

One run in a fresh interpreter, in a session of its own (its own Ray cluster,
never the shared instance of conftest), about 30-35 s on 2 cores (up to 60 s
when the machine is busy): the cluster's start and the servers' ``import
torch`` under training load dominate, not the steps.
"""
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest


ROOT = Path(__file__).resolve().parent.parent.parent


def _session_processes(sid: int) -> List[str]:
    """Live (not zombie) processes of session ``sid``: the demo's and Ray's,
    which start in the demo's session and never leave it."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(f"{entry} {cmdline.decode(errors='replace')[:120]}")
    return found


@pytest.mark.timeout(150)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ray_elastic_demo_small() -> None:
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    # the demo starts a Ray of its own (token authentication on, a private
    # directory) and makes its own job secret
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("MOE_AUTOGRAD_WORKERS", None)
    # --latency 0.03: fewer steps per second leave the 2 cores to the servers'
    # start (their import torch), which is what this test waits for
    cmd = [sys.executable, "-m", "moe_autograd", "demo", "--elastic", "--engine", "ray",
           "--steps", "8", "--latency", "0.03", "--target", "0", "--quiet",
           "--ray-timeout", "90"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=130)
    finally:
        if proc.poll() is None:  # timed out: the session's processes go too
            os.killpg(proc.pid, 9)
            proc.communicate()
    seconds = time.monotonic() - started
    deadline = time.monotonic() + 20.0  # workers exit once their raylet is gone
    left = _session_processes(proc.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _session_processes(proc.pid)
    shown = f"exit {proc.returncode} after {seconds:.1f} s\n{out}\n-- stderr --\n{err[-3000:]}"
    assert proc.returncode == 0, shown
    assert not left, f"Ray processes outlived the demo: {left}\n{shown}"

    report = out[out.index("churn events"):]
    story = ["kill node_b", "node_c joins with server_c", "server_c joined",
             "server_c served its first call", "server_d joined",
             "server_a leaves with drain", "server_a left (expert0, expert1): draining",
             "server_a drained and ended (left undrained: 0 calls in flight, 0 states)",
             "node_a left the cluster"]
    at = [report.find(text) for text in story]
    assert all(k >= 0 for k in at), (dict(zip(story, at)), shown)
    assert at[0] < at[1] < at[2], shown  # kill, node_c's start, server_c's join
    assert at[5] < min(at[6], at[7]) and at[7] < at[8], shown  # leave, drain, node gone
    masked = {line.split("steps")[0].strip(): int(line.split(":")[1].split("masked")[0])
              for line in report.splitlines() if " masked, median step" in line}
    assert masked["before the kill"] == 0, shown
    assert masked["no server for expert2/3"] > 0, shown  # the dead node's experts, masked
    assert masked["server_a leaving/gone"] == 0, shown   # the drain lost no call
    assert "training never stopped" in report and "target 0%: reached" in report, shown
