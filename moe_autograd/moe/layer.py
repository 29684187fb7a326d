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
  gradient reaches its input or parameters (held back until the call is
  accepted), while the gate still learns through the weights. A token left
  with fewer than ``backward_k_min`` surviving backwards raises.

Data flow is one way: this module uses the runtime
(:func:`moe_autograd.parallel.start_calls` / ``finish_calls``); nothing in the
runtime knows about gates or tokens.
"""
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..node import BackwardPolicy
from ..executor import CallCancelled, TaskGroup
from ..parallel import ModuleCall, finish_calls, start_calls
from .gating import combine_weights, load_balancing_loss, route
from .quorum import gather
from .stats import StatsBook

__all__ = ["MixtureOfExperts", "NotEnoughExperts"]


class NotEnoughExperts(RuntimeError):
    """Too few experts answered (forward) or survived backward for a token."""


def _describe(errors: Sequence[Tuple[int, BaseException]]) -> str:
    shown = "; ".join(f"expert {e}: {type(err).__name__}: {err}" for e, err in errors[:4])
    more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
    return shown + more


class MixtureOfExperts(nn.Module):
    """Top-k mixture of experts; ``y, aux_loss = moe(x)``.

    ``x`` is ``[..., in_features]``; ``y`` has ``x``'s leading dimensions and
    the experts' output dimensions. ``aux_loss`` is the differentiable
    load-balancing loss. See the module docstring for the failure semantics.
    """

    def __init__(self, experts: Sequence[nn.Module], in_features: int, k: int = 2, *,
                 k_min: int = 1, forward_timeout: Optional[float] = None,
                 timeout_after_k_min: Optional[float] = None, backward_k_min: int = 1,
                 backward_timeout: Optional[float] = None, allow_zero_outputs: bool = False,
                 detect_anomalies: bool = False, checkpoint: bool = False,
                 gate_noise: float = 0.0, out_features: Optional[int] = None) -> None:
        super().__init__()
        if not experts:
            raise ValueError("MixtureOfExperts needs at least one expert")
        if not 1 <= k <= len(experts):
            raise ValueError(f"k must be in [1, {len(experts)}], got {k}")
        if not 0 <= k_min <= k:
            raise ValueError(f"k_min must be in [0, k={k}], got {k_min}")
        if not 0 <= backward_k_min <= k:
            raise ValueError(f"backward_k_min must be in [0, k={k}], got {backward_k_min}")
        for name, value in (("forward_timeout", forward_timeout),
                            ("timeout_after_k_min", timeout_after_k_min),
                            ("backward_timeout", backward_timeout)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        self.experts = nn.ModuleList(experts)
        self.gate = nn.Linear(in_features, len(experts))
        self.in_features, self.k, self.k_min = in_features, k, k_min
        self.forward_timeout, self.timeout_after_k_min = forward_timeout, timeout_after_k_min
        self.backward_k_min, self.backward_timeout = backward_k_min, backward_timeout
        self.allow_zero_outputs, self.detect_anomalies = allow_zero_outputs, detect_anomalies
        self.checkpoint, self.gate_noise = checkpoint, gate_noise
        self.out_shape: Optional[Tuple[int, ...]] = None if out_features is None else (out_features,)
        self.expert_stats = StatsBook(len(experts))

    def stats(self) -> List[Dict[str, object]]:
        """Per-expert counts of calls, failures, timeouts, non-finite outputs,
        backward failures/timeouts, and latency percentiles (ms)."""
        return self.expert_stats.snapshot()

    def _validate(self, call: ModuleCall, tokens: int) -> None:
        outputs = call.outputs
        if len(outputs) != 1 or outputs[0].dim() == 0 or outputs[0].shape[0] != tokens:
            shapes = [list(o.shape) for o in outputs]
            raise ValueError(f"{call.name} must return one tensor with {tokens} rows, "
                             f"got shapes {shapes}")
        if self.detect_anomalies and not bool(torch.isfinite(outputs[0]).all()):
            raise FloatingPointError(f"{call.name} returned non-finite values")

    @torch._disable_dynamo  # type: ignore[attr-defined]  # opaque to torch.compile
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MixtureOfExperts expects [..., {self.in_features}], "
                             f"got {list(x.shape)}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        num_tokens = flat.shape[0]
        logits = self.gate(flat)
        if self.training and self.gate_noise > 0:
            logits = logits + self.gate_noise * torch.randn_like(logits)
        routing = route(logits, self.k)
        aux_loss = load_balancing_loss(logits, routing.top_experts)

        active = [e for e, tokens in enumerate(routing.tokens) if len(tokens)]
        sizes = [len(routing.tokens[e]) for e in active]
        calls, group = start_calls(
            [self.experts[e] for e in active],
            [flat.index_select(0, routing.tokens[e]) for e in active],
            checkpoint=self.checkpoint,
            check_finite_grads=self.detect_anomalies, name="MixtureOfExperts",
            labels=[f"expert {e}" for e in active],
            validate=lambda call: self._validate(call, sizes[call.index]),
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

        survivors = [(e, calls[i]) for i, e in enumerate(active) if ok[i]]
        policy = BackwardPolicy(self.backward_timeout, tolerate_failures=True,
                                check=self._backward_check(survivors, routing.tokens, answered))
        outputs = finish_calls([c for _, c in survivors], policy, name="MixtureOfExperts")
        if outputs:
            self.out_shape = tuple(outputs[0].shape[1:])
        out_shape = self.out_shape or (self.in_features,)
        dtype = outputs[0].dtype if outputs else flat.dtype
        y = flat.new_zeros((num_tokens, *out_shape), dtype=dtype)
        if not outputs and weights.requires_grad:
            # No expert answered (allow_zero_outputs): keep the zeros in the
            # graph, so that ``loss.backward()`` still works (zero gradients).
            y = y + weights.sum().to(dtype) * 0
        for (e, _), out in zip(survivors, outputs):
            if tuple(out.shape[1:]) != out_shape:
                raise ValueError(f"MixtureOfExperts: expert {e} returned rows of shape "
                                 f"{list(out.shape[1:])}, others {list(out_shape)}")
            w = weights[routing.tokens[e], routing.slots[e]].to(dtype)
            y = y.index_add(0, routing.tokens[e], out * w.view(-1, *([1] * len(out_shape))))
        return y.reshape(*lead, *out_shape), aux_loss

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

    def _backward_check(self, survivors: List[Tuple[int, ModuleCall]], tokens: List[Tensor],
                        answered: Tensor) -> Any:
        book, backward_k_min = self.expert_stats, self.backward_k_min
        needed = answered.sum(dim=-1).clamp(max=backward_k_min)

        def check(outcomes: List[Optional[BaseException]]) -> None:
            survived = torch.zeros_like(needed)
            failed: List[Tuple[int, BaseException]] = []
            for (e, _), error in zip(survivors, outcomes):
                late = isinstance(error, TimeoutError)
                book.record(e, backward_calls=1, backward_timeouts=int(late),
                            backward_failures=int(error is not None and not late))
                if error is None:
                    survived[tokens[e]] += 1
                else:
                    failed.append((e, error))
            short = survived < needed
            if bool(short.any()):
                raise NotEnoughExperts(
                    f"MixtureOfExperts backward: {int(short.sum())} tokens kept fewer than "
                    f"backward_k_min={backward_k_min} expert backwards; {_describe(failed)}")
        return check
