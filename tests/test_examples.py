"""Every script in examples/ runs, at its small size (``--small``), in a fresh
interpreter with a timeout, and prints what it promises."""
import importlib.util
import os
import subprocess
import sys
from typing import List

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO_ROOT, "examples")


def _run(script: str, timeout: float = 240, **env_vars: str) -> List[str]:
    env = dict(os.environ, **env_vars)
    env.pop("MOE_AUTOGRAD_WORKERS", None)
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--small"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (f"{script} exited with {proc.returncode}:\n"
                                  f"{proc.stdout}\n{proc.stderr}")
    return proc.stdout.splitlines()


def test_every_example_has_a_test():
    scripts = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
    assert scripts == ["checkpointed_experts.py", "mixtral.py", "parallel_backward.py",
                       "remote_experts.py"]


@pytest.mark.timeout(300)
def test_parallel_backward():
    lines = _run("parallel_backward.py")
    assert any(line.startswith("modules:") and "same gradients" in line for line in lines)
    assert any(line.startswith("Function:") and "same gradients" in line for line in lines)


@pytest.mark.timeout(300)
def test_checkpointed_experts():
    lines = _run("checkpointed_experts.py")
    kept = {line.split("  ")[0].strip(): float(line.split("backward")[1].split("MiB")[0])
            for line in lines if "kept for backward" in line}
    assert set(kept) == {"plain", "checkpoint", "checkpoint + recompute_early"}
    assert kept["checkpoint"] < kept["plain"]
    assert lines[-1].startswith("gradients: identical")


@pytest.mark.timeout(300)
def test_remote_experts(tmp_path):
    """The trainer and its server (a ``serve`` subprocess) share the job
    secret that the example makes, through a private file (mode 600) it
    removes at exit (its temporary files go to ``tmp_path`` here)."""
    lines = _run("remote_experts.py", TMPDIR=str(tmp_path))
    assert sum(line.startswith("step ") for line in lines) == 3
    assert lines[-1] == "calls per expert: [3, 3, 3, 3]"
    left = [f for f in os.listdir(tmp_path) if f.startswith("moe-job-")]
    assert left == [], left  # the secret file's private directory is gone


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed: it is the optional extra "
                           "'examples' (pip install -e '.[examples]'); make test installs it")
def test_mixtral():
    lines = _run("mixtral.py")
    assert any(line.startswith("plain:") and "bit-for-bit equal" in line for line in lines)
    assert any(line.startswith("gradient checkpointing:") and "bit-for-bit equal" in line
               for line in lines)
    assert any(line.startswith("MixtureOfExperts.from_mixtral blocks:") for line in lines)
