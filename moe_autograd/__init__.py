"""moe_autograd: a parallel mixture-of-experts backward runtime for PyTorch.

A batch of expert calls becomes one autograd node whose forward and backward
both fan out over a worker pool, with gradients equal to sequential autograd.
"""
from .autograd import (
    EmulatedAutogradContext,
    map_with_parallel_backward,
    run_isolated_backward,
    run_isolated_forward,
)
from .checkpoint import is_checkpointing, is_recomputing
from .parallel import parallel_apply, recompute_early

__all__ = [
    "EmulatedAutogradContext",
    "run_isolated_forward",
    "run_isolated_backward",
    "map_with_parallel_backward",
    "parallel_apply",
    "recompute_early",
    "is_checkpointing",
    "is_recomputing",
]

__version__ = "0.1.0"
