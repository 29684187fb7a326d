"""Mixtral-style models from ``transformers`` (5.x), run through moe_autograd.

Why this module exists: the sparse-MoE blocks of transformers 5.x
(``MixtralSparseMoeBlock`` and the models built like it) keep their experts
stacked in one module (``experts.gate_up_proj`` ``[E, 2I, H]``,
``experts.down_proj`` ``[E, H, I]``) and run them in a Python loop whose
forward and backward go one expert after another. Two ways to run them through
the parallel runtime instead:

* :func:`register_experts_implementation` adds ``"moe_autograd"`` to
  transformers' experts implementations, so ``model.set_experts_implementation
  ("moe_autograd")`` makes every such block call its experts through
  :func:`moe_autograd.moe.run_experts` (forward and backward overlap). The
  model is otherwise untouched: its router, router logits
  (``output_router_logits``), aux loss, checkpoints and
  ``gradient_checkpointing_enable()`` stay the stock ones, and loss, logits
  and gradients equal the stock eager loop's.
* :func:`from_mixtral` builds a :class:`~moe_autograd.moe.MixtureOfExperts`
  (with its deadlines, quorum and failure masking) that computes what a block
  computes, from copies of the block's router and experts; it loads the
  block's state dict as it is, and records its router logits in a
  transformers model (its gate is a copy of the block's router).

Invariants: nothing here imports ``transformers`` at import time (it is an
optional extra); the experts' weights reach each call as inputs (slices of
the stacked parameters taken on the caller's thread), so their gradients flow
through the parallel node into the stacked parameters, exactly as the loop's.
"""
import copy
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dispatch import run_experts
from .layer import MixtureOfExperts

__all__ = ["MixtralExpert", "from_mixtral", "stacked_experts_forward",
           "register_experts_implementation", "EXPERTS_IMPLEMENTATION"]

EXPERTS_IMPLEMENTATION = "moe_autograd"


def _gated_mlp(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
               act_fn: Callable[[Tensor], Tensor]) -> Tensor:
    """One transformers-style gated expert: the same ops as the eager loop."""
    gate, up = F.linear(x, gate_up_proj).chunk(2, dim=-1)
    return F.linear(act_fn(gate) * up, down_proj)


class MixtralExpert(nn.Module):
    """One expert of a Mixtral block as a module of its own:
    ``down_proj(act_fn(gate) * up)`` with ``gate, up = gate_up_proj(x)``.

    Its parameters are named as the block's stacked ones
    (``gate_up_proj`` ``[2I, H]``, ``down_proj`` ``[H, I]``), so that the
    block's ``experts.gate_up_proj`` ``[E, 2I, H]`` loads into
    ``experts.<e>.gate_up_proj`` of a :class:`MixtureOfExperts`.
    """

    def __init__(self, gate_up_proj: Tensor, down_proj: Tensor,
                 act_fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj.detach().clone())
        self.down_proj = nn.Parameter(down_proj.detach().clone())
        self.act_fn = act_fn

    def forward(self, x: Tensor) -> Tensor:
        return _gated_mlp(x, self.gate_up_proj, self.down_proj, self.act_fn)


def _stacked(experts: nn.Module, name: str) -> Tensor:
    value = getattr(experts, name, None)
    if not isinstance(value, Tensor):
        raise NotImplementedError(f"{type(experts).__name__} has no stacked {name}")
    return value


def _check_layout(experts: nn.Module) -> None:
    """Only the plain Mixtral layout is supported: say so for the others."""
    for flag, plain in (("has_gate", True), ("has_bias", False), ("is_transposed", False),
                        ("is_concatenated", True), ("has_post_expert_norm", False),
                        ("_is_expert_parallel", False)):
        if getattr(experts, flag, plain) != plain:
            raise NotImplementedError(
                f"moe_autograd runs experts stored as Mixtral's (gate_up_proj [E, 2I, H], "
                f"down_proj [E, H, I], no bias); this one has {flag}={not plain}")
    for name in ("gate_up_proj", "down_proj"):
        _stacked(experts, name)


def stacked_experts_forward(experts: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                            top_k_weights: Tensor) -> Tensor:
    """What a transformers 5.x experts module (``MixtralExperts`` and those
    built like it) computes, with its experts called through
    :func:`~moe_autograd.moe.run_experts`; the signature of transformers'
    experts implementations (``experts`` is the module, ``self`` there)."""
    _check_layout(experts)
    gate_up = list(_stacked(experts, "gate_up_proj").unbind(0))
    down = list(_stacked(experts, "down_proj").unbind(0))
    act_fn: Callable[[Tensor], Tensor] = getattr(experts, "act_fn")
    apply_gate = getattr(experts, "_apply_gate", None)

    def expert(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
        if apply_gate is None:
            return _gated_mlp(x, gate_up_proj, down_proj, act_fn)
        return F.linear(apply_gate(F.linear(x, gate_up_proj)), down_proj)

    return run_experts([expert] * len(gate_up), hidden_states, top_k_index, top_k_weights,
                       expert_args=list(zip(gate_up, down)))


def register_experts_implementation(name: str = EXPERTS_IMPLEMENTATION) -> str:
    """Registers :func:`stacked_experts_forward` as transformers' experts
    implementation ``name`` and returns ``name``; then
    ``model.set_experts_implementation(name)`` (or
    ``from_pretrained(..., experts_implementation=name)``) switches a model's
    sparse-MoE blocks to it. Needs ``transformers`` 5.x."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError("register_experts_implementation needs transformers>=5 "
                          "(pip install -e '.[examples]')") from error
    ExpertsInterface.register(name, stacked_experts_forward)
    return name


def from_mixtral(block: nn.Module, **options: Any) -> MixtureOfExperts:
    """A :class:`MixtureOfExperts` that computes what ``block`` (a
    transformers 5.x ``MixtralSparseMoeBlock``) computes, with copies of its
    router (as ``gate``, so ``gate.weight`` and the router-logit recording of
    transformers models carry over) and of its experts (one
    :class:`MixtralExpert` each).

    Defaults, each overridable through ``options`` (any
    :class:`MixtureOfExperts` keyword): ``k`` = the block's top-k,
    ``router_dtype=torch.float32`` (Mixtral routes in float32),
    ``aux_loss="mixtral"`` and ``return_aux_loss=False``, so that the layer
    returns ``y`` like the block and can replace it in the model
    (``layer.mlp = MixtureOfExperts.from_mixtral(layer.mlp)``). Outputs equal
    the block's up to float rounding: the block normalises its top-k
    probabilities, the layer softmaxes its top-k logits. Router jitter
    (``router_jitter_noise``) is not supported.
    """
    router, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if not isinstance(router, nn.Module) or not isinstance(experts, nn.Module):
        raise TypeError(f"from_mixtral expects a Mixtral-style block with .gate and .experts, "
                        f"got {type(block).__name__}")
    _check_layout(experts)
    if getattr(block, "jitter_noise", 0.0):
        raise NotImplementedError("from_mixtral: router_jitter_noise > 0 is not supported "
                                  "(it rescales the block's input); set it to 0")
    gate_up, down = _stacked(experts, "gate_up_proj"), _stacked(experts, "down_proj")
    act_fn: Callable[[Tensor], Tensor] = getattr(experts, "act_fn")
    num_experts, _, hidden = gate_up.shape
    top_k: Optional[int] = getattr(block, "top_k", getattr(router, "top_k", None))
    defaults: Dict[str, Any] = dict(k=top_k if top_k is not None else 2,
                                    router_dtype=torch.float32, aux_loss="mixtral",
                                    return_aux_loss=False, gate=copy.deepcopy(router))
    defaults.update(options)
    modules = [MixtralExpert(gate_up[e], down[e], act_fn) for e in range(num_experts)]
    return MixtureOfExperts(modules, hidden, **defaults)
