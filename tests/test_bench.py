"""Smoke tests of the benchmark command: it runs and prints its rows. No
timing is asserted (the numbers depend on the machine)."""
import math
import re

import pytest

from moe_autograd import bench
from moe_autograd.__main__ import main as cli_main


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
