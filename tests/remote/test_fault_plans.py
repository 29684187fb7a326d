"""Training under fault plans (issue 18): see :mod:`faults` for the harness.

The fixed plans (:data:`faults.FIXED_PLANS`) run once per session and
engine in one trainer process (torch RPC, then Ray: the same plans and
checks); each test below reads its report. ``pytest tests/remote --plans N
[--plans-seed S]`` also runs N random plans on each engine (the seed is
printed, so a failing run replays).
"""
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

import faults

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
_ABORTS = ("terminate called", "FATAL: exception not rethrown", "Aborted", "core dumped")


def run_plans(plans: List[faults.Plan], seed: int, workdir: Path,
              timeout: float, engine: str = "rpc") -> Tuple[Dict[str, Any], int, str]:
    """Runs the trainer on ``plans`` over ``engine`` (``rpc``: a torch RPC
    world; ``ray``: a local Ray instance of its own); returns its report,
    exit status and output."""
    spec = workdir / "plans.json"
    spec.write_text(json.dumps({"seed": seed, "plans": [p.to_json() for p in plans]}))
    report = workdir / "report.json"
    entry = (f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(ROOT)!r}]; import faults; "
             "sys.exit(faults.trainer_main(sys.argv[1:]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("MOE_AUTOGRAD_WORKERS", None)
    env.setdefault("PYTHONFAULTHANDLER", "1")
    done = subprocess.run([sys.executable, "-c", entry, str(spec), str(report), engine],
                          cwd=str(ROOT),
                          env=env, capture_output=True, text=True, timeout=timeout)
    data = json.loads(report.read_text()) if report.exists() else {"problems": ["no report"]}
    return data, done.returncode, done.stdout + done.stderr


def _summary(report: Dict[str, Any], status: int, output: str) -> str:
    problems = "\n".join(f"- {p}" for p in report.get("problems", []))
    return (f"exit status {status}; seed {report.get('seed')}; problems:\n{problems}\n"
            f"-- trainer output (tail) --\n{output[-4000:]}")


@pytest.fixture(scope="module", params=["rpc", "ray"])
def fixed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Tuple[Dict[str, Any], int, str]]:
    """The fixed plans' report, on each engine (issue 20: one conformance
    suite): the same plans, checks and exit under torch RPC and under Ray."""
    engine = request.param
    if engine == "ray":
        pytest.importorskip("ray", reason="ray is not installed (pip install 'moe_autograd[ray]')")
    started = time.monotonic()
    result = run_plans(faults.FIXED_PLANS, 1800, tmp_path_factory.mktemp(f"fixed-plans-{engine}"),
                       240, engine)
    result[0]["wall_s"] = time.monotonic() - started
    yield result


@pytest.mark.timeout(300)
def test_fixed_plans_hold_every_contract(fixed: Tuple[Dict[str, Any], int, str]) -> None:
    report, status, output = fixed
    assert not report["problems"], _summary(report, status, output)
    assert [p["name"] for p in report["plans"]] == [p.name for p in faults.FIXED_PLANS]
    assert status == faults.EXIT_STATUS, _summary(report, status, output)  # not an abort
    assert not any(text in output for text in _ABORTS), _summary(report, status, output)
    print(f"fixed fault plans: {report['wall_s']:.1f} s in all "
          f"(start-up {report['startup_s']:.1f} s; "
          + ", ".join(f"{p['name']} {p['seconds']:.1f} s" for p in report["plans"]) + ")")


@pytest.mark.timeout(300)
def test_plans_inject_what_they_say(fixed: Tuple[Dict[str, Any], int, str]) -> None:
    """The harness itself: every (phase, kind) pair of the fixed plans left
    its mark (a fault that did nothing would make the checks vacuous)."""
    report, status, output = fixed
    for plan in report["plans"]:
        for step in plan["steps"]:
            if not any(f["kind"] != "none" for f in step["faults"]):
                continue
            (_, masked1, const1), (_, masked2, const2) = step["stats"]
            effect = any(masked1 + const1 + masked2 + const2) or step["raised"] is not None
            assert effect, (plan["name"], step)
    assert any(step["dropped"] for plan in report["plans"] for step in plan["steps"])


@pytest.mark.timeout(300)
def test_replica_dies_between_forward_and_backward(fixed: Tuple[Dict[str, Any], int, str]
                                                   ) -> None:
    """Issue 18, item 6: a replica killed (SIGKILL) after serving a forward
    and before its backward: the fleet layer treats the call as a constant
    (its gradients are those of a replay where that call's backward fails:
    none flows into its input), and the step raises nothing unless a token
    lost its quorum, exactly where the replay raises too."""
    report, status, output = fixed
    plan = next(p for p in report["plans"]
                if p["name"] == "replica-dies-between-forward-and-backward")
    step = plan["steps"][0]
    (calls, masked, constant) = step["stats"][1]  # the fleet layer
    on_victim = [k for k, name in enumerate(faults.FLEET_EXPERTS)
                 if calls[k] and not masked[k] and step["served_by"].get(name) == "s1"]
    assert on_victim, step  # the plan's seed routes a call to the victim
    assert all(constant[k] for k in on_victim), step
    assert not any(constant[k] for k in range(len(calls)) if k not in on_victim), step
    assert step["raised"] is None or step["raised"][:2] == ["backward", "NotEnoughExperts"], step
    later = plan["steps"][1]
    assert later["served_by"].get("f2") in (None, "s0"), later  # its replica on s0 took over
    own = [f"plan {plan['name']!r}" in p for p in report["problems"]]
    assert not any(own), _summary(report, status, output)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", ["rpc", "ray"])
def test_random_plans(request: pytest.FixtureRequest, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str], engine: str) -> None:
    n = int(request.config.getoption("--plans", 0) or 0)
    if n <= 0:
        pytest.skip("random fault plans run with --plans N (pytest tests/remote --plans 5)")
    if engine == "ray":
        pytest.importorskip("ray", reason="ray is not installed (pip install 'moe_autograd[ray]')")
    seed = request.config.getoption("--plans-seed", None)
    seed = random.randrange(1 << 30) if seed is None else int(seed)
    line = (f"random fault plans on {engine}: seed={seed} "
            f"(replay: --plans {n} --plans-seed {seed})")
    with capsys.disabled():
        print(f"\n{line}", flush=True)
    plans = faults.random_plans(seed, n)
    report, status, output = run_plans(plans, seed, tmp_path, 120 + 60 * n, engine)
    assert not report["problems"], f"{line}\n" + _summary(report, status, output)
    assert status == faults.EXIT_STATUS, f"{line}\n" + _summary(report, status, output)
    assert not any(text in output for text in _ABORTS), f"{line}\n" + _summary(report, status,
                                                                               output)
