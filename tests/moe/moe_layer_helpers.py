"""Shared helpers for the MixtureOfExperts tests (tests/moe/test_moe_*.py).

* :class:`FaultyExpert`: a small MLP that misbehaves on demand, forward
  (raise / sleep / NaN / hang) and backward (raise / sleep / NaN).  Its fault
  settings live in a :class:`Faults` object that ``deepcopy`` turns into a
  clean one, so ``copy.deepcopy(expert)`` is the well-behaved twin used by the
  dense reference.
* :func:`dense_reference`: the layer's maths written densely (every expert on
  every token, then gathered), with experts masked in forward (``dead``) or
  turned into constants in backward (``detached``).
* the ``release`` fixture: an Event every sleeping/hanging expert waits on, set
  at teardown so that no straggler outlives its test by more than a moment.

Not a test module (no ``test_`` prefix); imported by the tests of this folder.
"""
import copy
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn

from moe_autograd.moe import MixtureOfExperts

# Every Event handed to an expert; set at teardown of the test that made it.
_EVENTS: List[threading.Event] = []


@pytest.fixture
def release():
    """An Event that sleeping experts wait on; set when the test ends."""
    event = threading.Event()
    _EVENTS.append(event)
    yield event
    event.set()
    _EVENTS.remove(event)


class Faults:
    """What an expert does wrong. ``deepcopy`` gives a clean instance.

    forward: None | "raise" | "sleep" | "nan" | "hang"
    backward: None | "raise" | "sleep" | "nan"
    ``plan`` (optional) maps an input id (see :func:`tag`) to
    ``(forward, backward)`` and overrides the two attributes for that input.
    """

    def __init__(self) -> None:
        self.forward: Optional[str] = None
        self.backward: Optional[str] = None
        self.delay = 3.0
        self.backward_delay = 3.0
        self.event: Optional[threading.Event] = None
        self.barrier: Optional[threading.Barrier] = None
        self.backward_barrier: Optional[threading.Barrier] = None
        self.plan: Optional[Dict[int, Tuple[Optional[str], Optional[str]]]] = None
        self.lock = threading.Lock()
        self.calls = 0  # forward calls (recomputations included)
        self.rows: List[int] = []  # rows seen per call
        self.finished = 0  # forward calls that returned or raised
        self.backward_calls = 0
        self.backward_finished = 0

    def __deepcopy__(self, memo) -> "Faults":
        return Faults()

    def wait(self, seconds: float) -> None:
        if self.event is not None:
            self.event.wait(seconds)
        else:
            time.sleep(seconds)


ID_SCALE = 64.0


def tag(x: Tensor, ident: int) -> Tensor:
    """Writes ``ident`` (0 < ident < 64) into the last feature of every row, so
    an expert can tell which input it is looking at (see ``Faults.plan``)."""
    x = x.clone()
    x[..., -1] = ident / ID_SCALE
    return x


def _ident(x: Tensor) -> int:
    return int(round(float(x[0, -1].detach()) * ID_SCALE))


class _BackwardFault(torch.autograd.Function):
    """Identity in forward; misbehaves in backward."""

    @staticmethod
    def forward(ctx, x, faults, mode):
        ctx.faults, ctx.mode = faults, mode
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        faults, mode = ctx.faults, ctx.mode
        with faults.lock:
            faults.backward_calls += 1
        try:
            if faults.backward_barrier is not None:
                faults.backward_barrier.wait()
            if mode == "raise":
                raise RuntimeError("injected backward failure")
            if mode == "sleep":
                faults.wait(faults.backward_delay)
            if mode == "nan":
                grad = grad * float("nan")
            return grad, None, None
        finally:
            with faults.lock:
                faults.backward_finished += 1


class FaultyExpert(nn.Module):
    """``fc2(tanh(fc1(x)))`` that misbehaves as ``self.faults`` says."""

    def __init__(self, in_features: int, out_features: int, hidden: int = 7) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, out_features)
        self.faults = Faults()

    def compute(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x: Tensor) -> Tensor:
        faults = self.faults
        with faults.lock:
            faults.calls += 1
            faults.rows.append(x.shape[0])
        try:
            fwd, bwd = faults.forward, faults.backward
            if faults.plan is not None:
                fwd, bwd = faults.plan.get(_ident(x), (None, None))
            if faults.barrier is not None:
                faults.barrier.wait()
            if fwd == "raise":
                raise RuntimeError("injected forward failure")
            if fwd == "sleep":
                faults.wait(faults.delay)
            if fwd == "hang":
                faults.wait(60.0)
            out = self.compute(x)
            if fwd == "nan":
                out = out * float("nan")
            if bwd is not None and torch.is_grad_enabled():
                out = _BackwardFault.apply(out, faults, bwd)
            return out
        finally:
            with faults.lock:
                faults.finished += 1


def make_moe(num_experts: int = 4, in_features: int = 6, out_features: int = 5, k: int = 2,
             seed: int = 0, declare_out_features: bool = False, **kwargs) -> MixtureOfExperts:
    """A float64 layer of :class:`FaultyExpert`\\ s (``out_features`` is the
    experts'; ``declare_out_features`` also passes it to the layer)."""
    torch.manual_seed(seed)
    experts = [FaultyExpert(in_features, out_features) for _ in range(num_experts)]
    if declare_out_features:
        kwargs["out_features"] = out_features
    return MixtureOfExperts(experts, in_features, k=k, **kwargs).double()


def force_routing(moe: MixtureOfExperts, bias: Sequence[float]) -> None:
    """Every token picks the experts with the largest ``bias`` entries."""
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.bias.copy_(torch.tensor(bias, dtype=moe.gate.bias.dtype))


def expert_of(moe: MixtureOfExperts, e: int) -> FaultyExpert:
    return moe.experts[e]  # type: ignore[return-value]


class Reference:
    """A dense twin of a layer: deep copies of its gate and experts."""

    def __init__(self, moe: MixtureOfExperts) -> None:
        self.gate = copy.deepcopy(moe.gate)
        self.experts = [copy.deepcopy(e) for e in moe.experts]
        self.k = moe.k

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def parameters(self) -> List[Tensor]:
        return list(self.gate.parameters()) + [p for e in self.experts for p in e.parameters()]

    def __call__(self, x: Tensor, dead: Iterable[int] = (), detached: Iterable[int] = (),
                 k_min: int = 1, allow_zero_outputs: bool = False) -> Tuple[Tensor, Tensor]:
        return dense_reference(self.gate, self.experts, x, self.k, dead=dead, detached=detached,
                               k_min=k_min, allow_zero_outputs=allow_zero_outputs)


def dense_reference(gate: nn.Linear, experts: Sequence[nn.Module], x: Tensor, k: int, *,
                    dead: Iterable[int] = (), detached: Iterable[int] = (), k_min: int = 1,
                    allow_zero_outputs: bool = False) -> Tuple[Tensor, Tensor]:
    """``y, aux_loss`` computed densely. ``dead`` experts are masked in forward
    (weights renormalised over the surviving top-k logits); ``detached`` ones
    are constants for autograd. Tokens with fewer than ``k_min`` survivors
    output zero (``allow_zero_outputs``) or raise AssertionError."""
    dead, detached = set(dead), set(detached)
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    num_experts = len(experts)
    logits = gate(flat)
    top_logits, top_experts = logits.topk(k, dim=-1)
    outs = []
    for e, expert in enumerate(experts):
        out = expert(flat)
        outs.append(out.detach() if e in detached else out)
    stacked = torch.stack(outs, dim=1)  # [T, E, O]
    chosen = stacked.gather(1, top_experts.unsqueeze(-1).expand(-1, -1, stacked.shape[-1]))
    alive = torch.ones_like(top_experts, dtype=torch.bool)
    for e in dead:
        alive &= top_experts != e
    enough = alive.sum(dim=-1) >= k_min
    if not allow_zero_outputs:
        assert bool(enough.all()), "reference: a token lacks its quorum"
    alive &= enough.unsqueeze(-1)
    any_alive = alive.any(dim=-1, keepdim=True)
    masked = top_logits.masked_fill(~alive, float("-inf"))
    masked = torch.where(any_alive, masked, torch.zeros_like(masked))
    weights = torch.softmax(masked, dim=-1) * any_alive
    # gather + sum (rather than multiplying every expert's output by a zero
    # weight) keeps masked outputs out of the result entirely.
    y = (weights.unsqueeze(-1) * torch.where(alive.unsqueeze(-1), chosen,
                                             torch.zeros_like(chosen))).sum(dim=1)
    probs = torch.softmax(logits, dim=-1).mean(dim=0)
    counts = torch.bincount(top_experts.reshape(-1), minlength=num_experts)
    aux = num_experts * (counts.to(probs.dtype) / top_experts.numel() * probs).sum()
    return y.reshape(*lead, y.shape[-1]), aux


def grad_or_zeros(p: Tensor) -> Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad


def assert_close(actual: Optional[Tensor], expected: Optional[Tensor], what: str = "") -> None:
    if actual is None or expected is None:
        assert actual is None and expected is None, f"{what}: {actual} vs {expected}"
        return
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")


def assert_grads_match(moe: MixtureOfExperts, ref: Reference, *, none_for: Iterable[int] = ()) -> None:
    """Gate and every expert parameter's ``.grad`` equal the reference's;
    experts in ``none_for`` must have no ``.grad`` at all."""
    none_for = set(none_for)
    assert_close(moe.gate.weight.grad, ref.gate.weight.grad, "gate.weight.grad")
    assert_close(moe.gate.bias.grad, ref.gate.bias.grad, "gate.bias.grad")
    for e, (mine, theirs) in enumerate(zip(moe.experts, ref.experts)):
        for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
            if e in none_for:
                assert p.grad is None, f"expert {e} {name}.grad should stay None"
                continue
            assert_close(grad_or_zeros(p), grad_or_zeros(q), f"expert {e} {name}.grad")


def active_experts(moe: MixtureOfExperts, x: Tensor) -> List[int]:
    """The experts the gate routes at least one token of ``x`` to."""
    with torch.no_grad():
        logits = moe.gate(x.reshape(-1, moe.in_features))
        chosen = logits.topk(moe.k, dim=-1).indices.unique().tolist()
    return sorted(chosen)


_warmed_up = False


def warm_up() -> None:
    """Pays this process's one-time lazy imports outside any deadline: a
    checkpointed call's first dispatch-mode op imports torch._dynamo, the
    first ``torch.autograd.grad`` with ``grad_outputs`` imports sympy (seconds
    on a loaded machine). That cold start has its own test
    (test_moe_cold_start.py); the deadline tests must not trip over it."""
    global _warmed_up
    if _warmed_up:
        return
    moe = make_moe(num_experts=2, k=2, seed=0, checkpoint=True)
    y, _ = moe(torch.randn(3, 6, dtype=torch.float64, requires_grad=True))
    y.sum().backward()
    _warmed_up = True


@pytest.fixture(scope="module")
def warmed_up():
    warm_up()


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
