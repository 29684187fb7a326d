"""Every code block and every command of the README runs in the test suite.

The README's fenced blocks and its inline commands (``python -m ...``,
``make ...``, ``pip install ...``, ...) are extracted, and each must be
accounted for below, exactly once:

* the cheap Python blocks run here, as written (:data:`RUN_HERE`), and the
  log line the README shows is checked against what a failing expert logs;
* the expensive ones (other processes, a Ray cluster) name the tests that run
  them at a small size (:data:`ELSEWHERE`, :data:`COMMANDS`); each named test
  must exist, and a command line of such a block must be one the named
  recipe test checks against the README (its ``in_readme`` calls), unless it
  is listed in :data:`NOT_RUN_AS_WRITTEN` with the reason;
* the layout block names files that must exist.

A block or command added to the README without an entry here, or an entry
whose block is gone, fails :func:`test_every_block_is_accounted_for` /
:func:`test_every_command_is_accounted_for`: the README cannot drift from
what the suite runs.
"""
import ast
import configparser
import copy
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest
import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# A block is named by a line it alone contains.
RUN_HERE = {
    "from moe_autograd import (": "test_import_block",
    "outputs = parallel_apply(experts, inputs)": "test_example_blocks",
    "moe = MixtureOfExperts(experts, in_features=64": "test_example_blocks",
    "set_experts_implementation(model)  # registers": "test_experts_implementation_block",
    "MixtureOfExperts: expert 1 (Broken): forward call 1 masked": "test_logged_line_block",
    'logging.getLogger("moe_autograd.moe.stats").setLevel': "test_logging_block",
    "  executor.py     the worker pool": "test_layout_block",
}
RECIPES = "tests/remote/test_recipes.py"
ELSEWHERE: Dict[str, List[str]] = {
    "make demo     # trains a small MoE": ["tests/test_demos.py::test_demo_small"],
    "make mutate SHARD=remote-state    # one shard": [
        "tests/test_mutate_tool.py::test_make_mutate_runs_the_tool_with_the_mutate_extra"],
    "python -m moe_autograd serve --experts my_experts:make --name server-b --rank 1":
        [f"{RECIPES}::test_static_world_recipe"],
    "ray start --head --port=6379": [f"{RECIPES}::test_ray_cluster_recipe"],
    'ray.init(address="10.0.0.1:6379")': [f"{RECIPES}::test_ray_cluster_recipe",
                                           "tests/remote/test_ray_demo.py::"
                                           "test_ray_elastic_demo_small"],
    'fleet = Fleet.start("trainer", "127.0.0.1", 29500)':
        [f"{RECIPES}::test_elastic_fleet_recipe"],
    "python -m moe_autograd serve --join": [f"{RECIPES}::test_elastic_fleet_recipe"],
    "ExpertServer(experts, batch_across_calls=True)": [
        "tests/remote/test_gather.py::test_options_are_checked",  # the options, serve's flags
        "tests/remote/test_gather.py::test_trainers_of_two_jobs_batched_on_both_engines"],
}
# Command lines of blocks in ELSEWHERE that their test does not run as
# written, and why (anything else must be one of the test's in_readme lines).
NOT_RUN_AS_WRITTEN = {
    "make test     # runs the test suite": "it is this suite",
    "make demo     # trains a small MoE with local and remote experts: python -m moe_autograd "
    "demo": "tests/test_demos.py runs python -m moe_autograd demo at 4 steps, 1 server "
            "(test_make_targets checks that make demo is that command)",
    "make mutate SHARD=remote-state    # one shard: remote/state.py, remote/sizes.py":
        "a mutation run takes minutes per shard: tests/test_mutate_tool.py checks its wiring",
    "make mutate                       # every shard, smallest first (remote-state, remote-wire,":
        "as make mutate SHARD=...",
    "make mutate-report                # kill rate per file, and every survivor":
        "reads a run's results (tools/mutate.py report)",
    "python tools/mutate.py recheck SHARD   # the survivors again, after new tests":
        "as make mutate SHARD=...",
    "ray start --head --port=6379 --num-cpus=4": "the test starts its head on loopback, in a "
        "temporary directory of its own, with the experts resource the workers would bring",
    "ray start --head --port=6379 --num-cpus=4 --node-ip-address=127.0.0.1 --resources='"
    "{\"experts\": 4}'": "the one-machine head: the test starts it as written, with a free port "
        "and a temporary directory of its own",
    "python -m moe_autograd serve --engine ray --address 127.0.0.1:6379 --experts "
    "my_experts:make --name server-b --backward stateful --resources '{\"experts\": 1}'":
        "the test serves with this line, at its head's free port",
    "ray start --address=10.0.0.1:6379 --resources='{\"experts\": 4}'": "a second machine: "
        "the Ray demo's test joins nodes with ray.cluster_utils (the same raylets), not this "
        "command",
}
# Inline commands of the README's text, and the tests that run them (or what
# is checked where running them does not fit in the suite's time).
COMMANDS: Dict[str, List[str]] = {
    "make test": ["(this suite)"],
    "python -m moe_autograd serve --encrypt": [
        "tests/remote/test_wire_crypto.py::test_serve_takes_encrypt",
        "tests/remote/test_wire_crypto.py::test_an_encrypting_job_on_torch_rpc_equals_local"],
    "make bench": ["tests/test_bench.py::test_quick_overhead_row", "test_make_targets"],
    "make fuzz": ["tests/oracle/test_oracle.py::test_runtime_equals_loop", "test_make_targets"],
    "make zoo": ["tests/moe/test_zoo_models.py::test_model_equals_stock", "test_make_targets"],
    # CI runs it (.ci/run); about 15 minutes with its venvs to build, 6 without
    "make compat": ["test_compat_matrix_is_the_supported_range"],
    "make mutate": ["tests/test_mutate_tool.py::test_make_mutate_runs_the_tool_with_the_mutate_extra"],
    "make mutate-report": ["tests/test_mutate_tool.py::"
                           "test_make_mutate_runs_the_tool_with_the_mutate_extra"],
    "make mutate SHARD=...": ["tests/test_mutate_tool.py::"
                              "test_mutation_shards_name_existing_files_and_cover_the_issue_34_modules"],
    "pip install -e '.[examples]'": ["test_extras"],
    "pip install -e '.[ray]'": ["test_extras"],
    # builds a venv of the newest releases and runs the zoo there: its report is tested
    "make latest": ["tests/test_latest_tool.py::test_report_rows", "test_make_targets"],
    "pytest tests/remote --plans N": ["tests/remote/test_fault_plans.py"],
    "python -m moe_autograd bench --quick": ["tests/test_bench.py::test_quick_overhead_row"],
    # 15 s and 76 s in bench --quick: their names are checked, the rows are not run.
    "python -m moe_autograd bench --only elastic": ["test_bench_groups"],
    "python -m moe_autograd bench --only ray-elastic": ["test_bench_groups"],
    "python -m moe_autograd bench --only remote": [  # minutes: its rows' parts are tested
        "test_bench_groups", "tests/test_bench_netns.py::test_rows_skip_with_the_reason"],
    "python -m moe_autograd bench --only replicas": ["test_bench_groups"],
    "python -m moe_autograd demo --elastic": ["tests/test_demos.py::test_elastic_demo_small"],
    # (its default state folder, a save every 5 steps: what the small demo runs)
    "python -m moe_autograd demo --elastic [--state-dir DIR] [--save-every N]":
        ["tests/test_demos.py::test_elastic_demo_small"],
    "python -m moe_autograd demo --elastic --engine ray":
        ["tests/remote/test_ray_demo.py::test_ray_elastic_demo_small"],
    "python -m moe_autograd ...": ["tests/test_demos.py::test_demo_small",  # its log handler
                                   "tests/test_logs.py::test_cli_handler_prints_prefixed_lines_once"],
    "python -m moe_autograd secret --out job.secret": [f"{RECIPES}::test_static_world_recipe"],
    "python -m moe_autograd serve": [f"{RECIPES}::test_static_world_recipe"],
    "ray start": [f"{RECIPES}::test_ray_cluster_recipe"],
    "ray start --head": [f"{RECIPES}::test_ray_cluster_recipe"],
    "ray start --address=...": ["tests/remote/test_ray_demo.py::test_ray_elastic_demo_small"],
}


def _blocks() -> List[Tuple[int, str, str]]:
    """(line, language, text) of every fenced block."""
    found = []
    for match in re.finditer(r"^```([a-z]*)\n(.*?)^```", README, flags=re.S | re.M):
        found.append((README.count("\n", 0, match.start()) + 1, match.group(1), match.group(2)))
    return found


def _block(marker: str) -> str:
    texts = [text for _, _, text in _blocks() if marker in text]
    assert len(texts) == 1, f"{len(texts)} README blocks contain {marker!r}"
    return texts[0]


def _commands() -> Set[str]:
    """The inline commands of the README's text (outside fenced blocks)."""
    text = re.sub(r"^```.*?^```", "", README, flags=re.S | re.M)
    spans = {re.sub(r"\s+", " ", span) for span in re.findall(r"`([^`]+)`", text)}
    return {s for s in spans if re.match(r"(python -m|make |pip install|pytest |ray start)", s)}


def _test_exists(node: str) -> bool:
    if node.startswith("(") or "::" not in node and not node.endswith(".py"):
        return node.startswith("(") or f"def {node}(" in Path(__file__).read_text()
    path, _, name = node.partition("::")
    source = (ROOT / path).read_text()
    return not name or f"def {name}(" in source


def test_every_block_is_accounted_for() -> None:
    markers = list(RUN_HERE) + list(ELSEWHERE)
    for line, _, text in _blocks():
        owners = [m for m in markers if m in text]
        assert len(owners) == 1, f"README block at line {line} is claimed by {owners}: {text[:200]}"
    for marker in markers:
        _block(marker)  # exactly one block each


def test_every_command_is_accounted_for() -> None:
    assert _commands() == set(COMMANDS), (sorted(_commands() - set(COMMANDS)),
                                          sorted(set(COMMANDS) - _commands()))


def test_named_tests_exist() -> None:
    named = [n for nodes in [*ELSEWHERE.values(), *COMMANDS.values()] for n in nodes]
    missing = [n for n in named if not _test_exists(n)]
    assert missing == [], missing


def _in_readme_lines(path: str) -> Set[str]:
    """The lines a recipe test checks against the README (``in_readme(...)``)."""
    lines: Set[str] = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "in_readme":
            lines.update(ast.literal_eval(arg) for arg in node.args)
    return lines


def test_commands_of_recipes_are_the_ones_their_tests_run() -> None:
    for marker, nodes in ELSEWHERE.items():
        text = re.sub(r"\\\n\s*", "", _block(marker))
        checked = set().union(*(_in_readme_lines(n.partition("::")[0]) for n in nodes
                                if n.startswith(RECIPES)))
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#") or not re.match(
                    r"(python |make |ray |export |\(umask|[A-Z_]+=)", line):
                continue
            assert line in NOT_RUN_AS_WRITTEN or any(c in line for c in checked), \
                f"{line!r} (block {marker!r}) is run by none of {nodes}"


def test_make_targets() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: .*\n\t\$\(PY\) -m pytest$", makefile, flags=re.M)
    assert re.search(r"^demo: .*\n\t\$\(PY\) -m moe_autograd demo$", makefile, flags=re.M)
    assert re.search(r"^bench: .*\n\t\$\(PY\) -m moe_autograd bench$", makefile, flags=re.M)
    assert "tests/oracle" in makefile.split("\nfuzz:")[1].split("\n\n")[0]
    assert "tests/moe/test_zoo_*.py" in makefile.split("\nzoo:")[1].split("\n\n")[0]
    assert "tools/latest.sh" in makefile.split("\nlatest:")[1].split("\n\n")[0]
    latest = (ROOT / "tools" / "latest.sh").read_text()
    assert "tests/moe/test_zoo_*.py" in latest and "tests/remote/test_ray_*.py" in latest


def test_compat_matrix_is_the_supported_range() -> None:
    """setup.cfg's torch range is exactly what CI tests: its floor is the
    oldest version of `make compat`, the newest is below its ceiling, and
    .ci/run calls `make compat` after `make test`."""
    makefile = (ROOT / "Makefile").read_text()
    versions = re.search(r"^COMPAT_VERSIONS \?= (.+)$", makefile, flags=re.M)
    assert versions is not None
    tested = sorted(tuple(int(p) for p in v.split(".")) for v in versions.group(1).split())
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    torch_req = [r for r in config["options"]["install_requires"].split() if r.startswith("torch")]
    bounds = re.fullmatch(r"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)", torch_req[0])
    assert bounds is not None, torch_req
    floor, ceiling = tuple(map(int, bounds.groups()[:2])), tuple(map(int, bounds.groups()[2:]))
    assert tested[0][:2] == floor and tested[0][2] == 0
    assert tested[-1][:2] < ceiling and (tested[-1][0], tested[-1][1] + 1) == ceiling
    assert "tools/compat.sh test" in makefile.split("\ncompat:")[1].split("\n\n")[0]
    ci = (ROOT / ".ci" / "run").read_text().split()
    assert ci[-4:] == ["make", "test", "make", "compat"]
    assert f"`{torch_req[0]}`" in README


def test_extras() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = {name: value.split() for name, value in config["options.extras_require"].items()}
    assert any(r.startswith("transformers") for r in extras["examples"])
    assert any(r.startswith("ray") for r in extras["ray"])
    for needed in ("transformers", "ray", "accelerate", "pytest"):
        assert any(r.startswith(needed) for r in extras["test"]), needed


def test_bench_groups() -> None:
    from moe_autograd.bench import GROUPS

    assert {"elastic", "ray-elastic", "replicas"} <= set(GROUPS)


# -- the blocks run here ------------------------------------------------------------------
def test_import_block() -> None:
    exec(compile(_block("from moe_autograd import ("), "README.md", "exec"), {})


@pytest.mark.timeout(120)
def test_example_blocks() -> None:
    scope: Dict[str, object] = {}
    exec(compile(_block("outputs = parallel_apply(experts, inputs)"), "README.md", "exec"),
         scope)
    inputs = scope["inputs"]
    assert all(x.grad is not None for x in inputs)  # type: ignore[attr-defined]
    exec(compile(_block("moe = MixtureOfExperts(experts, in_features=64").replace(
        "print(", "shown = ("), "README.md", "exec"), scope)
    assert {"calls", "failures", "timeouts", "p50_ms", "last_error"} <= set(scope["shown"])  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_experts_implementation_block() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    model.set_experts_implementation("eager")
    eager = copy.deepcopy(model)
    exec(compile(_block("set_experts_implementation(model)  # registers"), "README.md", "exec"),
         {"model": model})
    assert model.config._experts_implementation == "moe_autograd"
    ids = torch.randint(0, 64, (2, 8))
    assert torch.equal(model(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss)


class Broken(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("the disk is on fire")


def test_logged_line_block(caplog: pytest.LogCaptureFixture) -> None:
    from moe_autograd import MixtureOfExperts

    caplog.set_level(logging.WARNING, logger="moe_autograd.moe.stats")
    moe = MixtureOfExperts([nn.Linear(4, 4), Broken()], 4, k=2, k_min=0, allow_zero_outputs=True)
    moe(torch.randn(3, 4))
    shown = _block("MixtureOfExperts: expert 1 (Broken): forward call 1 masked").strip()
    assert [r.getMessage() for r in caplog.records] == [shown]


@pytest.mark.timeout(120)
def test_logging_block() -> None:
    """In a fresh interpreter (the block configures the root logger): INFO
    lines shown, the masked-call lines of ``moe_autograd.moe.stats`` not."""
    block = _block('logging.getLogger("moe_autograd.moe.stats").setLevel')
    code = block + """
import torch
from torch import nn
from moe_autograd import MixtureOfExperts

class Broken(nn.Module):
    def forward(self, x):
        raise RuntimeError("the disk is on fire")

moe = MixtureOfExperts([nn.Linear(4, 4), Broken()], 4, k=2, k_min=0, allow_zero_outputs=True)
moe(torch.randn(3, 4))
logging.getLogger("moe_autograd.remote.fleet").info("an INFO line")
print(moe.stats()[1]["failures"], flush=True)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_AUTOGRAD")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=100)
    out = proc.stdout
    assert proc.returncode == 0, out
    assert "INFO:moe_autograd.remote.fleet:an INFO line" in out, out
    assert "masked" not in out and out.splitlines()[-1] == "1", out


def test_layout_block() -> None:
    text = _block("  executor.py     the worker pool")
    named = re.findall(r"(?:^|\s)([a-z_]+(?:\.py|/))(?=\s|,|$)", text, flags=re.M)
    assert len(named) > 20, named
    package = ROOT / "moe_autograd"
    missing = [n for n in named
               if not any((base / n).exists()
                          for base in (ROOT, package, package / "remote", ROOT / "tools"))]
    assert missing == [], missing


def test_contents_list_every_heading_with_its_anchor() -> None:
    """The table of contents names every heading below it, in order and at
    its level, with GitHub's anchor (lower case, punctuation dropped, spaces
    to dashes)."""
    text = re.sub(r"^```.*?^```", "", README, flags=re.S | re.M)
    contents = text.split("## Contents\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^( *)- \[(.+)\]\(#([\w-]+)\)$", contents, flags=re.M)
    headings = re.findall(r"^(#{2,4}) (.+)$", text.split("## Contents\n", 1)[1], flags=re.M)
    assert [(len(indent) // 2 + 2, title) for indent, title, _ in listed] == \
        [(len(hashes), title) for hashes, title in headings]
    for _, title, anchor in listed:
        assert anchor == re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"), title
