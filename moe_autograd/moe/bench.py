"""The MoE-layer benchmark row: a training step with one straggling expert.

Goal (from the issue): with one expert that stalls far past
``forward_timeout``, the step takes at most ``forward_timeout`` plus the
backward work, plus 10%. The backward work is measured in the same run, as the
backward time of the same layer with no straggler.
"""
import statistics
import time
from typing import Dict, List

import torch
from torch import Tensor, nn

from .layer import MixtureOfExperts

__all__ = ["run"]


class _Expert(nn.Module):
    def __init__(self, width: int, stall: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
        self.stall = stall

    def forward(self, x: Tensor) -> Tensor:
        if self.stall:
            time.sleep(self.stall)
        return self.net(x)


def run(quick: bool = False) -> List[Dict[str, object]]:
    width, experts, tokens, timeout = 128, 8, 512, 0.1
    repeats = 3 if quick else 8
    torch.manual_seed(0)
    fast = MixtureOfExperts([_Expert(width) for _ in range(experts)], width, k=2,
                            forward_timeout=timeout)
    slow = MixtureOfExperts([_Expert(width) for _ in range(experts)], width, k=2,
                            forward_timeout=timeout)
    slow.load_state_dict(fast.state_dict())
    straggler = slow.experts[0]
    assert isinstance(straggler, _Expert)
    straggler.stall = 1.0
    # Route every token to the straggler too, so each step meets it.
    with torch.no_grad():
        for layer in (slow, fast):
            gate = layer.gate
            assert isinstance(gate, nn.Linear) and gate.bias is not None
            gate.bias[0] = 10.0
    x = torch.randn(tokens, width)
    backward_s: List[float] = []
    step_s: List[float] = []
    for _ in range(repeats + 1):
        y, _ = fast(x)
        start = time.perf_counter()
        y.sum().backward()
        backward_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        y, _ = slow(x)
        y.sum().backward()
        step_s.append(time.perf_counter() - start)
    backward_ms = statistics.median(backward_s[1:]) * 1000
    step_ms = statistics.median(step_s[1:]) * 1000
    limit_ms = timeout * 1000 + backward_ms
    return [{
        "name": "moe straggler step",
        "baseline_ms": limit_ms,
        "ours_ms": step_ms,
        "ratio": step_ms / limit_ms,
        "goal": "<= 1.10",
        "note": f"step with an expert stalling 1 s, forward_timeout={timeout}s; baseline = "
                f"forward_timeout + backward work ({backward_ms:.1f} ms, same layer without "
                f"straggler)",
    }]
