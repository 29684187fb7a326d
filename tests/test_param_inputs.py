"""Parameters as real inputs of the parallel node, unused calls, outputs'
``requires_grad``, default arguments and forward-mode AD (issue 8).

Every behaviour is compared with the same calls made sequentially under plain
autograd, in float64: ``torch.autograd.grad`` w.r.t. expert parameters,
``backward(inputs=...)``, parameter hooks of a module shared by several calls,
``None`` gradients of unused calls (an AdamW step must not move an unused
expert), ``requires_grad``/``grad_fn`` of outputs, Functions with
``setup_context`` and default arguments, and forward AD / ``torch.func``
transforms, which must equal sequential results or raise a clear
RuntimeError, never give a silent ``None`` tangent.
"""
import copy
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.autograd import Function

from moe_autograd import map_with_parallel_backward, parallel_apply, run_isolated_forward
from moe_autograd.moe import MixtureOfExperts
from helpers import MLP, Square, plain_moe

DT = torch.float64
RUNTIME_NAMES = ("moe_autograd", "parallel_apply", "map_with_parallel_backward")



def randn(*shape: int, seed: int, requires_grad: bool = True) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=DT, generator=g).requires_grad_(requires_grad)


def clone_leaf(t: Tensor) -> Tensor:
    return t.detach().clone().requires_grad_(t.requires_grad)


def close(got: Optional[Tensor], want: Optional[Tensor], what: str = "") -> None:
    if got is None or want is None:
        assert got is None and want is None, (
            f"{what}: {'None' if got is None else 'a gradient'}, sequential "
            f"{'None' if want is None else 'a gradient'}")
        return
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def weighted(outputs: Sequence[Tensor], seed: int = 0) -> Tensor:
    """A loss that is not linear in the outputs, with distinct weights."""
    g = torch.Generator().manual_seed(seed)
    total = torch.zeros((), dtype=DT)
    for out in outputs:
        w = torch.randn(out.shape, dtype=out.dtype, generator=g)
        total = total + (out.square() * w).sum() + (out * w).sum()
    return total


class Setup:
    """Four calls over three experts, expert 0 shared by calls 0 and 2, on the
    inputs x, 2x, sin(x), cos(x); a twin of everything for the sequential loop."""

    def __init__(self, seed: int = 0) -> None:
        self.experts = [MLP(seed=seed + e) for e in range(3)]
        self.ref_experts = copy.deepcopy(self.experts)
        self.x = randn(5, 4, seed=seed + 10)
        self.ref_x = clone_leaf(self.x)
        self.order = [0, 1, 0, 2]

    @staticmethod
    def _inputs(x: Tensor) -> List[Tensor]:
        return [x, 2 * x, x.sin(), x.cos()]

    def parallel(self) -> List[Tensor]:
        return parallel_apply([self.experts[e] for e in self.order], self._inputs(self.x))

    def sequential(self) -> List[Tensor]:
        return [self.ref_experts[e](inp) for e, inp in zip(self.order, self._inputs(self.ref_x))]

    def params(self, experts: Sequence[int], ref: bool = False) -> List[Tensor]:
        owners = self.ref_experts if ref else self.experts
        return [p for e in experts for p in owners[e].parameters()]

    def all_grads(self, ref: bool = False) -> List[Optional[Tensor]]:
        return [p.grad for p in self.params(range(3), ref)] + [(self.ref_x if ref else self.x).grad]


# -- torch.autograd.grad and backward(inputs=...) w.r.t. parameters -------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", [[0], [1], [0, 2], [0, 1, 2]], ids=str)
def test_autograd_grad_wrt_expert_parameters_matches_sequential(which: List[int]) -> None:
    s = Setup()
    loss, ref_loss = weighted(s.parallel()), weighted(s.sequential())
    got = torch.autograd.grad(loss, s.params(which) + [s.x])
    want = torch.autograd.grad(ref_loss, s.params(which, ref=True) + [s.ref_x])
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        close(g, w, f"gradient {k}")
    # torch.autograd.grad never writes .grad
    assert all(g is None for g in s.all_grads())


@pytest.mark.timeout(60)
def test_autograd_grad_wrt_an_unused_parameter_like_sequential() -> None:
    """Expert 3 is not called: sequential autograd raises without allow_unused
    and gives None with it; so must the runtime."""
    s = Setup()
    spare, ref_spare = MLP(seed=9), MLP(seed=9)
    loss, ref_loss = weighted(s.parallel()), weighted(s.sequential())
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(ref_loss, [*s.params([1], ref=True), *ref_spare.parameters()],
                            retain_graph=True)
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(loss, [*s.params([1]), *spare.parameters()], retain_graph=True)
    got = torch.autograd.grad(loss, [*s.params([1]), *spare.parameters()], allow_unused=True)
    want = torch.autograd.grad(ref_loss, [*s.params([1], ref=True), *ref_spare.parameters()],
                               allow_unused=True)
    for k, (g, w) in enumerate(zip(got, want)):
        close(g, w, f"gradient {k}")


@pytest.mark.timeout(60)
def test_gradient_penalty_on_expert_parameters_is_exact_or_raises() -> None:
    """``grad(..., create_graph=True)`` w.r.t. parameters (a gradient penalty)
    must either give the sequential second-order result or raise; never
    treat the gradients as constants."""
    s = Setup()
    params, ref_params = s.params([1]), s.params([1], ref=True)
    ref_grads = torch.autograd.grad(weighted(s.sequential()), ref_params, create_graph=True)
    ref_penalty = sum(g.square().sum() for g in ref_grads)
    ref_penalty.backward()
    try:
        grads = torch.autograd.grad(weighted(s.parallel()), params, create_graph=True)
        penalty = sum(g.square().sum() for g in grads)
        penalty.backward()
    except RuntimeError as error:
        assert "differentiate" in str(error) or any(n in str(error) for n in RUNTIME_NAMES), error
        return
    for k, (p, q) in enumerate(zip(params, ref_params)):
        close(p.grad, q.grad, f"penalty gradient of parameter {k}")


def _preset_grads(tensors: Sequence[Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.grad = torch.randn(t.shape, dtype=t.dtype, generator=g)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["expert1", "expert0_shared", "x", "x_and_expert2"])
@pytest.mark.parametrize("preset", [False, True], ids=["no_grad_yet", "existing_grad"])
def test_backward_inputs_leaves_other_grads_alone(target: str, preset: bool) -> None:
    s = Setup()
    if preset:
        _preset_grads(s.params(range(3)) + [s.x], seed=3)
        _preset_grads(s.params(range(3), ref=True) + [s.ref_x], seed=3)
    before = [None if g is None else g.clone() for g in s.all_grads()]

    def chosen(ref: bool) -> List[Tensor]:
        x = s.ref_x if ref else s.x
        return {"expert1": s.params([1], ref), "expert0_shared": s.params([0], ref), "x": [x],
                "x_and_expert2": [x, *s.params([2], ref)]}[target]

    weighted(s.parallel()).backward(inputs=chosen(False))
    weighted(s.sequential()).backward(inputs=chosen(True))
    targets = {id(t) for t in chosen(False)}
    every = s.params(range(3)) + [s.x]
    for k, (t, g, w, b) in enumerate(zip(every, s.all_grads(), s.all_grads(ref=True), before)):
        close(g, w, f"tensor {k}")
        if id(t) not in targets:  # untouched, bit for bit
            assert (g is None and b is None) or (g is not None and b is not None and torch.equal(g, b)), k


@pytest.mark.timeout(60)
def test_plain_backward_matches_sequential_with_shared_expert() -> None:
    s = Setup()
    weighted(s.parallel()).backward()
    weighted(s.sequential()).backward()
    for k, (g, w) in enumerate(zip(s.all_grads(), s.all_grads(ref=True))):
        close(g, w, f"tensor {k}")


# -- hooks on a parameter shared by several calls -------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["backward", "autograd_grad", "backward_inputs"])
def test_parameter_hooks_fire_once_with_the_summed_gradient(how: str) -> None:
    """Expert 0 serves calls 0 and 2 (and here also call 3): its weight's
    ``register_hook`` and ``register_post_accumulate_grad_hook`` fire exactly
    as often as sequentially (once per backward), with the summed gradient."""
    s = Setup()
    s.order = [0, 1, 0, 0]
    records: Dict[str, Dict[str, List[Tensor]]] = {"par": {"hook": [], "post": []},
                                                    "seq": {"hook": [], "post": []}}

    def install(p: Tensor, log: Dict[str, List[Tensor]]) -> None:
        p.register_hook(lambda g: log["hook"].append(g.detach().clone()))
        p.register_post_accumulate_grad_hook(lambda q: log["post"].append(q.grad.detach().clone()))

    weight, ref_weight = s.experts[0].fc1.weight, s.ref_experts[0].fc1.weight
    install(weight, records["par"])
    install(ref_weight, records["seq"])
    for step in range(2):
        for side, outs, w in (("par", s.parallel(), weight), ("seq", s.sequential(), ref_weight)):
            loss = weighted(outs, seed=step)
            if how == "backward":
                loss.backward()
            elif how == "autograd_grad":
                torch.autograd.grad(loss, [w])
            else:
                loss.backward(inputs=[w])
    par, seq = records["par"], records["seq"]
    assert len(seq["hook"]) == 2  # once per backward, sequentially
    assert len(par["hook"]) == len(seq["hook"]), (
        f"register_hook fired {len(par['hook'])} times over 2 backwards, sequentially "
        f"{len(seq['hook'])}")
    assert len(par["post"]) == len(seq["post"]), (
        f"post-accumulate hook fired {len(par['post'])} times over 2 backwards, "
        f"sequentially {len(seq['post'])}")
    for k, (g, w) in enumerate(zip(par["hook"] + par["post"], seq["hook"] + seq["post"])):
        close(g, w, f"hook record {k}")
    close(weight.grad, ref_weight.grad, "weight.grad")


# -- unused calls and outputs get None, as sequentially --------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_unused_call_gets_none_and_adamw_does_not_move_its_expert(weight_decay: float) -> None:
    experts = [MLP(seed=e) for e in range(3)]
    ref_experts = copy.deepcopy(experts)
    xs = [randn(5, 4, seed=20 + i) for i in range(3)]
    ref_xs = [clone_leaf(x) for x in xs]
    outs = parallel_apply(experts, xs)
    ref_outs = [e(x) for e, x in zip(ref_experts, ref_xs)]
    weighted([outs[0], outs[2]]).backward()  # call 1 unused
    weighted([ref_outs[0], ref_outs[2]]).backward()
    for i in range(3):
        close(xs[i].grad, ref_xs[i].grad, f"x{i}.grad")
        for (name, p), q in zip(experts[i].named_parameters(), ref_experts[i].parameters()):
            close(p.grad, q.grad, f"expert {i} {name}.grad")
    assert all(p.grad is None for p in experts[1].parameters())
    assert xs[1].grad is None

    before = [p.detach().clone() for p in experts[1].parameters()]
    opt = torch.optim.AdamW([p for e in experts for p in e.parameters()], lr=0.1,
                            weight_decay=weight_decay)
    ref_opt = torch.optim.AdamW([p for e in ref_experts for p in e.parameters()], lr=0.1,
                                weight_decay=weight_decay)
    opt.step()
    ref_opt.step()
    for p, b in zip(experts[1].parameters(), before):
        assert torch.equal(p.detach(), b), "AdamW moved the unused expert's weights"
    for p, q in zip([p for e in experts for p in e.parameters()],
                    [q for e in ref_experts for q in e.parameters()]):
        close(p.detach(), q.detach(), "weights after the AdamW step")


class TwoHeads(nn.Module):
    """Two outputs from two separate heads on a shared trunk."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.trunk = MLP(seed=seed)
        self.head_a = nn.Linear(4, 3, dtype=DT)
        self.head_b = nn.Linear(4, 2, dtype=DT)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = self.trunk(x)
        return self.head_a(h), self.head_b(h)


@pytest.mark.timeout(60)
def test_unused_output_of_a_used_call_gives_none_to_its_own_parameters() -> None:
    """A module call has no ctx that materializes gradients: a head whose
    output is not used gets None, as sequentially (not zeros)."""
    torch.manual_seed(0)
    models = [TwoHeads(seed=i) for i in range(2)]
    ref_models = copy.deepcopy(models)
    xs = [randn(3, 4, seed=30 + i) for i in range(2)]
    ref_xs = [clone_leaf(x) for x in xs]
    outs = parallel_apply(models, xs)
    ref_outs = [m(x) for m, x in zip(ref_models, ref_xs)]
    weighted([outs[0][0], outs[1][1]]).backward()
    weighted([ref_outs[0][0], ref_outs[1][1]]).backward()
    for i in range(2):
        close(xs[i].grad, ref_xs[i].grad, f"x{i}.grad")
        for (name, p), q in zip(models[i].named_parameters(), ref_models[i].parameters()):
            close(p.grad, q.grad, f"model {i} {name}.grad")
    assert all(p.grad is None for p in models[0].head_b.parameters())
    assert all(p.grad is None for p in models[1].head_a.parameters())


class LinearFn(Function):
    """``tanh(x @ w)`` with parameters passed as arguments."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        y = torch.tanh(x @ w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor]]:  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        gy = g * (1 - y * y)
        return (gy @ w.T if ctx.needs_input_grad[0] else None,
                x.T @ gy if ctx.needs_input_grad[1] else None)


@pytest.mark.timeout(60)
def test_map_unused_call_gives_none_to_its_inputs() -> None:
    ws = [randn(4, 3, seed=40 + i) for i in range(3)]
    xs = [randn(5, 4, seed=50 + i) for i in range(3)]
    ref_ws, ref_xs = [clone_leaf(w) for w in ws], [clone_leaf(x) for x in xs]
    outs = map_with_parallel_backward(LinearFn, *zip(xs, ws))
    ref_outs = [LinearFn.apply(x, w) for x, w in zip(ref_xs, ref_ws)]
    weighted([outs[0][0], outs[2][0]]).backward()
    weighted([ref_outs[0], ref_outs[2]]).backward()
    for i in range(3):
        close(xs[i].grad, ref_xs[i].grad, f"x{i}.grad")
        close(ws[i].grad, ref_ws[i].grad, f"w{i}.grad")
    assert xs[1].grad is None and ws[1].grad is None


# -- requires_grad / grad_fn of outputs -----------------------------------------------------

def _assert_same_flags(got: Tensor, want: Tensor, what: str) -> None:
    assert got.requires_grad == want.requires_grad, (
        f"{what}: requires_grad {got.requires_grad}, sequential {want.requires_grad}")
    assert (got.grad_fn is None) == (want.grad_fn is None), (
        f"{what}: grad_fn {got.grad_fn}, sequential {want.grad_fn}")
    if not want.requires_grad:
        torch.testing.assert_close(torch.from_numpy(got.numpy()), want.detach())


@pytest.mark.timeout(60)
def test_map_outputs_of_calls_without_grad_are_plain_tensors() -> None:
    x, c = randn(3, seed=1), randn(3, seed=2, requires_grad=False)
    got = map_with_parallel_backward(Square, (x,), (c,), (c * 2,))
    want = [Square.apply(x), Square.apply(c), Square.apply(c * 2)]
    for i, ((g,), w) in enumerate(zip(got, want)):
        _assert_same_flags(g, w, f"call {i}")
    assert got[1][0].grad_fn is None and not got[1][0].requires_grad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["callable", "frozen_module", "trainable_module"])
def test_parallel_apply_output_flags_match_sequential(case: str) -> None:
    x, c = randn(3, 4, seed=3), randn(3, 4, seed=4, requires_grad=False)
    frozen = MLP(seed=1).requires_grad_(False)
    trainable = MLP(seed=2)
    expert: Callable[[Tensor], Tensor] = {
        "callable": torch.tanh, "frozen_module": frozen, "trainable_module": trainable}[case]
    got = parallel_apply([trainable, expert], [x, c])
    want = [trainable(x), expert(c)]
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_same_flags(g, w, f"call {i}")


@pytest.mark.timeout(60)
def test_checkpointed_call_output_flags_match_sequential() -> None:
    """An expert whose output does not depend on its (differentiable) input."""
    x = randn(3, 4, seed=5)

    def constant(a: Tensor) -> Tensor:
        return a.detach() * 2
    got = parallel_apply([constant, constant], [x, x], checkpoint=True)
    _assert_same_flags(got[0], constant(x), "call 0")


# -- setup_context Functions with default arguments -----------------------------------------

class ScaleShift(Function):
    """``x * scale (+ shift)``: setup_context style, defaults in ``forward``."""

    @staticmethod
    def forward(x: Tensor, scale: float = 2.0, shift: Optional[Tensor] = None) -> Tensor:  # type: ignore[override]
        y = x * scale
        return y if shift is None else y + shift

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tensor) -> None:
        x, scale, shift = inputs  # Function.apply binds the defaults first
        ctx.scale = scale
        ctx.has_shift = shift is not None

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tuple[Optional[Tensor], None, Optional[Tensor]]:  # type: ignore[override]
        return g * ctx.scale, None, (g if ctx.has_shift else None)


@pytest.mark.timeout(60)
def test_run_isolated_forward_binds_default_arguments() -> None:
    x = randn(3, seed=5)
    ctx, out = run_isolated_forward(ScaleShift, x)
    assert ctx.scale == 2.0 and ctx.has_shift is False
    torch.testing.assert_close(out, (x * 2).detach())


@pytest.mark.timeout(60)
def test_map_with_default_arguments_matches_apply() -> None:
    x, y, z, shift = randn(3, seed=6), randn(3, seed=7), randn(3, seed=8), randn(3, seed=9)
    calls = [(x,), (y, 3.0), (z, 1.5, shift)]
    ref = {id(t): clone_leaf(t) for t in (x, y, z, shift)}
    ref_calls = [tuple(ref[id(a)] if isinstance(a, Tensor) else a for a in c) for c in calls]
    got = map_with_parallel_backward(ScaleShift, *calls)
    want = [ScaleShift.apply(*c) for c in ref_calls]
    for i, ((g,), w) in enumerate(zip(got, want)):
        close(g, w, f"call {i}")
    weighted([g for (g,) in got]).backward()
    weighted(want).backward()
    for t in (x, y, z, shift):
        close(t.grad, ref[id(t)].grad)


@pytest.mark.timeout(60)
def test_map_with_default_arguments_gradcheck() -> None:
    x, shift = randn(3, seed=10), randn(3, seed=11)

    def f(a: Tensor, b: Tensor) -> Tuple[Tensor, ...]:
        outs = map_with_parallel_backward(ScaleShift, (a,), (a, 0.5, b))
        return tuple(o for (o,) in outs)
    assert torch.autograd.gradcheck(f, (x, shift))


# -- forward-mode AD and torch.func ----------------------------------------------------------

class MulJvp(Function):
    """``x * y`` with backward, jvp and a generated vmap rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, y: Tensor) -> Tensor:  # type: ignore[override]
        return x * y

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        x, y = ctx.saved_tensors
        return g * y, g * x

    @staticmethod
    def jvp(ctx: Any, tx: Optional[Tensor], ty: Optional[Tensor]) -> Tensor:  # type: ignore[override]
        x, y = ctx.saved_tensors
        out = torch.zeros_like(x)
        if tx is not None:
            out = out + tx * y
        if ty is not None:
            out = out + ty * x
        return out


def assert_clear_error(error: BaseException, modes: Sequence[str]) -> None:
    message = str(error)
    assert any(n in message for n in RUNTIME_NAMES) and any(
        m.lower() in message.lower() for m in modes), (
        f"unclear error (must name the runtime and one of {list(modes)}): "
        f"{type(error).__name__}: {message}")


def equal_or_clear_error(run: Callable[[], Any], want: Any, modes: Sequence[str]) -> None:
    """``run()`` equals ``want`` (a tensor or a tuple of tensors; a None where
    a tensor is expected is a failure), or raises a RuntimeError whose
    message names the runtime and one of ``modes``."""
    try:
        got = run()
    except RuntimeError as error:
        assert_clear_error(error, modes)
        return
    got_t = got if isinstance(got, tuple) else (got,)
    want_t = want if isinstance(want, tuple) else (want,)
    assert len(got_t) == len(want_t)
    for k, (g, w) in enumerate(zip(got_t, want_t)):
        assert g is not None, f"result {k}: a silent None where sequential gives a tensor"
        close(g, w, f"result {k}")


FORWARD_MODES = ("forward", "jvp", "dual")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("primal_requires_grad", [False, True])
def test_forward_ad_through_map(primal_requires_grad: bool) -> None:
    x, y = randn(4, seed=12, requires_grad=primal_requires_grad), randn(4, seed=13)
    tx = randn(4, seed=14, requires_grad=False)
    x2, y2 = randn(4, seed=15, requires_grad=primal_requires_grad), randn(4, seed=16)
    with fwAD.dual_level():
        want = (fwAD.unpack_dual(MulJvp.apply(fwAD.make_dual(x, tx), y)).tangent,
                fwAD.unpack_dual(MulJvp.apply(x2, y2)).tangent)
    assert want[1] is None  # no dual input, no tangent

    def run() -> Tuple[Any, ...]:
        with fwAD.dual_level():
            outs = map_with_parallel_backward(MulJvp, (fwAD.make_dual(x, tx), y), (x2, y2))
            return tuple(fwAD.unpack_dual(o).tangent for (o,) in outs)

    try:
        got = run()
    except RuntimeError as error:
        assert_clear_error(error, FORWARD_MODES)
        return
    assert got[0] is not None, "a silent None tangent"
    close(got[0], want[0], "tangent of call 0")
    assert got[1] is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("primal_requires_grad", [False, True])
def test_forward_ad_through_parallel_apply(primal_requires_grad: bool) -> None:
    experts = [MLP(seed=1), MLP(seed=2)]
    x = randn(3, 4, seed=17, requires_grad=primal_requires_grad)
    c = randn(3, 4, seed=18, requires_grad=primal_requires_grad)
    tx = randn(3, 4, seed=19, requires_grad=False)
    with fwAD.dual_level():
        want = fwAD.unpack_dual(experts[0](fwAD.make_dual(x, tx))).tangent
        want_c = fwAD.unpack_dual(experts[1](c)).tangent
    assert want is not None and want_c is None

    def run() -> Tensor:
        with fwAD.dual_level():
            outs = parallel_apply(experts, [fwAD.make_dual(x, tx), c])
            assert fwAD.unpack_dual(outs[1]).tangent is None
            return fwAD.unpack_dual(outs[0]).tangent
    equal_or_clear_error(run, want, FORWARD_MODES)


@pytest.mark.timeout(60)
def test_torch_func_jvp_over_parallel_apply() -> None:
    expert = MLP(seed=3)
    x, t = randn(3, 4, seed=20, requires_grad=False), randn(3, 4, seed=21, requires_grad=False)
    want = torch.func.jvp(lambda a: expert(a), (x,), (t,))

    def run() -> Tuple[Tensor, Tensor]:
        return torch.func.jvp(lambda a: parallel_apply([expert, expert], [a, a])[1], (x,), (t,))
    equal_or_clear_error(run, want, FORWARD_MODES + ("torch.func",))


@pytest.mark.timeout(60)
def test_torch_func_jvp_over_map() -> None:
    x, y = randn(4, seed=22, requires_grad=False), randn(4, seed=23, requires_grad=False)
    t = randn(4, seed=24, requires_grad=False)
    want = torch.func.jvp(lambda a: MulJvp.apply(a, y), (x,), (t,))

    def run() -> Tuple[Tensor, Tensor]:
        return torch.func.jvp(lambda a: map_with_parallel_backward(MulJvp, (a, y), (y, a))[0][0],
                              (x,), (t,))
    equal_or_clear_error(run, want, FORWARD_MODES + ("torch.func",))


@pytest.mark.timeout(60)
def test_torch_func_grad_over_parallel_apply() -> None:
    expert = MLP(seed=4)
    x = randn(3, 4, seed=25, requires_grad=False)
    want = torch.func.grad(lambda a: expert(a).square().sum())(x)

    def run() -> Tensor:
        return torch.func.grad(lambda a: parallel_apply([expert], [a])[0].square().sum())(x)
    equal_or_clear_error(run, want, ("torch.func", "grad", "functorch"))


@pytest.mark.timeout(60)
def test_torch_func_grad_over_map() -> None:
    x, y = randn(4, seed=26, requires_grad=False), randn(4, seed=27, requires_grad=False)
    want = torch.func.grad(lambda a: (MulJvp.apply(a, y) * MulJvp.apply(y, a)).sum())(x)

    def run() -> Tensor:
        def f(a: Tensor) -> Tensor:
            (o1,), (o2,) = map_with_parallel_backward(MulJvp, (a, y), (y, a))
            return (o1 * o2).sum()
        return torch.func.grad(f)(x)
    equal_or_clear_error(run, want, ("torch.func", "grad", "functorch"))


@pytest.mark.timeout(60)
def test_torch_func_vmap_over_parallel_apply() -> None:
    expert = MLP(seed=5)
    xs = randn(3, 2, 4, seed=28, requires_grad=False)
    want = torch.func.vmap(expert)(xs)

    def run() -> Tensor:
        return torch.func.vmap(lambda a: parallel_apply([expert], [a])[0])(xs)
    equal_or_clear_error(run, want, ("vmap", "torch.func", "functorch"))


@pytest.mark.timeout(60)
def test_torch_func_vmap_over_map() -> None:
    xs, ys = randn(3, 4, seed=29, requires_grad=False), randn(3, 4, seed=30, requires_grad=False)
    want = torch.func.vmap(lambda a, b: MulJvp.apply(a, b))(xs, ys)

    def run() -> Tensor:
        return torch.func.vmap(lambda a, b: map_with_parallel_backward(MulJvp, (a, b))[0][0])(xs, ys)
    equal_or_clear_error(run, want, ("vmap", "torch.func", "functorch"))


# -- the MoE layer: parameters through torch.autograd.grad, failed calls as None -----------

class _FailBackward(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
        raise RuntimeError("injected backward failure")


class FailingInBackward(MLP):
    def forward(self, x: Tensor) -> Tensor:
        return _FailBackward.apply(super().forward(x))


def _moe(experts: Sequence[nn.Module]) -> MixtureOfExperts:
    torch.manual_seed(0)
    moe = MixtureOfExperts(list(experts), 4, k=2).double()
    with torch.no_grad():  # every expert gets tokens
        moe.gate.weight.copy_(torch.randn(3, 4, dtype=DT) * 2)
    return moe


@pytest.mark.timeout(60)
def test_moe_autograd_grad_wrt_expert_parameters_matches_plain_loop() -> None:
    moe = _moe([MLP(seed=e) for e in range(3)])
    ref = copy.deepcopy(moe)
    x = randn(12, 4, seed=31)
    ref_x = clone_leaf(x)
    y, aux = moe(x)
    y_ref, aux_ref = plain_moe(ref.gate, list(ref.experts), 2, ref_x)
    params = [p for e in moe.experts for p in e.parameters()] + [x]
    ref_params = [p for e in ref.experts for p in e.parameters()] + [ref_x]
    got = torch.autograd.grad(weighted([y]) + aux, params)
    want = torch.autograd.grad(weighted([y_ref]) + aux_ref, ref_params)
    for k, (g, w) in enumerate(zip(got, want)):
        close(g, w, f"gradient {k}")
    assert all(p.grad is None for p in moe.parameters())


@pytest.mark.timeout(60)
def test_moe_failed_backward_is_a_none_gradient_under_autograd_grad() -> None:
    """The layer's "failed call is a constant" policy: under
    torch.autograd.grad w.r.t. the experts' parameters, the failed expert's
    are None (allow_unused) and the others equal a plain loop where the failed
    expert's output is detached."""
    experts: List[nn.Module] = [MLP(seed=0), FailingInBackward(seed=1), MLP(seed=2)]
    moe = _moe(experts)
    ref = copy.deepcopy(moe)
    x = randn(12, 4, seed=32)
    ref_x = clone_leaf(x)
    y, _ = moe(x)

    class Detached(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, a: Tensor) -> Tensor:
            return MLP.forward(self.inner, a).detach()  # type: ignore[arg-type]

    ref_experts = [ref.experts[0], Detached(ref.experts[1]), ref.experts[2]]
    y_ref, _ = plain_moe(ref.gate, ref_experts, 2, ref_x)
    params = [p for e in moe.experts for p in e.parameters()] + [x]
    ref_params = [p for e in ref.experts for p in e.parameters()] + [ref_x]
    got = torch.autograd.grad(weighted([y]), params, allow_unused=True)
    want = torch.autograd.grad(weighted([y_ref]), ref_params, allow_unused=True)
    for k, (g, w) in enumerate(zip(got, want)):
        close(g, w, f"gradient {k}")
    n1 = len(list(moe.experts[0].parameters()))
    assert all(g is None for g in got[n1:n1 + len(list(moe.experts[1].parameters()))])


# -- tensors the experts reach without receiving them as arguments -------------------------

@pytest.mark.timeout(60)
def test_closure_over_a_leaf_weight_matches_sequential() -> None:
    """A callable expert closing over a leaf that requires grad: its gradient
    reaches ``.grad`` and its hooks fire as sequentially."""
    w = randn(4, 4, seed=40)
    ref_w = clone_leaf(w)
    x = randn(3, 4, seed=41, requires_grad=False)
    logs: Dict[str, List[Tensor]] = {"par": [], "seq": []}
    w.register_hook(lambda g: logs["par"].append(g.clone()))
    ref_w.register_hook(lambda g: logs["seq"].append(g.clone()))
    outs = parallel_apply([lambda a: a @ w, lambda a: (a @ w).tanh()], [x, 2 * x])
    assert all(o.requires_grad for o in outs)
    weighted(outs).backward()
    weighted([x @ ref_w, (2 * x @ ref_w).tanh()]).backward()
    close(w.grad, ref_w.grad, "w.grad")
    assert len(logs["par"]) == len(logs["seq"]) == 1
    close(logs["par"][0], logs["seq"][0], "hook gradient")


@pytest.mark.timeout(60)
def test_closure_over_a_caller_tensor_with_a_gradient_hook() -> None:
    """A callable expert closing over a NON-leaf tensor of the caller's graph
    (``w2 = tanh(w)``) that also feeds the loss directly, with a hook that
    clips its gradient: sequentially the hook runs once, on the summed
    gradient of ``w2``. The runtime must give the same ``w.grad`` (or refuse
    with a clear error), never clip partial gradients separately."""
    def run(parallel: bool) -> Tuple[Optional[Tensor], int, Optional[Tensor]]:
        w = randn(4, 4, seed=42)
        x1, x2 = randn(3, 4, seed=43), randn(3, 4, seed=44, requires_grad=False)
        w2 = w.tanh()
        fired: List[int] = []

        def clip(g: Tensor) -> Tensor:
            fired.append(1)
            return g.clamp(-0.5, 0.5)
        w2.register_hook(clip)

        def expert(a: Tensor) -> Tensor:
            return (a @ w2).sin()
        outs = parallel_apply([expert, expert], [x1, x2]) if parallel else [expert(x1), expert(x2)]
        (outs[0].square().sum() + 3 * outs[1].sum() + w2.square().sum()).backward()
        return w.grad, len(fired), x1.grad

    want_w, want_fired, want_x = run(parallel=False)
    try:
        got_w, got_fired, got_x = run(parallel=True)
    except RuntimeError as error:
        assert_clear_error(error, ("closure", "caller", "graph", "input"))
        return
    close(got_x, want_x, "x1.grad")
    close(got_w, want_w, "w.grad (the clipping hook ran on partial gradients?)")
    assert got_fired == want_fired, f"the hook ran {got_fired} times, sequentially {want_fired}"


@pytest.mark.timeout(60)
def test_closure_over_a_caller_tensor_without_hooks_matches_sequential() -> None:
    """The same closure over a non-leaf tensor of the caller's graph, without
    hooks: the loop's gradients, or a clear error (never wrong values)."""
    def run(parallel: bool) -> List[Optional[Tensor]]:
        w = randn(4, 4, seed=42)
        x1, x2 = randn(3, 4, seed=43), randn(3, 4, seed=44, requires_grad=False)
        w2 = w.tanh()

        def expert(a: Tensor) -> Tensor:
            return (a @ w2).sin()
        outs = parallel_apply([expert, expert], [x1, x2]) if parallel else [expert(x1), expert(x2)]
        (outs[0].square().sum() + 3 * outs[1].sum() + w2.square().sum()).backward()
        return [w.grad, x1.grad]

    want = run(parallel=False)
    try:
        got = run(parallel=True)
    except RuntimeError as error:
        assert_clear_error(error, ("closure", "caller", "graph", "input"))
        return
    for k, (g, w) in enumerate(zip(got, want)):
        close(g, w, f"gradient {k}")


@pytest.mark.timeout(60)
def test_module_full_backward_hooks_like_sequential() -> None:
    expert, ref = MLP(seed=5), MLP(seed=5)
    logs: Dict[str, List[Tuple[Optional[Tensor], Tensor]]] = {"par": [], "seq": []}
    for m, key in ((expert, "par"), (ref, "seq")):
        m.register_full_backward_hook(
            lambda mod, gi, go, key=key: logs[key].append(
                (None if gi[0] is None else gi[0].clone(), go[0].clone())))
    x = randn(3, 4, seed=45)
    ref_x = clone_leaf(x)
    weighted(parallel_apply([expert, expert], [x, 2 * x])).backward()
    weighted([ref(ref_x), ref(2 * ref_x)]).backward()
    assert len(logs["par"]) == len(logs["seq"]) == 2

    def key(entry: Tuple[Optional[Tensor], Tensor]) -> float:
        return float(entry[1].sum())
    for (gi, go), (gi_r, go_r) in zip(sorted(logs["par"], key=key), sorted(logs["seq"], key=key)):
        close(gi, gi_r, "grad_input")
        close(go, go_r, "grad_output")
    close(x.grad, ref_x.grad, "x.grad")


class _Gate(Function):
    """Identity whose backward signals ``entered`` and waits for ``proceed``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, entered: Any, proceed: Any) -> Tensor:  # type: ignore[override]
        ctx.entered, ctx.proceed = entered, proceed
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tuple[Tensor, None, None]:  # type: ignore[override]
        ctx.entered.set()
        assert ctx.proceed.wait(20)
        return g, None, None


@pytest.mark.timeout(60)
@pytest.mark.xfail(strict=True, reason=(
    "known limit (README 'Known limits'; node.py _mute_tensor_hooks): while a parallel "
    "call's backward runs, the register_hook hooks of the parameters it reaches are held "
    "back, so a backward of another thread through the same parameters at that moment "
    "does not run them"))
def test_parameter_hook_fires_in_a_concurrent_backward_of_another_thread() -> None:
    """Hogwild-style: thread A's parallel backward is inside expert e's
    backward; meanwhile this thread runs a plain backward through e. As
    sequentially, e's weight hook fires for this thread's backward too."""
    import threading

    e = MLP(seed=6)
    fired: List[str] = []
    e.fc1.weight.register_hook(lambda g: fired.append(threading.current_thread().name))
    entered, proceed = threading.Event(), threading.Event()

    class Gated(nn.Module):
        def forward(self, a: Tensor) -> Tensor:
            return _Gate.apply(e(a), entered, proceed)

    x = randn(3, 4, seed=46)
    errors: List[BaseException] = []

    def thread_a() -> None:
        try:
            parallel_apply([Gated(), Gated()], [x, 2 * x])[0].sum().backward()
        except BaseException as error:  # noqa: B902 - re-raised below
            errors.append(error)

    a = threading.Thread(target=thread_a, name="user-a")
    a.start()
    try:
        assert entered.wait(20), "thread A never reached the expert's backward"
        e(randn(3, 4, seed=47)).sum().backward()  # this thread, plain autograd
        mine = fired.count(threading.current_thread().name)
    finally:
        proceed.set()
        a.join(20)
    assert not a.is_alive() and not errors, errors
    assert mine == 1, f"the hook fired {mine} times for this thread's backward, sequentially 1"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("x_requires_grad", [False, True])
def test_forward_ad_with_a_dual_tensor_captured_by_an_expert(x_requires_grad: bool) -> None:
    """A dual tensor the runtime cannot see in the arguments (closed over by
    a callable expert): the tangent must still equal the loop's, or the call
    must raise clearly; never a silent None."""
    w, t = randn(4, seed=48, requires_grad=False), randn(4, seed=49, requires_grad=False)
    x = randn(3, 4, seed=50, requires_grad=x_requires_grad)
    with fwAD.dual_level():
        w_dual = fwAD.make_dual(w, t)

        def expert(a: Tensor) -> Tensor:
            return (a * w_dual).sin()
        want = fwAD.unpack_dual(expert(x)).tangent
        assert want is not None

        def run() -> Optional[Tensor]:
            return fwAD.unpack_dual(parallel_apply([expert, expert], [x, 2 * x])[0]).tangent
        equal_or_clear_error(run, want, FORWARD_MODES)


@pytest.mark.timeout(60)
def test_moe_under_forward_ad_is_exact_or_a_clear_error() -> None:
    moe = _moe([MLP(seed=e) for e in range(3)])
    ref = copy.deepcopy(moe)
    x, t = randn(8, 4, seed=51, requires_grad=False), randn(8, 4, seed=52, requires_grad=False)
    with fwAD.dual_level():
        y_ref, _ = plain_moe(ref.gate, list(ref.experts), 2, fwAD.make_dual(x, t))
        want = fwAD.unpack_dual(y_ref).tangent

        def run() -> Optional[Tensor]:
            y, _ = moe(fwAD.make_dual(x, t))
            return fwAD.unpack_dual(y).tangent
        equal_or_clear_error(run, want, FORWARD_MODES + ("MixtureOfExperts",))
