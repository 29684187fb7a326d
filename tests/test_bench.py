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


@pytest.mark.timeout(60)
def test_gpu_group_cpu_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """The ``gpu`` group's code at tiny sizes on the CPU (CI has no GPU): every
    variant runs and gets a ratio to the loop, or says why it was skipped."""
    assert bench.main(["--device", "cpu", "--only", "gpu", "--quick", "--markdown"]) == 0
    out = capsys.readouterr().out
    for setup in ("tiny-e4", "tiny-e16"):
        for variant in ("hf-grouped_mm", "grouped_mm", "moe", "run_experts"):
            ratio = _ratio_of(out, f"gpu/{setup}/{variant}")
            assert math.isfinite(ratio) and ratio > 0
        assert f"| gpu/{setup}/ours-grouped |" in out  # a ratio, or why not
    assert "FAILED" not in out and "bf16" in out and "k=2" in out


def test_gpu_group_skips_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert bench.main(["--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "skipped: CUDA is not available" in out
    assert re.search(r"^gpu:\s+none: CUDA is not available", out, re.M)  # the machine line


def test_grouped_swiglu_matches_the_loop() -> None:
    """Variant (c) of the gpu group computes the loop block's outputs and
    gradients (float32 on the CPU, where the grouped kernel runs too)."""
    from moe_autograd.bench.gpu import _route, grouped_swiglu
    from moe_autograd.bench.moe_scale import LoopBlock, SwiGLU

    torch.manual_seed(0)
    d, hidden, k = 16, 8, 2
    modules = [SwiGLU(d, hidden) for _ in range(5)]
    gate = nn.Linear(d, 5, bias=False)
    w_gate_up = torch.stack([torch.cat([e.w1.weight, e.w3.weight]).t() for e in modules])
    w_down = torch.stack([e.w2.weight.t() for e in modules])
    w_gate_up, w_down = (w.detach().contiguous().requires_grad_() for w in (w_gate_up, w_down))
    x = torch.randn(12, d, requires_grad=True)
    dy = torch.randn(12, d)
    y = LoopBlock(gate, nn.ModuleList(modules), k)(x)
    dx, dw1, dw2 = torch.autograd.grad(y, (x, modules[0].w1.weight, modules[0].w2.weight), dy)
    mine = grouped_swiglu(x, *_route(gate, x, k), w_gate_up, w_down)
    my_dx, my_dgu, my_dd = torch.autograd.grad(mine, (x, w_gate_up, w_down), dy)
    torch.testing.assert_close(mine, y)
    torch.testing.assert_close(my_dx, dx)
    torch.testing.assert_close(my_dgu[0, :, :hidden], dw1.t())
    torch.testing.assert_close(my_dd[0], dw2.t())
