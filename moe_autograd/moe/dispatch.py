"""Send tokens to their experts, and add the answers back in one pass.

Why this module exists: a top-k mixture calls every chosen expert once with
all of its tokens, then adds the weighted answers back in token order. Written
with one ``index_add`` per expert, the combine copies the whole
``[tokens, d]`` output once per expert, so it grows as experts x tokens x d.
Here the combine is one ``index_add`` over all the answers concatenated, so it
costs O(tokens x k x d) whatever the number of experts, as the dispatch does
(one ``index_select`` of its own rows per expert).

:func:`run_experts` puts the two around :func:`moe_autograd.parallel_apply`:
it runs a list of experts on their routed tokens, forward and backward
overlapping, and is what the transformers integration
(:mod:`moe_autograd.moe.mixtral`) plugs into a model's sparse-MoE blocks.
:class:`~moe_autograd.moe.MixtureOfExperts` uses the same grouping and combine
between its own, fault-tolerant, start and finish of the calls.

Invariants:

* :func:`group_by_expert` lists each token at most once per expert (top-k
  choices are distinct), ordered token by token, or slot by slot when
  ``slot_major`` (the order of transformers' eager expert loop, so that the
  experts see the same batches and their parameter gradients sum the same rows
  in the same order).
* :func:`combine` starts from zeros and adds each token's answers in the order
  of the calls given (increasing expert order): on CPU it computes the same
  sums, bit for bit, as one ``index_add`` per expert in that order.
* Gradients are those of plain autograd through the same operations.
"""
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..module_call import Expert
from ..parallel import parallel_apply

__all__ = ["group_by_expert", "dispatch", "combine", "run_experts"]


def group_by_expert(top_k_index: Tensor, num_experts: int, *,
                    slot_major: bool = False) -> Tuple[List[Tensor], List[Tensor]]:
    """``tokens[e], slots[e]`` for every expert ``e < num_experts``: the tokens
    that chose ``e`` (rows of ``top_k_index``, ``[tokens, k]``) and the slot
    (column) they chose it in.

    An index equal to ``num_experts`` is an empty slot and is skipped (the
    sentinel transformers' expert-parallel routing uses); any other index
    outside ``[0, num_experts]`` raises ``ValueError``. The returned tensors
    are views of two index tensors.
    """
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be [tokens, k], got {list(top_k_index.shape)}")
    num_tokens, k = top_k_index.shape
    flat = (top_k_index.t() if slot_major else top_k_index).reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts + 1).tolist() if flat.numel() else []
    if len(counts) > num_experts + 1:
        raise ValueError(f"top_k_index holds expert {len(counts) - 1}, but there are only "
                         f"{num_experts} experts")
    counts = (counts + [0] * (num_experts + 1))[:num_experts + 1]
    order = torch.argsort(flat, stable=True)
    if slot_major:
        tokens, slots = order % max(num_tokens, 1), torch.div(order, max(num_tokens, 1),
                                                               rounding_mode="floor")
    else:
        tokens, slots = torch.div(order, k, rounding_mode="floor"), order % k
    # The last group holds the empty slots (index == num_experts): dropped.
    return list(tokens.split(counts)[:num_experts]), list(slots.split(counts)[:num_experts])


def dispatch(hidden_states: Tensor, tokens: Sequence[Tensor]) -> List[Tensor]:
    """``[hidden_states[t] for t in tokens]``, each a tensor of its own.

    Not one gather split into views: a view that starts mid-allocation is
    not aligned as a fresh tensor is, and CPU matmuls round differently on
    such inputs (measured here), so the experts would no longer compute
    bit for bit what a loop's ``hidden_states[tokens]`` gives them."""
    return [hidden_states.index_select(0, t) for t in tokens]


def combine(outputs: Sequence[Tensor], tokens: Sequence[Tensor], weights: Tensor,
            num_tokens: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``y[t] = sum of weights[r] * rows[r]`` over the rows ``r`` of
    ``rows = torch.cat(outputs)`` whose token ``torch.cat(tokens)[r]`` is
    ``t``, as one ``index_add`` into zeros.

    ``tokens`` may be one index per output or, equally, the concatenated index
    as a one-element list; ``weights`` is 1-D, one entry per row. Each
    product is taken in the promoted dtype of the answer and its weight, then
    cast to ``dtype`` (default: the answers'), as transformers' experts do
    with float32 routing weights. Needs at least one output.

    The products are taken per output (elementwise, O(rows x d) in all) and
    then concatenated, so that in backward each output's gradient is a fresh
    tensor, as in a loop, not a view into a shared one (see :func:`dispatch`).
    """
    dtype = dtype or outputs[0].dtype
    shape = [1] * (outputs[0].dim() - 1)
    weighted = []
    for out, w in zip(outputs, weights.split([len(o) for o in outputs])):
        product = out * w.view(-1, *shape)
        weighted.append(product if product.dtype == dtype else product.to(dtype))
    rows = weighted[0] if len(weighted) == 1 else torch.cat(weighted)
    index = tokens[0] if len(tokens) == 1 else torch.cat(list(tokens))
    return rows.new_zeros((num_tokens, *rows.shape[1:])).index_add(0, index, rows)


def run_experts(experts: Sequence[Expert], hidden_states: Tensor, top_k_index: Tensor,
                top_k_weights: Tensor, *,
                expert_args: Optional[Sequence[Sequence[Any]]] = None,
                checkpoint: Union[bool, Sequence[bool]] = False) -> Tensor:
    """Runs every expert once on the tokens routed to it and returns
    ``y[t] = sum_j top_k_weights[t, j] * experts[top_k_index[t, j]](hidden_states[t])``.

    ``hidden_states`` is ``[tokens, d]``, ``top_k_index`` / ``top_k_weights``
    ``[tokens, k]`` (an index equal to ``len(experts)`` is an empty slot).
    The calls go through :func:`moe_autograd.parallel_apply`: forwards and
    backwards overlap, gradients equal a plain loop's. Experts without tokens
    are not called. ``y`` has ``hidden_states``' dtype (as transformers'
    expert modules return) and the experts' row shape.

    ``expert_args[e]`` are extra positional arguments of expert ``e``'s call
    after its tokens: pass per-expert tensors (e.g. its slice of stacked
    weights) here, never captured in a closure, so that their gradients flow
    back through the parallel node. ``checkpoint`` (a bool, or one per
    expert) recomputes a call's forward in backward.
    """
    num_experts = len(experts)
    if expert_args is not None and len(expert_args) != num_experts:
        raise ValueError(f"run_experts: {num_experts} experts but {len(expert_args)} expert_args")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"run_experts: top_k_weights {list(top_k_weights.shape)} and "
                         f"top_k_index {list(top_k_index.shape)} differ")
    num_tokens = hidden_states.shape[0]
    tokens, slots = group_by_expert(top_k_index, num_experts, slot_major=True)
    active = [e for e in range(num_experts) if len(tokens[e])]
    if not active:
        y = hidden_states.new_zeros(hidden_states.shape)
        # Keep the weights in the graph, so that backward still runs (zeros).
        return y + top_k_weights.sum().to(y.dtype) * 0 if top_k_weights.requires_grad else y
    flags = [bool(checkpoint)] * num_experts if isinstance(checkpoint, bool) else list(checkpoint)
    if len(flags) != num_experts:
        raise ValueError(f"run_experts: {num_experts} experts but {len(flags)} checkpoint flags")
    xs = dispatch(hidden_states, [tokens[e] for e in active])
    inputs = [(x, *(expert_args[e] if expert_args is not None else ())) for x, e in zip(xs, active)]
    outputs = parallel_apply([experts[e] for e in active], inputs,
                             checkpoint=[flags[e] for e in active])
    for e, out in zip(active, outputs):
        if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != len(tokens[e]):
            got = list(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"run_experts: expert {e} must return one tensor with "
                             f"{len(tokens[e])} rows, got {got}")
    index = torch.cat([tokens[e] for e in active])
    weights = top_k_weights[index, torch.cat([slots[e] for e in active])]
    return combine(outputs, [index], weights, num_tokens, dtype=hidden_states.dtype)
