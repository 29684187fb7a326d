"""``MixtureOfExperts``: the layer users drop into a model.

It routes tokens with a top-k gate, calls each chosen expert once with all of
its tokens through the parallel runtime (forward and backward overlap), and
keeps training when experts are slow, failing or return garbage:

* forward: a call that raises, misses its deadline (:mod:`.quorum`) or, with
  ``detect_anomalies``, returns non-finite values is *masked*: each of its
  tokens renormalises its weights over the chosen experts that answered. A
  token left with fewer than ``k_min`` answers raises :class:`NotEnoughExperts`
  or, with ``allow_zero_outputs``, outputs exactly zero;
* backward: a call whose backward raises, misses ``backward_timeout`` or
  (with ``detect_anomalies``) yields non-finite gradients is a constant: no
  gradient reaches its input or parameters (they are inputs of the parallel
  node, which returns None for the call), while the gate still learns
  through the weights. A token left with fewer than ``backward_k_min``
  surviving backwards raises.

Nothing is absorbed silently: every masked call and every backward treated
as a constant is counted in ``stats()``, which keeps each expert's last error
text, and logged as a WARNING naming the expert, the call and the error
(:mod:`.stats`: logger ``moe_autograd.moe.stats``, at most one line per
expert every 10 s).

Fitting real models (all optional; the defaults keep the original layer):
``gate_bias=False`` (Mixtral's router has no bias), ``router_dtype`` (routing
in e.g. float32 whatever the input dtype), ``aux_loss="mixtral"``
(transformers' ``load_balancing_loss_func`` convention) with a ``token_mask``,
``return_router_logits`` / ``return_aux_loss`` (what the forward returns),
``gate`` (any router module, e.g. a model's own), ``norm_topk_prob``,
``shared_expert`` / ``shared_expert_gate``, and
:meth:`MixtureOfExperts.from_mixtral` to build the layer from a transformers
sparse-MoE block (:mod:`.hf_blocks` reads it). A state dict whose experts are
stored stacked (``experts.<name>`` of shape ``[num_experts, ...]``,
transformers 5.x) loads into per-expert modules with a parameter ``<name>``.

The combine adds the surviving answers as one ``index_add_`` per expert in
expert order would, rounding after each in bfloat16 too (:mod:`.dispatch`),
and costs O(tokens x k x d), not O(experts x tokens x d).

``grouped_mm=True`` (opt-in, for GPUs with many small same-shape SwiGLU
experts) replaces the per-expert calls and the combine by two grouped GEMMs
over the experts' stacked weights (:mod:`.grouped`): one call, no failure
masking, and NOT bit-equal to the loop (equal within floating-point
tolerance). Every other path is unchanged by it.

Data flow is one way: this module uses the runtime
(:func:`moe_autograd.parallel.start_calls` / ``finish_calls``); nothing in the
runtime knows about gates or tokens.
"""
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..node import BackwardPolicy
from ..executor import CallCancelled, TaskGroup
from ..parallel import ModuleCall, finish_calls, start_calls
from ..policy import PARALLEL, Decision, Measure, choose, forced_mode, site_of
from ..transforms import opaque_to_dynamo
from .dispatch import combine, dispatch, no_answers
from .gating import (Routing, combine_weights, load_balancing_loss, mixtral_load_balancing_loss,
                     route)
from .grouped import check_experts, grouped_experts, grouped_mm_available, stack_experts
from .hf_blocks import read_block, rename_keys
from .quorum import check_timeout, gather
from .stats import StatsBook, error_text

__all__ = ["MixtureOfExperts", "NotEnoughExperts"]

AUX_LOSSES = ("switch", "mixtral")


class NotEnoughExperts(RuntimeError):
    """Too few experts answered (forward) or survived backward for a token."""


def _describe(errors: Sequence[Tuple[int, BaseException]]) -> str:
    shown = "; ".join(f"expert {e}: {type(err).__name__}: {err}" for e, err in errors[:4])
    more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
    return shown + more


def _load_stacked_experts(module: nn.Module, state_dict: Dict[str, Any], prefix: str,
                          local_metadata: Any, strict: bool, missing_keys: List[str],
                          unexpected_keys: List[str], error_msgs: List[str]) -> None:
    """Load-state-dict pre-hook: ``experts.<name>`` of shape ``[E, ...]`` (the
    stacked layout of transformers 5.x MoE blocks) becomes ``experts.<e>.<name>``
    for every expert ``e``, so such a checkpoint loads into per-expert modules."""
    head = prefix + "experts."
    experts = module.experts
    assert isinstance(experts, nn.ModuleList)
    for key in [key for key in state_dict if key.startswith(head)]:
        name = key[len(head):]
        value = state_dict[key]
        if "." in name or name.isdigit() or not isinstance(value, Tensor) \
                or value.dim() == 0 or value.shape[0] != len(experts):
            continue
        del state_dict[key]
        for e, part in enumerate(value.unbind(0)):
            state_dict[f"{head}{e}.{name}"] = part


def _check_grouped(experts: Sequence[nn.Module], in_features: int,
                   out_features: Optional[int], **options: Any) -> None:
    """ValueError naming the first option or expert that ``grouped_mm=True``
    cannot honour; NotImplementedError for a torch without ``_grouped_mm``."""
    refused = {"checkpoint": "there are no per-expert calls to recompute",
               "forward_timeout": "one grouped call cannot miss a deadline per expert",
               "timeout_after_k_min": "one grouped call cannot miss a deadline per expert",
               "backward_timeout": "one grouped backward cannot miss a deadline per expert",
               "detect_anomalies": "non-finite answers cannot be masked per expert",
               "allow_zero_outputs": "no expert can fail alone, so no token is left without "
                                     "answers",
               "mode": "there is one call, not one per expert, to schedule"}
    for name, why in refused.items():
        value = options[name]
        if value is not None and value is not False:
            raise ValueError(f"MixtureOfExperts(grouped_mm=True) does not take {name}="
                             f"{value!r}: {why}")
    if not grouped_mm_available():
        raise NotImplementedError(f"MixtureOfExperts(grouped_mm=True): torch {torch.__version__} "
                                  f"has no torch._grouped_mm (torch 2.8 or later needed)")
    d = check_experts(experts)  # refuses other experts, naming the first
    if d != in_features or (out_features is not None and out_features != d):
        raise ValueError(f"MixtureOfExperts(grouped_mm=True): the experts map {d} features to "
                         f"{d}, but in_features={in_features}, out_features={out_features}")


class MixtureOfExperts(nn.Module):
    """Top-k mixture of experts; ``y, aux_loss = moe(x)``.

    ``x`` is ``[..., in_features]``; ``y`` has ``x``'s leading dimensions and
    the experts' output dimensions. ``aux_loss`` is the differentiable
    load-balancing loss. See the module docstring for the failure semantics.

    Options for real models (defaults keep the behaviour above):

    * ``gate_bias``: whether the default ``nn.Linear`` gate has a bias
      (Mixtral's router has none);
    * ``router_dtype``: the dtype the logits are cast to before noise, top-k,
      softmax and the aux loss (Mixtral: ``torch.float32``). The gate itself
      runs in its parameters' dtype (the input is cast to it if they differ);
    * ``aux_loss``: ``"switch"`` (1 for a uniform load) or ``"mixtral"``
      (transformers' ``load_balancing_loss_func``: ``k`` times larger; pool
      several layers with :func:`~moe_autograd.moe.mixtral_load_balancing_loss`
      on the returned router logits). ``forward(x, token_mask)`` drops the
      tokens where ``token_mask`` (``x.shape[:-1]``) is 0 from the aux loss;
      they are still routed, as in transformers;
    * ``return_aux_loss`` / ``return_router_logits``: the forward returns
      ``y``, then ``aux_loss`` if asked (default), then the router logits
      (``[tokens, E]``, in ``router_dtype``, those the routing used) if asked;
      a lone ``y`` is returned bare (as a transformers 5.x block returns);
    * ``gate``: a router module used instead of the ``nn.Linear`` (its output,
      or the first element of a tuple output as transformers' routers return,
      is the ``[tokens, E]`` logits);
    * ``norm_topk_prob=False`` (transformers' Qwen-MoE, OLMoE): a token's
      weights sum to the softmax probability of its top-k over all experts,
      not 1 (the answered experts share it as they share 1 by default);
    * ``shared_expert`` (and ``shared_expert_gate``): a module every token
      also goes through, its answer (times ``sigmoid(shared_expert_gate(x))``)
      added to the routed experts' (transformers' Qwen2-MoE).

    ``mode`` (``"auto"``, ``"inline"``, ``"lanes"``, ``"parallel"``; default
    ``MOE_AUTOGRAD_MODE`` or auto) picks how the expert calls run (see
    :mod:`moe_autograd.policy`); with any deadline set (``forward_timeout``,
    ``timeout_after_k_min``, ``backward_timeout``) they always fan out, since
    the caller must never be caught inside a straggler. Results are the same
    in every mode.

    ``grouped_mm=True`` (opt-in; default False) runs the experts as two
    grouped GEMMs (``torch._grouped_mm``, :func:`~moe_autograd.moe.grouped_experts`)
    instead of one call each: for GPUs (CUDA, compute capability 9.x/10.x,
    bfloat16) with many small same-shape experts, whose per-call cost then
    dominates. Each forward stacks the weights of the experts that got tokens
    with ``torch.stack`` (differentiable: every such expert's parameters get
    their gradient; the others none, as in the loop). The experts must all be
    :class:`~moe_autograd.moe.MixtralExpert` or the bench's ``SwiGLU``
    (``w1``, ``w3``, ``w2`` ``nn.Linear`` without bias) of one shape, dtype and
    activation; ``checkpoint``, ``forward_timeout``, ``timeout_after_k_min``,
    ``backward_timeout``, ``detect_anomalies``, ``allow_zero_outputs`` and
    ``mode`` are refused (there are no per-expert calls to checkpoint, time,
    mask or schedule: any failure raises), as are other experts (remote ones
    included), each with a ValueError naming it. ``k_min`` and
    ``backward_k_min`` always hold (every chosen expert answers). Results are
    NOT bit-equal to the loop (a grouped GEMM sums in its own order, and the
    per-token sums are float32): equal within floating-point tolerance.
    ``stats()`` counts calls only.
    """

    def __init__(self, experts: Sequence[nn.Module], in_features: int, k: int = 2, *,
                 k_min: int = 1, forward_timeout: Optional[float] = None,
                 timeout_after_k_min: Optional[float] = None, backward_k_min: int = 1,
                 backward_timeout: Optional[float] = None, allow_zero_outputs: bool = False,
                 detect_anomalies: bool = False, checkpoint: bool = False,
                 gate_noise: float = 0.0, out_features: Optional[int] = None,
                 gate_bias: bool = True, router_dtype: Optional[torch.dtype] = None,
                 aux_loss: str = "switch", return_aux_loss: bool = True,
                 return_router_logits: bool = False, gate: Optional[nn.Module] = None,
                 mode: Optional[str] = None, norm_topk_prob: bool = True,
                 shared_expert: Optional[nn.Module] = None,
                 shared_expert_gate: Optional[nn.Module] = None,
                 grouped_mm: bool = False) -> None:
        super().__init__()
        forced_mode(mode)  # a bad mode fails here, naming the argument
        if not experts:
            raise ValueError("MixtureOfExperts needs at least one expert")
        if grouped_mm:
            _check_grouped(experts, in_features, out_features, checkpoint=checkpoint,
                           forward_timeout=forward_timeout,
                           timeout_after_k_min=timeout_after_k_min,
                           backward_timeout=backward_timeout, detect_anomalies=detect_anomalies,
                           allow_zero_outputs=allow_zero_outputs, mode=mode)
        if not 1 <= k <= len(experts):
            raise ValueError(f"k must be in [1, {len(experts)}], got {k}")
        if not 0 <= k_min <= k:
            raise ValueError(f"k_min must be in [0, k={k}], got {k_min}")
        if not 0 <= backward_k_min <= k:
            raise ValueError(f"backward_k_min must be in [0, k={k}], got {backward_k_min}")
        # None or math.inf: no limit; nan, 0, < 0 raise; huge values are clamped.
        forward_timeout = check_timeout("forward_timeout", forward_timeout)
        timeout_after_k_min = check_timeout("timeout_after_k_min", timeout_after_k_min)
        backward_timeout = check_timeout("backward_timeout", backward_timeout)
        if aux_loss not in AUX_LOSSES:
            raise ValueError(f"aux_loss must be one of {AUX_LOSSES}, got {aux_loss!r}")
        if router_dtype is not None and not router_dtype.is_floating_point:
            raise ValueError(f"router_dtype must be a floating dtype, got {router_dtype}")
        self.experts = nn.ModuleList(experts)
        self.gate: nn.Module = (nn.Linear(in_features, len(experts), bias=gate_bias)
                                if gate is None else gate)
        self.router_dtype, self.aux_loss = router_dtype, aux_loss
        self.return_aux_loss, self.return_router_logits = return_aux_loss, return_router_logits
        self.register_load_state_dict_pre_hook(_load_stacked_experts)
        self.in_features, self.k, self.k_min = in_features, k, k_min
        self.forward_timeout, self.timeout_after_k_min = forward_timeout, timeout_after_k_min
        self.backward_k_min, self.backward_timeout = backward_k_min, backward_timeout
        self.allow_zero_outputs, self.detect_anomalies = allow_zero_outputs, detect_anomalies
        self.checkpoint, self.gate_noise, self.mode = checkpoint, gate_noise, mode
        self.out_shape: Optional[Tuple[int, ...]] = None if out_features is None else (out_features,)
        self.expert_stats = StatsBook(len(experts))
        self.norm_topk_prob = norm_topk_prob
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.grouped_mm = grouped_mm

    def stats(self) -> List[Dict[str, object]]:
        """Per-expert counts of calls, failures, timeouts, non-finite outputs,
        backward failures/timeouts, latency percentiles (ms), and
        ``last_error``: the text of the expert's latest masked call or
        constant backward (None if it never failed)."""
        return self.expert_stats.snapshot()

    def _validate(self, call: ModuleCall, tokens: int) -> None:
        outputs = call.outputs
        if len(outputs) != 1 or outputs[0].dim() == 0 or outputs[0].shape[0] != tokens:
            shapes = [list(o.shape) for o in outputs]
            raise ValueError(f"{call.name} must return one tensor with {tokens} rows, "
                             f"got shapes {shapes}")
        if self.detect_anomalies and not bool(torch.isfinite(outputs[0]).all()):
            raise FloatingPointError(f"{call.name} returned non-finite values")

    @opaque_to_dynamo
    def forward(self, x: Tensor, token_mask: Optional[Tensor] = None
                ) -> Union[Tensor, Tuple[Tensor, ...]]:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MixtureOfExperts expects [..., {self.in_features}], "
                             f"got {list(x.shape)}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        num_tokens = flat.shape[0]
        if token_mask is not None and token_mask.numel() != num_tokens:
            raise ValueError(f"MixtureOfExperts: token_mask has {token_mask.numel()} entries "
                             f"for {num_tokens} tokens (shape {list(lead)})")
        logits = self._router_logits(flat)
        if self.training and self.gate_noise > 0:
            logits = logits + self.gate_noise * torch.randn_like(logits)
        routing = route(logits, self.k)
        aux_loss = self._aux_loss(logits, routing.top_experts, token_mask)
        if self.grouped_mm:
            return self._results(self._grouped(flat, logits, routing), flat, lead,
                                 (self.in_features,), aux_loss, logits)
        active = [e for e, tokens in enumerate(routing.tokens) if len(tokens)]
        inputs = dispatch(flat, [routing.tokens[e] for e in active])

        sizes = [len(routing.tokens[e]) for e in active]
        modules = [self.experts[e] for e in active]
        decision, lanes = self._decide(modules)
        with Measure(site_of(modules), len(modules), decision) as measure:
            calls, group = start_calls(
                modules,
                inputs,
                checkpoint=self.checkpoint,
                check_finite_grads=self.detect_anomalies, name="MixtureOfExperts",
                labels=[f"expert {e}" for e in active],
                validate=lambda call: self._validate(call, sizes[call.index]),
                lanes=lanes, measure=measure, deadline=self.forward_timeout,
            )
            started = time.monotonic()
            ok = gather(group, [routing.tokens[e] for e in active], num_tokens, self.k_min,
                        self.forward_timeout, self.timeout_after_k_min)
        self._record_forward(active, group, ok, started)

        answered = torch.zeros(num_tokens, self.k, dtype=torch.bool, device=flat.device)
        for i, e in enumerate(active):
            if ok[i]:
                answered[routing.tokens[e], routing.slots[e]] = True
        too_few = answered.sum(dim=-1) < self.k_min
        if bool(too_few.any()):
            if not self.allow_zero_outputs:
                failed = [(e, group.errors[i] or TimeoutError("no answer before the deadline"))
                          for i, e in enumerate(active) if not ok[i]]
                raise NotEnoughExperts(
                    f"MixtureOfExperts: {int(too_few.sum())} of {num_tokens} tokens got fewer "
                    f"than k_min={self.k_min} answers; {_describe(failed)}")
            answered[too_few] = False
        weights = combine_weights(routing.top_logits, answered)
        if not self.norm_topk_prob:
            # The top-k's share of the softmax over all experts.
            weights = weights * torch.exp(routing.top_logits.logsumexp(-1, keepdim=True)
                                          - logits.logsumexp(-1, keepdim=True))

        survivors = [(e, calls[i]) for i, e in enumerate(active) if ok[i]]
        policy = BackwardPolicy(self.backward_timeout, tolerate_failures=True,
                                check=self._backward_check([e for e, _ in survivors],
                                                           routing.tokens, answered))
        outputs = finish_calls([c for _, c in survivors], policy, name="MixtureOfExperts",
                               lanes=lanes)
        if outputs:
            self.out_shape = tuple(outputs[0].shape[1:])
        out_shape = self.out_shape or (self.in_features,)
        dtype = outputs[0].dtype if outputs else flat.dtype
        for (e, _), out in zip(survivors, outputs):
            if tuple(out.shape[1:]) != out_shape:
                raise ValueError(f"MixtureOfExperts: expert {e} returned rows of shape "
                                 f"{list(out.shape[1:])}, others {list(out_shape)}")
        if outputs:
            # The sums of one index_add_ per surviving expert, in expert order:
            # O(tokens * k * d) (see moe_autograd.moe.dispatch.combine).
            tokens = [routing.tokens[e] for e, _ in survivors]
            index = torch.cat(tokens)
            slots = torch.cat([routing.slots[e] for e, _ in survivors])
            y = combine(outputs, tokens, weights[index, slots], num_tokens, dtype)
        else:
            y = flat.new_zeros((num_tokens, *out_shape), dtype=dtype)
            if weights.requires_grad:
                # No expert answered (allow_zero_outputs): keep the zeros in the
                # graph, so that ``loss.backward()`` still works (zero gradients).
                y = y + weights.sum().to(dtype) * 0
        return self._results(y, flat, lead, out_shape, aux_loss, logits)

    def _results(self, y: Tensor, flat: Tensor, lead: Sequence[int], out_shape: Sequence[int],
                 aux_loss: Optional[Tensor], logits: Tensor
                 ) -> Union[Tensor, Tuple[Tensor, ...]]:
        """What the forward returns, from the routed experts' ``y`` (``[tokens,
        *out_shape]``): the shared expert added, then the aux loss and the
        router logits if asked."""
        if self.shared_expert is not None:
            y = y + self._shared(flat)
        results: List[Tensor] = [y.reshape(*lead, *out_shape)]
        if aux_loss is not None:
            results.append(aux_loss)
        if self.return_router_logits:
            results.append(logits)
        return results[0] if len(results) == 1 else tuple(results)

    def _grouped(self, flat: Tensor, logits: Tensor, routing: Routing) -> Tensor:
        """``grouped_mm=True``: the routed experts' ``[tokens, d]`` answer, in
        two grouped GEMMs over the stacked weights of the experts that got
        tokens (:func:`~moe_autograd.moe.grouped_experts`); every chosen expert
        answers, so the weights are the softmax of the top-k logits (scaled as
        ``norm_topk_prob`` says), as the other path's when nothing fails."""
        num_experts = len(self.experts)
        active = [e for e, tokens in enumerate(routing.tokens) if len(tokens)]
        for e in active:
            self.expert_stats.record(e, calls=1)
        answered = torch.ones(routing.top_experts.shape, dtype=torch.bool, device=flat.device)
        weights = combine_weights(routing.top_logits, answered)
        if not self.norm_topk_prob:
            weights = weights * torch.exp(routing.top_logits.logsumexp(-1, keepdim=True)
                                          - logits.logsumexp(-1, keepdim=True))
        if not active:
            return no_answers(flat, weights)  # no tokens
        # Only the experts with tokens are stacked (no empty group, no
        # gradient for the others, as in the loop): their ids become 0..n-1.
        stacked = stack_experts(list(self.experts), active)
        position = torch.full((num_experts,), len(active), dtype=torch.long,
                              device=routing.top_experts.device)
        position[active] = torch.arange(len(active), device=position.device)
        return grouped_experts(flat, position[routing.top_experts], weights, stacked.w_gate_up,
                               stacked.w_down, act=stacked.act)

    def _decide(self, modules: Sequence[nn.Module]) -> Tuple[Decision, Optional[int]]:
        """The execution mode of this step's calls, and their lanes (None:
        one worker each)."""
        n = len(modules)
        if self.forward_timeout is not None or self.timeout_after_k_min is not None \
                or self.backward_timeout is not None:
            return Decision(PARALLEL, n, "deadlines"), None
        decision = choose(site_of(modules), n, self.mode, modules)
        return decision, (None if decision.mode == PARALLEL else decision.lanes)

    def _router_logits(self, flat: Tensor) -> Tensor:
        """The gate's ``[tokens, E]`` logits, in ``router_dtype`` if set."""
        weight = getattr(self.gate, "weight", None)
        if isinstance(weight, Tensor) and weight.is_floating_point() and weight.dtype != flat.dtype:
            flat = flat.to(weight.dtype)  # the gate runs in its own dtype
        out = self.gate(flat)
        logits = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(logits, Tensor) or logits.shape != (flat.shape[0], len(self.experts)):
            got = list(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"MixtureOfExperts: the gate must return [{flat.shape[0]}, "
                             f"{len(self.experts)}] logits, got {got}")
        if self.router_dtype is not None and logits.dtype != self.router_dtype:
            logits = logits.to(self.router_dtype)
        return logits

    def _aux_loss(self, logits: Tensor, top_experts: Tensor,
                  token_mask: Optional[Tensor]) -> Optional[Tensor]:
        if not self.return_aux_loss:
            return None
        if self.aux_loss == "mixtral":
            return mixtral_load_balancing_loss(logits, len(self.experts), self.k, token_mask)
        return load_balancing_loss(logits, top_experts, token_mask)

    def _shared(self, flat: Tensor) -> Tensor:
        """The shared expert's answer, gated if it has a gate."""
        assert self.shared_expert is not None
        out = self.shared_expert(flat)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(flat)) * out
        return out

    @classmethod
    def from_mixtral(cls, block: nn.Module, **options: Any) -> "MixtureOfExperts":
        """A layer that computes what ``block`` (a transformers 5.x sparse-MoE
        block: Mixtral's, and those :mod:`.hf_blocks` recognises: Qwen2/3-MoE,
        OLMoE, Granite-MoE, Jamba, ...) computes, with copies of its router (as
        ``gate``, so ``gate.weight`` and the router-logit recording of
        transformers models carry over), of its experts (one
        :class:`~moe_autograd.moe.hf_blocks.MixtralExpert` each) and of its
        shared expert; the block's state dict loads into it as it is. Any
        other block raises NotImplementedError naming its class and what the
        layer would compute differently (shared experts of another kind,
        grouped or sigmoid routing, scaling factors, jitter, other experts).

        Defaults, each overridable through ``options`` (any keyword of this
        class): ``k`` = the block's top-k, ``norm_topk_prob`` = its router's,
        ``router_dtype=torch.float32`` (the routers softmax in float32),
        ``aux_loss="mixtral"`` and ``return_aux_loss=False``, so that the layer
        returns ``y`` like the block and can replace it in the model
        (``layer.mlp = MixtureOfExperts.from_mixtral(layer.mlp)``).

        Outputs and gradients equal the block's up to float rounding, not bit
        for bit: the layer weights a token's experts by a softmax of their
        top-k logits (the block: normalised top-k probabilities, rounded to
        the logits' dtype by some routers) and hands each expert its tokens
        in token order (the block: slot by slot). For the block's bits, keep
        the block and switch its experts with
        :func:`moe_autograd.moe.hf_experts.set_experts_implementation`.
        """
        spec = read_block(block)
        defaults = dict(spec.options)
        defaults.update(options)
        layer = cls(spec.experts, spec.hidden, **defaults)
        if spec.renames:
            layer.register_load_state_dict_pre_hook(
                lambda module, state_dict, prefix, *_: rename_keys(state_dict, prefix,
                                                                   spec.renames))
        return layer

    def _record_forward(self, active: List[int], group: TaskGroup[Any], ok: List[bool],
                        started: float) -> None:
        book = self.expert_stats
        for i, e in enumerate(active):
            error = group.errors[i]
            finished = group.finished_at[i]
            if finished is not None and not isinstance(error, CallCancelled):
                book.record_latency(e, (finished - started) * 1000)
            # A call that failed without an error had not answered when the
            # wait ended, even if it has finished since (a late answer).
            late = not ok[i] and (error is None or isinstance(error, TimeoutError))
            book.record(e, calls=1, timeouts=int(late),
                        non_finite=int(isinstance(error, FloatingPointError)),
                        failures=int(not ok[i] and not late))
            if not ok[i]:
                book.report(e, self._expert_name(e), False, self._why_masked(error))

    def _expert_name(self, e: int) -> str:
        """``expert <e> (<class>(<extra_repr>))``, as the logs name it."""
        module = self.experts[e]
        extra = module.extra_repr()
        shown = f"({extra})" if extra and len(extra) <= 120 else ""
        return f"expert {e} ({type(module).__name__}{shown})"

    def _why_masked(self, error: Optional[BaseException]) -> str:
        """The error text of a masked forward call (``error``: the call's,
        None if it had not answered when the layer stopped waiting)."""
        limits = ", ".join(f"{name}={value:g} s" for name, value in
                           (("forward_timeout", self.forward_timeout),
                            ("timeout_after_k_min", self.timeout_after_k_min))
                           if value is not None)
        if error is None:
            return f"no answer when the layer stopped waiting ({limits})"
        if isinstance(error, CallCancelled):
            return f"not started when the layer stopped waiting ({limits})"
        return error_text(error)

    def _backward_check(self, survivors: List[int], tokens: List[Tensor],
                        answered: Tensor) -> Any:
        """The backward quorum over the surviving experts ``survivors`` (ids,
        in call order). It holds expert ids, never the call records: the
        check lives as long as the caller's graph (a kept output), and a
        record would keep its expert's graph, saved activations and all, alive
        after its backward."""
        book, backward_k_min = self.expert_stats, self.backward_k_min
        needed = answered.sum(dim=-1).clamp(max=backward_k_min)
        layer = weakref.ref(self)  # named only on a failure; never keeps the layer alive

        def name(e: int) -> str:
            alive = layer()
            return f"expert {e}" if alive is None else alive._expert_name(e)

        def check(outcomes: List[Optional[BaseException]]) -> None:
            survived = torch.zeros_like(needed)
            failed: List[Tuple[int, BaseException]] = []
            for e, error in zip(survivors, outcomes):
                late = isinstance(error, TimeoutError)
                book.record(e, backward_calls=1, backward_timeouts=int(late),
                            backward_failures=int(error is not None and not late))
                if error is None:
                    survived[tokens[e]] += 1
                else:
                    failed.append((e, error))
                    book.report(e, name(e), True, error_text(error))
            short = survived < needed
            if bool(short.any()):
                raise NotEnoughExperts(
                    f"MixtureOfExperts backward: {int(short.sum())} tokens kept fewer than "
                    f"backward_k_min={backward_k_min} expert backwards; {_describe(failed)}")
        return check
