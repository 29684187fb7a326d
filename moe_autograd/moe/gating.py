"""Top-k gating: which experts see a token, and with which weights.

For each token ``t`` the gate's top-k logits choose the experts, and the
softmax over those k logits weights their outputs::

    y[t] = sum_{j in topk(t)} softmax(topk logits of t)_j * expert_j(x[t])

When some chosen experts do not answer, the softmax is taken over the logits
of the ones that did (masked logits are -inf). A token with no answering expert
gets weight 0 everywhere, never NaN.
"""
from typing import List, NamedTuple

import torch
from torch import Tensor

__all__ = ["Routing", "route", "combine_weights", "load_balancing_loss"]


class Routing(NamedTuple):
    """Where the tokens go. ``tokens[e]`` / ``slots[e]`` list, for expert ``e``,
    the tokens routed to it and the top-k slot they chose it in."""

    top_logits: Tensor  # [T, k]
    top_experts: Tensor  # [T, k]
    tokens: List[Tensor]
    slots: List[Tensor]


def route(logits: Tensor, k: int) -> Routing:
    num_experts = logits.shape[-1]
    top_logits, top_experts = logits.topk(k, dim=-1)
    flat_experts = top_experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=num_experts).tolist()
    tokens: List[Tensor] = []
    slots: List[Tensor] = []
    start = 0
    for count in counts:
        chosen = order[start:start + count]
        tokens.append(torch.div(chosen, k, rounding_mode="floor"))
        slots.append(chosen % k)
        start += count
    return Routing(top_logits, top_experts, tokens, slots)


def combine_weights(top_logits: Tensor, answered: Tensor) -> Tensor:
    """Softmax over the answered slots of each token; 0 where none answered."""
    masked = top_logits.masked_fill(~answered, float("-inf"))
    any_answer = answered.any(dim=-1, keepdim=True)
    # A row of -inf would softmax to NaN: give it finite logits, then zero it.
    safe = torch.where(any_answer, masked, torch.zeros_like(masked))
    return torch.softmax(safe, dim=-1) * any_answer


def load_balancing_loss(logits: Tensor, top_experts: Tensor) -> Tensor:
    """Switch-Transformer load balancing: ``E * sum_e f_e * P_e``, where ``f_e``
    is the fraction of routing choices that picked expert ``e`` (constant) and
    ``P_e`` the mean gate probability of ``e`` (trains the gate). It is 1 when
    the load is uniform and grows as it concentrates."""
    num_experts = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1).mean(dim=0)
    counts = torch.bincount(top_experts.reshape(-1), minlength=num_experts)
    fraction = counts.to(probs.dtype) / max(top_experts.numel(), 1)
    return num_experts * (fraction * probs).sum()
