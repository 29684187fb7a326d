"""transformers' sparse-MoE models (5.x) run through moe_autograd: the names
of the first integration, Mixtral's, kept for their users.

Why this module exists: it is where users found the integration; the work
is done elsewhere, one concept per module:

* :mod:`.hf_experts` runs a model's experts modules through the parallel
  runtime, bit for bit as their eager loops (:func:`stacked_experts_forward`
  is :func:`~moe_autograd.moe.hf_experts.experts_forward`;
  :func:`register_experts_implementation`,
  :func:`set_experts_implementation`);
* :mod:`.hf_blocks` reads a whole sparse-MoE block, for
  :func:`from_mixtral` (:meth:`MixtureOfExperts.from_mixtral
  <moe_autograd.moe.MixtureOfExperts.from_mixtral>`), which builds the
  fault-tolerant layer that computes what the block computes.

Invariants: imports go one way, this module -> layer -> hf_blocks ->
hf_experts -> dispatch; none imports this module, nor ``transformers`` at
import time.
"""
from typing import Any

from torch import nn

from .hf_blocks import MixtralExpert
from .hf_experts import (
    EXPERTS_IMPLEMENTATION, experts_forward, register_experts_implementation,
    set_experts_implementation,
)
from .layer import MixtureOfExperts

__all__ = ["MixtralExpert", "from_mixtral", "stacked_experts_forward",
           "register_experts_implementation", "set_experts_implementation",
           "EXPERTS_IMPLEMENTATION"]

stacked_experts_forward = experts_forward


def from_mixtral(block: nn.Module, **options: Any) -> MixtureOfExperts:
    """:meth:`MixtureOfExperts.from_mixtral
    <moe_autograd.moe.MixtureOfExperts.from_mixtral>`: the fault-tolerant
    layer computing what ``block`` computes, or NotImplementedError."""
    return MixtureOfExperts.from_mixtral(block, **options)
