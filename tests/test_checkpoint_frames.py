"""Saved-tensor frames around the runtime (issue 8): non-reentrant
``torch.utils.checkpoint`` (PyTorch's recommended mode), ``checkpoint_wrapper``
and selective activation checkpointing around ``parallel_apply``,
``map_with_parallel_backward`` and ``MixtureOfExperts``, at pool sizes 1, 2 and
the default; reentrant checkpoint and ``save_on_cpu`` keep working.

Every ``.grad`` is compared (float64) with the same loss computed without
moe_autograd and without any frame. A memory test shows that the experts'
activations are not kept under the non-reentrant frame (weak references to
them die after the forward, as they do for a checkpointed plain loop).
"""
import copy
import functools
import gc
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import Function
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from moe_autograd import map_with_parallel_backward, parallel_apply
from moe_autograd.moe import MixtureOfExperts
from helpers import MLP, plain_moe

DT = torch.float64
D = 4



# -- the three ways of calling experts, and their plain twins -------------------------------

class ExpertFn(Function):
    """``fc2(tanh(fc1(x)))`` with the weights as arguments; backward by hand."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor  # type: ignore[override]
                ) -> Tensor:
        h = torch.tanh(x @ w1.T + b1)
        ctx.save_for_backward(x, w1, w2, h)
        return h @ w2.T + b2

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        x, w1, w2, h = ctx.saved_tensors
        gh = (g @ w2) * (1 - h * h)
        return gh @ w1, gh.T @ x, gh.sum(0), g.T @ h, g.sum(0)


def fn_args(expert: MLP, x: Tensor) -> Tuple[Tensor, ...]:
    return (x, expert.fc1.weight, expert.fc1.bias, expert.fc2.weight, expert.fc2.bias)


def expert_inputs(x: Tensor) -> List[Tensor]:
    return [x, 2 * x, x.sin()]


def loss_of(outputs: Sequence[Tensor]) -> Tensor:
    return sum((o.square() + o.tanh()).sum() for o in outputs)  # type: ignore[return-value]


class Model(nn.Module):
    """Three experts called one of three ways; ``forward(x)`` is the loss."""

    def __init__(self, kind: str, hidden: int = 8, expert_cls: type = MLP) -> None:
        super().__init__()
        self.kind = kind
        experts = [expert_cls(d_in=D, hidden=hidden, d_out=D, seed=e) for e in range(3)]
        if kind == "moe":
            torch.manual_seed(0)
            self.moe = MixtureOfExperts(experts, D, k=2).double()
        else:
            self.experts = nn.ModuleList(experts)

    def expert_list(self) -> List[nn.Module]:
        return list(self.moe.experts if self.kind == "moe" else self.experts)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "parallel_apply":
            return loss_of(parallel_apply(list(self.experts), expert_inputs(x)))
        if self.kind == "map":
            outs = map_with_parallel_backward(
                ExpertFn, *[fn_args(e, i) for e, i in zip(self.experts, expert_inputs(x))])
            return loss_of([o for (o,) in outs])
        y, aux = self.moe(x)
        return loss_of([y]) + aux

    def plain(self, x: Tensor) -> Tensor:
        """The same loss without moe_autograd."""
        if self.kind == "parallel_apply":
            return loss_of([e(i) for e, i in zip(self.experts, expert_inputs(x))])
        if self.kind == "map":
            return loss_of([ExpertFn.apply(*fn_args(e, i))
                            for e, i in zip(self.experts, expert_inputs(x))])
        y, aux = plain_moe(self.moe.gate, list(self.moe.experts), self.moe.k, x)
        return loss_of([y]) + aux


def make_x(seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, D, dtype=DT, generator=g).requires_grad_()


# -- the frames -----------------------------------------------------------------------------

def _sac_policy() -> Callable[[], Any]:
    save = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
    return functools.partial(create_selective_checkpoint_contexts, save)


def run_in_frame(frame: str, model: Model, x: Tensor) -> Tensor:
    if frame == "checkpoint":
        return checkpoint(model, x, use_reentrant=False)
    if frame == "checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, checkpoint_wrapper)
        return checkpoint_wrapper(model, checkpoint_impl=CheckpointImpl.NO_REENTRANT)(x)
    if frame == "selective":
        return checkpoint(model, x, use_reentrant=False, context_fn=_sac_policy())
    if frame == "reentrant":
        return checkpoint(model, x, use_reentrant=True)
    if frame == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            return model(x)
    if frame == "none":
        return model(x)
    raise ValueError(frame)


FRAMES = ["checkpoint", "checkpoint_wrapper", "selective", "reentrant", "save_on_cpu"]
KINDS = ["parallel_apply", "map", "moe"]


def assert_grads_match(model: Model, ref: Model, x: Tensor, x_ref: Tensor) -> None:
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12,
                               msg=lambda m: f"x.grad: {m}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{name}.grad: {p.grad} vs {q.grad}"
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{name}.grad: {m}")


def check_frame(kind: str, frame: str, steps: int = 2) -> None:
    model = Model(kind)
    ref = copy.deepcopy(model)
    x, x_ref = make_x(), make_x()
    for step in range(steps):  # .grad accumulates over steps, as in a training loop
        loss = run_in_frame(frame, model, x)
        loss_ref = ref.plain(x_ref)
        torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-12, atol=1e-12)
        loss.backward()
        loss_ref.backward()
        assert_grads_match(model, ref, x, x_ref)


# -- equality with the plain loss -----------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", [1, 2, "default"], ids=lambda p: f"pool{p}")
@pytest.mark.parametrize("frame", FRAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_in_frame_equal_plain_loss(kind: str, frame: str, pool: Any,
                                             fresh_pool: Callable[[int], Any]) -> None:
    if pool != "default":
        fresh_pool(pool)
    check_frame(kind, frame)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_without_determinism_check_still_exact(kind: str) -> None:
    """``determinism_check="none"`` turns off torch's own shape check of
    recomputed tensors: the gradients must still be exact (a thread-dependent
    order of saved tensors would now be silent)."""
    model = Model(kind)
    ref = copy.deepcopy(model)
    x, x_ref = make_x(1), make_x(1)
    checkpoint(model, x, use_reentrant=False, determinism_check="none").backward()
    ref.plain(x_ref).backward()
    assert_grads_match(model, ref, x, x_ref)


class UnevenMLP(MLP):
    """Experts whose saved tensors have different shapes per expert (the
    hidden width depends on the seed): a checkpoint frame that sees the calls'
    saved tensors out of order cannot stay silent or exact by luck."""

    def __init__(self, d_in: int, hidden: int, d_out: int, seed: int) -> None:
        super().__init__(d_in=d_in, hidden=hidden + 3 * seed, d_out=d_out, seed=seed)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", [1, 2, "default"], ids=lambda p: f"pool{p}")
def test_uneven_experts_under_checkpoint(pool: Any, fresh_pool: Callable[[int], Any]) -> None:
    if pool != "default":
        fresh_pool(pool)
    model = Model("parallel_apply", expert_cls=UnevenMLP)
    ref = copy.deepcopy(model)
    for seed in range(3):
        x, x_ref = make_x(seed), make_x(seed)
        checkpoint(model, x, use_reentrant=False).backward()
        ref.plain(x_ref).backward()
        assert_grads_match(model, ref, x, x_ref)


@pytest.mark.timeout(60)
def test_checkpointed_calls_inside_a_non_reentrant_frame() -> None:
    """The runtime's own per-call checkpointing nested in torch's frame."""
    experts = [MLP(seed=e) for e in range(3)]
    ref = copy.deepcopy(experts)
    x, x_ref = make_x(2), make_x(2)

    def body(a: Tensor) -> Tensor:
        return loss_of(parallel_apply(experts, expert_inputs(a), checkpoint=[True, False, True]))
    checkpoint(body, x, use_reentrant=False).backward()
    loss_of([e(i) for e, i in zip(ref, expert_inputs(x_ref))]).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    for p, q in zip([p for e in experts for p in e.parameters()],
                    [q for e in ref for q in e.parameters()]):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", ["1", "2"])
def test_issue_reproduction_in_a_fresh_process(run_python: Callable[..., str], workers: str) -> None:
    """The issue's reproduction (with a loss that is not linear in the
    outputs), over three steps, with MOE_AUTOGRAD_WORKERS set."""
    out = run_python("""
        import copy, torch
        from torch import nn
        from torch.utils.checkpoint import checkpoint
        from moe_autograd import parallel_apply

        def main():
            torch.manual_seed(0)
            experts = [nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4)).double()
                       for _ in range(3)]
            ref = copy.deepcopy(experts)
            worst, errors = 0.0, []
            for step in range(3):
                x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
                xr = x.detach().clone().requires_grad_()
                try:
                    checkpoint(lambda x: sum(o.square().sum() for o in
                                             parallel_apply(experts, [x, 2 * x, x.sin()])),
                               x, use_reentrant=False).backward()
                except Exception as error:
                    errors.append(f"{type(error).__name__}: {error}")
                    continue
                sum(o.square().sum() for o in
                    [e(i) for e, i in zip(ref, [xr, 2 * xr, xr.sin()])]).backward()
                worst = max(worst, (x.grad - xr.grad).abs().max().item())
                for e, r in zip(experts, ref):
                    for p, q in zip(e.parameters(), r.parameters()):
                        worst = max(worst, (p.grad - q.grad).abs().max().item())
            print(errors)
            print(worst)

        main()
    """, env={"MOE_AUTOGRAD_WORKERS": workers})
    errors, worst = out.strip().splitlines()[-2:]
    assert errors == "[]", out
    assert float(worst) < 1e-10, out


# -- memory: the experts' activations are not kept under the frame --------------------------

class Probed(MLP):
    """An MLP with a wide hidden layer whose activations are watched."""

    def __init__(self, d_in: int, hidden: int, d_out: int, seed: int) -> None:
        super().__init__(d_in=d_in, hidden=256, d_out=d_out, seed=seed)
        self.refs: List["weakref.ref[Tensor]"] = []

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))  # saved for backward by tanh and by fc2
        self.refs.append(weakref.ref(h))
        return self.fc2(h)


class ProbedFn(Function):
    """ExpertFn whose hidden activation is watched."""

    refs: List["weakref.ref[Tensor]"] = []

    @staticmethod
    def forward(ctx: Any, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor  # type: ignore[override]
                ) -> Tensor:
        h = torch.tanh(x @ w1.T + b1)
        ProbedFn.refs.append(weakref.ref(h))
        ctx.save_for_backward(x, w1, w2, h)
        return h @ w2.T + b2

    backward = staticmethod(ExpertFn.backward)


def _watched(model: Model) -> List["weakref.ref[Tensor]"]:
    if model.kind == "map":
        return list(ProbedFn.refs)
    return [r for e in model.expert_list() for r in e.refs]  # type: ignore[union-attr]


def _forward_alive(model: Model, x: Tensor, how: str) -> Tuple[Tensor, int, int]:
    """Runs the forward ``how``; returns the loss, how many watched
    activations it made and how many are still alive after a collection."""
    ProbedFn.refs = []
    for e in model.expert_list():
        e.refs = []  # type: ignore[assignment]
    if how == "plain":
        loss = model.plain(x)
    elif how == "plain_checkpoint":
        loss = checkpoint(model.plain, x, use_reentrant=False)
    elif how == "runtime_checkpoint":
        loss = checkpoint(model, x, use_reentrant=False)
    else:
        raise ValueError(how)
    gc.collect()
    watched = _watched(model)
    return loss, len(watched), sum(r() is not None for r in watched)


class ProbedModel(Model):
    def __init__(self, kind: str) -> None:
        super().__init__(kind, expert_cls=Probed)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "map":
            outs = map_with_parallel_backward(
                ProbedFn, *[fn_args(e, i) for e, i in zip(self.experts, expert_inputs(x))])
            return loss_of([o for (o,) in outs])
        return super().forward(x)

    def plain(self, x: Tensor) -> Tensor:
        if self.kind == "map":
            return loss_of([ProbedFn.apply(*fn_args(e, i))
                            for e, i in zip(self.experts, expert_inputs(x))])
        return super().plain(x)



@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_non_reentrant_frame_does_not_keep_expert_activations(kind: str) -> None:
    model = ProbedModel(kind)
    ref = copy.deepcopy(model)
    x, x_ref = make_x(3), make_x(3)

    # the probe works: a plain forward keeps the activations for backward...
    loss, made, alive = _forward_alive(ref, x_ref, "plain")
    assert made > 0 and alive == made
    del loss
    # ...and a checkpointed plain loop does not
    loss, made, alive = _forward_alive(ref, x_ref, "plain_checkpoint")
    assert made > 0 and alive == 0
    loss.backward()
    for p in ref.parameters():
        p.grad = None
    x_ref.grad = None

    loss, made, alive = _forward_alive(model, x, "runtime_checkpoint")
    assert made > 0, "the experts ran"
    assert alive == 0, (
        f"{alive} of {made} expert activations are still alive after a forward under "
        f"checkpoint(use_reentrant=False): the frame saves no memory around {kind}")
    loss.backward()
    ref.plain(x_ref).backward()
    assert_grads_match(model, ref, x, x_ref)


# -- more ways of using the frame -----------------------------------------------------------

def _all_grads(model: Model, x: Tensor) -> List[Optional[Tensor]]:
    return [x.grad] + [p.grad for p in model.parameters()]


def _assert_all_close(got: Sequence[Optional[Tensor]], want: Sequence[Optional[Tensor]]) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"tensor {k}: {g} vs {w}"
        if g is not None and w is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"tensor {k}: {m}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_frame_with_retain_graph_backward_twice(kind: str) -> None:
    model = Model(kind)
    ref = copy.deepcopy(model)
    x, x_ref = make_x(4), make_x(4)
    loss = checkpoint(model, x, use_reentrant=False)
    loss.backward(retain_graph=True)
    loss.backward()
    loss_ref = ref.plain(x_ref)
    loss_ref.backward(retain_graph=True)
    loss_ref.backward()
    _assert_all_close(_all_grads(model, x), _all_grads(ref, x_ref))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_frame_under_autograd_grad(kind: str) -> None:
    model = Model(kind)
    ref = copy.deepcopy(model)
    x, x_ref = make_x(5), make_x(5)
    got = torch.autograd.grad(checkpoint(model, x, use_reentrant=False),
                              [x, *model.parameters()], allow_unused=True)
    want = torch.autograd.grad(ref.plain(x_ref), [x_ref, *ref.parameters()], allow_unused=True)
    _assert_all_close(got, want)
    assert all(p.grad is None for p in model.parameters()) and x.grad is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", [1, "default"], ids=lambda p: f"pool{p}")
def test_checkpoint_frame_with_an_unused_call(pool: Any, fresh_pool: Callable[[int], Any]) -> None:
    """Only calls 0 and 2 reach the loss: call 1's saved tensors are never
    unpacked, its expert gets None, as in the plain loop."""
    if pool != "default":
        fresh_pool(pool)
    experts = [MLP(seed=e) for e in range(3)]
    ref = copy.deepcopy(experts)
    x, x_ref = make_x(6), make_x(6)

    def body(a: Tensor) -> Tensor:
        outs = parallel_apply(experts, expert_inputs(a))
        return loss_of([outs[0], outs[2]])
    checkpoint(body, x, use_reentrant=False).backward()
    outs_ref = [e(i) for e, i in zip(ref, expert_inputs(x_ref))]
    loss_of([outs_ref[0], outs_ref[2]]).backward()
    _assert_all_close([x.grad] + [p.grad for e in experts for p in e.parameters()],
                      [x_ref.grad] + [p.grad for e in ref for p in e.parameters()])
    assert all(p.grad is None for p in experts[1].parameters())


class CheckpointedMLP(MLP):
    """An expert that checkpoints itself (non-reentrant) on the worker."""

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("outer", [False, True], ids=["bare", "in_outer_frame"])
def test_experts_that_checkpoint_themselves(outer: bool) -> None:
    experts = [CheckpointedMLP(seed=e) for e in range(3)]
    ref = [MLP(seed=e) for e in range(3)]
    x, x_ref = make_x(7), make_x(7)

    def body(a: Tensor) -> Tensor:
        return loss_of(parallel_apply(experts, expert_inputs(a)))
    (checkpoint(body, x, use_reentrant=False) if outer else body(x)).backward()
    loss_of([e(i) for e, i in zip(ref, expert_inputs(x_ref))]).backward()
    _assert_all_close([x.grad] + [p.grad for e in experts for p in e.parameters()],
                      [x_ref.grad] + [p.grad for e in ref for p in e.parameters()])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forward_mode,recompute_mode",
                         [("parallel", "inline"), ("inline", "parallel"), ("lanes", "parallel"),
                          ("parallel", "lanes")])
@pytest.mark.parametrize("kind", ["parallel_apply", "map"])
def test_frame_recomputes_in_another_mode(kind: str, forward_mode: str, recompute_mode: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The auto policy may run a site's forward in one mode and the frame's
    recomputation (a later batch of the same site) in another: the frame
    matches saved tensors by position, so every mode must save them in the
    order a loop does."""
    model = Model(kind, expert_cls=UnevenMLP)
    ref = copy.deepcopy(model)
    x, x_ref = make_x(8), make_x(8)
    monkeypatch.setenv("MOE_AUTOGRAD_MODE", forward_mode)
    loss = checkpoint(model, x, use_reentrant=False, determinism_check="none")
    monkeypatch.setenv("MOE_AUTOGRAD_MODE", recompute_mode)
    loss.backward()
    ref.plain(x_ref).backward()
    assert_grads_match(model, ref, x, x_ref)
