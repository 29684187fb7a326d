"""Smoke tests of the benchmark command: it runs and prints its rows. No
timing is asserted (the numbers depend on the machine)."""
import math
import re

import pytest
import torch
from torch import nn

from moe_autograd import bench
from moe_autograd.__main__ import main as cli_main
from moe_autograd.bench.checkpoint import kept_bytes


def _ratio_of(table: str, name: str) -> float:
    """The ratio cell of row ``name`` in a Markdown table."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == name:
            return float(cells[bench.HEADERS.index("ratio")])
    raise AssertionError(f"no row {name!r} in:\n{table}")


@pytest.mark.timeout(120)
def test_quick_overhead_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--only", "overhead"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("overhead "))
    cells = re.split(r"\s{2,}", row)  # columns are 2+ spaces apart; cells hold single spaces
    ratio = float(cells[bench.HEADERS.index("ratio")])
    assert math.isfinite(ratio) and ratio > 0
    assert "torch" in out and "MOE_AUTOGRAD_WORKERS" in out


@pytest.mark.timeout(120)
def test_cli_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--quick", "--only", "overhead", "--markdown"]) == 0
    ratio = _ratio_of(capsys.readouterr().out, "overhead")
    assert math.isfinite(ratio) and ratio > 0


def test_kept_bytes_counts_inputs_and_saved_tensors() -> None:
    """The memory method: a checkpointed call saves nothing (it keeps only its
    inputs); a plain one saves its activations, its inputs among them."""
    torch.manual_seed(0)
    experts = [nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(3)]
    xs = [torch.randn(4, 8, requires_grad=True) for _ in experts]
    inputs = sum(x.untyped_storage().nbytes() for x in xs)
    assert kept_bytes(experts, xs, checkpoint=True) == (0, inputs)
    saved, unsaved_inputs = kept_bytes(experts, xs, checkpoint=False)
    assert unsaved_inputs == 0 and saved > inputs  # the hooks reached the workers


def test_external_rows_show_both_times() -> None:
    """Rows from ``run(quick)`` dicts (remote, moe) carry both times and are
    judged against their goal when they bring no verdict."""
    row = bench._from_dict({"name": "remote/x", "baseline_ms": 10.0, "ours_ms": 5.0,
                            "ratio": None, "goal": "<= 0.67", "note": "n"})
    assert (row.baseline, row.ours, row.ratio) == (10.0, 5.0, 0.5)
    assert (row.goal, row.met) == ("<= 0.67", True)
    text = bench.format_text([("mode", "quick")], [row], [])
    line = next(line for line in text.splitlines() if line.startswith("remote/x"))
    assert "10.00 ms" in line and "5.00 ms" in line


def test_remote_rows_format() -> None:
    from moe_autograd.bench import remote

    rows = [{"name": "remote/vs-torch", "baseline_ms": 30.0, "ours_ms": 40.0, "ratio": 1.33,
             "goal": "<= 0.67", "note": "n"}]
    assert "30.000" in remote.format_rows(rows) and "40.000" in remote.format_rows(rows)
