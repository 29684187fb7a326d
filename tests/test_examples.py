"""Every script in examples/ runs, at its small size (``--small``), in a fresh
interpreter with a timeout, and prints what it promises.

The selected scripts start together, with the module's first test (16.5 s
for the four instead of 26 s one after another, on 2 cores; see
:mod:`started`), and each test reads its own."""
import importlib.util
import os
import sys
from typing import Dict, Iterator, List, Tuple

import pytest

from started import Started, selected

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO_ROOT, "examples")
SCRIPTS = ["checkpointed_experts.py", "mixtral.py", "parallel_backward.py", "remote_experts.py"]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

#: The running scripts, and the TMPDIR of each.
_RUNS: Dict[str, Tuple[Started, str]] = {}


@pytest.fixture(scope="module", autouse=True)
def _examples(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Starts the script of every selected test (``test_x`` reads ``x.py``),
    but mixtral's without its extra."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_AUTOGRAD_WORKERS"}
    for name in selected(request):
        script = f"{name[len('test_'):]}.py"
        if script in SCRIPTS and (script != "mixtral.py" or HAS_TRANSFORMERS):
            tmp = str(tmp_path_factory.mktemp(script[:-len(".py")]))
            _RUNS[script] = (Started([sys.executable, os.path.join(EXAMPLES, script), "--small"],
                                     240.0, cwd=REPO_ROOT, env=dict(env, TMPDIR=tmp)), tmp)
    yield
    for run, _ in _RUNS.values():
        run.kill()
    _RUNS.clear()


def _run(script: str) -> Tuple[List[str], str]:
    """The script's output lines and its TMPDIR, once it exited 0."""
    run, tmp = _RUNS.pop(script)
    out, err, late = run.finish()
    assert not late, f"{script} ran past {run.timeout:g} s:\n{out}\n{err}"
    assert run.process.returncode == 0, \
        f"{script} exited with {run.process.returncode}:\n{out}\n{err}"
    return out.splitlines(), tmp


def test_every_example_has_a_test():
    scripts = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
    assert scripts == SCRIPTS


@pytest.mark.timeout(300)
def test_parallel_backward():
    lines, _ = _run("parallel_backward.py")
    assert any(line.startswith("modules:") and "same gradients" in line for line in lines)
    assert any(line.startswith("Function:") and "same gradients" in line for line in lines)


@pytest.mark.timeout(300)
def test_checkpointed_experts():
    lines, _ = _run("checkpointed_experts.py")
    kept = {line.split("  ")[0].strip(): float(line.split("backward")[1].split("MiB")[0])
            for line in lines if "kept for backward" in line}
    assert set(kept) == {"plain", "checkpoint", "checkpoint + recompute_early"}
    assert kept["checkpoint"] < kept["plain"]
    assert lines[-1].startswith("gradients: identical")


@pytest.mark.timeout(300)
def test_remote_experts():
    """The trainer and its server (a ``serve`` subprocess) share the job
    secret that the example makes, through a private file (mode 600) it
    removes at exit (its temporary files go to a TMPDIR of its own here)."""
    lines, tmp = _run("remote_experts.py")
    assert sum(line.startswith("step ") for line in lines) == 3
    assert lines[-1] == "calls per expert: [3, 3, 3, 3]"
    left = [f for f in os.listdir(tmp) if f.startswith("moe-job-")]
    assert left == [], left  # the secret file's private directory is gone


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_TRANSFORMERS,
                    reason="transformers is not installed: it is the optional extra "
                           "'examples' (pip install -e '.[examples]'); make test installs it")
def test_mixtral():
    lines, _ = _run("mixtral.py")
    assert any(line.startswith("plain:") and "bit-for-bit equal" in line for line in lines)
    assert any(line.startswith("gradient checkpointing:") and "bit-for-bit equal" in line
               for line in lines)
    assert any(line.startswith("MixtureOfExperts.from_mixtral blocks:") for line in lines)
