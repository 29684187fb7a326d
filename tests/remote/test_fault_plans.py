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
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

import faults
from faults import RAY_START_S
from started import Started

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
_ABORTS = ("terminate called", "FATAL: exception not rethrown", "Aborted", "core dumped")


class _Trainer:
    """A trainer process running plans (see :func:`run_plans`), started now
    (:class:`started.Started`), its report read by :meth:`finish`."""

    def __init__(self, plans: List[faults.Plan], seed: int, workdir: Path,
                 engine: str, timeout: float) -> None:
        spec = workdir / "plans.json"
        spec.write_text(json.dumps({"seed": seed, "plans": [p.to_json() for p in plans]}))
        self.report = workdir / "report.json"
        entry = (f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(ROOT)!r}]; import faults; "
                 "sys.exit(faults.trainer_main(sys.argv[1:]))")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
        env.pop("MOE_AUTOGRAD_WORKERS", None)
        env.setdefault("PYTHONFAULTHANDLER", "1")
        self.run = Started([sys.executable, "-c", entry, str(spec), str(self.report), engine],
                           timeout, cwd=str(ROOT), env=env)

    def finish(self) -> Tuple[Dict[str, Any], int, str]:
        """Its report, exit status and output (killed past its time limit,
        from its start: then the report says so)."""
        out, err, _ = self.run.finish()
        data = json.loads(self.report.read_text()) if self.report.exists() \
            else {"problems": ["no report"]}
        data["wall_s"] = time.monotonic() - self.run.started
        return data, self.run.process.returncode, out + err


def run_plans(plans: List[faults.Plan], seed: int, workdir: Path,
              timeout: float, engine: str = "rpc") -> Tuple[Dict[str, Any], int, str]:
    """Runs the trainer on ``plans`` over ``engine`` (``rpc``: a torch RPC
    world; ``ray``: a local Ray instance of its own); returns its report,
    exit status and output."""
    return _Trainer(plans, seed, workdir, engine, timeout).finish()


def _summary(report: Dict[str, Any], status: int, output: str) -> str:
    problems = "\n".join(f"- {p}" for p in report.get("problems", []))
    return (f"exit status {status}; seed {report.get('seed')}; problems:\n{problems}\n"
            f"-- trainer output (tail) --\n{output[-4000:]}")


#: The fixed plans' trainers, by engine: both start with the first test that
#: needs either (their worlds mostly wait: timeouts, sleeps, start-ups), each
#: test reads its own engine's report.
_FIXED: Dict[str, _Trainer] = {}


def _selected_engines(request: pytest.FixtureRequest) -> List[str]:
    """The engines whose fixed-plan tests this session runs."""
    found = {item.callspec.params["fixed"] for item in request.session.items
             if getattr(item, "module", None) is request.module
             and "fixed" in getattr(getattr(item, "callspec", None), "params", {})}
    return [e for e in ("rpc", "ray") if e in found]


@pytest.fixture(scope="module", autouse=True)
def _no_trainer_left() -> Iterator[None]:
    """A trainer no test read (deselected, or the run stopped): killed."""
    yield
    for trainer in _FIXED.values():
        trainer.run.kill()
    _FIXED.clear()


@pytest.fixture(scope="module", params=["rpc", "ray"])
def fixed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Tuple[Dict[str, Any], int, str]:
    """The fixed plans' report, on each engine (issue 20: one conformance
    suite): the same plans, checks and exit under torch RPC and under Ray."""
    engine = request.param
    if engine == "ray":
        pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    if engine not in _FIXED:
        ray_ok = True
        try:
            import ray  # noqa: F401
        except ImportError:
            ray_ok = False
        for name in _selected_engines(request) or [engine]:
            if name not in _FIXED and (name != "ray" or ray_ok):
                _FIXED[name] = _Trainer(faults.FIXED_PLANS, 1800,
                                        tmp_path_factory.mktemp(f"fixed-plans-{name}"), name,
                                        240.0 + RAY_START_S)  # actors start (again) in plans
    return _FIXED.pop(engine).finish()


@pytest.mark.timeout(300 + RAY_START_S)
def test_fixed_plans_hold_every_contract(fixed: Tuple[Dict[str, Any], int, str]) -> None:
    report, status, output = fixed
    assert not report["problems"], _summary(report, status, output)
    assert [p["name"] for p in report["plans"]] == [p.name for p in faults.FIXED_PLANS]
    assert status == faults.EXIT_STATUS, _summary(report, status, output)  # not an abort
    assert not any(text in output for text in _ABORTS), _summary(report, status, output)
    print(f"fixed fault plans: {report['wall_s']:.1f} s in all "
          f"(start-up {report['startup_s']:.1f} s; "
          + ", ".join(f"{p['name']} {p['seconds']:.1f} s" for p in report["plans"]) + ")")


@pytest.mark.timeout(300 + RAY_START_S)
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


@pytest.mark.timeout(300 + RAY_START_S)
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
        pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
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
