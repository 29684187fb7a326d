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


@pytest.mark.timeout(60)
def test_a_failing_group_fails_the_run_after_the_whole_table(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 43: ``bench --quick`` printed a group's error and exited 0."""
    def broken(quick: bool) -> list:
        raise RuntimeError("no world")
    monkeypatch.setitem(bench.GROUPS, "overhead", broken)
    assert bench.main(["--quick", "--only", "overhead"]) == 1
    captured = capsys.readouterr()
    assert "FAILED: RuntimeError: no world" in captured.out
    assert "[bench] 1 group(s) failed: overhead" in captured.err


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


def test_trainers_rows_are_throughputs() -> None:
    """The ``trainers`` group's rows: steps/s of k trainers over one's
    (higher is better, judged against ">= 2.5"); its expert is row-wise."""
    from moe_autograd.bench import trainers

    samples = {"1": [40.0, 50.0, 40.0], "4": [120.0, 100.0, 100.0]}
    row = trainers._throughput_row("remote/clients-4-throughput", samples, "1", "4", ">= 2.5",
                                   "n")
    assert (row.unit, row.baseline, row.ours, row.ratio) == ("steps/s", 40.0, 100.0, 2.5)
    assert (row.goal, row.met) == (">= 2.50", True)
    expert = trainers.OneDeviceExpert(seconds=0.0)
    x = torch.randn(5, trainers.WIDTH)
    torch.testing.assert_close(expert(x)[2:], expert(x[2:]))  # (rounding: not bit-equal)


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


_LOCAL_RAY_CHECK = r"""
import json, os, stat, sys
import ray
from moe_autograd.bench.ray_remote import local_ray, own_job_secret
from moe_autograd.remote import JobSecret, job_secret
from moe_autograd.remote.ray_engine import token_auth_enabled

env_before = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR")}
seen = {}
with own_job_secret() as secret, local_ray(num_cpus=1, secret=secret) as here:
    mode = lambda path: stat.S_IMODE(os.stat(path).st_mode)
    seen["dir_mode"] = mode(here.dir)
    seen["token_mode"] = mode(os.environ["RAY_AUTH_TOKEN_PATH"])
    seen["token_inside"] = os.environ["RAY_AUTH_TOKEN_PATH"].startswith(here.dir + os.sep)
    seen["secret_mode"] = mode(here.secret_file)
    seen["secret_is_the_job's"] = JobSecret.from_file(here.secret_file) == job_secret() == secret
    seen["token_auth"] = token_auth_enabled()
    seen["temp_inside"] = ray.get_runtime_context().worker.node.get_temp_dir_path().startswith(
        here.dir + os.sep)
    seen["addresses"] = sorted({n["NodeManagerAddress"] for n in ray.nodes()})
    seen["worker_auth"] = ray.get(ray.remote(num_cpus=0)(
        lambda: os.environ.get("RAY_AUTH_MODE")).remote(), timeout=120)
    kept = here.dir
seen["dir_removed"] = not os.path.exists(kept)
seen["disconnected"] = not ray.is_initialized()
seen["env_restored"] = env_before == {k: os.environ.get(k) for k in env_before}
print(json.dumps(seen))
"""


@pytest.mark.timeout(240)
def test_local_ray_is_private_and_authenticated(tmp_path) -> None:
    """The benches' and demos' Ray (bench.ray_remote.local_ray): token
    authentication on in the driver and its workers, the token, Ray's files
    and the job secret in a private directory removed at exit (nothing in
    the user's ~/.ray), nodes on loopback, the environment restored."""
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, HOME=str(tmp_path))  # a ~/.ray written would show here
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR", "RAY_ADDRESS"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", _LOCAL_RAY_CHECK], cwd=root, env=env,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"dir_mode": 0o700, "token_mode": 0o600, "token_inside": True,
                    "secret_mode": 0o600, "secret_is_the_job's": True, "token_auth": True,
                    "temp_inside": True, "addresses": ["127.0.0.1"], "worker_auth": "token",
                    "dir_removed": True, "disconnected": True, "env_restored": True}, seen
    assert not os.path.exists(tmp_path / ".ray"), os.listdir(tmp_path / ".ray")


@pytest.mark.timeout(300)
def test_quick_durable_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44's four rows run (no timing or goal asserted: the recovery row
    measures whatever replicas of a training expert do) and leave no state
    directory; the two crash rows say what they measured."""
    import glob
    import tempfile

    before = set(glob.glob(f"{tempfile.gettempdir()}/moe-bench-durable-*"))
    assert bench.main(["--quick", "--only", "durable"]) == 0
    out = capsys.readouterr().out
    for name in ("durable/save-overhead", "durable/peer-transfer", "durable/mirror-cost",
                 "durable/recovery-steps-lost", "durable/loss-after-crash"):
        assert any(line.startswith(name) for line in out.splitlines()), out
    assert "MB/s" in out
    recovery = next(line for line in out.splitlines()
                    if line.startswith("durable/recovery-steps-lost"))
    assert "r1 from peer r0" in recovery and "steps without a crash" in recovery, recovery
    loss = next(line for line in out.splitlines() if line.startswith("durable/loss-after-crash"))
    assert "resumed from the snapshots" in loss and "from fresh weights" in loss, loss
    assert set(glob.glob(f"{tempfile.gettempdir()}/moe-bench-durable-*")) == before
