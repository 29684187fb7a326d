"""``moe-scale``: the MoE layer at scale on the CPU against a plain-loop block.

The baseline is built like ``transformers``' ``MixtralSparseMoeBlock``: one
router, a top-k of the softmax renormalised over the chosen experts, then a
Python loop over the experts, each run on its tokens and added back with
``index_add_``. Ours is :class:`~moe_autograd.moe.MixtureOfExperts` over the
*same* gate and experts (so the same routing and the same work). Forward +
backward of one step, 4,096 tokens, d = 512, SwiGLU experts with hidden
1,024, k = 2; 8, 64 and 256 experts show how the cost grows with the expert
count (the runtime's per-call cost, and the combine, which must not grow as
experts x tokens x d). Goal: ours <= 1.0 x the loop at 64 experts.

``moe-scale/64-peak-rss``: the high-water mark of the process's resident
memory over two such steps, each arm in a fresh process of its own (the
same model, seed and input), the interpreter's and torch's own footprint
included in both. Goal: ours <= the loop's + 5%.
"""
import multiprocessing
import resource
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..moe import MixtureOfExperts
from .measure import Plan, Row, compare, measure, row

__all__ = ["bench_moe_scale", "SwiGLU", "LoopBlock"]


class SwiGLU(nn.Module):
    """Mixtral's expert: w2(silu(w1 x) * w3 x)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopBlock(nn.Module):
    """The plain-loop block (Mixtral's routing and expert loop)."""

    def __init__(self, gate: nn.Module, experts: nn.ModuleList, k: int) -> None:
        super().__init__()
        self.gate, self.experts, self.k = gate, experts, k

    def forward(self, x: Tensor) -> Tensor:
        logits = self.gate(x)
        weights = F.softmax(logits, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(weights, self.k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(top_i, num_classes=len(self.experts)).permute(2, 1, 0)
        for e in torch.nonzero(mask.sum(dim=(-1, -2))).flatten().tolist():
            slot, idx = torch.where(mask[e])
            out.index_add_(0, idx, self.experts[e](x[idx]) * top_w[idx, slot, None])
        return out


def _build(count: int, tokens: int) -> Any:
    d, hidden, k = 512, 1024, 2
    torch.manual_seed(0)
    experts = [SwiGLU(d, hidden) for _ in range(count)]
    moe = MixtureOfExperts(experts, d, k=k)
    return moe, LoopBlock(moe.gate, moe.experts, k), torch.randn(tokens, d)


def _peak_rss_mib(arm: str, count: int, tokens: int) -> float:
    """In a fresh process: two fwd+bwd steps of one arm; the peak RSS."""
    moe, loop, x = _build(count, tokens)
    for _ in range(2):
        if arm == "ours":
            y, aux = moe(x)
            (y.square().mean() + aux).backward()
        else:
            loop(x).square().mean().backward()
    return _high_water_mib()


def _high_water_mib() -> float:
    """This process's peak resident memory: ``VmHWM``, which ``execve``
    resets (``ru_maxrss`` keeps the parent's peak across it, so a spawned
    child of a big parent would report the parent's)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _peak_rss_row(count: int, tokens: int) -> Row:
    context = multiprocessing.get_context("spawn")
    peaks: Dict[str, float] = {}
    with context.Pool(1, maxtasksperchild=1) as pool:
        for arm in ("loop", "ours"):
            peaks[arm] = pool.apply(_peak_rss_mib, (arm, count, tokens))
    return row(f"moe-scale/{count}-peak-rss", peaks["loop"], peaks["ours"],
               peaks["ours"] / peaks["loop"], 1.05,
               f"peak resident memory of a fresh process over two fwd+bwd steps, each arm in "
               f"its own process (interpreter and torch included); {count} experts, {tokens} "
               "tokens", unit="MiB")


def bench_moe_scale(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=1, reps=4), Plan(warmup=1, reps=2))
    tokens, d, hidden, k = (1024 if quick else 4096), 512, 1024, 2
    rows = []
    for count in (8, 64, 256):
        torch.manual_seed(0)
        experts = [SwiGLU(d, hidden) for _ in range(count)]
        moe = MixtureOfExperts(experts, d, k=k)
        loop = LoopBlock(moe.gate, moe.experts, k)
        x = torch.randn(tokens, d)

        def ours(moe: Any = moe) -> None:
            y, aux = moe(x)
            (y.square().mean() + aux).backward()

        def baseline(loop: Any = loop) -> None:
            y = loop(x)
            y.square().mean().backward()

        s: Dict[str, List[float]] = measure({"ours": ours, "loop": baseline}, plan.reps,
                                            plan.warmup)
        rows.append(compare(f"moe-scale/{count}", s, "loop", "ours", 1.0,  # issue 19: each
                            f"{count} SwiGLU experts {d}-{hidden}, {tokens} tokens, k={k}, "
                            "fwd+bwd; baseline = Mixtral-style loop block, same gate and experts"))
    rows.append(_peak_rss_row(64, tokens))
    return rows
