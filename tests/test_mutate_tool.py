"""``make mutate`` (tools/mutate.py): what a mutation run would need holds
without running one (a run takes minutes per shard; see the README's
Testing section): every shard names files that exist, the Makefile and
the ``mutate`` extra wire it, and every equivalent mutant has a reason and
belongs to a mutated file."""
import configparser
import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutate_tool", ROOT / "tools" / "mutate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate_tool"] = module
    spec.loader.exec_module(module)
    return module


def test_mutation_shards_name_existing_files_and_cover_the_issue_34_modules() -> None:
    tool = _tool()
    mutated = [f for files, _ in tool.SHARDS.values() for f in files]
    assert len(mutated) == len(set(mutated))  # each file in one shard
    for files, tests in tool.SHARDS.values():
        assert files and tests
        for path in files + tests:
            assert (ROOT / path).is_file(), path
    wanted = {"rng.py", "module_state.py", "module_call.py", "node.py", "parallel.py",
              "checkpoint.py", "remote/state.py", "remote/sizes.py", "remote/batching.py",
              "remote/batch_server.py", "remote/frame.py", "remote/wire.py", "remote/auth.py",
              "moe/layer.py"}
    assert {f"moe_autograd/{w}" for w in wanted} <= set(mutated)


def test_every_equivalent_mutant_has_a_reason_and_a_mutated_file() -> None:
    tool = _tool()
    modules = {f[:-len(".py")].replace("/", ".") for files, _ in tool.SHARDS.values()
               for f in files}
    entries = tomllib.loads((ROOT / "tests" / "mutation_equivalents.toml").read_text("utf-8"))
    for name, entry in entries["mutant"].items():
        assert re.search(r"__mutmut_\d+$", name), name
        assert name.rsplit(".", 1)[0] in modules, name
        assert len(entry["reason"]) > 20, name
    assert tool._equivalents().keys() == entries["mutant"].keys()


def test_make_mutate_runs_the_tool_with_the_mutate_extra() -> None:
    makefile = (ROOT / "Makefile").read_text()
    target = makefile.split("\nmutate:")[1].split("\n\n")[0]
    assert "nice -n 10 $(PY) tools/mutate.py run $(SHARD)" in target
    assert "'.[test,mutate]'" in makefile
    report = makefile.split("\nmutate-report:")[1].split("\n\n")[0]
    assert "$(PY) tools/mutate.py report" in report
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = config["options.extras_require"]
    assert extras["mutate"].split() == ["mutmut==3.8.1"]
    assert "mutmut" not in extras["test"]
    ignored = (ROOT / ".gitignore").read_text().split()
    assert ".mutate/" in ignored and "mutants/" in ignored
