"""What a transformers (5.x) sparse-MoE block computes, read for
:meth:`MixtureOfExperts.from_mixtral <moe_autograd.moe.MixtureOfExperts.from_mixtral>`.

Why this module exists: transformers' sparse-MoE blocks differ in ways a
layer built from "a router and some experts" silently gets wrong: shared
experts added to the routed ones, top-k probabilities left unnormalised
(``norm_topk_prob=False``), sigmoid or grouped routing with scaling factors,
jitter, custom expert activations. :func:`read_block` recognises the blocks it
can rebuild exactly, by fingerprints of their ``forward`` and their router's
(:func:`~moe_autograd.moe.hf_experts.source_fingerprint`), and refuses every
other one with ``NotImplementedError`` naming the block class and what it does
that the layer would not.

Recognised (transformers 5.x): the Mixtral block (MiniMax), the plain
router-then-experts blocks of Qwen3-MoE, OLMoE, FlexOlmo, Mellum, Jamba and
Granite-MoE (its router already weights by a softmax of the top-k logits), and
Qwen2-MoE's block with a sigmoid-gated shared expert (Qwen3-Next, Qwen3.5,
...); with routers that softmax, take the top-k and normalise them (or not,
``norm_topk_prob``), and experts with Mixtral's eager loop.

Invariants: nothing here imports ``transformers``, nor the layer (the layer
imports this module: one way); the block is never modified, the spec holds
copies of its modules.
"""
import copy
from typing import Any, Callable, Dict, List, NamedTuple, NoReturn, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .hf_experts import EagerLoop, eager_loop, source_fingerprint, stacked_weights

__all__ = ["MixtralExpert", "BlockSpec", "read_block", "rename_keys"]


def _gated_mlp(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
               act_fn: Callable[[Tensor], Tensor]) -> Tensor:
    """One transformers-style gated expert: the eager loop's operations."""
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


class BlockSpec(NamedTuple):
    """A block read by :func:`read_block`: the layer is
    ``MixtureOfExperts(experts, hidden, **options)`` with the block's
    state-dict keys starting with ``renames``' keys renamed to their values."""

    experts: List[nn.Module]
    hidden: int
    options: Dict[str, Any]
    renames: Dict[str, str]


class _Block(NamedTuple):
    router: str                   # the block's attribute holding the router
    shared: bool = False          # + sigmoid(shared_expert_gate(x)) * shared_expert(x)
    jitter: Optional[str] = None  # the attribute holding its input jitter (must be 0)


# Fingerprints of the block forwards from_mixtral rebuilds (transformers 5.x).
_BLOCKS: Dict[str, _Block] = {
    "9078bc930efcb07f": _Block("gate", jitter="jitter_noise"),  # Mixtral, MiniMax
    "4d50cef1b6b2b569": _Block("gate"),  # Qwen3-MoE, Mellum, Inkling2
    "10cba5390774cd64": _Block("gate"),  # OLMoE, FlexOlmo
    "b19951872a52b3c6": _Block("router"),  # Granite-MoE (and -Shared, -Hybrid, -SWA)
    "79e28da335619356": _Block("router"),  # Jamba
    "2448daeac5d56933": _Block("gate", shared=True),  # Qwen2-MoE, Qwen3-Next, Qwen3.5, ...
}

# Fingerprints of the router forwards (softmax, top-k) and whether they
# normalise the top-k probabilities (None: as their norm_topk_prob says).
_ROUTERS: Dict[str, Optional[bool]] = {
    "1498c70e89f7d029": True,  # MixtralTopKRouter, MiniMax
    "ae4ef73ad69a063f": None,  # Qwen2/Qwen3-MoE, OLMoE, FlexOlmo, Mellum, Qwen3-Next
    "2e6cec1b5b00833c": True,  # Qwen3.5-MoE
    "3c11c7b35ca77642": True,  # Granite-MoE: softmax of the top-k logits
    "625b962f84e5308f": False,  # Jamba
}


def _hints(block: nn.Module, router: Optional[nn.Module]) -> List[str]:
    """What ``block`` does that the layer would not, as far as can be named."""
    hints: List[str] = []
    for attr, what in (("e_score_correction_bias", "sigmoid scores with a correction bias"),
                       ("n_group", "grouped routing"), ("num_group", "grouped routing"),
                       ("routed_scaling_factor", "a routed_scaling_factor"),
                       ("input_jitter_noise", "input jitter"),
                       ("router_jitter_noise", "router jitter")):
        for holder in (block, router):
            value = getattr(holder, attr, None)
            hint = f"{what} ({attr})"
            if value is not None and not (isinstance(value, (int, float)) and value in (0, 1)) \
                    and hint not in hints:
                hints.append(hint)
    for name in ("shared_experts", "shared_expert", "shared_mlp"):
        if isinstance(getattr(block, name, None), nn.Module):
            hints.append(f"shared experts ({name})")
    return hints


def _refuse(block: nn.Module, reason: str, router: Optional[nn.Module] = None) -> NoReturn:
    hints = _hints(block, router)
    more = f"; it has {', '.join(hints)}" if hints else ""
    raise NotImplementedError(f"from_mixtral cannot reproduce {type(block).__name__}: "
                              f"{reason}{more}")


def read_block(block: nn.Module) -> BlockSpec:
    """The :class:`BlockSpec` of ``block``, or NotImplementedError naming its
    class and what the layer would compute differently."""
    if not isinstance(getattr(block, "experts", None), nn.Module):
        raise TypeError(f"from_mixtral expects a transformers sparse-MoE block (with .experts), "
                        f"got {type(block).__name__}")
    kind = _BLOCKS.get(source_fingerprint(type(block).forward) or "")
    if kind is None:
        _refuse(block, "its forward is not one of the blocks from_mixtral rebuilds "
                       "(Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, Jamba and their copies)",
                getattr(block, "gate", getattr(block, "router", None)))
    router, experts = getattr(block, kind.router, None), getattr(block, "experts", None)
    if not isinstance(router, nn.Module) or not isinstance(experts, nn.Module):
        raise TypeError(f"from_mixtral expects a sparse-MoE block with .{kind.router} and "
                        f".experts, got {type(block).__name__}")
    jitter: Any = getattr(block, kind.jitter) if kind.jitter is not None else None
    if jitter:
        raise NotImplementedError(f"from_mixtral cannot reproduce {type(block).__name__}: "
                                  f"router_jitter_noise > 0 (it rescales the block's input) "
                                  f"is not supported; set it to 0")
    fingerprint = source_fingerprint(type(router).forward) or ""
    if fingerprint not in _ROUTERS:
        _refuse(block, f"its router {type(router).__name__} does not route by a softmax "
                       f"top-k", router)
    normalise = _ROUTERS[fingerprint]
    if normalise is None:
        normalise = bool(getattr(router, "norm_topk_prob"))
    try:
        loop = eager_loop(experts)
        stacked_weights(experts, loop)
    except NotImplementedError as error:
        _refuse(block, f"its experts: {error}")
    if loop != EagerLoop() or not hasattr(experts, "act_fn"):
        _refuse(block, f"its experts ({type(experts).__name__}) do not compute as "
                       f"Mixtral's ({loop})")
    gate_up, down = getattr(experts, "gate_up_proj"), getattr(experts, "down_proj")
    act_fn: Callable[[Tensor], Tensor] = getattr(experts, "act_fn")
    num_experts, _, hidden = gate_up.shape
    top_k: Optional[int] = getattr(block, "top_k", getattr(router, "top_k", None))
    options: Dict[str, Any] = dict(k=top_k if top_k is not None else 2,
                                   router_dtype=torch.float32, aux_loss="mixtral",
                                   return_aux_loss=False, gate=copy.deepcopy(router),
                                   norm_topk_prob=normalise)
    if kind.shared:
        options.update(shared_expert=copy.deepcopy(getattr(block, "shared_expert")),
                       shared_expert_gate=copy.deepcopy(getattr(block, "shared_expert_gate")))
    modules: List[nn.Module] = [MixtralExpert(gate_up[e], down[e], act_fn)
                                for e in range(num_experts)]
    renames = {} if kind.router == "gate" else {kind.router + ".": "gate."}
    return BlockSpec(modules, hidden, options, renames)


def rename_keys(state_dict: Dict[str, Any], prefix: str, renames: Dict[str, str]) -> None:
    """Renames, in place, the keys ``prefix + old...`` of ``state_dict`` to
    ``prefix + new...`` for every ``old: new`` of ``renames``."""
    for key in list(state_dict):
        for old, new in renames.items():
            if key.startswith(prefix + old):
                state_dict[prefix + new + key[len(prefix + old):]] = state_dict.pop(key)
