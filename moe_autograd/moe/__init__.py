"""The mixture-of-experts layer, built on the parallel runtime.

:class:`MixtureOfExperts` is the fault-tolerant top-k layer;
:func:`run_experts` runs a list of experts on their routed tokens (one
dispatch, parallel calls, one combine) for models that route themselves;
:mod:`.hf_experts` runs transformers' experts modules through it, bit for
bit, and :mod:`.hf_blocks` rebuilds transformers' sparse-MoE blocks as the
layer (:mod:`.mixtral` keeps the first names of both).
:func:`grouped_experts` runs stacked same-shape SwiGLU experts in two grouped
GEMMs (``torch._grouped_mm``): opt-in, for GPUs, equal to the loop within
tolerance only (:mod:`.grouped`; the layer's ``grouped_mm=True``).
"""
from .dispatch import run_experts
from .gating import load_balancing_loss, mixtral_load_balancing_loss
from .grouped import grouped_experts
from .layer import MixtureOfExperts, NotEnoughExperts
from .mixtral import (
    MixtralExpert, from_mixtral, register_experts_implementation, set_experts_implementation,
)
from .stats import ExpertStats

__all__ = ["MixtureOfExperts", "NotEnoughExperts", "ExpertStats", "run_experts",
           "load_balancing_loss", "mixtral_load_balancing_loss", "MixtralExpert",
           "from_mixtral", "register_experts_implementation", "set_experts_implementation",
           "grouped_experts"]
