"""The emulated ctx, isolated forward/backward, and map_with_parallel_backward.

Every behaviour is compared with calling ``func.apply`` once per call under
plain autograd, in float64.
"""
import math
import threading
import time
import weakref

import pytest
import torch
from torch import Tensor
from torch.autograd import Function

from moe_autograd import (
    EmulatedAutogradContext,
    map_with_parallel_backward,
    run_isolated_backward,
    run_isolated_forward,
)
from moe_autograd.executor import DEFAULT_WORKERS
from helpers import Square, run_threads

DT = torch.float64


def leaf(*shape, requires_grad=True, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, dtype=DT, generator=g).requires_grad_(requires_grad)


def weighted_loss(outputs, seed=0):
    """A loss that gives every floating output a distinct random upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    total = 0
    for out in outputs:
        if isinstance(out, Tensor) and out.requires_grad:
            total = total + (out * torch.randn(out.shape, dtype=out.dtype, generator=g)).sum()
    return total


def flat(results):
    return [o for outs in results for o in outs]


def grads_of(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
        elif isinstance(x, Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
        else:
            assert x == y


# -- Functions under test --------------------------------------------------------------------

class SinSum(Function):
    """Any arity; tensors (same shape) and non-tensor scales mixed:
    returns (scale * sum(sin(t)), exp(first tensor))."""

    @staticmethod
    def forward(ctx, *args):
        ctx.kinds = [isinstance(a, Tensor) for a in args]
        ctx.scale = math.prod(a for a in args if not isinstance(a, Tensor))
        tensors = [a for a in args if isinstance(a, Tensor)]
        ctx.save_for_backward(*tensors)
        return sum(t.sin() for t in tensors) * ctx.scale, tensors[0].exp()

    @staticmethod
    def backward(ctx, g_sum, g_exp):
        tensors = iter(ctx.saved_tensors)
        grads, first = [], True
        for is_tensor in ctx.kinds:
            if not is_tensor:
                grads.append(None)
                continue
            t = next(tensors)
            g = g_sum * t.cos() * ctx.scale
            if first:
                g = g + g_exp * t.exp()
                first = False
            grads.append(g)
        return tuple(grads)



class MulSetup(Function):
    """setup_context style: forward without ctx."""

    @staticmethod
    def forward(x, y, k):
        return x * y * k, (x + y).tanh()

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, k = inputs
        ctx.k = k
        ctx.save_for_backward(x, y, output[1])

    @staticmethod
    def backward(ctx, g_prod, g_tanh):
        x, y, t = ctx.saved_tensors
        common = g_tanh * (1 - t * t)
        return g_prod * y * ctx.k + common, g_prod * x * ctx.k + common, None


# -- EmulatedAutogradContext -----------------------------------------------------------------

def test_ctx_defaults_and_attributes():
    ctx = EmulatedAutogradContext()
    assert ctx.saved_tensors == ()
    assert isinstance(ctx.saved_tensors, tuple)
    assert ctx.needs_input_grad == ()
    assert ctx.materialize_grads is True
    ctx.anything = {"a": 1}
    ctx.other = [1, 2]
    assert ctx.anything == {"a": 1} and ctx.other == [1, 2]


def test_ctx_save_for_backward_and_flags():
    x, y = torch.randn(2), torch.randn(3)
    ctx = EmulatedAutogradContext((True, False, True))
    assert ctx.needs_input_grad == (True, False, True)
    ctx.save_for_backward(x, None, y)
    saved = ctx.saved_tensors
    assert isinstance(saved, tuple) and len(saved) == 3
    assert saved[0] is x and saved[1] is None and saved[2] is y
    ctx.save_for_backward()
    assert ctx.saved_tensors == ()
    ctx.set_materialize_grads(False)
    assert ctx.materialize_grads is False
    ctx.mark_non_differentiable(x)
    ctx.mark_non_differentiable(y)
    assert [t is s for t, s in zip(ctx.non_differentiable, (x, y))] == [True, True]
    ctx.mark_dirty(y)
    assert len(ctx.dirty_tensors) == 1 and ctx.dirty_tensors[0] is y


# -- run_isolated_forward / run_isolated_backward --------------------------------------------

def test_run_isolated_forward_on_detached_copies():
    seen = {}

    class Probe(Function):
        @staticmethod
        def forward(ctx, x, y, k):
            seen["grad_enabled"] = torch.is_grad_enabled()
            seen["args"] = (x, y, k)
            seen["needs"] = ctx.needs_input_grad
            ctx.save_for_backward(x, y)
            ctx.k = k
            return x * y * k

        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensors
            return g * y * ctx.k, g * x * ctx.k, None

    a = leaf(3) * 1  # non-leaf with a graph
    b = leaf(3, requires_grad=False)
    ctx, out = run_isolated_forward(Probe, a, b, 2.5)
    x, y, k = seen["args"]
    assert seen["grad_enabled"] is False
    assert x is not a and y is not b and k == 2.5
    assert x.grad_fn is None and y.grad_fn is None
    assert x.requires_grad is True and y.requires_grad is False
    assert x.data_ptr() == a.data_ptr()  # a copy of the handle, not of the data
    assert seen["needs"] == (True, False, False) == ctx.needs_input_grad
    assert isinstance(ctx, EmulatedAutogradContext)
    assert out.grad_fn is None and not out.requires_grad
    assert a.grad_fn is not None  # the caller's graph is untouched
    torch.testing.assert_close(out, (a * b * 2.5).detach())

    g = torch.randn(3, dtype=DT)
    grads = run_isolated_backward(Probe, ctx, g)
    assert isinstance(grads, tuple) and len(grads) == 3
    expected = torch.autograd.grad(Probe.apply(a, b, 2.5), a, g)[0]
    torch.testing.assert_close(grads[0], expected)
    torch.testing.assert_close(grads[1], g * a.detach() * 2.5)
    assert grads[2] is None


def test_run_isolated_backward_runs_under_no_grad_and_wraps_single_grad():
    seen = {}

    class One(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            seen["grad_enabled"] = torch.is_grad_enabled()
            (x,) = ctx.saved_tensors
            return g * x.cos()  # a bare tensor, not a tuple

    x = leaf(4)
    ctx, out = run_isolated_forward(One, x)
    g = torch.ones(4, dtype=DT)
    with torch.enable_grad():
        grads = run_isolated_backward(One, ctx, g)
    assert seen["grad_enabled"] is False
    assert isinstance(grads, tuple) and len(grads) == 1
    assert grads[0].grad_fn is None
    torch.testing.assert_close(grads[0], torch.autograd.grad(One.apply(x).sum(), x)[0])


def test_run_isolated_forward_setup_context_style():
    x, y = leaf(3), leaf(3, requires_grad=False)
    ctx, (prod, t) = run_isolated_forward(MulSetup, x, y, 3.0)
    assert ctx.k == 3.0
    assert ctx.needs_input_grad == (True, False, False)
    assert len(ctx.saved_tensors) == 3
    torch.testing.assert_close(prod, (x * y * 3).detach())
    g1, g2 = torch.randn(3, dtype=DT), torch.randn(3, dtype=DT)
    grads = run_isolated_backward(MulSetup, ctx, g1, g2)
    p2, t2 = MulSetup.apply(x, y, 3.0)
    expected = torch.autograd.grad((p2, t2), x, (g1, g2))[0]
    torch.testing.assert_close(grads[0], expected)


# -- map_with_parallel_backward: equality with apply -----------------------------------------

def test_map_matches_apply_with_mixed_arity_and_non_tensor_args():
    a, b, c, d = leaf(2, 3, seed=1), leaf(2, 3, seed=2), leaf(4, seed=3), leaf(4, seed=4)
    e = leaf(4, requires_grad=False, seed=5)
    calls = [(a, 2.0, b), (c,), (d, e, 0.5, 3), (a, a)]
    results = map_with_parallel_backward(SinSum, *calls)
    expected = [SinSum.apply(*args) for args in calls]

    assert isinstance(results, tuple) and len(results) == len(calls)
    for got, want in zip(results, expected):
        assert isinstance(got, tuple) and len(got) == 2
        assert_same(got, want)
        assert all(o.requires_grad for o in got)
    leaves = [a, b, c, d]
    assert_same(grads_of(weighted_loss(flat(results)), leaves),
                grads_of(weighted_loss(flat(expected)), leaves))


def test_map_single_tensor_forward_returns_tuples():
    xs = [leaf(3, seed=i) for i in range(3)]
    results = map_with_parallel_backward(Square, *[(x,) for x in xs])
    assert isinstance(results, tuple) and len(results) == 3
    for got, x in zip(results, xs):
        assert isinstance(got, tuple) and len(got) == 1 and isinstance(got[0], Tensor)
        torch.testing.assert_close(got[0], (x * x).detach())
    assert_same(grads_of(weighted_loss(flat(results)), xs),
                grads_of(weighted_loss([Square.apply(x) for x in xs]), xs))


def test_map_keeps_non_tensor_outputs():
    class WithMeta(Function):
        @staticmethod
        def forward(ctx, x, tag):
            return x * 3, tag, None

        @staticmethod
        def backward(ctx, g, g_tag, g_none):
            assert g_tag is None and g_none is None
            return g * 3, None

    x = leaf(2)
    results = map_with_parallel_backward(WithMeta, (x, "a"), (x, "b"))
    expected = [WithMeta.apply(x, "a"), WithMeta.apply(x, "b")]
    for got, want in zip(results, expected):
        assert got[1:] == want[1:]
        torch.testing.assert_close(got[0], want[0])
    assert_same(grads_of(results[0][0].sum() + 2 * results[1][0].sum(), [x]),
                grads_of(expected[0][0].sum() + 2 * expected[1][0].sum(), [x]))


def test_map_gradcheck_float64():
    def fn(a, b, c):
        results = map_with_parallel_backward(SinSum, (a, 1.5, b), (c,), (b, c, -2.0))
        return tuple(flat(results))

    inputs = (leaf(2, 3, seed=7), leaf(2, 3, seed=8), leaf(2, 3, seed=9))
    assert torch.autograd.gradcheck(fn, inputs)

    def fn_setup(a, b):
        return tuple(flat(map_with_parallel_backward(MulSetup, (a, b, 2.0), (b, a, -1.0))))

    assert torch.autograd.gradcheck(fn_setup, (leaf(3, seed=10), leaf(3, seed=11)))


def test_map_setup_context_style_matches_apply():
    x, y, z = leaf(3, seed=1), leaf(3, seed=2), leaf(3, requires_grad=False, seed=3)
    calls = [(x, y, 2.0), (y, z, 0.5), (z, x, -1.0)]
    results = map_with_parallel_backward(MulSetup, *calls)
    expected = [MulSetup.apply(*args) for args in calls]
    for got, want in zip(results, expected):
        assert_same(got, want)
    assert_same(grads_of(weighted_loss(flat(results)), [x, y]),
                grads_of(weighted_loss(flat(expected)), [x, y]))


def test_map_uses_one_node_for_all_calls():
    xs = [leaf(3, seed=i) for i in range(5)]
    results = map_with_parallel_backward(SinSum, *[(x, 1.0) for x in xs])
    nodes = {id(o.grad_fn) for o in flat(results)}
    assert len(nodes) == 1


def test_map_needs_input_grad_per_call_matches_apply():
    records = {}

    class Probe(Function):
        @staticmethod
        def forward(ctx, key, *args):
            records[key] = ctx.needs_input_grad
            return sum(a for a in args if isinstance(a, Tensor)) * 1.0

        @staticmethod
        def backward(ctx, g):
            return (None,) + tuple(g if isinstance(n, bool) and n else None
                                   for n in ctx.needs_input_grad[1:])

    x, y = leaf(2), leaf(2, requires_grad=False)
    calls = [(x, y), (y, x), (y, 3.0, y), (x, "s", x)]
    map_with_parallel_backward(Probe, *[(("map", i),) + args for i, args in enumerate(calls)])
    for i, args in enumerate(calls):
        Probe.apply(("apply", i), *args)
    for i in range(len(calls)):
        assert records[("map", i)] == records[("apply", i)]
    assert records[("map", 1)] == (False, False, True)


@pytest.mark.parametrize("materialize", [True, False])
def test_map_unused_output_gradients(materialize):
    records = {}

    class TwoOut(Function):
        @staticmethod
        def forward(ctx, key, x):
            ctx.key = key
            ctx.set_materialize_grads(materialize)
            return x * 2, x * 3

        @staticmethod
        def backward(ctx, g1, g2):
            records[ctx.key] = (g1, g2)
            grad = 0
            if g1 is not None:
                grad = grad + g1 * 2
            if g2 is not None:
                grad = grad + g2 * 3
            return None, grad

    x = leaf(4)
    got = map_with_parallel_backward(TwoOut, ("map", x))
    want = TwoOut.apply("apply", x)
    assert_same(grads_of(got[0][0].sum(), [x]), grads_of(want[0].sum(), [x]))
    g_map, g_apply = records["map"][1], records["apply"][1]
    if materialize:
        assert g_map is not None and g_apply is not None
        assert torch.equal(g_map, torch.zeros(4, dtype=DT))
        assert g_map.dtype == g_apply.dtype and g_map.shape == g_apply.shape
    else:
        assert g_map is None and g_apply is None


def test_map_mark_dirty_like_apply():
    class Double_(Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(2)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g * 2

    a = leaf(3)
    x_apply = a * 1
    y_apply = Double_.apply(x_apply)
    x_map, z = a * 1, a * 1
    (y_map,), (y_z,) = map_with_parallel_backward(Double_, (x_map,), (z,))
    assert y_apply is x_apply
    assert y_map is x_map and y_z is z  # the input object itself, as with apply
    torch.testing.assert_close(y_map, y_apply)
    torch.testing.assert_close(x_map, (a * 2).detach())  # modified in place
    assert_same(grads_of(y_map.sum() + 3 * y_z.sum(), [a]),
                grads_of(y_apply.sum() * 4, [a]))

    # a leaf that requires grad cannot be modified in place, with map as with apply
    with pytest.raises(RuntimeError, match="leaf"):
        Double_.apply(leaf(3))
    with pytest.raises(RuntimeError, match="leaf"):
        map_with_parallel_backward(Double_, (leaf(3),), (leaf(3),))


def test_map_mark_non_differentiable_like_apply():
    records = {}

    class WithIndex(Function):
        @staticmethod
        def forward(ctx, key, x):
            ctx.key = key
            mask = (x > 0).to(x.dtype)
            ctx.mark_non_differentiable(mask)
            return x * 5, mask

        @staticmethod
        def backward(ctx, g, g_mask):
            records[ctx.key] = g_mask
            return None, g * 5

    x = leaf(6)
    got = map_with_parallel_backward(WithIndex, ("map", x), ("map2", x))
    want = WithIndex.apply("apply", x)
    for outs in got:
        assert outs[0].requires_grad and not outs[1].requires_grad
        assert outs[1].grad_fn is None
        torch.testing.assert_close(outs[1], want[1])
    assert not want[1].requires_grad
    assert_same(grads_of(got[0][0].sum() + got[1][0].sum(), [x]),
                grads_of(want[0].sum() * 2, [x]))
    # the non-differentiable output's gradient is materialized as with apply
    assert torch.equal(records["map"], records["apply"])


def test_map_extra_none_gradients_are_accepted_like_apply():
    class Extra(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 4

        @staticmethod
        def backward(ctx, g):
            return g * 4, None, None

    x = leaf(3)
    (y,), = map_with_parallel_backward(Extra, (x,))
    assert_same(grads_of(y.sum(), [x]), grads_of(Extra.apply(x).sum(), [x]))


def test_map_broadcast_gradient_is_reduced_like_apply():
    class Wide(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return (g * 2).expand(5, *g.shape)  # expandable: autograd sums it

    x = leaf(3)
    (y,), = map_with_parallel_backward(Wide, (x,))
    assert_same(grads_of(y.sum(), [x]), grads_of(Wide.apply(x).sum(), [x]))


def test_map_under_no_grad_keeps_no_graph():
    x = leaf(3)
    with torch.no_grad():
        results = map_with_parallel_backward(SinSum, (x, 2.0), (x,))
        expected = [SinSum.apply(x, 2.0), SinSum.apply(x)]
    for got, want in zip(results, expected):
        assert_same(got, want)
        assert all(o.grad_fn is None and not o.requires_grad for o in got)


def test_map_inputs_without_grad_give_plain_outputs():
    x = leaf(3, requires_grad=False)
    results = map_with_parallel_backward(SinSum, (x,), (x, 3.0))
    for got, want in zip(results, [SinSum.apply(x), SinSum.apply(x, 3.0)]):
        assert_same(got, want)
        assert all(not o.requires_grad for o in got)


def test_map_empty_and_type_errors():
    assert map_with_parallel_backward(Square) == ()
    with pytest.raises(TypeError):
        map_with_parallel_backward(lambda x: x, (torch.ones(1),))
    with pytest.raises(TypeError):
        map_with_parallel_backward(int, (torch.ones(1),))


def test_map_autocast_reaches_forward_like_apply():
    class MatMul(Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.t().to(g.dtype), x.t().to(g.dtype) @ g

    x, w = torch.randn(4, 5, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = MatMul.apply(x, w)
        got = map_with_parallel_backward(MatMul, (x, w), (x, w), (x, w))
    assert want.dtype == torch.bfloat16
    assert all(outs[0].dtype == torch.bfloat16 for outs in got)
    for outs in got:
        torch.testing.assert_close(outs[0], want)
    # the workers' state is restored afterwards
    after = map_with_parallel_backward(MatMul, (x, w), (x, w))
    assert all(outs[0].dtype == torch.float32 for outs in after)


# -- errors ----------------------------------------------------------------------------------

class Injected(Exception):
    pass


def _failing_function(fail_forward, fail_backward, finished, lock, delay=0.05):
    class Flaky(Function):
        @staticmethod
        def forward(ctx, x, i):
            ctx.i = i
            if i == fail_forward:
                raise Injected(f"forward of {i}")
            time.sleep(delay)
            with lock:
                finished.append(("forward", i))
            return x * (i + 1)

        @staticmethod
        def backward(ctx, g):
            if ctx.i == fail_backward:
                raise Injected(f"backward of {ctx.i}")
            time.sleep(delay)
            with lock:
                finished.append(("backward", ctx.i))
            return g * (ctx.i + 1), None

    return Flaky


@pytest.mark.timeout(30)
def test_map_forward_error_names_call_and_joins_others():
    finished, lock = [], threading.Lock()
    Flaky = _failing_function(2, None, finished, lock)
    x = leaf(3)
    with pytest.raises(Injected, match="forward of 2") as info:
        map_with_parallel_backward(Flaky, *[(x, i) for i in range(5)])
    assert any("call 2 of 5" in note and "Flaky" in note for note in info.value.__notes__)
    # every other forward had finished before the error reached the caller
    assert sorted(finished) == [("forward", i) for i in (0, 1, 3, 4)]
    time.sleep(0.1)
    assert len(finished) == 4


@pytest.mark.timeout(30)
def test_map_backward_error_names_call_and_joins_others(wait_dead):
    finished, lock = [], threading.Lock()
    Flaky = _failing_function(None, 3, finished, lock)
    x = leaf(3)
    results = map_with_parallel_backward(Flaky, *[(x, i) for i in range(6)])
    finished.clear()
    with pytest.raises(Injected, match="backward of 3") as info:
        sum(o.sum() for o in flat(results)).backward()
    assert any("call 3 of 6" in note for note in info.value.__notes__)
    assert sorted(finished) == [("backward", i) for i in (0, 1, 2, 4, 5)]
    time.sleep(0.1)
    assert len(finished) == 5
    assert x.grad is None  # the failed backward accumulated nothing


def test_map_single_call_error_has_note():
    finished, lock = [], threading.Lock()
    Flaky = _failing_function(0, None, finished, lock, delay=0)
    with pytest.raises(Injected) as info:
        map_with_parallel_backward(Flaky, (leaf(2), 0))
    assert any("call 0 of 1" in note for note in info.value.__notes__)


def test_wrong_number_of_gradients_names_function_and_call():
    class Few(Function):
        @staticmethod
        def forward(ctx, x, y, bad):
            ctx.bad = bad
            return x * y

        @staticmethod
        def backward(ctx, g):
            if ctx.bad:
                return (g,)
            return g, g, None

    x, y = leaf(3), leaf(3)
    with pytest.raises(RuntimeError, match="incorrect number of gradients"):
        Few.apply(x, y, True).sum().backward()
    results = map_with_parallel_backward(Few, (x, y, False), (x, y, True), (y, x, False))
    with pytest.raises(RuntimeError, match="incorrect number of gradients") as info:
        sum(o.sum() for o in flat(results)).backward()
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert "Few" in text and "call 1 of 3" in text

    class Many(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return g, g  # a non-None gradient for an input that does not exist

    with pytest.raises(RuntimeError, match="incorrect number of gradients"):
        Many.apply(x).sum().backward()
    (out,), = map_with_parallel_backward(Many, (x,))
    with pytest.raises(RuntimeError, match="incorrect number of gradients") as info:
        out.sum().backward()
    assert "Many" in str(info.value)


def test_gradient_shape_mismatch_names_call():
    class BadShape(Function):
        @staticmethod
        def forward(ctx, x, bad):
            ctx.bad = bad
            return x * 2

        @staticmethod
        def backward(ctx, g):
            if ctx.bad:
                return torch.ones(7, dtype=g.dtype), None
            return g * 2, None

    x = leaf(3)
    with pytest.raises(RuntimeError, match="shape"):
        BadShape.apply(x, True).sum().backward()
    results = map_with_parallel_backward(BadShape, (x, False), (x, False), (x, True))
    with pytest.raises(RuntimeError, match="shape") as info:
        sum(o.sum() for o in flat(results)).backward()
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert "call 2 of 3" in text


def test_gradient_for_non_tensor_argument_is_an_error():
    class NonTensorGrad(Function):
        @staticmethod
        def forward(ctx, x, k):
            ctx.k = k
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g * ctx.k, torch.ones(())  # k is a float: must get None

    x = leaf(3)
    with pytest.raises(RuntimeError, match="not a"):
        NonTensorGrad.apply(x, 2.0).sum().backward()
    results = map_with_parallel_backward(NonTensorGrad, (x, 2.0), (x, 3.0))
    with pytest.raises(RuntimeError, match="not a tensor") as info:
        sum(o.sum() for o in flat(results)).backward()
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert "NonTensorGrad" in text and "call 1 of 2" in text  # the loop meets call 1 first


# -- double backward -------------------------------------------------------------------------

def test_double_backward_raises_when_grad_outputs_require_grad():
    x = leaf(3)
    (y,), = map_with_parallel_backward(Square, (x,))
    (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    torch.testing.assert_close(g, (4 * x ** 3).detach())  # first order is right
    with pytest.raises(RuntimeError, match="differentiate twice|once_differentiable"):
        g.sum().backward()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_backward_with_create_graph_gives_first_order_grads():
    x, y = leaf(3, seed=1), leaf(3, seed=2)
    results = map_with_parallel_backward(SinSum, (x, 2.0, y), (y,))
    weighted_loss(flat(results)).backward(create_graph=True)
    got = (x.grad.detach().clone(), y.grad.detach().clone())
    # differentiating those gradients again is an error, never a silent constant
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.grad(x.grad.sum(), x)
    x.grad = y.grad = None
    weighted_loss(flat([SinSum.apply(x, 2.0, y), SinSum.apply(y)])).backward()
    assert_same(got, (x.grad, y.grad))


def test_double_backward_is_never_silently_wrong():
    # Gradient-penalty pattern: the incoming gradient (of a sum) does not require
    # grad, yet the input gradient depends on x. Plain autograd gives the second
    # order term; the runtime must give it too or raise, never drop it.
    x = leaf(3)
    y = Square.apply(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (expected,) = torch.autograd.grad(y.sum() + (g * g).sum(), x)

    (y,), = map_with_parallel_backward(Square, (x,))
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    try:
        (got,) = torch.autograd.grad(y.sum() + (g * g).sum(), x)
    except RuntimeError as error:
        assert "differentiate twice" in str(error) or "once_differentiable" in str(error)
    else:
        torch.testing.assert_close(got, expected)


# -- concurrency -----------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [8, 16])
def test_map_forwards_and_backwards_all_run_concurrently(fresh_pool, n):
    fresh_pool(DEFAULT_WORKERS)  # the default size, whatever MOE_AUTOGRAD_WORKERS says here
    forward_barrier = threading.Barrier(n, timeout=20)
    backward_barrier = threading.Barrier(n, timeout=20)

    class Meet(Function):
        @staticmethod
        def forward(ctx, x, i):
            forward_barrier.wait()  # BrokenBarrierError unless all n forwards overlap
            ctx.i = i
            return x * (i + 1)

        @staticmethod
        def backward(ctx, g):
            backward_barrier.wait()
            return g * (ctx.i + 1), None

    x = leaf(3)
    results = map_with_parallel_backward(Meet, *[(x, i) for i in range(n)])
    (grad,) = torch.autograd.grad(sum(o.sum() for o in flat(results)), x)
    torch.testing.assert_close(grad, torch.full((3,), n * (n + 1) / 2, dtype=DT))


@pytest.mark.timeout(60)
def test_map_from_many_user_threads(thread_guard):
    errors = []

    def user(u):
        try:
            gen = torch.Generator().manual_seed(u)
            for it in range(20):
                n = 1 + (u + it) % 5
                xs = [torch.randn(2, 3, dtype=DT, generator=gen).requires_grad_() for _ in range(n)]
                scales = [float(k + 1) for k in range(n)]
                calls = [(x, s, xs[0]) for x, s in zip(xs, scales)]
                got = map_with_parallel_backward(SinSum, *calls)
                want = [SinSum.apply(*args) for args in calls]
                for a, b in zip(got, want):
                    assert_same(a, b)
                assert_same(grads_of(weighted_loss(flat(got), it), xs),
                            grads_of(weighted_loss(flat(want), it), xs))
        except BaseException as error:
            errors.append(error)

    run_threads(user, 8)
    assert not errors, errors[0]


# -- lifetime --------------------------------------------------------------------------------

def _tracking_function(refs):
    class Tracked(Function):
        @staticmethod
        def forward(ctx, x):
            refs.append(weakref.ref(ctx))
            ctx.big = torch.zeros(1000)
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    return Tracked


@pytest.mark.timeout(30)
def test_ctx_released_after_backward(wait_dead):
    refs = []
    Tracked = _tracking_function(refs)
    x = leaf(3)
    results = map_with_parallel_backward(Tracked, (x,), (x,), (x,))
    assert len(refs) == 3
    sum(o.sum() for o in flat(results)).backward()
    # the outputs (and the node) are still alive, but the calls' state is not
    assert not any(wait_dead(refs))
    assert results[0][0].grad_fn is not None
    torch.testing.assert_close(x.grad, torch.full((3,), 6.0, dtype=DT))


@pytest.mark.timeout(30)
def test_ctx_kept_with_retain_graph_then_released(wait_dead):
    refs = []
    Tracked = _tracking_function(refs)
    x = leaf(3)
    results = map_with_parallel_backward(Tracked, (x,), (x,))
    loss = sum(o.sum() for o in flat(results))
    loss.backward(retain_graph=True)
    assert all(r() is not None for r in refs)
    loss.backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 8.0, dtype=DT))
    assert not any(wait_dead(refs))
    with pytest.raises(RuntimeError):
        loss.backward()


@pytest.mark.timeout(30)
def test_ctx_released_when_outputs_die_without_backward(wait_dead):
    refs = []
    Tracked = _tracking_function(refs)
    results = map_with_parallel_backward(Tracked, (leaf(3),), (leaf(3),))
    del results
    assert not any(wait_dead(refs))


@pytest.mark.timeout(30)
def test_ctx_released_after_failed_backward(wait_dead):
    refs = []

    class FailBack(Function):
        @staticmethod
        def forward(ctx, x):
            refs.append(weakref.ref(ctx))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise Injected("no")

    results = map_with_parallel_backward(FailBack, (leaf(3),), (leaf(3),))
    with pytest.raises(Injected):
        sum(o.sum() for o in flat(results)).backward()
    del results
    assert not any(wait_dead(refs))


class _DoublesInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * 2


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_mark_dirty_on_views_of_one_base_equals_apply(mode):
    """Two calls marking dirty views of one base: each call gets its own
    node (autograd lets such a node return one tensor), as apply (issue 17)."""
    base = torch.randn(4, requires_grad=True)
    grads = []
    for run in ("apply", "map"):
        b = base * 1
        v1, v2 = b[:2], b[2:]
        if run == "apply":
            outs = [_DoublesInPlace.apply(v1), _DoublesInPlace.apply(v2)]
        else:
            outs = [o for (o,) in map_with_parallel_backward(
                _DoublesInPlace, (v1,), (v2,), (b * 1,), mode=mode)][:2]
        assert outs[0] is v1 and outs[1] is v2
        (outs[0].sum() * 3 + outs[1].sum() + b.sum()).backward()
        grads.append(base.grad)
        base.grad = None
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_mark_dirty_on_one_view_equals_apply(mode):
    base = torch.randn(4, requires_grad=True)
    grads = []
    for run in ("apply", "map"):
        b = base * 1
        v = b[:2]
        out = _DoublesInPlace.apply(v) if run == "apply" else \
            map_with_parallel_backward(_DoublesInPlace, (v,), mode=mode)[0][0]
        assert out is v
        (out.sum() * 3 + b.sum()).backward()
        grads.append(base.grad)
        base.grad = None
    assert torch.equal(grads[0], grads[1])
