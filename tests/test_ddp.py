"""DistributedDataParallel over models whose experts run through the runtime
(issue 8): gloo, 2 processes on loopback.

One world of two fresh processes (this file run as a script) runs every
variant in turn, one result file per variant and rank. For each variant, every
process builds the same model twice, once with its experts called through
``parallel_apply`` / ``MixtureOfExperts`` and once with a plain expert loop,
wraps both in DDP, runs two training steps on its own data, and saves every
parameter's ``.grad`` after each step. The test compares them (float64):
runtime against plain loop in each process, and the two processes against
each other. Variants cover ``find_unused_parameters=True`` and experts that
get no tokens in one process but do in the other.
"""
import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # helpers, when run as a script

from helpers import MLP, plain_moe  # noqa: E402

DT = torch.float64
D = 4
STEPS = 2

# variant: (model kind, find_unused_parameters, experts with tokens on rank 0, on rank 1)
VARIANTS: Dict[str, Tuple[str, bool, Tuple[int, ...], Tuple[int, ...]]] = {
    "parallel_apply": ("experts", False, (0, 1, 2), (0, 1, 2)),
    "parallel_apply_find_unused": ("experts", True, (0, 1, 2), (0, 1, 2)),
    "parallel_apply_no_tokens_on_one_rank": ("experts", True, (0, 1), (1, 2)),
    "moe": ("moe", False, (0, 1, 2), (0, 1, 2)),
    "moe_no_tokens_on_one_rank": ("moe", True, (0, 1), (1, 2)),
}


# -- the models (used in the child processes) ----------------------------------------------

class Experts(nn.Module):
    """A projection, then each active expert on its share of the tokens."""

    def __init__(self, use_runtime: bool) -> None:
        super().__init__()
        self.use_runtime = use_runtime
        self.inp = nn.Linear(D, D, dtype=DT)
        self.experts = nn.ModuleList([MLP(d_in=D, hidden=8, d_out=D, seed=e) for e in range(3)])

    def forward(self, x: Tensor, active: Sequence[int]) -> Tensor:
        from moe_autograd import parallel_apply

        h = torch.tanh(self.inp(x))
        shares = [h[j::len(active)] for j in range(len(active))]
        modules = [self.experts[e] for e in active]
        if self.use_runtime:
            outs = parallel_apply(modules, shares)
        else:
            outs = [m(s) for m, s in zip(modules, shares)]
        return torch.cat(outs).square().sum()


class PlainMoE(nn.Module):
    """The same parameters (same names) as MixtureOfExperts, as a plain loop."""

    def __init__(self, experts: Sequence[nn.Module], gate: nn.Linear, k: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.gate = gate
        self.k = k

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return plain_moe(self.gate, list(self.experts), self.k, x)


class MoEModel(nn.Module):
    def __init__(self, use_runtime: bool) -> None:
        super().__init__()
        from moe_autograd.moe import MixtureOfExperts

        experts = [MLP(d_in=D, hidden=8, d_out=D, seed=e) for e in range(3)]
        torch.manual_seed(0)
        gate = nn.Linear(D, 3, dtype=DT)
        with torch.no_grad():  # expert e's logit is 10 * x[:, e]
            gate.weight.zero_()
            gate.bias.zero_()
            for e in range(3):
                gate.weight[e, e] = 10.0
        if use_runtime:
            moe = MixtureOfExperts(experts, D, k=2).double()
            moe.gate = gate
            self.moe: nn.Module = moe
        else:
            self.moe = PlainMoE(experts, gate, k=2)

    def forward(self, x: Tensor, active: Sequence[int]) -> Tensor:
        y, aux = self.moe(x)
        return y.square().sum() + aux


def make_inputs(kind: str, rank: int, active: Sequence[int], step: int) -> Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(12, D, dtype=DT, generator=g)
    if kind == "moe":
        for e in range(3):
            if e not in active:  # expert e never makes a token's top 2
                x[:, e] = -5.0
    return x


def child(variants: str, rank: int, world: int, out_dir: str) -> None:
    """Every variant of ``variants`` (comma-separated) in one process group,
    each variant's results in ``out_dir/<variant>-<rank>.pt``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for variant in variants.split(","):
            _variant(variant, rank, str(Path(out_dir) / f"{variant}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _variant(variant: str, rank: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    kind, find_unused, active0, active1 = VARIANTS[variant]
    active = active0 if rank == 0 else active1
    results: Dict[str, List[Dict[str, Optional[Tensor]]]] = {}
    errors: Dict[str, str] = {}
    try:
        for impl in ("plain", "runtime"):
            use_runtime = impl == "runtime"
            torch.manual_seed(0)
            module = Experts(use_runtime) if kind == "experts" else MoEModel(use_runtime)
            model = DDP(module, find_unused_parameters=find_unused)
            steps: List[Dict[str, Optional[Tensor]]] = []
            try:
                for step in range(STEPS):
                    x = make_inputs(kind, rank, active, step)
                    model(x, active).backward()
                    steps.append({name: None if p.grad is None else p.grad.detach().clone()
                                  for name, p in module.named_parameters()})
            except Exception as error:  # noqa: BLE001 - reported to the test
                import traceback
                errors[impl] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
                break  # the collectives of the two processes are out of step now
            results[impl] = steps
    finally:
        torch.save({"results": results, "errors": errors}, out)


# -- the test (the pytest process) ----------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(variants: Sequence[str], tmp_path: Path, world: int = 2, timeout: float = 200.0
              ) -> Dict[str, List[dict]]:
    """Runs every variant in one world; ``{variant: [rank 0's, rank 1's results]}``."""
    port = _free_port()
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1", MOE_AUTOGRAD_MODE="parallel",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, __file__, ",".join(variants), str(rank),
                               str(world), str(tmp_path)], env=env, cwd=str(HERE.parent),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    logs: List[str] = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            logs.append(stdout)
    finally:
        for p in procs:  # leave no process behind
            if p.poll() is None:
                p.kill()
            p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log}"
    return {v: [torch.load(tmp_path / f"{v}-{rank}.pt") for rank in range(world)]
            for v in variants}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, List[dict]]:
    """Every variant's results, from one world (two process starts, not ten)."""
    return run_world(list(VARIANTS), tmp_path_factory.mktemp("ddp"))


def _close(a: Optional[Tensor], b: Optional[Tensor], what: str) -> None:
    assert (a is None) == (b is None), f"{what}: {a} vs {b}"
    if a is not None and b is not None:
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ddp_gradients_match_plain_expert_loop(variant: str,
                                               worlds: Dict[str, List[dict]]) -> None:
    ranks = worlds[variant]
    for rank, saved in enumerate(ranks):
        errors = saved["errors"]
        assert "plain" not in errors, f"rank {rank}: the reference failed:\n{errors['plain']}"
        assert not errors, f"rank {rank}: DDP over the runtime raised:\n{errors['runtime']}"
        plain, runtime = saved["results"]["plain"], saved["results"]["runtime"]
        assert len(plain) == len(runtime) == STEPS
        for step, (want, got) in enumerate(zip(plain, runtime)):
            assert set(got) == set(want)
            for name in want:
                _close(got[name], want[name], f"rank {rank} step {step} {name}.grad")
    # DDP averaged: both processes hold the same gradients
    for step in range(STEPS):
        a, b = ranks[0]["results"]["runtime"][step], ranks[1]["results"]["runtime"][step]
        for name in a:
            _close(a[name], b[name], f"step {step} {name}.grad, rank 0 vs rank 1")


if __name__ == "__main__":
    child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
