"""``make mutate``: mutation testing of the runtime's subtle modules, in shards.

Why: a suite that passes says nothing about the bugs it would miss. A
mutation tool (mutmut 3, https://github.com/boxed/mutmut) writes small bugs
into the code one at a time and runs the tests that reach the mutated
function (it records, in one traced run, which tests call which function);
a mutant no test kills is a bug the suite lets through (issue 34).

How: each shard (:data:`SHARDS`) names the files it mutates and the test
files that matter to them. A shard runs in a directory of its own,
``.mutate/<shard>/`` (a copy of ``moe_autograd/``, ``tests/`` and
``setup.cfg`` with a ``[mutmut]`` section), so shards run alone, resume
where they stopped, and never mix their results. mutmut copies the package
into ``mutants/`` there and puts it first on ``sys.path``; this driver also
sets ``PYTHONPATH`` to it, so a subprocess a test spawns (a server, an
example) imports the mutated code, and mutmut's ``MUTANT_UNDER_TEST``
(inherited through the environment) switches the same mutant on there.

What a run leaves out, and why:

* tests that use the shared RPC world or Ray instance (``world``,
  ``ray_world``: servers spawned once per session; a mutant's run would spawn
  them again, seconds each, and the engines' own threads do not survive a
  fork): ``MOE_AUTOGRAD_MUTATE=1`` deselects them (tests/remote/conftest.py).
  In-process servers (``ExpertServer`` with an in-process transport) cover
  the same code;
* what a mutant changes only in a subprocess is seen only by a test that also
  reaches the function in its own process (mutmut's test selection is
  in-process): such mutants show as "no tests".

Equivalent mutants (no test can tell them apart from the code) are listed,
each with its reason, in ``tests/mutation_equivalents.toml``; the kill rate
is ``killed / (mutants - equivalent)`` per file (a mutant that no test
reaches counts as a survivor; the report says how many there are).

Usage::

    python tools/mutate.py run SHARD [--jobs N]    # make mutate SHARD=remote-state
    python tools/mutate.py report [SHARD ...]      # kill rates, survivors
    python tools/mutate.py recheck SHARD           # survivors again, after new tests
    python tools/mutate.py list                    # the shards
"""
import argparse
import configparser
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutate"
EQUIVALENTS = ROOT / "tests" / "mutation_equivalents.toml"

_PKG = "moe_autograd/"
_REMOTE = "moe_autograd/remote/"

#: shard -> (files it mutates, test files that matter to them). Smallest first.
SHARDS: Dict[str, Tuple[List[str], List[str]]] = {
    "remote-state": (
        [_REMOTE + "state.py", _REMOTE + "sizes.py"],
        ["tests/remote/test_state.py", "tests/remote/test_sizes.py",
         "tests/remote/test_remote_units.py", "tests/remote/test_remote_limits.py"]),
    "remote-wire": (
        [_REMOTE + "frame.py", _REMOTE + "wire.py", _REMOTE + "auth.py"],
        ["tests/remote/test_wire.py", "tests/remote/test_auth.py",
         "tests/remote/test_remote_units.py", "tests/remote/test_remote_limits.py",
         # in-process servers: the channel's sealing and opening, packed (compressed)
         # tensors, the gate's per-job refusals
         "tests/remote/test_compression.py", "tests/remote/test_ray_engine.py",
         "tests/remote/test_batching_deadlines.py"]),
    "remote-batching": (
        [_REMOTE + "batching.py", _REMOTE + "batch_server.py"],
        ["tests/remote/test_batching_deadlines.py", "tests/remote/test_remote_batching.py",
         "tests/remote/test_remote_stragglers.py", "tests/remote/test_remote_units.py",
         "tests/remote/test_remote_limits.py"]),
    "rng": (
        [_PKG + "rng.py"],
        ["tests/test_rng.py", "tests/test_rng_router.py", "tests/test_rng_streams.py",
         "tests/test_rng_batches.py",
         "tests/test_regressions_order.py", "tests/test_checkpoint.py"]),
    "module-state": (
        [_PKG + "module_state.py", _PKG + "checkpoint.py"],
        ["tests/test_module_state.py", "tests/test_checkpoint.py",
         "tests/test_parallel_checkpoint.py", "tests/test_kept.py"]),
    "calls": (
        [_PKG + "module_call.py", _PKG + "node.py", _PKG + "parallel.py"],
        ["tests/test_parallel.py", "tests/test_autograd.py", "tests/test_parallel_checkpoint.py",
         "tests/test_kept.py", "tests/test_module_state.py", "tests/test_rng_batches.py",
         "tests/test_regressions_order.py", "tests/test_node.py", "tests/test_param_inputs.py",
         "tests/test_regressions_oracle.py", "tests/test_checkpoint_frames.py",
         # the node's backward policy: the layer's tolerant passes, deadlines and quorum
         "tests/moe/test_moe_faults.py"]),
    "layer": (
        [_PKG + "moe/layer.py"],
        ["tests/moe/test_moe_layer.py", "tests/moe/test_moe_options.py",
         "tests/moe/test_moe_faults.py", "tests/moe/test_moe_gaps.py",
         "tests/moe/test_moe_layer_parts.py", "tests/moe/test_moe_logs.py",
         "tests/moe/test_grouped.py", "tests/moe/test_mixtral.py", "tests/moe/test_zoo_blocks.py",
         "tests/test_module_state.py"]),
}

_KILLED = {1, 3, 37}
_SURVIVED = {0}
_NO_TESTS = {5, 33}
_TIMEOUT = {36, -24, 24, 152, 255}


def _prepare(shard: str) -> Path:
    """``.mutate/<shard>/``: the package, the tests and a setup.cfg whose
    ``[mutmut]`` section names the shard's files and tests. A kept
    ``mutants/`` keeps its results (mutmut resumes) unless the sources changed
    (mutmut compares them itself)."""
    files, tests = SHARDS[shard]
    here = WORK / shard
    here.mkdir(parents=True, exist_ok=True)
    for name in ("moe_autograd", "tests"):
        target = here / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(ROOT / name, target,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # PYTHONPATH names mutants/ (see _env): it must exist when mutmut starts,
    # or the import system caches "no such directory" for it and the package
    # copied there later is never found.
    (here / "mutants").mkdir(exist_ok=True)
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    cfg["mutmut"] = {
        "source_paths": "\nmoe_autograd",
        "only_mutate": "\n" + "\n".join(files),
        "pytest_add_cli_args_test_selection": "\n" + "\n".join(tests),
        "process_isolation": "forkserver",
        "timeout_multiplier": "3.0",
        "timeout_constant": "4.0",
        "debug": os.environ.get("MUTATE_DEBUG", "false"),
    }
    with open(here / "setup.cfg", "w") as f:
        cfg.write(f)
    return here


def _env(here: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(here / "mutants")
    env["MOE_AUTOGRAD_MUTATE"] = "1"
    env.setdefault("MOE_AUTOGRAD_WORKERS", "4")
    return env


def run(shard: str, jobs: int, only: Sequence[str] = ()) -> int:
    """Runs the shard's mutants (``only``: those whose names match these
    patterns, e.g. ``moe_autograd.remote.wire.*``)."""
    here = _prepare(shard)
    print(f"mutate: shard {shard!r} in {here} ({jobs} at a time)", flush=True)
    code = subprocess.call([sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs),
                            *only], cwd=here, env=_env(here))
    report([shard])
    return code


def recheck(shard: str, jobs: int) -> int:
    """Runs the shard's survivors again (after new tests: mutmut keeps a
    verdict until told to rerun it)."""
    here = _prepare(shard)
    equivalent = _equivalents()
    names = [name for codes in _results(shard).values() for name, code in codes.items()
             if (code in _SURVIVED or code in _NO_TESTS) and name not in equivalent]
    if not names:
        print(f"{shard}: no survivors to recheck")
        return 0
    print(f"mutate: rechecking {len(names)} survivors of {shard!r}", flush=True)
    code = subprocess.call([sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs),
                            *names], cwd=here, env=_env(here))
    report([shard])
    return code


def _equivalents() -> Dict[str, str]:
    if not EQUIVALENTS.exists():
        return {}
    import tomllib
    data = tomllib.loads(EQUIVALENTS.read_text("utf-8"))
    return {name: entry["reason"] for name, entry in data.get("mutant", {}).items()}


def _results(shard: str) -> Dict[str, Dict[str, int]]:
    """file -> {mutant name: exit code}."""
    out: Dict[str, Dict[str, int]] = {}
    for path in SHARDS[shard][0]:
        meta = WORK / shard / "mutants" / (path + ".meta")
        if meta.exists():
            out[path] = json.loads(meta.read_text())["exit_code_by_key"]
    return out


def report(shards: Sequence[str]) -> Dict[str, Tuple[int, int, int, int, int]]:
    """Prints, per file, the kill rate and every survivor not listed as
    equivalent; returns file -> (killed, survived, equivalent, no tests, other)."""
    equivalent = _equivalents()
    table: Dict[str, Tuple[int, int, int, int, int]] = {}
    for shard in shards:
        results = _results(shard)
        if not results:
            print(f"{shard}: no results (run: make mutate SHARD={shard})")
            continue
        for path, codes in results.items():
            killed = survived = equiv = untested = other = 0
            survivors: List[str] = []
            for name, code in sorted(codes.items()):
                if name in equivalent:
                    equiv += 1
                elif code in _KILLED or code in _TIMEOUT:
                    killed += 1
                elif code in _SURVIVED:
                    survived += 1
                    survivors.append(name)
                elif code in _NO_TESTS:
                    untested += 1
                    survivors.append(name + " (no test reaches it)")
                else:
                    other += 1
                    survivors.append(f"{name} (exit {code})")
            judged = killed + survived + untested  # a mutant no test reaches survives
            rate = 100.0 * killed / judged if judged else 100.0
            table[path] = (killed, survived, equiv, untested, other)
            print(f"{path}: {rate:.1f}% killed ({killed}/{judged}; {equiv} equivalent, "
                  f"{untested} reached by no test, {other} not checked)")
            for name in survivors:
                print(f"    survived: {name}")
    return table


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tools/mutate.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run one shard's mutants (or 'all', one after another)")
    p_run.add_argument("shard", choices=[*SHARDS, "all"])
    p_run.add_argument("--jobs", type=int, default=2, help="mutants at a time (default 2)")
    p_run.add_argument("--only", nargs="+", default=(), metavar="PATTERN",
                       help="only the mutants whose names match (fnmatch), e.g. "
                       "'moe_autograd.remote.wire.*'")
    p_recheck = sub.add_parser("recheck", help="run a shard's survivors again (after new tests)")
    p_recheck.add_argument("shard", choices=list(SHARDS))
    p_recheck.add_argument("--jobs", type=int, default=2, help="mutants at a time (default 2)")
    p_report = sub.add_parser("report", help="kill rates and survivors of shards run before")
    p_report.add_argument("shards", nargs="*", metavar="SHARD")
    sub.add_parser("list", help="the shards, their files and tests")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, (files, tests) in SHARDS.items():
            print(f"{name}: {' '.join(files)}\n    tests: {' '.join(tests)}")
        return 0
    if args.command == "report":
        unknown = [s for s in args.shards if s not in SHARDS]
        if unknown:
            parser.error(f"unknown shard(s) {unknown}: one of {list(SHARDS)}")
        report(args.shards or list(SHARDS))
        return 0
    if args.command == "recheck":
        return recheck(args.shard, args.jobs)
    shards = list(SHARDS) if args.shard == "all" else [args.shard]
    return max(run(shard, args.jobs, args.only) for shard in shards)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
