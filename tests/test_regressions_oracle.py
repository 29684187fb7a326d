"""Named regression tests for the divergences the differential oracle
(``tests/oracle``) found between the runtime and a plain loop.

Each test is the smallest form of one divergence: it runs the same thing
through ``parallel_apply`` and through ``[m(*a) for m, a in zip(...)]`` and
asserts that what the caller can observe is the same (or that the runtime
raises a clear error naming the call, where that is the contract). A test
of a divergence not fixed yet is ``xfail(strict=True)``: when the fix lands
it XPASSes and fails, and the mark (and the matching entry of
``tests/oracle/oracle_known.py``) must go.

Replay the oracle case a test came from with the ``pytest tests/oracle
--fuzz-seed=S --fuzz-case=K`` line in its docstring, where it has one.
"""
import copy
from typing import Any, Callable, List, Sequence, Tuple

import pytest
import torch
import torch.utils.checkpoint as tuc
import torch.nn.functional as F
from torch import Tensor, nn

from moe_autograd import map_with_parallel_backward, parallel_apply

from helpers import RaisesInBackward as RaisesInBackwardFn, bits_equal

pytestmark = pytest.mark.timeout(60)

MODES = ["inline", "lanes", "parallel"]


def loop(modules: Sequence[nn.Module], inputs: Sequence[Any]) -> List[Any]:
    return [m(*(a if isinstance(a, tuple) else (a,))) for m, a in zip(modules, inputs)]


def twins(make: Callable[[], nn.Module], n: int = 1) -> Tuple[List[Any], List[Any]]:
    """``n`` modules, and an identical deep copy of them (for the loop)."""
    torch.manual_seed(0)
    mods = [make() for _ in range(n)]
    return mods, copy.deepcopy(mods)


class Nested(nn.Module):
    """An expert that runs a nested batch of two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.nested_loop = False

    def forward(self, x: Tensor) -> Tensor:
        subs = list(self.subs)
        a, b = loop(subs, [x, x]) if self.nested_loop else parallel_apply(subs, [x, x])
        return a + b


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_nested_parallel_apply_leaves_global_rng_alone(mode: str, checkpoint: bool) -> None:
    """oracle: stage nested; e.g. pytest tests/oracle --fuzz-seed=0 --fuzz-case=32 (was D1)"""
    (expert,), _ = twins(Nested)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    x = torch.ones(3, 4, requires_grad=True)
    parallel_apply([expert], [x], mode=mode, checkpoint=checkpoint)[0].sum().backward()
    assert torch.equal(torch.get_rng_state(), before)


class TensorAttr(nn.Module):
    """Keeps a plain tensor attribute and a counter buffer, set in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.count: Tensor
        self.register_buffer("count", torch.zeros(()))
        self.last: Any = None

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.count += 1
        self.last = x.detach().sum()
        return self.fc(x) * (1 + self.count)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_call_keeps_tensor_attribute_as_set(mode: str) -> None:
    """oracle: checkpoint:all + stage:counter; pytest tests/oracle --fuzz-seed=0 --fuzz-case=13"""
    (mod,), (ref,) = twins(TensorAttr)
    x = torch.randn(3, 4, requires_grad=True)
    parallel_apply([mod], [x], checkpoint=True, mode=mode)[0].sum().backward()
    ref(x.detach().requires_grad_()).sum().backward()
    assert mod.last.requires_grad == ref.last.requires_grad
    assert (mod.last.grad_fn is None) == (ref.last.grad_fn is None)
    assert bits_equal(mod.last, ref.last) and bits_equal(mod.count, ref.count)


@pytest.mark.xfail(strict=True, reason="D3: a checkpointed call recomputes from an input that "
                   "was modified in place after the call, silently (the loop raises)")
@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_call_detects_input_modified_in_place(mode: str) -> None:
    """oracle: checkpoint:all + post:in_add_; pytest tests/oracle --fuzz-seed=0 --fuzz-case=7"""
    (mod,), _ = twins(lambda: nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    y = parallel_apply([mod], [x], checkpoint=True, mode=mode)[0]
    with torch.no_grad():
        x.add_(1)  # the loop's Linear saved x: its backward raises
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


class InnerReentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return tuc.checkpoint(self.fc, x, use_reentrant=True)


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_reentrant_checkpoint_inside_expert_raises_clearly(mode: str) -> None:
    """D4 (raising is the contract): reentrant torch.utils.checkpoint inside an
    expert cannot run in the runtime's backward (a torch.autograd.grad); the
    error names the call and the construct. oracle: stage:ckpt_reentrant;
    pytest tests/oracle --fuzz-seed=0 --fuzz-case=12"""
    (mod,), _ = twins(InnerReentrant)
    x = torch.randn(3, 4, requires_grad=True)
    y = parallel_apply([mod], [x], mode=mode)[0]
    with pytest.raises(RuntimeError, match=r"call 0 of 1.*use_reentrant=True"):
        y.sum().backward()


class TwoOutputs(nn.Module):
    """Returns ``h`` and something computed from ``h``; ``self.aux`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.aux: Any = None

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = self.fc(x)
        self.aux = (h ** 2).mean()
        return h, h * 2


@pytest.mark.xfail(strict=True, reason="D5: a hook on an output that other outputs (or "
                   "self.aux) are computed from runs before the call's backward, with only "
                   "its direct gradient")
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_output_hook_sees_gradient_through_other_outputs(mode: str) -> None:
    """oracle: hook:out + output:tuple / output:aux;
    pytest tests/oracle --fuzz-seed=0 --fuzz-case=126"""
    (mod,), (ref,) = twins(TwoOutputs)
    x = torch.randn(3, 4, requires_grad=True)
    got: List[Tensor] = []
    want: List[Tensor] = []
    h, h2 = parallel_apply([mod], [x], mode=mode)[0]
    h.register_hook(lambda g: got.append(g.clone()))  # the value the hook sees
    (h.sum() + h2.sum() + mod.aux).backward()
    rh, rh2 = ref(x.detach().requires_grad_())
    rh.register_hook(lambda g: want.append(g.clone()))
    (rh.sum() + rh2.sum() + ref.aux).backward()
    assert len(got) == len(want) == 1 and bits_equal(got[0], want[0])


_D5B = pytest.mark.xfail(strict=True, reason=(
    "D5b: torch.autograd.grad captures the gradient of an output the call computes further "
    "from before the node runs: asked for with the call's input, it is the direct part only"))


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
@pytest.mark.parametrize("how", ["retain_grad", pytest.param("autograd_grad", marks=_D5B),
                                 "backward_inputs"])
def test_gradient_of_an_output_other_outputs_are_computed_from(mode: str, how: str) -> None:
    """D5 (fixed for everything but hooks, issue 30): ``.grad`` after
    retain_grad(), torch.autograd.grad and backward(inputs=...) of an output
    that the call computes further from (``return h, h * 2``, ``self.aux``)
    sum its gradient through the other outputs too, as the loop's."""
    (mod,), (ref,) = twins(TwoOutputs)
    x = torch.randn(3, 4, requires_grad=True)
    results = []
    for expert, run in ((mod, lambda m, t: parallel_apply([m], [t], mode=mode)[0]),
                        (ref, lambda m, t: m(t))):
        t = x.detach().requires_grad_()
        h, h2 = run(expert, t)
        loss = h.sum() + h2.sum() + expert.aux
        if how == "retain_grad":
            h.retain_grad()
            loss.backward()
            results.append((h.grad, t.grad))
        elif how == "autograd_grad":
            results.append(torch.autograd.grad(loss, [h, t]))
        else:
            loss.backward(inputs=[h, t])
            results.append((h.grad, t.grad))
    (got_h, got_x), (want_h, want_x) = results
    assert bits_equal(got_h, want_h) and bits_equal(got_x, want_x)


class Identity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return x


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_expert_returning_its_input(mode: str) -> None:
    """D6 (fixed): checkpoint=True and an expert returning its input raised a
    bare AssertionError in ModuleCall.rebuild.
    oracle: checkpoint:all + output:identity; pytest tests/oracle --fuzz-seed=0 --fuzz-case=29"""
    (mod,), _ = twins(Identity)
    x = torch.randn(3, 4, requires_grad=True)
    try:
        y = parallel_apply([mod], [x], checkpoint=True, mode=mode)[0]
    except Exception as error:  # a clear error is the other acceptable outcome
        assert "call 0 of 1" in str(error) + "".join(getattr(error, "__notes__", ()))
        return
    assert y is x or bits_equal(y, x)
    y.sum().backward()
    assert bits_equal(x.grad, torch.ones(3, 4))


class SetsRequiresGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        x.requires_grad_()
        return self.fc(x)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_requires_grad_on_input_inside_expert(mode: str, checkpoint: bool) -> None:
    """D7 (fixed): x.requires_grad_() on an input inside an expert reaches the
    caller's tensor. oracle: stage:requires_grad_ + x:leaf;
    pytest tests/oracle --fuzz-seed=0 --fuzz-case=3"""
    (mod,), (ref,) = twins(SetsRequiresGrad)
    x, rx = torch.randn(3, 4), torch.randn(3, 4)
    rx.copy_(x)
    if checkpoint:  # a recomputation cannot know where the loop starts tracking x (D7b)
        with pytest.raises(RuntimeError, match="the checkpointed expert called requires_grad_"):
            parallel_apply([mod], [x], checkpoint=checkpoint, mode=mode)
        return
    parallel_apply([mod], [x], checkpoint=checkpoint, mode=mode)[0].sum().backward()
    ref(rx).sum().backward()
    assert x.requires_grad == rx.requires_grad
    assert bits_equal(x.grad, rx.grad)
    assert bits_equal(mod.fc.weight.grad, ref.fc.weight.grad)


class ViewOfInput(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x[:, :2]


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])  # inference: was D8
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_view_of_input_under_no_grad(mode: str, grad_mode: str) -> None:
    """oracle: grad_mode:inference + output:input_view; pytest tests/oracle --fuzz-seed=0 --fuzz-case=56"""
    x = torch.randn(3, 4)
    with getattr(torch, grad_mode)():
        y = parallel_apply([ViewOfInput()], [x], mode=mode)[0]
        ry = ViewOfInput()(x)
    assert (y._base is x) == (ry._base is x)


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


@pytest.mark.xfail(strict=True, reason="D9: backward(inputs=...) / autograd.grad of a subset "
                   "still runs every call's backward: hooks fire and retained grads appear on "
                   "outputs the loop's backward never reaches")
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_backward_inputs_prunes_calls(mode: str) -> None:
    """oracle: grad_method:backward_inputs + hook:out / retain_grad;
    pytest tests/oracle --fuzz-seed=0 --fuzz-case=283"""
    mods, refs = twins(Two, 2)
    xs = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    fired: List[int] = []
    ys = parallel_apply(mods, xs, mode=mode)
    ys[1].register_hook(lambda g: fired.append(1))
    (ys[0].sum() + ys[1].sum()).backward(inputs=[mods[0].fc.weight])
    ref_fired: List[int] = []
    rys = loop(refs, [x.detach().requires_grad_() for x in xs])
    rys[1].register_hook(lambda g: ref_fired.append(1))
    (rys[0].sum() + rys[1].sum()).backward(inputs=[refs[0].fc.weight])
    assert fired == ref_fired == []


class RaisesInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        # (a module-level FailsInBackward below is a Module: named here, it
        # made these tests fail in their own forward, whatever D9/D10/D21 did)
        return RaisesInBackwardFn.apply(x, "expert backward failed") * self.gain


@pytest.mark.xfail(strict=True, reason="D9: autograd.grad w.r.t. parameters only still runs "
                   "the part of a call's backward the loop never runs (here: raises)")
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_autograd_grad_of_params_skips_unneeded_backward(mode: str) -> None:
    """oracle: grad_method:autograd_grad + raise:backward; pytest tests/oracle --fuzz-seed=0 --fuzz-case=200"""
    (mod,), (ref,) = twins(RaisesInBackward)
    x = torch.randn(3, 4, requires_grad=True)
    (want,) = torch.autograd.grad(ref(x).sum(), [ref.gain])
    (got,) = torch.autograd.grad(parallel_apply([mod], [x], mode=mode)[0].sum(), [mod.gain])
    assert bits_equal(got, want)


@pytest.mark.xfail(strict=True, reason="D10: in inline mode an expert's error in backward does "
                   "not name the call")
def test_inline_backward_error_names_the_call() -> None:
    """oracle: raise:backward + mode:inline (or auto once it runs inline)"""
    (mod,), _ = twins(RaisesInBackward)
    y = parallel_apply([mod, mod], [torch.randn(3, 4, requires_grad=True)] * 2, mode="inline")
    with pytest.raises(ValueError) as info:
        (y[0].sum() + y[1].sum()).backward()
    text = str(info.value) + "".join(getattr(info.value, "__notes__", ()))
    assert "call 1 of 2" in text or "call 0 of 2" in text


class NestedPassThrough(nn.Module):
    """A nested batch on ``x`` twice, and ``x`` itself returned too."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Nested()

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return self.inner(x), x


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_nested_batch_on_a_passed_through_input(mode: str) -> None:
    """oracle: stage:nested + output:input_pass; pytest tests/oracle --fuzz-seed=0 --fuzz-case=84"""
    (mod,), (ref,) = twins(NestedPassThrough)
    ref.inner.nested_loop = True
    torch.manual_seed(3)
    x = torch.randn(3, 4, requires_grad=True)
    rx = x.detach().clone().requires_grad_()
    w = torch.randn(3, 4)
    y, same = parallel_apply([mod], [x], mode=mode)[0]
    ((y * w).sum() + (same * 3).sum()).backward()
    ry, rsame = ref(rx)
    ((ry * w).sum() + (rsame * 3).sum()).backward()
    assert bits_equal(x.grad, rx.grad)


class SpectralLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_shared_spectral_norm_module(mode: str) -> None:
    """oracle: shared + stage:spectral_norm (was D11); e.g. pytest tests/oracle --fuzz-seed=0
    --fuzz-case=322"""
    (mod,), (ref,) = twins(SpectralLinear)
    xs = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    ys = parallel_apply([mod, mod], xs, mode=mode)
    rys = loop([ref, ref], [x.detach().requires_grad_() for x in xs])
    for y, ry in zip(ys, rys):
        assert bits_equal(y, ry)
    (ys[0].sum() + 2 * ys[1].sum()).backward()
    (rys[0].sum() + 2 * rys[1].sum()).backward()
    original = mod.fc.parametrizations.weight.original
    assert bits_equal(original.grad, ref.fc.parametrizations.weight.original.grad)
    assert bits_equal(mod.fc.parametrizations.weight[0]._u, ref.fc.parametrizations.weight[0]._u)


class Scale(nn.Module):
    """``x * w``; with ``flip``, calls ``x.requires_grad_()`` first."""

    def __init__(self, flip: bool = False, returns_input: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.flip, self.returns_input = flip, returns_input

    def forward(self, x: Tensor) -> Tensor:
        if self.flip:
            x.requires_grad_()
        return x if self.returns_input else x * self.w


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_requires_grad_on_input_shared_with_a_later_call_raises(mode: str) -> None:
    """oracle: stage:requires_grad_ + same_input; pytest tests/oracle --fuzz-seed=0
    --fuzz-case=140 (was D7a, silent: the later call's use got no gradient)."""
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"call 0 of 2: the expert called requires_grad_\(\) "
                       r"on an input that call 1 of 2 also receives"):
        parallel_apply([Scale(flip=True), Scale()], [x, x], mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_requires_grad_on_input_shared_with_an_earlier_call(mode: str) -> None:
    """The earlier call's use is not tracked in the loop either: equal."""
    x, rx = torch.randn(3, 4), torch.randn(3, 4)
    rx.copy_(x)
    ys = parallel_apply([Scale(), Scale(flip=True)], [x, x], mode=mode)
    (ys[0].sum() + ys[1].sum()).backward()
    rys = loop([Scale(), Scale(flip=True)], [rx, rx])
    (rys[0].sum() + rys[1].sum()).backward()
    assert bits_equal(x.grad, rx.grad)


class LinearThenFlip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)  # x does not require grad yet: the loop does not track this use
        x.requires_grad_()
        return h + x


@pytest.mark.parametrize("mode", MODES)
def test_requires_grad_inside_checkpointed_call(mode: str) -> None:
    """oracle: checkpoint + stage:requires_grad_; pytest tests/oracle --fuzz-seed=0 --fuzz-case=234
    (was D7b, silent: the recomputation tracked the input from the start)."""
    (mod,), _ = twins(LinearThenFlip)
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError) as info:
        parallel_apply([mod], [x], checkpoint=True, mode=mode)
    assert str(info.value) == (
        "parallel_apply: call 0 of 1: the checkpointed expert called requires_grad_() on an "
        "input that did not require grad; its recomputation cannot reproduce where the loop "
        "starts tracking it: pass it requiring grad, or call this expert with checkpoint=False")


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_requires_grad_on_returned_input(mode: str) -> None:
    """oracle: stage:requires_grad_ + output:identity; pytest tests/oracle --fuzz-seed=0 --fuzz-case=484
    (was D7c: every call needing no gradient skipped adopting the flip)"""
    x = torch.randn(3, 4)
    y = parallel_apply([Scale(flip=True, returns_input=True)], [x], mode=mode)[0]
    assert x.requires_grad and y.requires_grad


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_requires_grad_inside_reentrant_checkpoint_frame(mode: str) -> None:
    """oracle: frame:ckpt_reentrant + stage:requires_grad_; pytest tests/oracle --fuzz-seed=0 --fuzz-case=187
    (was D7d)"""
    x, rx = torch.randn(3, 4), torch.randn(3, 4)
    rx.copy_(x)
    w = torch.ones(4, requires_grad=True)  # so that the frame's output requires grad
    tuc.checkpoint(lambda x, w: parallel_apply([Scale(flip=True)], [x], mode=mode)[0] * w,
                   x, w, use_reentrant=True).sum().backward()
    tuc.checkpoint(lambda x, w: Scale(flip=True)(x) * w, rx, w, use_reentrant=True).sum().backward()
    assert x.requires_grad == rx.requires_grad


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_requires_grad_under_no_grad(mode: str, grad_mode: str) -> None:
    """oracle: grad_mode:no_grad + stage:requires_grad_; pytest tests/oracle --fuzz-seed=0 --fuzz-case=35
    (was D7e)"""
    x = torch.randn(3, 4)
    with getattr(torch, grad_mode)():
        parallel_apply([Scale(flip=True)], [x], mode=mode)
    assert x.requires_grad


class BatchNormExpert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(x)


@pytest.mark.xfail(strict=True, reason="D14: a non-reentrant checkpoint frame around "
                   "checkpoint=True calls that update buffers: running stats differ")
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_frame_around_checkpointed_batchnorm(mode: str) -> None:
    """oracle: frame:ckpt_nonreentrant + checkpoint + stage:bn; pytest tests/oracle --fuzz-seed=0 --fuzz-case=963"""
    (mod,), (ref,) = twins(BatchNormExpert)
    x = torch.randn(3, 4, requires_grad=True)
    tuc.checkpoint(lambda x: parallel_apply([mod], [x], checkpoint=True, mode=mode)[0], x,
                   use_reentrant=False).sum().backward()
    tuc.checkpoint(ref, x, use_reentrant=False).sum().backward()
    assert bits_equal(mod.bn.running_mean, ref.bn.running_mean)
    assert bits_equal(mod.bn.num_batches_tracked, ref.bn.num_batches_tracked)


class DoublesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        x.mul_(2)  # in place on the caller's (non-leaf) tensor
        return x * self.w


@pytest.mark.xfail(strict=True, reason="D15: an expert's in-place op on its non-leaf input "
                   "raises 'a leaf Variable that requires grad is being used in an in-place "
                   "operation'")
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_expert_in_place_on_its_input(mode: str) -> None:
    """oracle: stage:input_inplace + x:nonleaf; pytest tests/oracle --fuzz-seed=0 --fuzz-case=640"""
    root = torch.randn(3, 4, requires_grad=True)
    x = root * 1.5
    parallel_apply([DoublesInput()], [x], mode=mode)
    rx = root * 1.5
    DoublesInput()(rx)
    assert bits_equal(x, rx)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_expert_in_place_on_its_input_raises(mode: str) -> None:
    """A checkpointed expert that modifies its input in place: its recomputation
    would see other values, so the forward raises, naming the call and why."""
    x = torch.randn(3, 4, requires_grad=True) * 1.5
    with pytest.raises(RuntimeError) as info:
        parallel_apply([DoublesInput()], [x], checkpoint=True, mode=mode)
    assert str(info.value) == (
        "parallel_apply: call 0 of 1: the checkpointed expert modified in place an input that "
        "requires grad; its recomputation would see other values: clone the input first, or "
        "call this expert with checkpoint=False")


class PassThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.save_for_backward(w)
        return x, x * w

    @staticmethod
    def backward(ctx: Any, gx: Tensor, gy: Tensor) -> Any:  # type: ignore[override]
        (w,) = ctx.saved_tensors
        return gx + gy * w, None


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_map_function_returning_its_input_is_a_view(mode: str) -> None:
    """oracle: fn:FPassThrough; pytest tests/oracle --fuzz-seed=0 --fuzz-case=170"""
    from moe_autograd import map_with_parallel_backward
    x, w = torch.randn(3, 4, requires_grad=True), torch.ones(4)
    (out, _), = map_with_parallel_backward(PassThrough, (x, w), mode=mode)
    ref, _ = PassThrough.apply(x, w)
    assert (out._base is x) == (ref._base is x)


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_map_function_returning_its_input_under_no_grad(mode: str) -> None:
    """oracle: fn:FPassThrough + grad_mode:no_grad; pytest tests/oracle --fuzz-seed=0 --fuzz-case=961"""
    from moe_autograd import map_with_parallel_backward
    x, w = torch.randn(3, 4, requires_grad=True), torch.ones(4)
    with torch.no_grad():
        (out, _), = map_with_parallel_backward(PassThrough, (x, w), mode=mode)
        ref, _ = PassThrough.apply(x, w)
    assert out.requires_grad == ref.requires_grad


class WithIndex(torch.autograd.Function):
    """A float output and an integer one; backward records what it got."""

    seen: List[Tuple[bool, bool]] = []

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        return x * 2, x.argmax(-1)

    @staticmethod
    def backward(ctx: Any, gy: Tensor, gi: Any) -> Tensor:  # type: ignore[override]
        WithIndex.seen.append((gy is None, gi is None))
        return gy * 2


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_map_function_integer_output_gradient(mode: str) -> None:
    """oracle: fn:FNonDiff; pytest tests/oracle --fuzz-seed=0 --fuzz-case=105"""
    from moe_autograd import map_with_parallel_backward
    x = torch.randn(3, 4, requires_grad=True)
    WithIndex.seen.clear()
    WithIndex.apply(x)[0].sum().backward()
    (y, _), = map_with_parallel_backward(WithIndex, (x,), mode=mode)
    y.sum().backward()
    assert WithIndex.seen[0] == WithIndex.seen[1]


class SavesInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_map_saved_input_modified_in_place(mode: str) -> None:
    """oracle: entry:map + post:in_add_; pytest tests/oracle --fuzz-seed=0 --fuzz-case=598"""
    from moe_autograd import map_with_parallel_backward
    x, w = torch.randn(3, 4, requires_grad=True), torch.ones(4, requires_grad=True)
    (y,), = map_with_parallel_backward(SavesInput, (x, w), mode=mode)
    with torch.no_grad():
        x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


class CountsBackward(torch.autograd.Function):
    calls: List[int] = []

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        CountsBackward.calls.append(1)
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


@pytest.mark.xfail(strict=True, reason="D9: backward(inputs=...) runs the backward of map calls "
                   "that the loop's backward never reaches")
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_map_backward_inputs_prunes_calls(mode: str) -> None:
    """oracle: entry:map + grad_method:backward_inputs; pytest tests/oracle --fuzz-seed=0 --fuzz-case=210"""
    from moe_autograd import map_with_parallel_backward
    xs = [torch.randn(3, 4) for _ in range(2)]
    ws = [torch.ones(4, requires_grad=True) for _ in range(2)]
    CountsBackward.calls.clear()
    ys = [CountsBackward.apply(x, w) for x, w in zip(xs, ws)]
    (ys[0].sum() + ys[1].sum()).backward(inputs=[ws[0]])
    want = len(CountsBackward.calls)
    CountsBackward.calls.clear()
    ys = [y for (y,) in map_with_parallel_backward(CountsBackward, *zip(xs, ws), mode=mode)]
    (ys[0].sum() + ys[1].sum()).backward(inputs=[ws[0]])
    assert len(CountsBackward.calls) == want == 1


class SeesItsInput(nn.Module):
    """Records what the expert sees of its input and of grad mode."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.seen: List[Tuple[bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append((x.is_leaf, torch.is_grad_enabled()))
        return x * self.w


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_expert_sees_grad_enabled(mode: str) -> None:
    """oracle: checkpoint + stage:introspect; pytest tests/oracle --fuzz-seed=0 --fuzz-case=31"""
    mod = SeesItsInput()
    parallel_apply([mod], [torch.randn(3, 4, requires_grad=True)], checkpoint=True, mode=mode)
    assert mod.seen[0] == (True, True)


@pytest.mark.xfail(strict=True, reason="D19b: the expert sees a non-leaf input as a leaf")
@pytest.mark.parametrize("grad_mode", ["enable_grad", "no_grad"])
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_expert_sees_non_leaf_input_as_non_leaf(mode: str, grad_mode: str) -> None:
    """oracle: stage:introspect + x:nonleaf; pytest tests/oracle --fuzz-seed=0 --fuzz-case=152"""
    mod = SeesItsInput()
    x = torch.randn(3, 4, requires_grad=True) * 2
    with getattr(torch, grad_mode)():
        parallel_apply([mod], [x], mode=mode)
    assert mod.seen[0][0] is False


class IgnoresWeight(nn.Module):
    """Has a parameter its output does not depend on."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return x * 2


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_unused_parameter_hooks_do_not_fire(mode: str) -> None:
    """oracle: checkpoint + output:identity + hook:param / hook:post_acc;
    pytest tests/oracle --fuzz-seed=1 --fuzz-case=425"""
    mod = IgnoresWeight()
    fired: List[Any] = []
    mod.w.register_hook(fired.append)
    mod.w.register_post_accumulate_grad_hook(fired.append)
    x = torch.randn(3, 4, requires_grad=True)
    parallel_apply([mod], [x], checkpoint=True, mode=mode)[0].sum().backward()
    assert fired == [] and mod.w.grad is None


@pytest.mark.xfail(strict=True, reason="D21: under autocast, an expert's error in backward does "
                   "not name the call")
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_backward_error_under_autocast_names_the_call(mode: str) -> None:
    """oracle: frame:autocast + raise:backward; pytest tests/oracle --fuzz-seed=1 --fuzz-case=467"""
    x = torch.randn(3, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = parallel_apply([RaisesInBackward()], [x], mode=mode)[0]
    with pytest.raises(ValueError) as info:
        y.float().sum().backward()
    assert "call 0 of 1" in str(info.value) + "".join(getattr(info.value, "__notes__", ()))


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_output_modified_in_place(mode: str) -> None:
    """oracle: checkpoint + output:aux + post:out_mul_; pytest tests/oracle --fuzz-seed=1 --fuzz-case=445"""
    (mod,), _ = twins(TwoOutputs)
    x = torch.randn(3, 4, requires_grad=True)
    h, _ = parallel_apply([mod], [x], checkpoint=True, mode=mode)[0]
    h.mul_(2)  # self.aux = (h ** 2).mean() needs h as it was
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (h.sum() + mod.aux).backward()


class EmbedThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4, sparse=True)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor, idx: Tensor) -> Tensor:
        return self.fc(x + self.emb(idx))


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_sparse_gradient_does_not_alias_input_gradient(mode: str) -> None:
    """oracle: stage:embedding + a Linear after it + iterations>1;
    pytest tests/oracle --fuzz-seed=7 --fuzz-case=1274"""
    (mod,), (ref,) = twins(EmbedThenLinear)
    x = torch.randn(3, 4, requires_grad=True)
    rx = x.detach().clone().requires_grad_()
    idx = torch.tensor([1, 2, 1])
    for _ in range(2):
        parallel_apply([mod], [(x, idx)], mode=mode)[0].sum().backward()
        ref(rx, idx).sum().backward()
        assert bits_equal(mod.emb.weight.grad.to_dense(), ref.emb.weight.grad.to_dense())


class Gated(nn.Module):
    """Reads its input twice (SwiGLU's two projections), optionally twice
    more through a second argument and a weight the caller also uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor, y: Any = None) -> Tensor:
        out = torch.tanh(self.a(x)) * self.b(x)
        if y is not None:
            out = out + self.a(y) * y
        return out


def _shared_input_grads(runner: Callable[..., List[Any]], mods: Sequence[nn.Module],
                        x0: Tensor, twice: bool) -> List[Tensor]:
    h = torch.tanh(x0)
    args = [(h, h) if twice else h for _ in mods]
    outs = runner(list(mods), args)
    # The caller uses h and a weight of the experts too: their terms come first.
    (sum((o * (k + 1)).sum() for k, o in enumerate(outs)) + (h * h).sum()
     + (mods[0].a.weight ** 2).sum()).backward()
    return [x0.grad, *(p.grad for m in mods for p in m.parameters())]


@pytest.mark.parametrize("checkpoint", [False, True])  # True: was D11
@pytest.mark.parametrize("twice", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_input_read_on_several_paths_sums_as_the_loop(mode: str, shared: bool, twice: bool,
                                                       checkpoint: bool) -> None:
    """An input the expert reads twice, that another call (same module or
    not) and the caller also use: the engine must add its gradient terms one
    by one in the loop's order, not each call's sum at once (last bits).
    oracle: stage:mlp + stage:requires_grad_ + same_input; pytest tests/oracle
    --fuzz-seed=1795467467 --fuzz-case=19597 (and 8157: a nested batch)."""
    torch.manual_seed(0)
    made = [Gated() for _ in range(2)]
    mods = [made[0], made[0]] if shared else made
    refs = copy.deepcopy(mods)
    for _ in range(3):  # rounding differs in some seeds only: try several inputs
        x0 = torch.randn(8, 4, requires_grad=True)
        rx0 = x0.detach().clone().requires_grad_()
        for m in (*mods, *refs):
            m.zero_grad(set_to_none=True)
        got = _shared_input_grads(lambda ms, a: parallel_apply(ms, a, mode=mode,
                                                              checkpoint=checkpoint),
                                  mods, x0, twice)
        want = _shared_input_grads(loop, refs, rx0, twice)
        assert all(bits_equal(g, w) for g, w in zip(got, want))


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor) -> Tensor:
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise ValueError("expert backward failed on purpose")


class DoublesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        x.mul_(2)  # again in the frame's recomputation: that one fails to match
        return x * self.g


class FailsInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return _FailingBackward.apply(x * self.g)


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_frame_recomputation_failure_is_met_where_the_loop_meets_it(mode: str) -> None:
    """A non-reentrant checkpoint frame whose recomputation fails (an expert
    modifies its input in place again): the loop's backward meets the last
    call's own error first and never recomputes; the runtime unpacks the
    calls' saved tensors before their backward, so that failure must wait for
    a call that needs them. oracle: frame:ckpt_nonreentrant + input_inplace +
    raise:backward; pytest tests/oracle --fuzz-seed=1795467467 --fuzz-case=17553"""
    def run(runner: Callable[[List[nn.Module], List[Tensor]], List[Tensor]]) -> BaseException:
        torch.manual_seed(0)
        mods: List[nn.Module] = [DoublesItsInput(), FailsInBackward()]
        x0, x1 = torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)

        def frame(a: Tensor, b: Tensor) -> Tensor:
            out = runner(mods, [a, b])
            return out[0].sum() + out[1].sum()
        with pytest.raises(Exception) as info:
            tuc.checkpoint(frame, x0, x1, use_reentrant=False).backward()
        return info.value
    got = run(lambda ms, xs: parallel_apply(ms, xs, mode=mode))
    want = run(loop)
    assert type(got) is type(want) and str(got) == str(want)
    assert "call 1 of 2" in "".join(getattr(got, "__notes__", ()))


@pytest.mark.xfail(strict=True, reason="D7f: requires_grad_() inside an expert in a non-reentrant "
                   "checkpoint frame: the loop's recomputation raises CheckpointError, the "
                   "runtime computes")
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_requires_grad_inside_non_reentrant_frame(mode: str) -> None:
    """oracle: frame:ckpt_nonreentrant + stage:requires_grad_ + checkpoint:mixed; pytest
    tests/oracle --fuzz-seed=0 --fuzz-case=468 (without checkpoint=True calls the runtime
    raises the loop's CheckpointError too)"""
    def run(runner: Callable[[List[nn.Module], List[Tensor]], List[Tensor]]) -> str:
        torch.manual_seed(0)
        mods: List[nn.Module] = [Scale(), Scale(flip=True)]
        x = torch.randn(3, 4)

        def frame(a: Tensor) -> Tensor:
            ys = runner(mods, [a, a])
            return ys[0].sum() + ys[1].sum()
        try:
            tuc.checkpoint(frame, x, use_reentrant=False).backward()
        except Exception as error:  # noqa: BLE001
            return type(error).__name__
        return "ok"
    want = run(loop)
    assert want == "CheckpointError"
    assert run(lambda ms, xs: parallel_apply(ms, xs, mode=mode,
                                             checkpoint=[True, False])) == want


class HeadView(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x[:, :2]


@pytest.mark.xfail(strict=True, reason="D7g: a view of an input returned by a call, the input "
                   "flipped by requires_grad_() in a later call: the runtime makes the view "
                   "after the flip (a non-leaf view), the loop before it (a leaf view)")
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_view_of_input_before_a_later_flip(mode: str) -> None:
    """oracle: output:input_view + same_input + stage:requires_grad_; pytest tests/oracle
    --fuzz-seed=1795473307 --fuzz-case=15648"""
    x, rx = torch.randn(3, 4), torch.randn(3, 4)
    got = parallel_apply([HeadView(), Scale(flip=True)], [x, x], mode=mode)[0]
    want = loop([HeadView(), Scale(flip=True)], [rx, rx])[0]
    assert (got.requires_grad, got.is_leaf) == (want.requires_grad, want.is_leaf)


class FailsInForward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise ValueError("expert failed on purpose")


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_failed_forward_leaves_global_rng_as_the_loop(mode: str) -> None:
    """Was D27: a later call that draws ran concurrently with the failing one
    and took the batch's draw from the global generator; the loop stopped
    before it. oracle: draws + a forward that raises; pytest tests/oracle
    --fuzz-seed=1795473307 --fuzz-case=4786"""
    def state_after(runner: Callable[[List[nn.Module], List[Tensor]], Any]) -> Tensor:
        torch.manual_seed(0)
        x = torch.randn(3, 4)
        with pytest.raises(ValueError):
            runner([FailsInForward(), nn.Dropout(0.5)], [x, x])
        return torch.get_rng_state()
    assert torch.equal(state_after(lambda ms, xs: parallel_apply(ms, xs, mode=mode)),
                       state_after(loop))


class _DropoutThenFail(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fail: bool) -> Tensor:  # type: ignore[override]
        if fail:
            raise ValueError("call failed on purpose")
        return torch.nn.functional.dropout(x, 0.5)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_failed_map_call_leaves_global_rng_as_the_loop(mode: str) -> None:
    """D27's fix on the map path: call 0 fails, call 1 draws."""
    def state_after(runner: Callable[[], Any]) -> Tensor:
        torch.manual_seed(0)
        with pytest.raises(ValueError):
            runner()
        return torch.get_rng_state()
    x = torch.randn(3, 4)
    mapped = state_after(lambda: map_with_parallel_backward(
        _DropoutThenFail, (x, True), (x, False), mode=mode))
    looped = state_after(lambda: [_DropoutThenFail.apply(x, f) for f in (True, False)])
    assert torch.equal(mapped, looped)


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_failed_call_after_a_drawing_call_keeps_the_draw(mode: str) -> None:
    """The loop ran the drawing call 0 before call 1 failed: the generator
    moved, so the batch's one draw stays (the rewind is only for calls the
    loop never reached)."""
    def state_after(fail: bool) -> Tensor:
        torch.manual_seed(0)
        x = torch.randn(3, 4)
        modules = [nn.Dropout(0.5), FailsInForward() if fail else nn.Identity()]
        if fail:
            with pytest.raises(ValueError):
                parallel_apply(modules, [x, x], mode=mode)
        else:
            parallel_apply(modules, [x, x], mode=mode)
        return torch.get_rng_state()
    torch.manual_seed(0)
    torch.randn(3, 4)
    untouched = torch.get_rng_state()
    assert torch.equal(state_after(True), state_after(False))
    assert not torch.equal(state_after(True), untouched)


class _Dirty(torch.autograd.Function):
    """Doubles its input in place (``mark_dirty``) and returns it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad * 2


@pytest.mark.xfail(strict=True, reason="D9b: backward(inputs=...) does not prune inside the "
                   "map's node: the retained grad of a call off the inputs' paths is filled")
def test_backward_inputs_leaves_retained_grad_of_a_pruned_dirty_call_empty() -> None:
    """oracle: pytest tests/oracle --fuzz-seed=1795473307 --fuzz-case=12941"""
    def retained(runner: Callable[[List[Tuple[Tensor]]], Any]) -> List[Any]:
        torch.manual_seed(0)
        root, other = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
        outs = runner([(root * 1,), (other * 1,)])
        for out in outs:
            out.retain_grad()
        sum(out.sum() for out in outs).backward(inputs=[root])
        return [out.grad for out in outs]
    got = retained(lambda args: [out for (out,) in map_with_parallel_backward(
        _Dirty, *args, mode="parallel")])
    want = retained(lambda args: [_Dirty.apply(*a) for a in args])
    assert [g is None for g in got] == [g is None for g in want]



class _KeepsOnly(nn.Module):
    """Returns its input as is and keeps ``fc(x)`` in an attribute: its
    parameters reach only the kept tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        self.keep = self.fc(x)
        return x


@pytest.mark.xfail(strict=True, reason="D9c: a parameter that reaches only a call's outputs or "
                   "kept tensors the pass does not reach is an input of the node: the engine "
                   "runs its accumulator with None, and its post-accumulate hooks fire")
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_post_accumulate_hook_of_a_parameter_only_an_unused_kept_tensor_reaches(
        mode: str) -> None:
    """oracle: pytest tests/oracle --fuzz-seed=1795791825 --fuzz-case=1462 (and 3177)"""
    def fired(runner: Callable[[nn.Module, Tensor], Tensor]) -> List[Any]:
        expert, seen = _KeepsOnly(), []
        expert.fc.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
        x = torch.randn(3, 4, requires_grad=True)
        runner(expert, x).sum().backward()
        return seen
    other = nn.Linear(4, 4)  # the loss reaches the node through this call

    def ours(e: nn.Module, x: Tensor) -> Tensor:
        a, b = parallel_apply([e, other], [x, x * 2], mode=mode)
        return a + b
    got = fired(ours)
    assert fired(lambda e, x: e(x) + other(x * 2)) == [] and got == []


class CheckpointedDropout(nn.Module):
    """torch.utils.checkpoint around a block that draws (dropout), inside the
    expert; ``inner`` False runs the block as it is (the same function)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.reentrant = reentrant
        self.inner = True

    def block(self, x: Tensor) -> Tensor:
        return torch.tanh(F.dropout(self.fc(x), 0.5, True))

    def forward(self, x: Tensor) -> Tensor:
        if not self.inner:
            return self.block(x)
        return tuc.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpoint_inside_an_expert_replays_the_calls_random_numbers(
        mode: str, reentrant: bool, checkpoint: bool) -> None:
    """torch.utils.checkpoint inside an expert recomputes its block from
    torch.get_rng_state(): inside a call that is the call's stream, so the
    recomputed dropout mask is the forward's and the gradients equal those of
    the same experts without it (checkpointing is transparent in the loop).
    Was silent in every mode: the recomputation drew from the global
    generator, at a state the forward never drew from."""
    if reentrant and (mode != "inline" or checkpoint):
        pytest.skip("reentrant checkpoint inside a call's own backward raises (see above)")
    mods, refs = twins(lambda: CheckpointedDropout(reentrant), 4)
    for r in refs:
        r.inner = False
    xs = [torch.randn(3, 8, requires_grad=True) for _ in range(4)]
    rxs = [x.detach().clone().requires_grad_() for x in xs]
    torch.manual_seed(5)
    outs = parallel_apply(mods, xs, mode=mode, checkpoint=checkpoint)
    sum((o * (k + 1)).sum() for k, o in enumerate(outs)).backward()
    after = torch.get_rng_state()
    torch.manual_seed(5)
    routs = parallel_apply(refs, rxs, mode=mode, checkpoint=checkpoint)
    sum((o * (k + 1)).sum() for k, o in enumerate(routs)).backward()
    assert torch.equal(after, torch.get_rng_state())
    for o, ro, x, rx in zip(outs, routs, xs, rxs):
        assert bits_equal(o, ro) and bits_equal(x.grad, rx.grad)
    for m, r in zip(mods, refs):
        assert bits_equal(m.fc.weight.grad, r.fc.weight.grad)


# -- found by an outside probe (2026-11-26) ---------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_call_refuses_a_parameter_changed_before_backward(mode: str) -> None:
    """An optimizer step (or weight clipping) between forward and backward:
    the loop's backward raises (the weight was saved), the recomputation
    would silently use the new weight; it raises, naming the call."""
    mods, _ = twins(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), 2)
    x = torch.randn(3, 4, requires_grad=True)
    outs = parallel_apply(mods, [x, x], checkpoint=True, mode=mode)
    with torch.no_grad():
        mods[0][0].weight.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"call 0 of 2: a parameter \(an optimizer step "
                       r"before the backward\?\) of the checkpointed call was modified in place"):
        sum(o.sum() for o in outs).backward()


class ShrinksItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.fc.weight.mul_(0.9)  # a max-norm style constraint
        return self.fc(x)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_expert_changing_its_parameter_in_forward_raises(mode: str) -> None:
    """Its recomputation would change the parameter again (0.81 x, not 0.9 x)."""
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        parallel_apply([ShrinksItsWeight()], [x], checkpoint=True, mode=mode)
    assert str(info.value) == (
        "parallel_apply: call 0 of 1: the checkpointed expert modified one of its parameters in "
        "place in its forward; its recomputation would modify it again: call this expert with "
        "checkpoint=False")
    (mod,), (ref,) = twins(ShrinksItsWeight)
    parallel_apply([mod], [x], mode=mode)[0].sum().backward()
    ref(x).sum().backward()  # without checkpointing it equals the loop
    assert bits_equal(mod.fc.weight, ref.fc.weight) and bits_equal(mod.fc.weight.grad,
                                                                   ref.fc.weight.grad)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_a_shape_passed_or_returned_stays_a_torch_size(mode: str, checkpoint: bool) -> None:
    """torch.Size is a pytree node that unflattens to a plain tuple."""
    lin = nn.Linear(4, 4)

    def expert(x: Tensor, shape: torch.Size) -> Tuple[Tensor, torch.Size, bool]:
        return lin(x).reshape(shape), x.shape, isinstance(shape, torch.Size)
    x = torch.randn(3, 4, requires_grad=True)
    ((y, shape, got_size),) = parallel_apply([expert], [(x, torch.Size([4, 3]))], mode=mode,
                                              checkpoint=checkpoint)
    assert type(shape) is torch.Size and shape.numel() == 12 and got_size
    assert y.shape == (4, 3)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_forward_graph_reached_from_outside_names_the_call(mode: str) -> None:
    """A tensor the checkpointed expert leaves in a list attribute, added to
    the loss: its forward graph keeps nothing, so the backward raises, naming
    the call (without checkpointing, the call's input guard raises)."""
    class StashesInAList(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.aux: List[Tensor] = []

        def forward(self, x: Tensor) -> Tensor:
            y = self.fc(x)
            self.aux = [torch.tanh(y).sum()]
            return y
    mod = StashesInAList()
    y = parallel_apply([mod], [torch.randn(3, 4, requires_grad=True)], checkpoint=True,
                       mode=mode)[0]
    with pytest.raises(RuntimeError) as info:
        (y.sum() + mod.aux[0]).backward()
    assert str(info.value) == (
        "parallel_apply: call 0 of 1: a backward reached the checkpointed call's forward graph "
        "(autograd.grad or backward inside the expert's forward, or a tensor the expert left in "
        "a list, a closure or a global), which keeps nothing for backward: return that tensor "
        "from the expert, or call it with checkpoint=False")


class OwnNoise(nn.Module):
    """Multiplicative noise from a torch.Generator the expert was given."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gen = gen

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * torch.rand(x.shape, generator=self.gen, dtype=x.dtype)


def _run_own_noise(runner: Callable[[List[nn.Module], List[Tensor]], List[Tensor]],
                   shared: bool) -> Tuple[List[Tensor], Tensor, Tensor, List[Tensor]]:
    torch.manual_seed(0)
    gens = [torch.Generator().manual_seed(7 + (0 if shared else k)) for k in range(3)]
    if shared:
        gens = [gens[0]] * 3
    mods: List[nn.Module] = [OwnNoise(g) for g in gens]
    x = torch.randn(3, 4, requires_grad=True)
    outs = runner(mods, [x, x, x])
    sum(o.sum() for o in outs).backward()
    assert x.grad is not None
    return outs, x.grad, gens[0].get_state(), [g.get_state() for g in gens]


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_explicit_generators_replay_in_recomputation(mode: str, checkpoint: bool) -> None:
    """A random op given the expert's own generator: a checkpointed call's
    recomputation draws what its forward drew (from a copy), and the
    generator advances once, as in the loop. Was silent with checkpoint=True
    in every mode (found by an outside probe)."""
    want = _run_own_noise(lambda ms, xs: loop(ms, xs), shared=False)
    got = _run_own_noise(lambda ms, xs: parallel_apply(ms, xs, mode=mode, checkpoint=checkpoint),
                         shared=False)
    assert all(bits_equal(a, b) for a, b in zip(want[0], got[0]))
    assert bits_equal(want[1], got[1])
    assert all(torch.equal(a, b) for a, b in zip(want[3], got[3]))


def test_a_generator_shared_by_concurrent_calls_raises() -> None:
    """Calls that run at once would interleave their draws from one generator
    in no fixed order: that raises, naming the calls; inline equals the loop."""
    with pytest.raises(RuntimeError, match=r"draw from the same torch.Generator"):
        _run_own_noise(lambda ms, xs: parallel_apply(ms, xs, mode="parallel"), shared=True)
    want = _run_own_noise(lambda ms, xs: loop(ms, xs), shared=True)
    got = _run_own_noise(lambda ms, xs: parallel_apply(ms, xs, mode="inline", checkpoint=True),
                         shared=True)
    assert all(bits_equal(a, b) for a, b in zip(want[0], got[0]))
    assert bits_equal(want[1], got[1]) and torch.equal(want[2], got[2])
