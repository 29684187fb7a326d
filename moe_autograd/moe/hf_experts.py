"""transformers' experts classes (5.x) run through moe_autograd, bit for bit.

Why this module exists: transformers 5.x keeps a sparse-MoE block's experts
stacked in one module (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj``
``[E, H, I]``, ...) whose class is decorated with ``@use_experts_implementation``:
its ``forward`` then dispatches to the function registered under the model's
``config._experts_implementation``, else runs the class's own *eager loop*
(one expert after the other, forward and backward). :func:`experts_forward`
is such a function: it runs the experts through
:func:`moe_autograd.moe.dispatch.call_experts` (forwards and backwards
overlap) and computes what the class's eager loop computes, bit for bit.

The eager loops are not all the same: some store their weights transposed
(``x @ W``), add biases, interleave or clamp the gate (a custom
``_apply_gate``), have no gate, normalise each expert's answer, compute in
float32, or sum in float32 or in the routing weights' dtype. A class's loop
is recognised by a fingerprint of its source (tokens, so comments and layout
do not count) and mapped to a :class:`EagerLoop` that says which; a loop not
recognised raises ``NotImplementedError`` naming the class, never runs
something else.

Invariants:

* :func:`experts_forward` equals the recognised eager loop bit for bit:
  output and every gradient (tokens, routing weights, parameters), in every
  dtype (tests/moe/test_zoo_experts.py checks every class of the installed
  transformers);
* the experts' weights reach each call as inputs (per-expert slices of the
  stacked parameters, taken on the caller's thread), so their gradients flow
  through the parallel node into the stacked parameters;
* :func:`set_experts_implementation` either switches every experts module of
  a model to :func:`experts_forward` or raises: a model whose experts class
  cannot dispatch (not decorated: Llama4, DBRX, ``nn.ModuleList`` experts)
  would otherwise silently keep its stock loop;
* nothing here imports ``transformers`` at import time (an optional extra).
"""
import hashlib
import inspect
import io
import textwrap
import tokenize
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dispatch import call_experts, combine, no_answers

__all__ = ["EXPERTS_IMPLEMENTATION", "experts_forward", "register_experts_implementation",
           "set_experts_implementation", "check_experts_implementation", "can_dispatch",
           "source_fingerprint", "EagerLoop", "eager_loop", "stacked_weights"]

EXPERTS_IMPLEMENTATION = "moe_autograd"


class EagerLoop(NamedTuple):
    """What one eager loop does, beyond the skeleton they all share (route,
    per expert: gather its tokens, up-project, gate, down-project, weight,
    ``index_add_`` in expert order)."""

    matmul: bool = False      # ``x @ W`` (weights ``[E, in, out]``), else ``F.linear(x, W)``
    bias: bool = False        # ``+ <name>_bias[e]`` after each projection
    gate: str = "inline"      # "inline": act_fn(gate) * up of the projection's halves;
    #                           "apply_gate": experts._apply_gate(projection);
    #                           "none": act_fn(up_proj x), no gate
    post_norm: bool = False   # experts.post_expert_norm on each answer, before the weight
    upcast: bool = False      # projections, gate and weights in float32
    sums: str = "hidden"      # dtype of the sums: "hidden", "float32" or "weights"
    single_route: bool = False  # one route per row (top_k_index [tokens, 1]), its weight
    #                             ignored, its answer assigned: ErgoExpertProjections


# Fingerprints (source_fingerprint) of the eager loops of transformers 5.x, and
# what each does. The zoo tests list the classes of each.
_LOOPS: Dict[str, EagerLoop] = {
    "ae87000aac240d4f": EagerLoop(),  # MixtralExperts and most others
    "5f05fd87545dc52b": EagerLoop(gate="apply_gate"),  # DeepseekV4Experts, BeamExperts, ...
    "be7ff6a570027bae": EagerLoop(matmul=True),  # AriaExperts
    "a6d43e0d25abf417": EagerLoop(matmul=True, bias=True, gate="apply_gate"),  # GptOssExperts
    "18019090211e1fd7": EagerLoop(gate="apply_gate", sums="float32"),  # Inkling2Experts
    "e5b77c00fad6baa5": EagerLoop(post_norm=True),  # MuseSparkExperts
    "f38b7d59ddaee168": EagerLoop(gate="none", sums="weights"),  # NemotronHExperts (<= 5.24)
    "68c1ba3b11641621": EagerLoop(gate="none"),  # NemotronHExperts (5.25: sums in hidden's dtype)
    "bf4782902af040e4": EagerLoop(matmul=True, bias=True, gate="apply_gate", upcast=True,
                              sums="float32"),  # OpenAIPrivacyFilterExperts
    "04bef06d383d8a78": EagerLoop(matmul=True, gate="none",
                              single_route=True),  # ErgoExpertProjections (5.25)
}


def source_fingerprint(function: Callable[..., Any]) -> Optional[str]:
    """A fingerprint of ``function``'s source: its tokens without comments,
    docstring or line breaks inside brackets; None when the source cannot be
    read."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError):
        return None
    kept = [tokenize.tok_name[tok.type] if tok.type in _STRUCTURE else tok.string
            for tok in tokens if tok.type not in _IGNORED]
    header = kept.index("NEWLINE") if "NEWLINE" in kept else len(kept)
    body = kept[header + 1:]
    if body[:1] == ["INDENT"] and body[1:2] and body[1][:1] in "'\"" and body[2:3] == ["NEWLINE"]:
        del kept[header + 2:header + 4]  # the docstring and its NEWLINE
    return hashlib.sha256(" ".join(kept).encode()).hexdigest()[:16]


_STRUCTURE = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
_IGNORED = (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER)
_DECORATED_FORWARD: List[Any] = []


def _decorated_forward_code() -> Any:
    """The code object of the ``forward`` that ``@use_experts_implementation``
    gives a class (the same for every decorated class)."""
    if not _DECORATED_FORWARD:
        from transformers.integrations.moe import use_experts_implementation

        class _Probe(nn.Module):
            def __init__(self, config: Any) -> None:
                super().__init__()

        _DECORATED_FORWARD.append(use_experts_implementation(_Probe).forward.__code__)
    return _DECORATED_FORWARD[0]


def can_dispatch(experts_class: type) -> bool:
    """Whether ``experts_class``'s ``forward`` dispatches through transformers'
    experts implementations (the class is decorated with
    ``@use_experts_implementation`` and its subclasses did not override it)."""
    forward = getattr(experts_class, "forward", None)
    return getattr(forward, "__code__", None) is _decorated_forward_code()


_KNOWN: Dict[type, EagerLoop] = {}


def eager_loop(experts: Any) -> EagerLoop:
    """The :class:`EagerLoop` of ``experts``' eager loop (an experts module,
    or its class), or NotImplementedError."""
    cls: Any = experts if isinstance(experts, type) else type(experts)
    loop = _KNOWN.get(cls)
    if loop is not None:
        return loop
    name = cls.__name__
    if not can_dispatch(cls):
        raise NotImplementedError(
            f"moe_autograd: {name} does not dispatch to transformers' experts implementations "
            f"(its class is not decorated with @use_experts_implementation)")
    fingerprint = source_fingerprint(getattr(cls.forward, "__wrapped__", cls.forward))
    found = _LOOPS.get(fingerprint) if fingerprint is not None else None
    if found is None:
        raise NotImplementedError(
            f"moe_autograd: {name}'s eager expert loop (fingerprint {fingerprint}) is not one "
            f"moe_autograd knows how to reproduce bit for bit; run it with "
            f"experts_implementation='eager'")
    _KNOWN[cls] = found
    return found


def _weight_names(loop: EagerLoop) -> Tuple[str, ...]:
    first = "up_proj" if loop.gate == "none" else "gate_up_proj"
    names: Tuple[str, ...] = (first, "down_proj")
    return names + (first + "_bias", "down_proj_bias") if loop.bias else names


def stacked_weights(experts: nn.Module, loop: EagerLoop) -> Tuple[Tensor, ...]:
    """The stacked weights of ``experts`` in :func:`_weight_names` order; raises
    NotImplementedError for what the eager loop would not do the same way."""
    name = type(experts).__name__
    if getattr(experts, "_is_expert_parallel", False):
        raise NotImplementedError(f"moe_autograd: {name} is expert-parallel (its routing holds "
                                  f"sentinels for remote experts); not supported")
    flags = {"has_gate": loop.gate != "none", "has_bias": loop.bias,
             "is_transposed": loop.matmul, "has_post_expert_norm": loop.post_norm}
    for flag, value in flags.items():
        if getattr(experts, flag, value) != value:
            raise NotImplementedError(f"moe_autograd: {name} has {flag}={not value}, but its "
                                      f"eager loop computes as if {flag}={value}")
    weights: List[Tensor] = []
    for attr in _weight_names(loop):
        weight = getattr(experts, attr, None)
        if not isinstance(weight, Tensor) or weight.dim() < 2:
            raise NotImplementedError(f"moe_autograd: {name} has no stacked {attr}")
        weights.append(weight)
    if len({w.shape[0] for w in weights}) != 1:
        raise NotImplementedError(f"moe_autograd: {name}'s stacked weights disagree on the "
                                  f"number of experts: {[list(w.shape) for w in weights]}")
    stacked = set(_weight_names(loop))
    shared = [n for n, _ in experts.named_parameters()
              if n not in stacked and not (loop.post_norm and n.startswith("post_expert_norm."))]
    if shared:
        raise NotImplementedError(f"moe_autograd: {name} has parameters shared by its experts "
                                  f"({', '.join(shared)}); not supported")
    return tuple(weights)


def _project(loop: EagerLoop, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    if loop.upcast:
        x, weight = x.float(), weight.float()
    out = x @ weight if loop.matmul else F.linear(x, weight)
    if bias is not None:
        out = out + (bias.float() if loop.upcast else bias)
    return out


def _expert_fn(experts: nn.Module, loop: EagerLoop) -> Callable[..., Tensor]:
    """One expert's call, ``(tokens, w_in, w_out[, b_in, b_out]) -> answer``:
    the eager loop's operations from the gathered tokens to the down
    projection."""
    act_fn: Optional[Callable[..., Tensor]] = getattr(experts, "act_fn", None)
    apply_gate: Optional[Callable[[Tensor], Tensor]] = getattr(experts, "_apply_gate", None)
    if loop.gate != "apply_gate" and act_fn is None:
        raise NotImplementedError(f"moe_autograd: {type(experts).__name__} has no act_fn")
    if loop.gate == "apply_gate" and apply_gate is None:
        raise NotImplementedError(f"moe_autograd: {type(experts).__name__} has no _apply_gate")

    def expert(x: Tensor, w_in: Tensor, w_out: Tensor, b_in: Optional[Tensor] = None,
               b_out: Optional[Tensor] = None) -> Tensor:
        h = _project(loop, x, w_in, b_in)
        if loop.gate == "inline":
            assert act_fn is not None
            gate, up = h.chunk(2, dim=-1)
            h = act_fn(gate) * up
        elif loop.gate == "apply_gate":
            assert apply_gate is not None
            h = apply_gate(h)
            h = h.float() if loop.upcast else h
        else:
            assert act_fn is not None
            h = act_fn(h)
        return _project(loop, h, w_out, b_out)

    return expert


def experts_forward(experts: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                    top_k_weights: Tensor) -> Tensor:
    """What ``experts`` (a transformers 5.x experts module, ``self`` in its
    class) computes with its eager loop, bit for bit, with its experts called
    through :func:`~moe_autograd.moe.dispatch.call_experts`; the signature of
    transformers' experts implementations. Raises NotImplementedError for a
    class whose loop it does not reproduce (see the module docstring)."""
    loop = eager_loop(experts)
    stacked = stacked_weights(experts, loop)
    if loop.single_route:
        if top_k_index.dim() != 2 or top_k_index.shape[1] != 1:
            raise ValueError(f"moe_autograd: {type(experts).__name__}'s eager loop takes one "
                             f"route per row (top_k_index [tokens, 1]), got top_k_index "
                             f"{list(top_k_index.shape)}")
        # the loop ignores the weights and assigns each row's one answer: a
        # product with 1 and a sum into zeros are exact
        top_k_weights = torch.ones(top_k_index.shape, dtype=hidden_states.dtype,
                                   device=hidden_states.device)
    per_expert = list(zip(*(w.unbind(0) for w in stacked)))
    routed = call_experts([_expert_fn(experts, loop)] * len(per_expert), hidden_states,
                          top_k_index, expert_args=per_expert)
    sums = {"hidden": hidden_states.dtype, "float32": torch.float32,
            "weights": top_k_weights.dtype}[loop.sums]
    if not routed.active:
        return no_answers(hidden_states.to(sums), top_k_weights).to(hidden_states.dtype)
    outputs = routed.outputs
    if loop.post_norm:
        # A module shared by the experts: run on this thread, expert after
        # expert, so its parameters' gradients sum in the loop's order.
        norm = experts.post_expert_norm
        assert isinstance(norm, nn.Module)
        outputs = [norm(out) for out in outputs]
    weights = top_k_weights[torch.cat(routed.tokens), torch.cat(routed.slots)]
    if loop.upcast:
        weights = weights.float()
    y = combine(outputs, routed.tokens, weights, hidden_states.shape[0], dtype=sums)
    return y.to(hidden_states.dtype)


def register_experts_implementation(name: str = EXPERTS_IMPLEMENTATION) -> str:
    """Registers :func:`experts_forward` as transformers' experts
    implementation ``name`` and returns ``name``; then
    :func:`set_experts_implementation` (or ``model.set_experts_implementation
    (name)``, or ``from_pretrained(..., experts_implementation=name)``)
    switches a model's experts to it. Needs ``transformers`` 5.x.

    ``model.set_experts_implementation`` silently leaves alone the experts
    classes that cannot dispatch (Llama4, DBRX, ...): prefer
    :func:`set_experts_implementation`, which refuses them."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError("register_experts_implementation needs transformers>=5 "
                          "(pip install -e '.[examples]')") from error
    ExpertsInterface.register(name, experts_forward)
    return name


def _experts_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The modules of ``model`` that hold routed experts: those of a class
    that can dispatch, and those named ``experts`` or of a class named
    ``*Experts`` but not shared (dense) ones; outermost only."""
    found: List[Tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p, _ in found):
            continue
        name, cls = path.rsplit(".", 1)[-1], type(module).__name__
        routed = (name == "experts" or cls.endswith("Experts")) \
            and "shared" not in name and "Shared" not in cls
        if can_dispatch(type(module)) or routed:
            found.append((path, module))
    return found


def check_experts_implementation(model: nn.Module,
                                 name: str = EXPERTS_IMPLEMENTATION) -> List[str]:
    """The paths of ``model``'s experts modules, all of which run
    :func:`experts_forward` under the experts implementation ``name``; raises
    NotImplementedError naming the first that would not (a class that cannot
    dispatch, a config that did not switch, a loop not reproduced) and when
    ``model`` has no experts module at all."""
    modules = _experts_modules(model)
    if not modules:
        raise NotImplementedError(f"moe_autograd: {type(model).__name__} has no experts module")
    for path, module in modules:
        cls = type(module).__name__
        if not can_dispatch(type(module)):
            base = next((b.__name__ for b in type(module).__mro__[1:] if can_dispatch(b)), None)
            why = (f"its forward wraps the dispatching forward of {base} with computations "
                   f"of its own" if base is not None else
                   "its class is not decorated with @use_experts_implementation")
            raise NotImplementedError(
                f"moe_autograd: {type(model).__name__}.{path} ({cls}) cannot dispatch to "
                f"transformers' experts implementations ({why}): it would silently keep its "
                f"stock loop")
        config = getattr(module, "config", None)
        current = getattr(config, "_experts_implementation", None)
        if current != name:
            raise NotImplementedError(
                f"moe_autograd: {type(model).__name__}.{path} ({cls}) runs experts "
                f"implementation {current!r}, not {name!r}")
        stacked_weights(module, eager_loop(module))
    return [path for path, _ in modules]


def set_experts_implementation(model: nn.Module, name: str = EXPERTS_IMPLEMENTATION) -> nn.Module:
    """Registers :func:`experts_forward` as ``name``, switches ``model`` (a
    transformers 5.x ``PreTrainedModel``) to it and checks that every experts
    module now runs it (:func:`check_experts_implementation`); returns
    ``model``. Raises NotImplementedError (after switching back to the
    previous implementation) when some would not."""
    register_experts_implementation(name)
    setter = getattr(model, "set_experts_implementation", None)
    getter = getattr(model, "get_experts_implementation", None)
    if setter is None or getter is None:
        raise TypeError(f"set_experts_implementation expects a transformers 5.x model, got "
                        f"{type(model).__name__}")
    previous = getter()
    setter(name)
    try:
        check_experts_implementation(model, name)
    except NotImplementedError:
        setter(previous)
        raise
    return model
