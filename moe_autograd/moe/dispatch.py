"""Send tokens to their experts, and add the answers back.

Why this module exists: a top-k mixture calls every chosen expert once with
all of its tokens, then adds the weighted answers back in token order, as
transformers' eager loop does: ``final.index_add_(0, tokens, answer.to(dtype))``
once per expert, in increasing expert order, each sum rounded to ``dtype``.
:func:`combine` reproduces those sums bit for bit at the least cost:

* float32 / float64 on the CPU: one ``index_add`` over all the answers
  concatenated. The CPU kernel adds repeated indices one after the other in
  the sum's own dtype, so it computes the loop's sums in the loop's order
  (tested), at O(tokens x k x d) whatever the number of experts;
* any other dtype (bfloat16, float16: the CPU kernel sums repeated indices in
  float32 and rounds once, where the loop rounds after each expert) or device
  (CUDA adds repeated indices with atomics, in no fixed order): one in-place
  ``index_add_`` per expert, in order, as the loop. In place, each call only
  touches its own rows, so this is O(tokens x k x d) too, plus one kernel per
  expert.

The dispatch is one ``index_select`` of its own rows per expert.

:func:`run_experts` puts the two around :func:`moe_autograd.parallel_apply`:
it runs a list of experts on their routed tokens, forward and backward
overlapping, and is what the transformers integration
(:mod:`moe_autograd.moe.hf_experts`) builds on.
:class:`~moe_autograd.moe.MixtureOfExperts` uses the same grouping and combine
between its own, fault-tolerant, start and finish of the calls.

Invariants:

* :func:`group_by_expert` lists each token at most once per expert (top-k
  choices are distinct), ordered token by token, or slot by slot when
  ``slot_major`` (the order of transformers' eager expert loop, so that the
  experts see the same batches and their parameter gradients sum the same rows
  in the same order).
* :func:`combine` starts from zeros and adds each token's answers in the order
  of the outputs given (increasing expert order), rounding to its dtype after
  each one: the sums of one ``index_add_`` per output in that order, bit for
  bit, in every dtype.
* Gradients are those of plain autograd through the same operations.
"""
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..module_call import Expert
from ..parallel import parallel_apply

__all__ = ["group_by_expert", "dispatch", "combine", "call_experts", "Routed", "no_answers",
           "run_experts"]


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
    ``t``, summed in ``dtype`` output after output, as one ``index_add_`` per
    output into zeros (see the module docstring for how).

    ``tokens`` is one index per output or, equally, the concatenated index
    as a one-element list; ``weights`` is 1-D, one entry per row. Each
    product is taken in the promoted dtype of the answer and its weight, then
    cast to ``dtype`` (default: the answers'), as transformers' experts do
    with float32 routing weights. Needs at least one output.

    The products are taken per output (elementwise, O(rows x d) in all), so
    that in backward each output's gradient is a fresh tensor, as in a loop,
    not a view into a shared one (see :func:`dispatch`).
    """
    dtype = dtype or outputs[0].dtype
    sizes = [len(o) for o in outputs]
    if len(tokens) == 1 and len(outputs) > 1:
        tokens = list(tokens[0].split(sizes))
    if len(tokens) != len(outputs):
        raise ValueError(f"combine: {len(outputs)} outputs but {len(tokens)} token indices")
    shape = [1] * (outputs[0].dim() - 1)
    weighted = []
    for out, w in zip(outputs, weights.split(sizes)):
        product = out * w.view(-1, *shape)
        weighted.append(product if product.dtype == dtype else product.to(dtype))
    y = weighted[0].new_zeros((num_tokens, *weighted[0].shape[1:]))
    if _sums_in_order(y):
        rows = weighted[0] if len(weighted) == 1 else torch.cat(weighted)
        index = tokens[0] if len(tokens) == 1 else torch.cat(list(tokens))
        return y.index_add(0, index, rows)
    for index, rows in zip(tokens, weighted):
        y.index_add_(0, index, rows)
    return y


def _sums_in_order(y: Tensor) -> bool:
    """Whether one ``index_add`` into ``y`` adds repeated indices one after
    the other in ``y``'s dtype (the loop's sums): the CPU kernel, in float32
    and float64."""
    return y.device.type == "cpu" and y.dtype in (torch.float32, torch.float64)


class Routed(NamedTuple):
    """The calls :func:`call_experts` made: ``outputs[i]`` is the answer of
    expert ``active[i]`` (increasing) on its ``tokens[i]``, which chose it in
    top-k slots ``slots[i]``."""

    active: List[int]
    tokens: List[Tensor]
    slots: List[Tensor]
    outputs: List[Tensor]


def call_experts(experts: Sequence[Expert], hidden_states: Tensor, top_k_index: Tensor, *,
                 expert_args: Optional[Sequence[Sequence[Any]]] = None,
                 checkpoint: Union[bool, Sequence[bool]] = False) -> Routed:
    """The calls of :func:`run_experts` without the combine: every expert
    with tokens runs once on them (rows in the eager loop's slot-major order)
    through :func:`moe_autograd.parallel_apply`; see :func:`run_experts` for
    the arguments."""
    num_experts = len(experts)
    if expert_args is not None and len(expert_args) != num_experts:
        raise ValueError(f"run_experts: {num_experts} experts but {len(expert_args)} expert_args")
    flags = [bool(checkpoint)] * num_experts if isinstance(checkpoint, bool) else list(checkpoint)
    if len(flags) != num_experts:
        raise ValueError(f"run_experts: {num_experts} experts but {len(flags)} checkpoint flags")
    tokens, slots = group_by_expert(top_k_index, num_experts, slot_major=True)
    active = [e for e in range(num_experts) if len(tokens[e])]
    if not active:
        return Routed([], [], [], [])
    xs = dispatch(hidden_states, [tokens[e] for e in active])
    inputs = [(x, *(expert_args[e] if expert_args is not None else ())) for x, e in zip(xs, active)]
    outputs = parallel_apply([experts[e] for e in active], inputs,
                             checkpoint=[flags[e] for e in active])
    for e, out in zip(active, outputs):
        if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != len(tokens[e]):
            got = list(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"run_experts: expert {e} must return one tensor with "
                             f"{len(tokens[e])} rows, got {got}")
    return Routed(active, [tokens[e] for e in active], [slots[e] for e in active], outputs)


def no_answers(like: Tensor, top_k_weights: Tensor) -> Tensor:
    """The result when no expert was called: zeros like ``like``, kept in the
    graph of ``top_k_weights`` if they need a gradient (so that backward still
    runs, and gives them zeros)."""
    y = like.new_zeros(like.shape)
    return y + top_k_weights.sum().to(y.dtype) * 0 if top_k_weights.requires_grad else y


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
    expert modules return) and the experts' row shape; its sums are those of
    transformers' eager loop, bit for bit, in every dtype (:func:`combine`).

    ``expert_args[e]`` are extra positional arguments of expert ``e``'s call
    after its tokens: pass per-expert tensors (e.g. its slice of stacked
    weights) here, never captured in a closure, so that their gradients flow
    back through the parallel node. ``checkpoint`` (a bool, or one per
    expert) recomputes a call's forward in backward.
    """
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"run_experts: top_k_weights {list(top_k_weights.shape)} and "
                         f"top_k_index {list(top_k_index.shape)} differ")
    routed = call_experts(experts, hidden_states, top_k_index, expert_args=expert_args,
                          checkpoint=checkpoint)
    if not routed.active:
        return no_answers(hidden_states, top_k_weights)
    weights = top_k_weights[torch.cat(routed.tokens), torch.cat(routed.slots)]
    return combine(routed.outputs, routed.tokens, weights, hidden_states.shape[0],
                   dtype=hidden_states.dtype)
