"""Grouped-GEMM SwiGLU experts: every expert's tokens in two ``torch._grouped_mm`` calls.

Why this module exists: on a GPU, many small same-shape experts are bound by
the cost of launching (and, for the runtime, of scheduling) one pair of
matrix products per expert, not by the arithmetic. When the experts are
SwiGLU MLPs whose weights can be stacked (``[E, d, 2*hidden]`` and
``[E, hidden, d]``: transformers' ``gate_up_proj`` / ``down_proj``
transposed), one grouped GEMM per projection
runs them all at once: :func:`grouped_experts` sorts the routed (token, slot)
pairs by expert, runs ``torch._grouped_mm`` on the sorted rows with int32
row-end offsets, the activation, the second ``torch._grouped_mm``, then weights
the rows and adds them back per token. Forward and backward are plain autograd
through those operations (``torch._grouped_mm`` has a derivative).
:class:`~moe_autograd.moe.MixtureOfExperts` reaches it with
``grouped_mm=True`` (:func:`stack_experts` builds the stacked weights from its
expert modules, each forward).

This path is **not** bit-equal to the sequential loop that the rest of the
package reproduces: a grouped GEMM sums its products in another order than
one ``F.linear`` per expert, and the per-token sums below are taken in
float32 and rounded once (the loop rounds after each expert). Outputs and
gradients equal the loop's within floating-point tolerance. It is opt-in, and
meant for GPUs (CUDA, compute capability 9.x or 10.x, bfloat16) with many
small same-shape experts; on the CPU it runs too (float32, bfloat16, float16), which
is what the tests check against the loop.

Invariants:

* never a silent fallback: where ``torch._grouped_mm`` would not run as a
  grouped kernel (a torch without it, a dtype, a device, a layout or an
  alignment it refuses, too many groups) :func:`grouped_experts` raises
  ``ValueError`` (the arguments) or ``NotImplementedError`` (the platform)
  naming what was wrong, before any GEMM;
* the grouped rows are exactly the routed pairs: empty slots (index ``E``) are
  dropped before the GEMMs, so the last offset equals the number of rows and
  no uninitialised output row of ``torch._grouped_mm`` (it leaves rows past the
  last offset unwritten) is ever read;
* an expert with no tokens is an empty group: its weights get an exact zero
  gradient (``torch._grouped_mm``'s backward), it costs nothing else. (Reported
  against torch on B200, pytorch/pytorch#172439: non-zero gradients for empty
  groups; :class:`~moe_autograd.moe.MixtureOfExperts` never passes empty
  groups, it stacks only the experts that got tokens);
* the per-token sum is one ``index_add_`` of float32 rows into float32
  zeros, cast once to ``hidden_states``' dtype: more accurate than the loop's
  bfloat16 sums, and on CUDA in no fixed order (atomics), so two runs may
  differ in the last bits;
* no expert with tokens at all (or no tokens): zeros, kept in the graph of
  ``top_k_weights`` as :func:`~moe_autograd.moe.run_experts` does; the stacked
  weights then get no gradient (``None``), as uncalled experts in the loop.
"""
import sys
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dispatch import no_answers
from .hf_blocks import MixtralExpert

__all__ = ["grouped_experts", "grouped_mm_available", "stack_experts", "check_experts",
           "StackedExperts", "MAX_CUDA_GROUPS"]

# torch._grouped_mm's CUDA bfloat16 kernel takes fewer than 1024 groups
# (torch/_native/ops/foreach_mm/impl.py, torch 2.13).
MAX_CUDA_GROUPS = 1023
# The compute capabilities (majors) on which torch runs its CUTLASS grouped
# kernel (sm90 Hopper, sm100 datacenter Blackwell); on the others torch runs a
# loop of matrix products instead, a silent fallback that is refused here.
_CUDA_MAJORS = (9, 10)
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.bfloat16,)
_SWIGLU_MODULE = "moe_autograd.bench.moe_scale"


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (torch 2.8 and later)."""
    return callable(getattr(torch, "_grouped_mm", None))


def _check_platform(device: torch.device, dtype: torch.dtype, num_experts: int) -> None:
    """NotImplementedError / ValueError where ``torch._grouped_mm`` would not
    run as a grouped kernel on ``device`` in ``dtype``."""
    if not grouped_mm_available():
        raise NotImplementedError(f"grouped_experts: torch {torch.__version__} has no "
                                  f"torch._grouped_mm (torch 2.8 or later needed)")
    if device.type == "cpu":
        if dtype not in _CPU_DTYPES:
            raise ValueError(f"grouped_experts: dtype {dtype} is not supported on the CPU "
                             f"(torch._grouped_mm takes {', '.join(map(str, _CPU_DTYPES))})")
        return
    if device.type != "cuda":
        raise NotImplementedError(f"grouped_experts: device {device} is not supported "
                                  f"(torch._grouped_mm runs on cpu and cuda)")
    if torch.version.hip is not None:
        raise NotImplementedError(f"grouped_experts: ROCm (HIP {torch.version.hip}) is not "
                                  f"supported: its grouped kernel was not validated here")
    if dtype not in _CUDA_DTYPES:
        raise ValueError(f"grouped_experts: dtype {dtype} is not supported on CUDA "
                         f"(torch._grouped_mm's grouped kernel takes torch.bfloat16; "
                         f"other dtypes would run a loop of matrix products)")
    major, minor = torch.cuda.get_device_capability(device)
    if major not in _CUDA_MAJORS:
        raise NotImplementedError(
            f"grouped_experts: {device} has compute capability {major}.{minor}; "
            f"torch._grouped_mm's grouped kernel runs on compute capability 9.x and 10.x "
            f"(elsewhere torch would run a loop of matrix products)")
    if num_experts > MAX_CUDA_GROUPS:
        raise NotImplementedError(f"grouped_experts: {num_experts} experts; torch._grouped_mm's "
                                  f"CUDA kernel takes at most {MAX_CUDA_GROUPS} groups")


def _check_weight(name: str, weight: Tensor, shape: Tuple[int, int, int]) -> None:
    """ValueError unless ``weight`` is ``shape``, row- or column-major in its
    last two dimensions with 16-byte-aligned strides and start."""
    if tuple(weight.shape) != shape:
        raise ValueError(f"grouped_experts: {name} must be {list(shape)}, "
                         f"got {list(weight.shape)}")
    align = 16 // weight.element_size()
    _, rows, cols = weight.shape
    s0, s1, s2 = weight.stride()
    row_major = s2 == 1 and s1 >= max(cols, 1) and s1 % align == 0
    col_major = s1 == 1 and s2 >= max(rows, 1) and s2 % align == 0
    if not (row_major or col_major) or s0 % align or weight.data_ptr() % 16:
        raise ValueError(
            f"grouped_experts: {name} (shape {list(weight.shape)}, strides {[s0, s1, s2]}) must "
            f"be row- or column-major in its last two dimensions, with strides that are "
            f"multiples of 16 bytes ({align} elements of {weight.dtype}) and a 16-byte-aligned "
            f"start; make it .contiguous()")


def _check(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
           w_gate_up: Tensor, w_down: Tensor) -> None:
    """Every refusal of :func:`grouped_experts`, before any work."""
    if hidden_states.dim() != 2:
        raise ValueError(f"grouped_experts: hidden_states must be [tokens, d], "
                         f"got {list(hidden_states.shape)}")
    if top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape \
            or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"grouped_experts: top_k_index {list(top_k_index.shape)} and "
                         f"top_k_weights {list(top_k_weights.shape)} must both be [tokens, k] "
                         f"with tokens = {hidden_states.shape[0]}")
    if top_k_index.is_floating_point() or top_k_index.is_complex() \
            or top_k_index.dtype == torch.bool:
        raise ValueError(f"grouped_experts: top_k_index must be an integer tensor, "
                         f"got {top_k_index.dtype}")
    if not top_k_weights.is_floating_point():
        raise ValueError(f"grouped_experts: top_k_weights must be floating point, "
                         f"got {top_k_weights.dtype}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"grouped_experts: w_gate_up and w_down must be 3-D ([E, d, 2*hidden], "
                         f"[E, hidden, d]), got {list(w_gate_up.shape)} and "
                         f"{list(w_down.shape)}")
    devices = {t.device for t in (hidden_states, top_k_index, top_k_weights, w_gate_up, w_down)}
    if len(devices) != 1:
        raise ValueError(f"grouped_experts: hidden_states, top_k_index, top_k_weights, "
                         f"w_gate_up and w_down must be on one device, got "
                         f"{sorted(map(str, devices))}")
    dtypes = {hidden_states.dtype, w_gate_up.dtype, w_down.dtype}
    if len(dtypes) != 1:
        raise ValueError(f"grouped_experts: hidden_states ({hidden_states.dtype}), w_gate_up "
                         f"({w_gate_up.dtype}) and w_down ({w_down.dtype}) must share one dtype")
    num_experts, d, two_hidden = w_gate_up.shape
    if two_hidden % 2:
        raise ValueError(f"grouped_experts: w_gate_up's last dimension ({two_hidden}) must be "
                         f"2*hidden (gate, then up)")
    if d != hidden_states.shape[1]:
        raise ValueError(f"grouped_experts: w_gate_up is [E, {d}, ...] but hidden_states has "
                         f"d = {hidden_states.shape[1]}")
    _check_platform(hidden_states.device, hidden_states.dtype, num_experts)
    if num_experts == 0:
        raise ValueError("grouped_experts: needs at least one expert (w_gate_up is [0, ...])")
    align = 16 // hidden_states.element_size()
    hidden = two_hidden // 2
    if d % align or hidden % align:
        raise ValueError(f"grouped_experts: d = {d} and hidden = {hidden} must be multiples of "
                         f"{align} in {hidden_states.dtype} (torch._grouped_mm needs "
                         f"16-byte-aligned rows)")
    _check_weight("w_gate_up", w_gate_up, (num_experts, d, two_hidden))
    _check_weight("w_down", w_down, (num_experts, hidden, d))


def grouped_experts(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                    w_gate_up: Tensor, w_down: Tensor, *,
                    act: Callable[[Tensor], Tensor] = F.silu) -> Tensor:
    """``y[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t])``
    for SwiGLU experts stored stacked, in two grouped GEMMs.

    ``expert_e(x) = (act(x @ G_e) * (x @ U_e)) @ w_down[e]`` with
    ``w_gate_up[e] = [G_e | U_e]`` (``[E, d, 2*hidden]``, gate then up along
    the last dimension) and ``w_down`` ``[E, hidden, d]``; ``hidden_states``
    ``[tokens, d]``, ``top_k_index`` / ``top_k_weights`` ``[tokens, k]`` (an
    index equal to ``E`` is an empty slot, as in
    :func:`~moe_autograd.moe.run_experts`; any other index outside ``[0, E]``
    raises). ``hidden_states`` and both weights share one dtype; ``y`` has it
    too. Weights may be row- or column-major in their last two dimensions
    (``stacked.transpose(1, 2)`` of transformers' ``[E, 2*hidden, d]`` is
    fine). ``act`` is applied elementwise to the gate half.

    Differentiable in ``hidden_states``, both weights and ``top_k_weights``
    (an empty slot's weight gets a zero gradient; an expert without tokens
    zero weight gradients). NOT bit-equal to a loop over the experts (the
    grouped GEMMs sum in their own order; the per-token sums are float32,
    rounded once): equal within floating-point tolerance; see the module
    docstring. Needs ``torch._grouped_mm``; on CUDA, bfloat16 and compute
    capability 9.x or 10.x (H100/H200, B200); ``d`` and ``hidden`` multiples of 16 bytes'
    worth of elements (8 in bfloat16, 4 in float32). Anything else raises
    ``ValueError`` (the arguments) or ``NotImplementedError`` (the platform),
    never runs something else. One host synchronisation per call (the number
    of routed rows).
    """
    _check(hidden_states, top_k_index, top_k_weights, w_gate_up, w_down)
    num_tokens, k = top_k_index.shape
    num_experts = w_gate_up.shape[0]
    flat = top_k_index.reshape(-1)
    # counts[e] for the experts, counts[E] the empty slots, counts[E + 1] the
    # indices out of range; one host synchronisation reads the last two.
    invalid = (flat < 0) | (flat > num_experts)
    counts = torch.bincount(torch.where(invalid, num_experts + 1, flat),
                            minlength=num_experts + 2)
    empty, out_of_range = counts[num_experts:].tolist()
    if out_of_range:
        bad = flat[invalid][0].item()
        raise ValueError(f"grouped_experts: top_k_index holds expert {bad}, but there are "
                         f"only {num_experts} experts (index {num_experts} is an empty slot)")
    rows = flat.numel() - empty
    if rows == 0:
        return no_answers(hidden_states, top_k_weights)
    # Pairs p = t * k + j in expert order (token order within an expert);
    # the empty slots sort last and are cut off.
    order = torch.argsort(flat, stable=True)[:rows]
    tokens = torch.div(order, k, rounding_mode="floor")
    offsets = counts[:num_experts].cumsum(0).to(torch.int32)
    x = hidden_states.index_select(0, tokens)
    gate, up = torch._grouped_mm(x, w_gate_up, offs=offsets).chunk(2, dim=-1)
    out = torch._grouped_mm(act(gate) * up, w_down, offs=offsets)
    weights = top_k_weights.reshape(-1).index_select(0, order)
    weighted = out.float() * weights.float().unsqueeze(-1)
    y = weighted.new_zeros((num_tokens, out.shape[-1])).index_add_(0, tokens, weighted)
    return y.to(hidden_states.dtype)


class StackedExperts(NamedTuple):
    """The experts of a layer as :func:`grouped_experts` takes them:
    ``w_gate_up`` ``[n, d, 2*hidden]``, ``w_down`` ``[n, hidden, d]`` (the
    experts' parameters stacked, differentiably) and their activation."""

    w_gate_up: Tensor
    w_down: Tensor
    act: Callable[[Tensor], Tensor]


def _swiglu_class() -> Optional[type]:
    """The bench's ``SwiGLU`` if its module is loaded (an instance of it
    cannot exist otherwise; importing the bench from here would invert the
    package's layering)."""
    module = sys.modules.get(_SWIGLU_MODULE)
    found = getattr(module, "SwiGLU", None)
    return found if isinstance(found, type) else None


def _refuse_expert(index: int, expert: nn.Module, reason: str) -> ValueError:
    return ValueError(f"MixtureOfExperts(grouped_mm=True): expert {index} "
                      f"({type(expert).__name__}) {reason}")


class _Weights(NamedTuple):
    """One expert's weights in ``F.linear`` layout: ``gate_up`` are the row
    blocks whose concatenation is ``[2*hidden, d]`` (gate rows first),
    ``down`` is ``[d, hidden]``."""

    gate_up: Tuple[Tensor, ...]
    down: Tensor
    act: Callable[[Tensor], Tensor]

    def shapes(self) -> Tuple[List[int], List[int]]:
        first = self.gate_up[0]
        rows = sum(part.shape[0] for part in self.gate_up)
        return [rows, *first.shape[1:]], list(self.down.shape)


def _expert_weights(index: int, expert: nn.Module) -> _Weights:
    """One expert's :class:`_Weights`, or ValueError naming why it cannot be
    grouped."""
    cls = type(expert)
    if cls.__module__.startswith("moe_autograd.remote"):
        raise _refuse_expert(index, expert, "is a remote expert: its weights live on another "
                                            "process and cannot be stacked")
    if expert._forward_hooks or expert._forward_pre_hooks:
        raise _refuse_expert(index, expert, "has forward hooks, which the grouped path would "
                                            "not run")
    if cls is MixtralExpert and isinstance(expert, MixtralExpert):
        return _Weights((expert.gate_up_proj,), expert.down_proj, expert.act_fn)
    swiglu = _swiglu_class()
    if swiglu is not None and cls is swiglu:
        linears = [getattr(expert, name, None) for name in ("w1", "w3", "w2")]
        if not all(type(lin) is nn.Linear and lin.bias is None for lin in linears):
            raise _refuse_expert(index, expert, "needs w1, w3 and w2 to be nn.Linear without "
                                                "bias")
        w1, w3, w2 = (lin.weight for lin in linears if isinstance(lin, nn.Linear))
        return _Weights((w1, w3), w2, F.silu)
    raise _refuse_expert(index, expert, "is not a same-shape SwiGLU expert the grouped path "
                                        "knows (moe_autograd.moe.MixtralExpert, or "
                                        "moe_autograd.bench.moe_scale.SwiGLU; subclasses "
                                        "excluded, they may compute otherwise)")


def _expert_weights_all(experts: Sequence[nn.Module]) -> List[_Weights]:
    """:func:`_expert_weights` of every expert, checked to agree."""
    if not experts:
        raise ValueError("MixtureOfExperts(grouped_mm=True): no experts")
    found = [_expert_weights(e, expert) for e, expert in enumerate(experts)]
    first = found[0]
    (rows, *rest), down0 = first.shapes()
    if len(rest) != 1 or len(down0) != 2 or rows % 2 or down0 != [rest[0], rows // 2]:
        raise _refuse_expert(0, experts[0], f"has weights {[rows, *rest]} / {down0}, not a "
                                            f"SwiGLU's [2*hidden, d] / [d, hidden]")
    dtype, device = first.down.dtype, first.down.device
    for e, weights in enumerate(found):
        if weights.shapes() != first.shapes() \
                or [p.shape for p in weights.gate_up] != [p.shape for p in first.gate_up]:
            raise _refuse_expert(e, experts[e], f"has weights {weights.shapes()}, expert 0 "
                                                f"{first.shapes()}: grouped experts must share "
                                                f"one shape")
        tensors = (*weights.gate_up, weights.down)
        if any(t.dtype != dtype or t.device != device for t in tensors):
            raise _refuse_expert(e, experts[e], f"has weights in "
                                                f"{sorted({str(t.dtype) for t in tensors})} on "
                                                f"{sorted({str(t.device) for t in tensors})}, "
                                                f"expert 0 in {dtype} on {device}")
        if weights.act is not first.act:
            raise _refuse_expert(e, experts[e], f"has activation {weights.act!r}, expert 0 "
                                                f"{first.act!r}: grouped experts must share one")
    return found


def check_experts(experts: Sequence[nn.Module]) -> int:
    """``d``, the features the experts map to themselves, if
    :func:`stack_experts` can stack them; else ``ValueError`` naming the first
    expert it cannot (nothing is stacked or copied)."""
    return int(_expert_weights_all(experts)[0].down.shape[0])


def stack_experts(experts: Sequence[nn.Module], indices: Optional[Sequence[int]] = None
                  ) -> StackedExperts:
    """The :class:`StackedExperts` of ``experts[i]`` for ``i`` in ``indices``
    (default: all; at least one), for :func:`grouped_experts`: their weights
    copied once into ``[n, 2*hidden, d]`` / ``[n, d, hidden]`` by
    ``torch.cat`` / ``torch.stack`` (differentiable: each expert's parameters
    get their gradient), returned as ``[n, d, 2*hidden]`` / ``[n, hidden, d]``
    transposed views (column-major, which ``torch._grouped_mm`` takes as they
    are).

    Every expert (all of them, not only ``indices``) must be a
    :class:`~moe_autograd.moe.MixtralExpert` or the bench's ``SwiGLU``
    (``w1``, ``w3``, ``w2`` ``nn.Linear`` without bias), exactly those classes,
    without forward hooks, with one shape, dtype and device and one activation
    (the same object); anything else raises ``ValueError`` naming the expert.
    """
    found = _expert_weights_all(experts)
    chosen: List[int] = list(range(len(experts))) if indices is None else list(indices)
    if not chosen:
        raise ValueError("stack_experts: no experts chosen")
    (rows, d), _ = found[0].shapes()
    # One copy: the row blocks of every chosen expert, end to end.
    gate_up = torch.cat([part for e in chosen for part in found[e].gate_up])
    w_gate_up = gate_up.view(len(chosen), rows, d).transpose(1, 2)
    w_down = torch.stack([found[e].down for e in chosen]).transpose(1, 2)
    return StackedExperts(w_gate_up, w_down, found[0].act)
