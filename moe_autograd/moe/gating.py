"""Top-k gating: which experts see a token, and with which weights.

For each token ``t`` the gate's top-k logits choose the experts, and the
softmax over those k logits weights their outputs::

    y[t] = sum_{j in topk(t)} softmax(topk logits of t)_j * expert_j(x[t])

When some chosen experts do not answer, the softmax is taken over the logits
of the ones that did (masked logits are -inf). A token with no answering expert
gets weight 0 everywhere, never NaN.

Two load-balancing (aux) losses, both differentiable through the gate's
softmax only (the routing counts are constants):

* :func:`load_balancing_loss`, the Switch-Transformer form ``E * sum_e f_e *
  P_e`` with ``f_e`` the fraction of routing *choices* that picked ``e``: 1
  when the load is uniform, whatever ``k``;
* :func:`mixtral_load_balancing_loss`, transformers'
  ``load_balancing_loss_func`` (Mixtral, Qwen-MoE, ...): ``f_e`` is the number
  of choices per *token*, so the loss is ``k`` times the Switch form, and
  several layers' logits are pooled (counts and probabilities summed over
  layers, then multiplied), not averaged.

Both accept a token mask (transformers' ``attention_mask``: 1 for tokens that
count, 0 for padding), which leaves the routing alone and only drops masked
tokens from the loss.
"""
from typing import List, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from .dispatch import group_by_expert

__all__ = ["Routing", "route", "combine_weights", "load_balancing_loss",
           "mixtral_load_balancing_loss"]


class Routing(NamedTuple):
    """Where the tokens go. ``tokens[e]`` / ``slots[e]`` list, for expert ``e``,
    the tokens routed to it and the top-k slot they chose it in."""

    top_logits: Tensor  # [T, k]
    top_experts: Tensor  # [T, k]
    tokens: List[Tensor]
    slots: List[Tensor]


def route(logits: Tensor, k: int) -> Routing:
    top_logits, top_experts = logits.topk(k, dim=-1)
    tokens, slots = group_by_expert(top_experts, logits.shape[-1])
    return Routing(top_logits, top_experts, tokens, slots)


def combine_weights(top_logits: Tensor, answered: Tensor) -> Tensor:
    """Softmax over the answered slots of each token; 0 where none answered."""
    masked = top_logits.masked_fill(~answered, float("-inf"))
    any_answer = answered.any(dim=-1, keepdim=True)
    # A row of -inf would softmax to NaN: give it finite logits, then zero it.
    safe = torch.where(any_answer, masked, torch.zeros_like(masked))
    return torch.softmax(safe, dim=-1) * any_answer


def load_balancing_loss(logits: Tensor, top_experts: Tensor,
                        token_mask: Optional[Tensor] = None) -> Tensor:
    """Switch-Transformer load balancing: ``E * sum_e f_e * P_e``, where ``f_e``
    is the fraction of routing choices that picked expert ``e`` (constant) and
    ``P_e`` the mean gate probability of ``e`` (trains the gate). It is 1 when
    the load is uniform and grows as it concentrates.

    ``logits`` is ``[T, E]``, ``top_experts`` ``[T, k]``; ``token_mask``
    (``[T]``, nonzero for tokens that count) restricts both means to the
    tokens it keeps."""
    num_experts = logits.shape[-1]
    probs_per_token = torch.softmax(logits, dim=-1)
    if token_mask is None:
        probs = probs_per_token.mean(dim=0)
        counts = torch.bincount(top_experts.reshape(-1), minlength=num_experts)
        fraction = counts.to(probs.dtype) / max(top_experts.numel(), 1)
        return num_experts * (fraction * probs).sum()
    mask = token_mask.reshape(-1).to(probs_per_token.dtype)
    kept = mask.sum().clamp(min=1)
    probs = (probs_per_token * mask.unsqueeze(-1)).sum(dim=0) / kept
    k = top_experts.shape[-1]
    counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device).scatter_add_(
        0, top_experts.reshape(-1), mask.repeat_interleave(k))
    return num_experts * (counts / (kept * k) * probs).sum()


def mixtral_load_balancing_loss(router_logits: Union[Tensor, Sequence[Tensor]],
                                num_experts: Optional[int] = None, top_k: int = 2,
                                attention_mask: Optional[Tensor] = None) -> Tensor:
    """transformers' ``load_balancing_loss_func`` (Mixtral's aux loss), with
    the same arguments and result.

    ``router_logits`` is one layer's ``[T, E]`` logits or a sequence of them
    (one per layer, as ``output_router_logits=True`` returns them): choice
    counts and softmax probabilities are summed over layers and tokens, then
    ``E * sum_e (counts_e / rows) * (probs_e / rows)``. ``attention_mask``
    (``[batch, seq]`` with ``batch * seq == T``, or ``[T]``) drops padding
    tokens. The top-k choices are recomputed from the logits, as transformers
    does; sums are float32 (float64 for float64 logits).
    """
    layers = [router_logits] if isinstance(router_logits, Tensor) else list(router_logits)
    if not layers:
        raise ValueError("mixtral_load_balancing_loss needs at least one layer's logits")
    num_experts = num_experts if num_experts is not None else layers[0].shape[-1]
    device = layers[0].device
    # float32 sums as transformers (float64 logits keep float64)
    dtype = torch.promote_types(torch.float32, layers[0].dtype)
    counts_sum = torch.zeros(num_experts, dtype=dtype, device=device)
    probs_sum = torch.zeros(num_experts, dtype=dtype, device=device)
    rows: Union[float, Tensor] = 0.0
    flat_mask = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=dtype)
    for logits in layers:
        probs = torch.softmax(logits.to(device), dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        if flat_mask is None:
            counts_sum = counts_sum + torch.bincount(
                chosen.reshape(-1), minlength=num_experts).to(dtype)
            probs_sum = probs_sum + probs.to(dtype).sum(dim=0)
            rows = rows + probs.shape[0]
        else:
            counts_sum = counts_sum + torch.zeros(
                num_experts, dtype=dtype, device=device).scatter_add_(
                    0, chosen.reshape(-1), flat_mask.repeat_interleave(top_k))
            probs_sum = probs_sum + (probs.to(dtype) * flat_mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + flat_mask.sum()
    return (counts_sum / rows * (probs_sum / rows).unsqueeze(0)).sum() * num_experts
