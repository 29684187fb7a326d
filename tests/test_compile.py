"""``torch.compile`` of models that call the runtime (issue 8).

The runtime's entry points must be opaque to dynamo (a clean graph break), so
a compiled model around ``parallel_apply``, ``map_with_parallel_backward`` and
``MixtureOfExperts`` runs, over several steps (guards re-checked), and gives
the same outputs and gradients as the same model in eager mode (float64).
The ``eager`` and ``aot_eager`` backends keep it fast; one case compiles with
inductor.
"""
import copy
from typing import Any, Iterator, List, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import Function

from moe_autograd import map_with_parallel_backward, parallel_apply
from moe_autograd.moe import MixtureOfExperts
from helpers import MLP

DT = torch.float64
D = 4



class ScaleFn(Function):
    """``x * w`` with a hand-written backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class Model(nn.Module):
    """Compiled code before and after the runtime: a projection in, the
    experts (one of three ways), and a head out."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(D, D, dtype=DT)
        self.out = nn.Linear(D, 1, dtype=DT)
        experts = [MLP(d_in=D, hidden=8, d_out=D, seed=e) for e in range(3)]
        if kind == "moe":
            torch.manual_seed(0)
            self.moe = MixtureOfExperts(experts, D, k=2).double()
        else:
            self.experts = nn.ModuleList(experts)
            self.scales = nn.ParameterList(
                [nn.Parameter(torch.full((D,), 0.5 + e, dtype=DT)) for e in range(3)])

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = torch.tanh(self.inp(x))
        if self.kind == "parallel_apply":
            outs = parallel_apply(list(self.experts), [h, 2 * h, h.sin()])
            y = outs[0] + outs[1] * outs[2]
            aux = h.new_zeros(())
        elif self.kind == "map":
            outs = map_with_parallel_backward(ScaleFn, *[(h * (e + 1), s) for e, s in
                                                          enumerate(self.scales)])
            y = outs[0][0] + outs[1][0].tanh() + outs[2][0]
            aux = h.new_zeros(())
        else:
            y, aux = self.moe(h)
        return self.out(y).squeeze(-1), aux


def inputs(steps: int) -> Iterator[Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        yield torch.randn(6, D, dtype=DT, generator=g).requires_grad_()


@pytest.fixture(autouse=True)
def _reset_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def check_compiled(kind: str, backend: str, steps: int = 3) -> None:
    model = Model(kind)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    for x in inputs(steps):
        x_ref = x.detach().clone().requires_grad_()
        y, aux = compiled(x)
        y_ref, aux_ref = ref(x_ref)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(aux, aux_ref, rtol=1e-12, atol=1e-12)
        ((y.square()).sum() + aux).backward()
        ((y_ref.square()).sum() + aux_ref).backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"{name}.grad: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("kind", ["parallel_apply", "map", "moe"])
def test_compiled_model_matches_eager(kind: str, backend: str) -> None:
    check_compiled(kind, backend)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["parallel_apply", "moe"])
def test_compiled_model_under_no_grad_matches_eager(kind: str) -> None:
    model = Model(kind)
    compiled = torch.compile(model, backend="aot_eager")
    for x in inputs(2):
        with torch.no_grad():
            y, _ = compiled(x)
            y_ref, _ = model(x)
        assert not y.requires_grad
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(300)
def test_compiled_experts_inside_parallel_apply() -> None:
    """The user may compile the experts themselves; the runtime runs them."""
    experts = [MLP(seed=e) for e in range(3)]
    ref = copy.deepcopy(experts)
    compiled: List[Any] = [torch.compile(e, backend="aot_eager") for e in experts]
    for x in inputs(2):
        x_ref = x.detach().clone().requires_grad_()
        outs = parallel_apply(compiled, [x, 2 * x, x.cos()])
        outs_ref = [e(i) for e, i in zip(ref, [x_ref, 2 * x_ref, x_ref.cos()])]
        for o, r in zip(outs, outs_ref):
            torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
        sum(o.square().sum() for o in outs).backward()
        sum(o.square().sum() for o in outs_ref).backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
        for p, q in zip([p for e in experts for p in e.parameters()],
                        [q for e in ref for q in e.parameters()]):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(600)
def test_compiled_model_with_inductor_matches_eager() -> None:
    pytest.importorskip("torch._inductor")
    check_compiled("parallel_apply", "inductor", steps=2)


# -- compiled experts (issue 30 item 5) ------------------------------------------------------

@pytest.mark.timeout(600)
def test_inductor_experts_after_the_loops_backward() -> None:
    """An expert compiled with inductor, whose backward was first compiled
    by a loop's backward (without retain_graph: its buffers donated): every
    mode runs it, as the loop does; retain_graph=True raises inductor's
    own error, as in the loop. (Each call's backward kept its graph
    before: 'compiled with non-empty donated buffers' in every mode.)"""
    pytest.importorskip("torch._inductor")

    @torch.compile(backend="inductor")
    def expert(x: Tensor, w: Tensor) -> Tensor:
        return torch.nn.functional.gelu(x @ w).tanh() @ w.t()

    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(2)]
    expert(xs[0], w).sum().backward()  # the loop compiles the backward first
    want = torch.autograd.grad(sum(expert(x, w).sum() for x in xs), [w, *xs])
    for mode in ("lanes", "parallel"):
        for checkpoint in (False, True):
            outs = parallel_apply([expert, expert], [(x, w) for x in xs], mode=mode,
                                  checkpoint=checkpoint)
            got = torch.autograd.grad(sum(o.sum() for o in outs), [w, *xs])
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (mode, checkpoint)
    outs = parallel_apply([expert, expert], [(x, w) for x in xs], mode="parallel")
    with pytest.raises(RuntimeError, match="donated buffers"):
        sum(o.sum() for o in outs).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="donated buffers"):
        sum(expert(x, w).sum() for x in xs).backward(retain_graph=True)
