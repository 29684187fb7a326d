"""parallel_apply: equality with a sequential loop under plain autograd (float64),
concurrency of forward and backward, errors, thread-local state, lifetime."""
import copy
import functools
import json
import threading
import time
import types
import weakref
from typing import List, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import Function

import torch.autograd.forward_ad as fwAD
import moe_autograd.parallel as parallel_module
from moe_autograd import ForeignGraphError, map_with_parallel_backward, parallel_apply, policy
from moe_autograd.executor import DEFAULT_WORKERS, CallCancelled
from moe_autograd.module_call import ModuleCall
from moe_autograd.parallel import finish_calls, start_calls
from moe_autograd.policy import Decision, Measure, execution_stats
from helpers import (COLLECTOR, BackwardBarrier, CollectedCall, Scaled, Square, params_of,
                     run_threads)

DT = torch.float64


class Expert(nn.Module):
    def __init__(self, d_in=4, d_hidden=6, d_out=4, seed=0):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden).to(DT)
        self.fc2 = nn.Linear(d_hidden, d_out).to(DT)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, dtype=DT, generator=g) * 0.5)

    def forward(self, x, scale=None):
        h = torch.tanh(self.fc1(x))
        if scale is not None:
            h = h * scale
        return self.fc2(h)


def randn(*shape, seed, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=DT, generator=g).requires_grad_(requires_grad)


def clone_leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad)


def tensors_in(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, Tensor)]


def weighted_loss(outputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = torch.zeros((), dtype=DT)
    for out in tensors_in(outputs):
        if out.requires_grad:
            total = total + (out * torch.randn(out.shape, dtype=out.dtype, generator=g)).sum()
    return total


def close(a, b):
    if a is None or b is None:
        assert a is None and b is None
    else:
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def assert_trees_close(got, want):
    g_leaves, g_spec = torch.utils._pytree.tree_flatten(got)
    w_leaves, w_spec = torch.utils._pytree.tree_flatten(want)
    assert g_spec == w_spec
    for a, b in zip(g_leaves, w_leaves):
        if isinstance(b, Tensor):
            assert isinstance(a, Tensor) and a.dtype == b.dtype and a.requires_grad == b.requires_grad
            close(a, b)
        else:
            assert a == b


def check_against_sequential(make_modules, owners, make_inputs, kwargs=None, seed=0):
    """Runs ``make_modules(owners)`` with parallel_apply, and ``make_modules``
    of deep copies of ``owners`` (the nn.Modules whose parameters matter) in a
    plain loop on copies of the inputs (tensors shared between calls stay
    shared); compares outputs, input gradients and parameter gradients."""
    ref_owners = copy.deepcopy(owners)
    modules, ref_modules = make_modules(owners), make_modules(ref_owners)
    inputs = make_inputs()
    memo = {}

    def copy_arg(a):
        if not isinstance(a, Tensor):
            return a
        if id(a) not in memo:
            memo[id(a)] = clone_leaf(a)
        return memo[id(a)]

    ref_inputs = [tuple(copy_arg(a) for a in args) if isinstance(args, tuple) else copy_arg(args)
                  for args in inputs]
    ref_kwargs = [{k: copy_arg(v) for k, v in (kw or {}).items()}
                  for kw in (kwargs or [None] * len(modules))]

    got = parallel_apply(modules, inputs, kwargs)
    want = []
    for m, args, kw in zip(ref_modules, ref_inputs, ref_kwargs):
        args = args if isinstance(args, tuple) else (args,)
        want.append(m(*args, **kw))
    assert isinstance(got, list) and len(got) == len(want)
    assert_trees_close(got, want)

    weighted_loss(got, seed).backward()
    weighted_loss(want, seed).backward()
    kw_tensors = [v for kw in (kwargs or []) for v in (kw or {}).values() if isinstance(v, Tensor)]
    for a in tensors_in(inputs) + kw_tensors:
        close(a.grad, memo[id(a)].grad)
    for p, q in zip(params_of(owners), params_of(ref_owners)):
        close(p.grad, q.grad)
    return got


# -- equality with sequential autograd -------------------------------------------------------

def test_modules_shared_modules_and_callables_match_sequential():
    def experts(owners):
        a, b = owners
        return [a, b, a, functools.partial(lambda m, x: m(x).relu(), b),
                lambda x: (x * 2).sin(), a]

    check_against_sequential(experts, [Expert(seed=0), Expert(seed=1)],
                             lambda: [randn(3, 4, seed=i) for i in range(6)])


def test_same_input_tensor_in_every_call():
    e = Expert(seed=3)
    x = randn(5, 4, seed=1)
    check_against_sequential(lambda o: [o[0]] * 4, [e], lambda: [x] * 4)


def test_tuple_inputs_kwargs_and_pytree_outputs():
    class Router(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.expert = Expert(seed=seed)
            self.gate = nn.Parameter(torch.ones(4, dtype=DT) * (seed + 1))

        def forward(self, x, y, k, *, scale, bias=None):
            out = self.expert(x, scale=scale) * self.gate
            return {
                "out": out + (bias if bias is not None else 0),
                "aux": (y * k, "label", None),
                "index": out.argmax(-1),          # integer output: not differentiable
                "const": torch.ones(2, dtype=DT),  # output without a graph
            }

    scale = randn(6, seed=9)
    bias = randn(4, seed=10)
    kwargs = [{"scale": scale, "bias": bias}, {"scale": scale}, {"scale": 2.0}]
    got = check_against_sequential(
        lambda o: [o[0], o[1], o[0]], [Router(0), Router(1)],
        lambda: [(randn(2, 4, seed=i), randn(3, seed=10 + i), 0.5 * i) for i in range(3)],
        kwargs,
    )
    assert got[0]["aux"][1:] == ("label", None)
    assert got[0]["index"].dtype == torch.int64 and not got[0]["index"].requires_grad
    assert not got[1]["const"].requires_grad
    # kwargs tensors get their gradients too (the reference used the same tensors)
    assert scale.grad is not None and bias.grad is not None


def test_kwargs_tensor_gradients_match_sequential():
    e = Expert(seed=4)
    r = copy.deepcopy(e)
    s, rs = randn(6, seed=1), randn(6, seed=1)
    xs = [randn(2, 4, seed=i) for i in range(3)]
    got = parallel_apply([e] * 3, xs, [{"scale": s}] * 3)
    want = [r(clone_leaf(x), scale=rs) for x in xs]
    weighted_loss(got).backward()
    weighted_loss(want).backward()
    close(s.grad, rs.grad)
    for p, q in zip(e.parameters(), r.parameters()):
        close(p.grad, q.grad)


def test_gradients_accumulate_into_existing_grad():
    e = Expert(seed=5)
    r = copy.deepcopy(e)
    for p, q in zip(e.parameters(), r.parameters()):
        p.grad = torch.full_like(p, 0.25)
        q.grad = torch.full_like(q, 0.25)
    x = randn(3, 4, seed=2)
    rx = clone_leaf(x)
    x.grad = torch.ones_like(x)
    rx.grad = torch.ones_like(rx)
    weighted_loss(parallel_apply([e, e], [x, x * 2])).backward()
    weighted_loss([r(rx), r(rx * 2)]).backward()
    close(x.grad, rx.grad)
    for p, q in zip(e.parameters(), r.parameters()):
        close(p.grad, q.grad)


def test_parameter_only_gradients_reach_parameters():
    experts = [Expert(seed=i) for i in range(3)]
    refs = copy.deepcopy(experts)
    xs = [randn(2, 4, seed=i, requires_grad=False) for i in range(3)]
    got = parallel_apply(experts, xs)
    assert all(o.requires_grad for o in got)
    weighted_loss(got).backward()
    weighted_loss([r(x) for r, x in zip(refs, xs)]).backward()
    for p, q in zip(params_of(experts), params_of(refs)):
        assert p.grad is not None
        close(p.grad, q.grad)


def test_partially_differentiable_calls():
    e = Expert(seed=7)
    frozen = Expert(seed=8).requires_grad_(False)
    x = randn(2, 4, seed=1)
    check_against_sequential(
        lambda o: [o[1], o[0], lambda t: t.detach() * 3, o[1], nn.Identity()], [e, frozen],
        lambda: [randn(2, 4, seed=5, requires_grad=False), x, x, x, x],
    )


def test_module_returning_its_input_or_the_same_tensor_twice():
    holder = nn.Module()
    holder.w = nn.Parameter(torch.ones(4, dtype=DT) * 3)

    def experts(owners):
        w = owners[0].w

        def twice(x):
            y = x * w
            return y, y

        def param(x):
            return w
        return [nn.Identity(), twice, param, twice]

    check_against_sequential(
        experts, [holder],
        lambda: [randn(4, seed=i) for i in range(4)],
    )


def test_all_outputs_hang_off_one_node():
    e = Expert(seed=0)
    outs = parallel_apply([e, e, e], [randn(2, 4, seed=i) for i in range(3)])
    assert len({id(o.grad_fn) for o in outs}) == 1


def test_retain_graph_allows_a_second_backward():
    e = Expert(seed=1)
    r = copy.deepcopy(e)
    xs = [randn(2, 4, seed=i) for i in range(3)]
    rxs = [clone_leaf(x) for x in xs]
    loss = weighted_loss(parallel_apply([e] * 3, xs))
    ref = weighted_loss([r(x) for x in rxs])
    loss.backward(retain_graph=True)
    ref.backward(retain_graph=True)
    loss.backward()
    ref.backward()
    for x, rx in zip(xs, rxs):
        close(x.grad, rx.grad)
    for p, q in zip(e.parameters(), r.parameters()):
        close(p.grad, q.grad)
    with pytest.raises(RuntimeError):  # the graph is freed now, as with plain autograd
        loss.backward()


def test_torch_autograd_grad_wrt_inputs_matches_sequential():
    e = Expert(seed=2)
    r = copy.deepcopy(e)
    x = randn(3, 4, seed=3)
    rx = clone_leaf(x)
    (gx,) = torch.autograd.grad(weighted_loss(parallel_apply([e, e], [x, x])), [x])
    (rgx,) = torch.autograd.grad(weighted_loss([r(rx), r(rx)]), [rx])
    close(gx, rgx)
    assert x.grad is None


def test_torch_autograd_grad_wrt_inputs_leaves_parameter_grads_alone():
    # Plain autograd computes only what was asked: torch.autograd.grad (or
    # backward(inputs=...)) never accumulates into the parameters' .grad. A
    # gradient penalty on the input must not leak into the optimizer's grads.
    e = Expert(seed=2)
    x = randn(3, 4, seed=3)
    (gx,) = torch.autograd.grad(weighted_loss(parallel_apply([e, e], [x, x])), [x])
    assert gx is not None
    assert all(p.grad is None for p in e.parameters())

    parallel_apply([e], [x])[0].sum().backward(inputs=[x])
    assert x.grad is not None
    assert all(p.grad is None for p in e.parameters())


def test_no_grad_keeps_no_graph():
    e = Expert(seed=3)
    x = randn(2, 4, seed=4)
    with torch.no_grad():
        outs = parallel_apply([e, e, lambda t: t * 2], [x, x, x])
        want = [e(x), e(x), x * 2]
    for o, w in zip(outs, want):
        assert o.grad_fn is None and not o.requires_grad
        close(o, w)


def test_inference_mode_reaches_workers():
    e = Expert(seed=3)
    x = randn(2, 4, seed=4, requires_grad=False)
    with torch.inference_mode():
        outs = parallel_apply([e, e], [x, x])
    assert all(o.is_inference() for o in outs)
    outs = parallel_apply([e, e], [x, x])
    assert not any(o.is_inference() for o in outs)


def test_checkpointed_calls_match_sequential():
    experts = [Expert(seed=i) for i in range(3)]
    refs = copy.deepcopy(experts)
    xs = [randn(2, 4, seed=i) for i in range(3)]
    rxs = [clone_leaf(x) for x in xs]
    got = parallel_apply(experts, xs, checkpoint=True)
    want = [r(x) for r, x in zip(refs, rxs)]
    for a, b in zip(got, want):
        close(a, b)
    weighted_loss(got).backward()
    weighted_loss(want).backward()
    for x, rx in zip(xs, rxs):
        close(x.grad, rx.grad)
    for p, q in zip(params_of(experts), params_of(refs)):
        close(p.grad, q.grad)


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="known limitation: a call's tensor inputs are detached leaves, "
                          "so an in-place op on an input raises 'a leaf Variable that "
                          "requires grad is being used in an in-place operation'")
def test_expert_modifying_its_input_in_place_matches_sequential():
    # e.g. an expert that starts with an in-place activation; plain autograd
    # allows it because the caller's input is not a leaf.
    e = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4).to(DT))
    r = copy.deepcopy(e)
    a = randn(2, 4, seed=0)
    ra = clone_leaf(a)
    got = parallel_apply([e], [a * 2])
    want = [r(ra * 2)]
    close(got[0], want[0])
    weighted_loss(got).backward()
    weighted_loss(want).backward()
    close(a.grad, ra.grad)


def test_length_mismatch_is_a_value_error():
    with pytest.raises(ValueError):
        parallel_apply([nn.Identity()] * 2, [torch.ones(1)])
    with pytest.raises(ValueError):
        parallel_apply([nn.Identity()] * 2, [torch.ones(1)] * 2, [{}])
    assert parallel_apply([], []) == []


# -- double backward -------------------------------------------------------------------------

def test_double_backward_raises_or_is_exact():
    x = randn(3, 4, seed=0)
    y = torch.tanh(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (expected,) = torch.autograd.grad(y.sum() + (g * g).sum(), x)

    (y,) = parallel_apply([torch.tanh], [x])
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    try:
        (got,) = torch.autograd.grad(y.sum() + (g * g).sum(), x)
    except RuntimeError as error:
        assert "differentiate twice" in str(error) or "once_differentiable" in str(error)
    else:
        close(got, expected)

    (y,) = parallel_apply([torch.tanh], [x])
    (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice|once_differentiable"):
        g.sum().backward()


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("modules", ["modules", "functions"])
def test_what_differentiates_the_gradients_raises_naming_the_batch(mode, checkpoint, modules):
    """jvp (the double-backward trick: it differentiates the gradients with
    respect to the incoming ones), hvp, vhp and hessian raise, where they
    silently gave zeros (issue 30 item 3); jacobian and vjp equal the loop."""
    from torch.autograd.functional import hessian, hvp, jacobian, jvp, vhp, vjp
    experts = ([Expert(seed=0), Expert(seed=1)] if modules == "modules"
               else [torch.tanh, lambda t: torch.sin(t) * t])
    x, v = randn(3, 4, seed=0, requires_grad=False), randn(3, 4, seed=1, requires_grad=False)

    def ours(t):
        a, b = parallel_apply(experts, [t, t * 2], mode=mode, checkpoint=checkpoint)
        return a + b

    def loop(t):
        return experts[0](t) + experts[1](t * 2)

    for transform in (lambda f: jvp(f, x, v), lambda f: hvp(lambda t: f(t).sum(), x, v),
                      lambda f: vhp(lambda t: f(t).sum(), x, v),
                      lambda f: hessian(lambda t: f(t).sum(), x)):
        with pytest.raises(RuntimeError, match="parallel_apply: trying to differentiate twice"):
            transform(ours)
    assert torch.equal(jacobian(ours, x), jacobian(loop, x))
    assert all(torch.equal(a, b) for a, b in zip(vjp(ours, x, v), vjp(loop, x, v)))



class _SparseEmbeddingExpert(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(10, 4, sparse=True)

    def forward(self, x):
        return self.emb(torch.tensor([1, 3, 3])) * x


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_sparse_gradients_under_create_graph_equal_the_loop_then_refuse_a_second(mode):
    """An expert whose gradient is sparse (``nn.Embedding(sparse=True)``)
    under ``create_graph=True``: the gradients equal the loop's, and
    differentiating them raises the node's refusal (sparse tensors have no
    views; it was a NotImplementedError from ``aten::view`` on SparseCPU;
    ``make fuzz`` seed 1795791825 cases 2663 and 3526, via hvp)."""
    experts = [_SparseEmbeddingExpert(0), _SparseEmbeddingExpert(1)]
    x = randn(3, 4, seed=2)
    a, b = parallel_apply(experts, [x, x * 2], mode=mode)
    params = [experts[0].emb.weight, experts[1].emb.weight]
    ours = torch.autograd.grad((a * b).sum(), [x, *params], create_graph=True)
    want = torch.autograd.grad((experts[0](x) * experts[1](x * 2)).sum(), [x, *params])
    assert ours[1].is_sparse and ours[2].is_sparse
    for got, expected in zip(ours, want):
        assert torch.equal(got.to_dense(), expected.to_dense())
    with pytest.raises(RuntimeError, match="parallel_apply: trying to differentiate twice"):
        torch.autograd.grad(ours[0].sum(), x)


# -- shared stateful submodules ---------------------------------------------------------------

class Counting(nn.Module):
    """A module of its own class, state changed by its forward."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def forward(self, x):
        self.seen += 1
        return x * self.seen


@pytest.mark.parametrize("mode", ["lanes", "parallel", "auto"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_stateful_submodule_shared_by_distinct_experts_updates_in_call_order(mode, checkpoint):
    """One BatchNorm (buffers) and one module of a class of its own inside
    several distinct experts: running statistics, attributes, outputs and
    gradients are the loop's in every mode (issue 30 item 1)."""
    def world():
        torch.manual_seed(0)
        bn, count = nn.BatchNorm1d(4).to(DT), Counting()
        experts = [nn.Sequential(nn.Linear(4, 4).to(DT), bn, count, nn.Tanh()) for _ in range(4)]
        return experts, bn, count, [randn(6, 4, seed=i) for i in range(4)]

    def observe(experts, bn, count, outs, xs):
        sum(o.sum() for o in outs).backward()
        return ([o.detach() for o in outs] + [bn.running_mean, bn.running_var, xs[0].grad]
                + [p.grad for e in experts for p in e.parameters()], count.seen)

    experts, bn, count, xs = world()
    want = observe(experts, bn, count, [e(x) for e, x in zip(experts, xs)], xs)
    experts, bn, count, xs = world()
    for _ in range(2 if mode == "auto" else 1):  # auto: the second batch in the site's mode
        experts, bn, count, xs = world()
        got = observe(experts, bn, count,
                      parallel_apply(experts, xs, mode=mode, checkpoint=checkpoint), xs)
        assert got[1] == want[1]
        assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))


class Overlaps(nn.Module):
    """Records whether a second call entered its forward while the first was
    still inside: the first waits up to ``patience`` s for one to come."""

    def __init__(self, patience: float):
        super().__init__()
        self.patience, self.inside, self.overlapped = patience, 0, False
        self.lock, self.second = threading.Lock(), threading.Event()

    def forward(self, x):
        with self.lock:
            self.inside += 1
            first = self.inside == 1
            if not first:
                self.overlapped = True
                self.second.set()
        if first:
            self.second.wait(self.patience)
        with self.lock:
            self.inside -= 1
        return x * 2


@pytest.mark.timeout(60)
def test_a_stateful_first_child_shared_by_distinct_experts_orders_the_calls(fresh_pool):
    """The ordering looks at every submodule, the first child too: distinct
    experts whose one shared stateful module is their first child never run
    it at once. (Correct code cannot overlap; the first call waits 0.5 s for a
    second to come in, which is how a missed ordering shows.)"""
    fresh_pool(4)
    shared = Overlaps(patience=0.5)
    experts = [nn.Sequential(shared, nn.Linear(4, 4).to(DT)) for _ in range(2)]
    outs = parallel_apply(experts, [randn(2, 4, seed=i) for i in range(2)], mode="parallel")
    assert not shared.overlapped
    assert all(torch.equal(o, e(x)) for o, e, x in zip(
        outs, experts, [randn(2, 4, seed=i) for i in range(2)]))


@pytest.mark.timeout(60)
def test_experts_sharing_only_modules_that_compute_still_overlap(fresh_pool):
    """A torch.nn module without buffers or hooks (a tied Linear) orders
    nothing: the calls still run concurrently."""
    fresh_pool(4)
    shared = nn.Linear(4, 4).to(DT)
    barrier = threading.Barrier(3, timeout=20)

    class Meets(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = shared

        def forward(self, x):
            barrier.wait()  # BrokenBarrierError unless the three calls overlap
            return self.shared(x)

    outs = parallel_apply([Meets(), Meets(), Meets()], [randn(2, 4, seed=i) for i in range(3)],
                          mode="parallel")
    sum(o.sum() for o in outs).backward()
    assert shared.weight.grad is not None


# -- interruptions ---------------------------------------------------------------------------

class _Interrupt(BaseException):
    pass


class Raises(nn.Module):
    def __init__(self, error=None, delay=0.0):
        super().__init__()
        self.error, self.delay, self.ran = error, delay, []

    def forward(self, x):
        time.sleep(self.delay)
        self.ran.append(time.monotonic())
        if self.error is not None:
            raise self.error
        return x * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["inline", "lanes", "parallel", "auto"])
@pytest.mark.parametrize("interrupt", [SystemExit(3), _Interrupt(), GeneratorExit()])
def test_an_interruption_after_an_error_in_call_order_loses_to_it(mode, interrupt):
    """ValueError in call 1, a BaseException in call 2: the loop raises the
    ValueError; so does every mode, after every call it started ended
    (issue 30 item 6: lanes raised the SystemExit, at once)."""
    experts = [Raises(delay=0.05), Raises(ValueError("first")), Raises(interrupt),
               Raises(delay=0.1)]
    with pytest.raises(ValueError, match="first") as info:
        parallel_apply(experts, [randn(2, 4, seed=i) for i in range(4)], mode=mode)
    returned = time.monotonic()
    assert "parallel_apply: call 1 of 4" in info.value.__notes__
    assert experts[0].ran  # earlier calls ran, as in the loop
    assert all(t <= returned for e in experts for t in e.ran)  # none after the error returned


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_an_interruption_is_raised_once_the_batch_has_stopped(mode):
    experts = [Raises(delay=0.2), Raises(_Interrupt())] + [Raises(delay=0.05) for _ in range(4)]
    with pytest.raises(_Interrupt):
        parallel_apply(experts, [randn(2, 4, seed=i) for i in range(6)], mode=mode)
    returned = time.monotonic()
    assert experts[0].ran  # the call running beside it ended first
    time.sleep(0.3)
    assert all(t <= returned for e in experts for t in e.ran)
    if mode == "lanes":  # later calls were still pending: never started
        assert not any(e.ran for e in experts[2:])


# -- concurrency -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [8, 16])
def test_forwards_and_backwards_all_run_concurrently(fresh_pool, n):
    fresh_pool(DEFAULT_WORKERS)  # the default size, whatever MOE_AUTOGRAD_WORKERS says here
    forward_barrier = threading.Barrier(n, timeout=20)
    backward_barrier = threading.Barrier(n, timeout=20)
    e = Expert(seed=0)
    r = copy.deepcopy(e)

    def expert(x):
        forward_barrier.wait()  # BrokenBarrierError unless all n forwards overlap
        return BackwardBarrier.apply(e(x), backward_barrier)

    xs = [randn(2, 4, seed=i) for i in range(n)]
    rxs = [clone_leaf(x) for x in xs]
    weighted_loss(parallel_apply([expert] * n, xs)).backward()
    weighted_loss([r(x) for x in rxs]).backward()
    for x, rx in zip(xs, rxs):
        close(x.grad, rx.grad)
    for p, q in zip(e.parameters(), r.parameters()):
        close(p.grad, q.grad)


@pytest.mark.timeout(60)
def test_many_user_threads(thread_guard):
    errors = []

    def user(u):
        try:
            experts = [Expert(seed=10 * u + k) for k in range(3)]
            refs = copy.deepcopy(experts)
            for it in range(20):
                n = 1 + (u + it) % 4
                mods = [experts[k % 3] for k in range(n)]
                ref_mods = [refs[k % 3] for k in range(n)]
                xs = [randn(1 + k, 4, seed=1000 * u + 10 * it + k) for k in range(n)]
                ref_xs = [clone_leaf(x) for x in xs]
                for m in experts + refs:
                    m.zero_grad(set_to_none=True)
                got = parallel_apply(mods, xs)
                want = [m(x) for m, x in zip(ref_mods, ref_xs)]
                for a, b in zip(got, want):
                    close(a, b)
                weighted_loss(got, it).backward()
                weighted_loss(want, it).backward()
                for x, rx in zip(xs, ref_xs):
                    close(x.grad, rx.grad)
                for p, q in zip(params_of(experts), params_of(refs)):
                    close(p.grad, q.grad)
        except BaseException as error:
            errors.append(error)

    run_threads(user, 8)
    assert not errors, errors[0]



def _nested_model(inner, parallel):
    """Three levels: parallel_apply of experts that call parallel_apply of
    experts that call map_with_parallel_backward; or the same computation as
    plain calls (``parallel=False``)."""
    def leaf_call(x):
        if not parallel:
            return Square.apply(x) + Square.apply(x.sin())
        (a,), (b,) = map_with_parallel_backward(Square, (x,), (x.sin(),))
        return a + b

    def middle(x):
        mods, xs = [inner[0], inner[1], leaf_call], [x, x, x]
        outs = parallel_apply(mods, xs) if parallel else [m(t) for m, t in zip(mods, xs)]
        return sum(outs)

    def outer(x):
        mods, xs = [middle, middle, inner[2]], [x, x * 2, x]
        outs = parallel_apply(mods, xs) if parallel else [m(t) for m, t in zip(mods, xs)]
        return sum(outs)

    return outer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_nested_calls_never_deadlock(fresh_pool, workers):
    pool = fresh_pool(workers)
    inner = [Expert(seed=s) for s in range(3)]
    xs = [randn(2, 4, seed=i) for i in range(4)]
    got = parallel_apply([_nested_model(inner, parallel=True)] * 4, xs)
    weighted_loss(got).backward()
    got_grads = [x.grad for x in xs] + [p.grad for p in params_of(inner)]
    assert len(pool.threads) <= workers

    for p in params_of(inner):
        p.grad = None
    rxs = [clone_leaf(x) for x in xs]
    outer = _nested_model(inner, parallel=False)
    want = [outer(x) for x in rxs]
    for a, b in zip(got, want):
        close(a, b)
    weighted_loss(want).backward()
    want_grads = [x.grad for x in rxs] + [p.grad for p in params_of(inner)]
    for a, b in zip(got_grads, want_grads):
        close(a, b)


@pytest.mark.timeout(120)
def test_nested_calls_with_two_workers_in_a_fresh_process(run_python):
    out = run_python(
        """
        import json, threading, torch
        from torch import nn
        from moe_autograd import map_with_parallel_backward, parallel_apply
        from moe_autograd import executor

        class Square(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * x

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return 2 * x * g

        torch.manual_seed(0)
        lin = nn.Linear(3, 3).double()

        def leaf_call(x):
            (a,), (b,) = map_with_parallel_backward(Square, (x,), (x + 1,), )
            return a + b

        def middle(x):
            return sum(parallel_apply([lin, leaf_call, leaf_call, lin], [x] * 4))

        def outer(x):
            return sum(parallel_apply([middle] * 4, [x] * 4))

        x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
        outs = parallel_apply([outer] * 4, [x] * 4)
        sum(o.sum() for o in outs).backward()
        got = (x.grad.clone(), lin.weight.grad.clone())

        # sequential reference, without the runtime
        x.grad = None
        lin.weight.grad = None
        def leaf_ref(x):
            return Square.apply(x) + Square.apply(x + 1)
        def middle_ref(x):
            return lin(x) + leaf_ref(x) + leaf_ref(x) + lin(x)
        sum((4 * middle_ref(x)).sum() for _ in range(4)).backward()
        ok = torch.allclose(got[0], x.grad) and torch.allclose(got[1], lin.weight.grad)
        workers = [t.name for t in threading.enumerate()
                   if t.name.startswith("moe_autograd-worker-")]
        print(json.dumps({"ok": ok, "workers": workers,
                          "max": executor.get_pool().max_workers}))
        """,
        env={"MOE_AUTOGRAD_WORKERS": "2"},
        timeout=100,
    )
    report = json.loads(out.strip().splitlines()[-1])
    assert report["max"] == 2
    assert report["ok"] is True
    assert 1 <= len(report["workers"]) <= 2


# -- errors ----------------------------------------------------------------------------------

class Injected(Exception):
    pass


class _FailInBackward(Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise Injected("backward failed")


@pytest.mark.timeout(30)
def test_forward_error_names_call_and_joins_others():
    finished, lock = [], threading.Lock()

    def expert(i):
        def run(x):
            if i == 1:
                raise Injected(f"forward {i}")
            time.sleep(0.05)
            with lock:
                finished.append(i)
            return x * i
        return run

    x = randn(3, seed=0)
    with pytest.raises(Injected, match="forward 1") as info:
        parallel_apply([expert(i) for i in range(5)], [x] * 5)
    assert any("call 1 of 5" in note for note in info.value.__notes__)
    assert sorted(finished) == [0, 2, 3, 4]
    time.sleep(0.1)
    assert len(finished) == 4


@pytest.mark.timeout(30)
def test_backward_error_names_call_and_joins_others():
    finished, lock = [], threading.Lock()

    class Slow(Function):
        @staticmethod
        def forward(ctx, x, i):
            ctx.i = i
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.05)
            with lock:
                finished.append(ctx.i)
            return g, None

    def expert(i):
        def run(x):
            if i == 2:
                return _FailInBackward.apply(x * 2)
            return Slow.apply(x * 2, i)
        return run

    x = randn(3, seed=0)
    outs = parallel_apply([expert(i) for i in range(5)], [x] * 5)
    with pytest.raises(Injected, match="backward failed") as info:
        sum(o.sum() for o in outs).backward()
    assert any("call 2 of 5" in note for note in info.value.__notes__)
    assert sorted(finished) == [0, 1, 3, 4]
    time.sleep(0.1)
    assert len(finished) == 4


# -- thread-local state ----------------------------------------------------------------------

def test_autocast_reaches_workers_and_is_restored():
    w = torch.randn(4, 4)

    def expert(x):
        return x @ w

    x = torch.randn(3, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = parallel_apply([expert] * 4, [x] * 4)
        want = expert(x)
    assert want.dtype == torch.bfloat16
    assert all(o.dtype == torch.bfloat16 for o in outs)
    for o in outs:
        torch.testing.assert_close(o, want)
    sum(o.float().sum() for o in outs).backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    outs = parallel_apply([expert] * 4, [x] * 4)
    assert all(o.dtype == torch.float32 for o in outs)


@pytest.mark.timeout(60)
def test_saved_tensors_hooks_see_the_workers_saved_tensors_in_call_order():
    """The user's hooks see every tensor the calls save, packed on the
    caller's thread in call order (as a loop packs them), never on a worker,
    whatever order the workers ran in."""
    e = Expert(seed=0)
    x = randn(2, 4, seed=1)

    def recorder(log):
        def pack(t):
            log.append(("pack", tuple(t.shape), threading.current_thread().name))
            return t

        def unpack(t):
            log.append(("unpack", tuple(t.shape), threading.current_thread().name))
            return t
        return pack, unpack

    seq_log = []
    with torch.autograd.graph.saved_tensors_hooks(*recorder(seq_log)):
        ref = e(x)
    ref.sum().backward()
    seq_packs = [s for kind, s, _ in seq_log if kind == "pack"]
    assert seq_packs

    log = []
    # The barrier makes the three calls run on three threads, so that at least
    # two of them run on workers (the caller may run one itself).
    barrier = threading.Barrier(3, timeout=10)

    def rendezvous_then_e(t):
        barrier.wait()
        return e(t)
    with torch.autograd.graph.saved_tensors_hooks(*recorder(log)):
        outs = parallel_apply([rendezvous_then_e] * 3, [x, x, x])
    sum(o.sum() for o in outs).backward()
    packs = [s for kind, s, _ in log if kind == "pack" and 0 not in s]
    assert packs == seq_packs * 3
    me = threading.current_thread().name
    assert all(name == me for _, _, name in log)
    unpacks = sorted(s for kind, s, _ in log if kind == "unpack" and 0 not in s)
    assert unpacks == sorted(packs)

    # outside the context, the workers no longer use the hooks
    log.clear()
    outs = parallel_apply([e, e, e], [x, x, x])
    sum(o.sum() for o in outs).backward()
    assert log == []


def test_copying_saved_tensors_hooks_work():
    # An offloading-style hook packs a copy of each saved tensor.
    e = Expert(seed=0)
    r = copy.deepcopy(e)
    xs = [randn(2, 4, seed=i) for i in range(3)]
    rxs = [clone_leaf(x) for x in xs]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        outs = parallel_apply([e] * 3, xs)
        want = [r(x) for x in rxs]
    weighted_loss(outs).backward()
    weighted_loss(want).backward()
    for x, rx in zip(xs, rxs):
        close(x.grad, rx.grad)
    for p, q in zip(e.parameters(), r.parameters()):
        close(p.grad, q.grad)


# -- lifetime --------------------------------------------------------------------------------

def _tracked_expert(refs, seed=0):
    e = Expert(seed=seed)

    def expert(x):
        y = e(x)
        refs.append(weakref.ref(y))
        return y
    return expert


@pytest.mark.timeout(30)
def test_local_graph_released_after_backward(wait_dead):
    refs = []
    expert = _tracked_expert(refs)
    outs = parallel_apply([expert] * 4, [randn(2, 4, seed=i) for i in range(4)])
    assert len(refs) == 4 and all(r() is not None for r in refs)
    sum(o.sum() for o in outs).backward()
    # the returned outputs are alive; the calls' local outputs and graphs are not
    assert not any(wait_dead(refs))
    assert all(o.grad_fn is not None for o in outs)


@pytest.mark.timeout(30)
def test_local_graph_released_with_the_outputs(wait_dead):
    refs = []
    expert = _tracked_expert(refs)
    outs = parallel_apply([expert] * 3, [randn(2, 4, seed=i) for i in range(3)])
    del outs
    assert not any(wait_dead(refs))


@pytest.mark.timeout(30)
def test_local_graph_released_after_failed_backward(wait_dead):
    refs = []
    expert = _tracked_expert(refs)

    def failing(x):
        return _FailInBackward.apply(expert(x))

    outs = parallel_apply([expert, failing, expert], [randn(2, 4, seed=i) for i in range(3)])
    with pytest.raises(Injected):
        sum(o.sum() for o in outs).backward()
    del outs
    assert not any(wait_dead(refs))


@pytest.mark.timeout(60)
def test_thread_count_stable_over_many_calls(thread_guard):
    from moe_autograd.executor import get_pool

    e = Expert(seed=0)
    parallel_apply([e] * 4, [randn(2, 4, seed=0)] * 4)
    before = threading.active_count()
    pool = get_pool()
    for it in range(40):
        n = 1 + it % 8
        outs = parallel_apply([e] * n, [randn(2, 4, seed=it)] * n)
        sum(o.sum() for o in outs).backward()
    workers = [t for t in threading.enumerate() if t.name.startswith("moe_autograd-worker-")]
    assert len(workers) <= pool.max_workers
    assert threading.active_count() <= before + pool.max_workers


@pytest.mark.parametrize("checkpoint", [False, True])
def test_closure_over_a_non_leaf_raises_and_over_a_leaf_is_a_parameter(checkpoint):
    """Checkpointed or not, a call's graph that reaches into the caller's
    through a closure is refused, naming the call and the node it met."""
    w = torch.randn(4, 4, dtype=DT, requires_grad=True)
    x = torch.randn(2, 4, dtype=DT, requires_grad=True)
    w2 = w.tanh()
    with pytest.raises(ForeignGraphError) as info:
        parallel_apply([lambda a: a @ w2], [x], checkpoint=checkpoint)
    assert str(info.value) == (
        "parallel_apply: call 0 of 1: the expert differentiates into its caller's graph through "
        "a tensor it did not receive as an argument (a closure over a non-leaf tensor, reached "
        "at TanhBackward0); pass that tensor as an input of the call")
    with torch.no_grad(), pytest.raises(ForeignGraphError):  # an expert enabling grad itself
        parallel_apply([lambda a: torch.enable_grad()(lambda: a @ w2)()], [x])
    (out,) = parallel_apply([lambda a: a @ w], [x], checkpoint=checkpoint)
    out.sum().backward()
    want = x.detach().t() @ torch.ones(2, 4, dtype=DT)
    torch.testing.assert_close(w.grad, want)


def test_a_calls_gradient_node_runs_on_its_devices_engine_thread():
    """The engine runs a node on the thread of the first device among its
    outputs that is not the CPU (its input buffer's device); a call's gradient
    node's token is put there, so the node runs where the loop's nodes of that
    call run. ``tests/test_cuda.py`` checks the threads themselves on CUDA;
    here, the rule for outputs on several devices."""
    from moe_autograd.node import _engine_device
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert _engine_device([]) == cpu
    assert _engine_device([((2,), DT, cpu), ((3,), DT, cpu)]) == cpu
    assert _engine_device([((2,), DT, cpu), ((1,), DT, meta),
                           ((1,), DT, torch.device("cuda", 1))]) == meta


# -- start_calls / finish_calls, the two halves the MoE layer uses: what each
# -- argument reaches, and the inline mode's own loop ----------------------------



def _joined(calls, group):
    assert group.wait(30.0)
    group.raise_first_error("call")
    return calls


def test_start_calls_defaults_name_the_calls_and_neither_checkpoint_nor_check():
    x = randn(3, 4, seed=1)
    calls = _joined(*start_calls([Expert(seed=0), Expert(seed=1)], [x, x]))
    assert [c.name for c in calls] == ["parallel_apply: call 0 of 2", "parallel_apply: call 1 of 2"]
    assert [(c.checkpoint, c.check_finite_grads) for c in calls] == [(False, False)] * 2
    calls = _joined(*start_calls([Expert(seed=0), Expert(seed=1)], [x, x], name="MyLayer",
                                 labels=["expert 3", "expert 5"]))
    assert [c.name for c in calls] == ["MyLayer: expert 3", "MyLayer: expert 5"]


def test_start_calls_refusals_name_the_caller():
    x = randn(3, 4, seed=1)
    experts = [Expert(seed=0), Expert(seed=1)]
    with pytest.raises(ValueError, match=r"^MyLayer: 2 modules but 1 inputs$"):
        start_calls(experts, [x], name="MyLayer")
    with pytest.raises(ValueError, match=r"^MyLayer: 2 modules but 3 kwargs$"):
        start_calls(experts, [x, x], [{}, {}, {}], name="MyLayer")
    with pytest.raises(ValueError, match=r"^parallel_apply: checkpoint has 1 entries for 2 calls$"):
        start_calls(experts, [x, x], checkpoint=[True])
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), torch.ones_like(x))
        with pytest.raises(RuntimeError, match=r"^MyLayer does not support forward-mode AD"):
            start_calls(experts, [dual, dual], name="MyLayer")


def test_start_calls_passes_kwargs_and_finish_calls_equals_the_loop():
    x = randn(3, 4, seed=1)
    scales = [torch.tensor(2.0, dtype=DT), torch.tensor(-1.5, dtype=DT)]
    experts = [Expert(seed=0), Expert(seed=1)]
    ref = [m(x, scale=s) for m, s in zip(experts, scales)]
    calls = _joined(*start_calls(experts, [x, x], [{"scale": s} for s in scales]))
    for got, want in zip(finish_calls(calls), ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Draws(nn.Module):
    """Draws from the generator it is given (one for all experts here)."""

    def __init__(self, gen):
        super().__init__()
        self.gen = gen

    def forward(self, x):
        self.thread = threading.get_ident()
        return x + torch.randn(x.shape, dtype=x.dtype, generator=self.gen)


def test_one_lane_runs_every_call_on_one_thread_so_a_shared_generator_is_the_loops():
    """``lanes=1``: the calls run one after another on one thread, in call
    order, so experts that share an explicit generator draw as the loop does;
    with two lanes the same batch is refused (its draws would interleave)."""
    x = torch.zeros(3, dtype=DT)
    gen = torch.Generator().manual_seed(7)
    experts = [_Draws(gen), _Draws(gen), _Draws(gen)]
    gen.manual_seed(7)
    want = [m(x) for m in experts]
    gen.manual_seed(7)
    calls = _joined(*start_calls(experts, [x, x, x], lanes=1))
    assert len({m.thread for m in experts}) == 1
    for got, w in zip(finish_calls(calls), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    calls, group = start_calls(experts, [x, x, x], lanes=2)
    group.wait(30.0)
    with pytest.raises(RuntimeError, match="draw from the same torch.Generator"):
        group.raise_first_error("call")
    # One lane: call 0 waits in vain for call 1, which starts only after it.
    started, seen = threading.Event(), []
    waits = [_Signals(lambda: seen.append(started.wait(0.5))), _Signals(started.set)]
    _joined(*start_calls(waits, [x, x], lanes=1))
    assert seen == [False]


class _Signals(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        self.act()
        return x


def test_start_calls_hands_collected_calls_to_their_collector_with_the_deadline_and_measure():
    """A collected expert (its own record type) goes to its collector, with
    the caller's deadline, and is timed by the caller's measure; a
    checkpointed one is a plain call (recomputation runs here)."""
    COLLECTOR.deadlines.clear()
    x = torch.randn(2, 3)
    measure = Measure("test", 2, Decision("parallel", 2, "forced"))
    calls = _joined(*start_calls([Scaled(2.0), nn.Identity()], [x, x], deadline=1.5,
                                 measure=measure))
    assert COLLECTOR.deadlines == [1.5]
    assert type(calls[0]) is CollectedCall and type(calls[1]) is ModuleCall
    assert measure.walls[0] > 0.0
    torch.testing.assert_close(finish_calls(calls)[0], 2 * x)
    calls = _joined(*start_calls([Scaled(2.0), nn.Identity()], [x, x], checkpoint=[True, False]))
    assert type(calls[0]) is ModuleCall and COLLECTOR.deadlines == [1.5]


class _Steps(nn.Module):
    """One module for every call (its state is shared): a call interrupts,
    or fails, as its keyword says."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=DT))
        self.ran = []

    def forward(self, x, i, fail=None, meet=None):
        if meet is not None:
            meet.wait()
        if fail is not None:
            raise fail
        self.count += 1
        self.ran.append(i)
        return x * self.count


class _Meets(nn.Module):
    def forward(self, x, meet):
        meet.wait()
        return x


@pytest.mark.timeout(30)
def test_an_interruption_stops_the_later_calls_reaching_the_same_module():
    """As a loop stops at a KeyboardInterrupt: the calls after it that reach
    the same module do not run, each cancelled naming what stopped it; an
    ordinary error fails its own call only (the MoE layer masks it). Call 0
    raises once call 3 runs: the calls before 3 have started (a worker each,
    taken in order), waiting for the call before them."""
    m = _Steps()
    x = torch.ones(2, dtype=DT)
    meet = threading.Barrier(2, timeout=10)
    calls, group = start_calls([m, m, m, _Meets()], [x] * 4,
                               [{"i": 0, "fail": KeyboardInterrupt(), "meet": meet}, {"i": 1},
                                {"i": 2}, {"meet": meet}])
    group.wait(30.0)
    assert isinstance(group.errors[0], KeyboardInterrupt) and group.succeeded(3)
    for i, stop in [(1, "KeyboardInterrupt"), (2, "CallCancelled")]:
        assert isinstance(group.errors[i], CallCancelled) and str(group.errors[i]) == (
            f"parallel_apply: call {i} of 4: not run: an earlier call reaching the same module "
            f"raised {stop}")
    assert m.ran == [] and m.count.item() == 0

    m = _Steps()
    calls, group = start_calls([m, m, m], [x] * 3,
                               [{"i": 0}, {"i": 1, "fail": ValueError("bad")}, {"i": 2}])
    group.wait(30.0)
    assert isinstance(group.errors[1], ValueError)
    assert group.succeeded(0) and group.succeeded(2) and m.ran == [0, 2]


class _Dropout(nn.Module):
    def forward(self, x, scale=1.0):
        return nn.functional.dropout(x, 0.5, training=True) * scale


def test_inline_mode_draws_from_each_calls_own_stream_and_passes_kwargs():
    """The inline mode is the loop with the batch's random streams: the same
    draws as every other mode (each call its own stream, forked in call
    order), and the keyword arguments passed."""
    x = torch.ones(64, dtype=DT)
    experts = [_Dropout(), _Dropout(), _Dropout()]
    kwargs = [{"scale": 1.0}, {"scale": 2.0}, {"scale": 3.0}]
    outs = {}
    for mode in ["inline", "parallel"]:
        torch.manual_seed(5)
        outs[mode] = parallel_apply(experts, [x, x, x], kwargs, mode=mode)
        outs[mode].append(torch.rand(()))  # the generator after the batch
    for a, b in zip(outs["inline"], outs["parallel"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(outs["inline"][0], outs["inline"][1] / 2)  # distinct streams
    assert set(outs["inline"][2].unique().tolist()) == {0.0, 6.0}


@pytest.mark.timeout(30)
def test_under_no_grad_autocast_does_not_serialize_the_calls():
    """Autocast's weight cache makes calls that record gradients run as the
    loop; with no gradients recorded (no_grad) the calls still fan out: two
    experts meet at a barrier."""
    barrier = threading.Barrier(2, timeout=10)

    class Meets(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            barrier.wait()
            return self.lin(x)

    x = torch.randn(2, 4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outs = parallel_apply([Meets(), Meets()], [x, x], mode="parallel")
    assert [o.dtype for o in outs] == [torch.bfloat16] * 2


@pytest.mark.timeout(60)
def test_an_expert_that_enables_grad_under_no_grad_gets_the_loops_graph():
    """Its outputs have a graph, as in the loop, carried by the node: the
    calls' backwards still overlap (they meet at a barrier)."""
    barrier = threading.Barrier(2, timeout=10)

    class Enables(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4).to(DT)

        def forward(self, x):
            with torch.enable_grad():
                return BackwardBarrier.apply(self.lin(x), barrier)

    experts = [Enables(), Enables()]
    x = randn(2, 4, seed=3, requires_grad=False)
    with torch.no_grad():
        outs = parallel_apply(experts, [x, x], mode="parallel")
    want = [m.lin(x) for m in experts]
    assert [o.requires_grad for o in outs] == [True, True]
    got = torch.autograd.grad(sum(o.sum() for o in outs), params_of(experts))
    ref = torch.autograd.grad(sum(o.sum() for o in want), params_of(experts))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_inline_batch_that_auto_mode_picked_is_measured(monkeypatch):
    """Auto mode learns from its inline batches too: each call is timed."""
    class _TinyForTimes(nn.Module):
        def forward(self, x):
            return x * 2

    monkeypatch.setattr(parallel_module, "choose",
                        lambda site, n, mode, modules: Decision("inline", 1, "tiny calls"))
    experts = [_TinyForTimes(), _TinyForTimes()]
    x = torch.ones(3)
    try:
        parallel_apply(experts, [x, x])
        stats = next(s for s in execution_stats() if "_TinyForTimes" in s["site"])
        assert stats["batches"] == {"inline": 1} and stats["wall_per_call_us"] > 0, stats
    finally:
        policy._forget(policy.site_of(experts))


class _RecordsThreads(nn.Module):
    """Records the thread of each forward and of its backward."""

    def __init__(self, seed):
        super().__init__()
        self.lin = Expert(seed=seed)
        self.forwards, self.backwards = [], []

    def forward(self, x):
        self.forwards.append(threading.get_ident())
        return _BackwardThread.apply(self.lin(x), self.backwards)


class _BackwardThread(Function):
    @staticmethod
    def forward(ctx, x, threads):
        ctx.threads = threads
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.threads.append(threading.get_ident())
        return g, None


@pytest.mark.timeout(60)
def test_in_lanes_a_checkpointed_call_recomputes_on_the_lane_that_runs_its_backward():
    """Within the cores, a lane recomputes its call where its backward then
    runs (queued on other workers, recomputations would crowd the cores)."""
    experts = [_RecordsThreads(seed) for seed in range(4)]
    x = randn(3, 4, seed=2)
    outs = parallel_apply(experts, [x] * 4, checkpoint=True, mode="lanes")
    sum(o.sum() for o in outs).backward()
    for m in experts:
        assert len(m.forwards) == 2 and len(m.backwards) == 1
        assert m.forwards[1] == m.backwards[0]


def test_an_expert_given_no_tensor_and_holding_none_runs_on_the_cpu():
    """An expert without parameters, called without tensors (it builds its
    output from plain arguments), runs as the loop; its call is on the CPU."""
    class Ones(nn.Module):
        def forward(self, n: int, scale: float = 1.0) -> Tensor:
            return torch.ones(n) * scale

    out = parallel_apply([Ones(), Ones()], [(2,), (3, 2.0)], mode="parallel")
    assert [o.tolist() for o in out] == [[1.0, 1.0], [2.0, 2.0, 2.0]]
    assert ModuleCall(Ones(), (2,), {}).device == torch.device("cpu")


def test_an_expert_flipping_requires_grad_beside_plain_and_constant_arguments():
    """An expert that calls requires_grad_() on one input, called with it, a
    tensor that does not require grad and a float: only that input starts
    requiring grad, as in the loop, and it gets the loop's gradient."""
    class Flips(nn.Module):
        def forward(self, x: Tensor, y: Tensor, scale: float) -> Tensor:
            x.requires_grad_()
            return (x * y * scale).sum()

    x, y = randn(2, 3, seed=0, requires_grad=False), randn(2, 3, seed=1, requires_grad=False)
    rx, ry = x.clone(), y.clone()
    parallel_apply([Flips()], [(x, y, 2.0)], mode="parallel")[0].backward()
    Flips()(rx, ry, 2.0).backward()
    assert x.requires_grad and not y.requires_grad
    assert torch.equal(x.grad, rx.grad) and y.grad is None


def test_a_module_call_built_with_its_defaults_is_a_plain_call():
    """The defaults a subclass (an expert's ``moe_call_type``) relies on:
    not checkpointed, no finite check, named "call", index 0, a random
    stream of its own (its forward runs without one given)."""
    x = randn(2, 3, seed=0)
    lin = nn.Linear(3, 3, dtype=DT)
    call = ModuleCall(lin, (x,), {})
    assert (call.checkpoint, call.check_finite_grads, call.name, call.index) == (
        False, False, "call", 0)
    call.forward()
    assert torch.equal(call.outputs[0], lin(x))


@pytest.mark.timeout(60)
def test_two_backwards_running_through_one_call_at_once_both_get_their_gradients():
    """Two threads differentiate one call's output (retain_graph) at once:
    while one is still inside the call's backward, the other's finishing
    does not make its gradient look like one that bypassed the call."""
    barrier, done = threading.Barrier(2, timeout=20), threading.Event()

    class Meets(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            if barrier.wait() == 0:  # both are inside; this one leaves last
                assert done.wait(20)
            return g * 2

    class Expert(nn.Module):
        def forward(self, x):
            return Meets.apply(x)

    x = randn(3, seed=0)
    (out,) = parallel_apply([Expert()], [x], mode="parallel")
    grads = {}

    def run(k):
        try:
            grads[k] = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
        except Exception as error:  # noqa: BLE001 - compared below
            grads[k] = error
        done.set()
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [torch.equal(grads[k], torch.full_like(x, 2.0)) for k in range(2)] == [True, True], grads


def test_a_calls_backward_after_its_release_is_refused_naming_it():
    """The record's own refusal (the node refuses a second backward first)."""
    call = ModuleCall(nn.Identity(), (randn(2, seed=0),), {}, name="layer 3: call 1 of 2")
    call.release()
    with pytest.raises(RuntimeError) as info:
        call.backward([randn(2, seed=1)])
    assert str(info.value) == "layer 3: call 1 of 2: backward after its graph was freed"


def test_a_result_hiding_tensors_in_a_plain_object_is_refused_naming_the_call():
    """Outputs are followed through pytrees only: an object (not a pytree)
    that holds tensors, directly or up to three objects deep, is refused (the
    search is bounded: deeper ones are not looked for); one holding no tensor
    (even one that refers to itself) passes as it is."""
    class Holds(nn.Module):
        def __init__(self, wrap):
            super().__init__()
            self.wrap = wrap

        def forward(self, x):
            return self.wrap(x * 2)

    def cycle(x):
        o = types.SimpleNamespace(n=3, name="plain")
        o.me = o
        return x, o

    x = randn(2, 3, seed=0)
    for wrap in [lambda y: types.SimpleNamespace(out=y),
                 lambda y: types.SimpleNamespace(inner=types.SimpleNamespace(items=[y]))]:
        with pytest.raises(TypeError) as info:
            parallel_apply([nn.Identity(), Holds(wrap)], [x, x], mode="parallel")
        assert str(info.value) == (
            "parallel_apply: call 1 of 2: the expert returned a SimpleNamespace holding tensors; "
            "outputs are followed through pytrees only (tuples, lists, dicts, namedtuples, types "
            "registered with torch.utils._pytree, e.g. register_dataclass): register the type or "
            "return its tensors in a tuple or dict")
    # The search is bounded: three objects deep, no deeper.
    three = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(t=x)))
    with pytest.raises(TypeError, match="holding tensors"):
        parallel_apply([Holds(lambda y: (y, three))], [x], mode="parallel")
    four = types.SimpleNamespace(a=three)
    assert parallel_apply([Holds(lambda y: (y, four))], [x], mode="parallel")[0][1] is four
    y, o = parallel_apply([Holds(cycle)], [x], mode="parallel")[0]
    assert o.me is o and o.n == 3 and torch.equal(y, x * 2)
    marker = object()  # no __dict__ at all
    y, o = parallel_apply([Holds(lambda y: (y, marker))], [x], mode="parallel")[0]
    assert o is marker


def test_under_a_torch_func_transform_the_calls_draw_as_the_loop():
    """Under ``torch.func.grad`` the calls run as the loop, drawing from the
    global generator in call order (not from streams of their own)."""
    experts = [_Dropout(), _Dropout()]
    x = torch.ones(32, dtype=DT)

    def batch(x):
        return sum((o * o).sum() for o in parallel_apply(experts, [x, x], mode="parallel"))

    def loop(x):
        return sum((o * o).sum() for o in [m(x) for m in experts])

    torch.manual_seed(3)
    got = torch.func.grad(batch)(x)
    torch.manual_seed(3)
    want = torch.func.grad(loop)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_backward_through_a_stashed_tensor_is_refused_after_the_calls_own_backward():
    """The call's input guard lets its own backward through, and only that:
    once the call's backward is over, a backward reaching its graph through
    a tensor the expert stashed in a list raises, naming the call."""
    class Stashes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4).to(DT)
            self.aux = []

        def forward(self, x):
            y = self.fc(x)
            self.aux = [y * 2]
            return y

    m = Stashes()
    x = randn(3, 4, seed=4)
    y = parallel_apply([nn.Identity(), m], [x, x], mode="parallel")[1]
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError) as info:
        m.aux[0].sum().backward()
    assert str(info.value) == (
        "parallel_apply: call 1 of 2: a backward reached this call's graph other than through "
        "its outputs (a tensor the expert left somewhere other than its result or a plain tensor "
        "attribute of its module: a list, a closure, a global); the gradient for the call's "
        "input would be lost. Return that tensor from the expert instead")


def test_torch_checkpoint_with_use_reentrant_inside_an_expert_is_refused_naming_the_call():
    class Reentrant(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4).to(DT)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.fc, x, use_reentrant=True)

    x = randn(3, 4, seed=5)
    outs = parallel_apply([Reentrant(), Expert()], [x, x], mode="parallel")
    with pytest.raises(RuntimeError) as info:
        sum(o.sum() for o in outs).backward()
    assert str(info.value) == (
        "parallel_apply: call 0 of 2: the expert uses torch.utils.checkpoint(use_reentrant=True), "
        "which cannot run inside a parallel call's backward (each call's backward is a "
        "torch.autograd.grad); use use_reentrant=False, or parallel_apply(..., checkpoint=True)")


def test_requires_grad_flipped_on_an_input_a_later_call_receives_is_refused_word_for_word():
    class Flips(nn.Module):
        def forward(self, x):
            x.requires_grad_()
            return x * 2

    x = torch.ones(3, dtype=DT)
    calls = _joined(*start_calls([Flips(), nn.Identity()], [x, x], name="layer 2: moe",
                                 labels=["expert 0", "expert 1"]))
    with pytest.raises(RuntimeError) as info:
        finish_calls(calls)
    assert str(info.value) == (
        "layer 2: moe: expert 0: the expert called requires_grad_() on an input that expert 1 "
        "also receives; that call started before and does not track it (the loop's would): "
        "pass the tensor requiring grad")


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_an_expert_returning_its_own_weight_gets_the_loops_gradients(mode):
    """An output that is a leaf itself (the expert returns a parameter) is one
    of the call's parameters: its gradient is the loop's."""
    class ReturnsWeight(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.w = nn.Parameter(randn(4, 4, seed=seed, requires_grad=False))
            self.b = nn.Parameter(randn(4, seed=seed + 1, requires_grad=False))

        def forward(self, x):
            return x @ self.w, self.b

    experts = [ReturnsWeight(0), ReturnsWeight(2)]
    x = randn(3, 4, seed=9)
    outs = parallel_apply(experts, [x, x], mode=mode)
    got = torch.autograd.grad(weighted_loss(outs), [x] + params_of(experts))
    want = torch.autograd.grad(weighted_loss([m(x) for m in experts]), [x] + params_of(experts))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _ReturnsEveryKind(nn.Module):
    """A result with every kind of tensor the node rebuilds: an internal
    tensor, its view, that view again (one object twice), the input, a view
    of the input, a parameter and a view of it."""

    def __init__(self, seed):
        super().__init__()
        self.w = nn.Parameter(randn(4, 4, seed=seed, requires_grad=False))

    def forward(self, x):
        h = torch.tanh(x @ self.w)
        v = h.view(-1)
        return h, v, v, x, x[:2], self.w, self.w[1:]


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_a_result_of_every_kind_is_rebuilt_as_the_loop_returns_it(mode):
    experts = [_ReturnsEveryKind(0), _ReturnsEveryKind(1)]
    x = randn(3, 4, seed=6)
    outs = parallel_apply(experts, [x, x], mode=mode)
    want = [m(x) for m in experts]
    for got, ref in zip(outs, want):
        assert got[1] is got[2] and got[3] is x and got[5] is ref[5]
        assert got[1]._base is got[0] and got[4]._base is x and got[6]._base is ref[5]
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    got = torch.autograd.grad(weighted_loss(outs), [x] + params_of(experts))
    ref = torch.autograd.grad(weighted_loss(want), [x] + params_of(experts))
    # x's gradient: the term of the returned view of x comes first (D12, last bits).
    torch.testing.assert_close(got[0], ref[0], rtol=1e-14, atol=1e-14)
    for a, b in zip(got[1:], ref[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_check_finite_grads_names_the_call_whose_gradient_is_not_finite():
    class Sqrt(nn.Module):
        def forward(self, x):
            return torch.sqrt(x)  # an infinite gradient at 0

    x = torch.tensor([0.0, 1.0], dtype=DT, requires_grad=True)
    calls = _joined(*start_calls([nn.Identity(), Sqrt()], [x, x], check_finite_grads=True,
                                 labels=["expert 0", "expert 1"]))
    outs = finish_calls(calls)
    with pytest.raises(FloatingPointError) as info:
        sum(o.sum() for o in outs).backward()
    assert str(info.value) == "parallel_apply: expert 1: non-finite gradient"


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_a_checkpointed_call_that_draws_nothing_leaves_the_generator_as_the_loop(mode):
    experts = [Expert(seed=0), Expert(seed=1)]
    x = randn(3, 4, seed=8)
    torch.manual_seed(11)
    sum(o.sum() for o in parallel_apply(experts, [x, x], checkpoint=True, mode=mode)).backward()
    after = torch.rand(4)
    torch.manual_seed(11)
    sum(m(x).sum() for m in experts).backward()
    assert torch.equal(after, torch.rand(4))


def test_arguments_that_are_not_tensors_or_do_not_require_grad_pass_as_the_loops():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4).to(DT)

        def forward(self, x, n, c):
            return self.fc(x) * n + c

    experts = [Mixed(), Mixed()]
    x, c = randn(2, 4, seed=1), randn(4, seed=2, requires_grad=False)
    outs = parallel_apply(experts, [(x, 3, c), (x, 2, c)], mode="parallel")
    want = [m(x, n, c) for m, n in zip(experts, [3, 2])]
    got = torch.autograd.grad(weighted_loss(outs), [x] + params_of(experts))
    ref = torch.autograd.grad(weighted_loss(want), [x] + params_of(experts))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not c.requires_grad


class _MutatesSaved(nn.Module):
    """Changes in place a tensor its own graph saved (``sin`` saved ``h``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = h.sin()
        h.mul_(2)
        return y + h


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("mode", ["inline", "lanes", "parallel"])
def test_allow_mutation_on_saved_tensors_gives_the_loops_gradients(mode: str,
                                                                  checkpoint: bool) -> None:
    """(issue 46, class 3) Under ``allow_mutation_on_saved_tensors()`` the
    calls run as the loop, on the caller (its clone-before-mutate mode is the
    caller thread's): the gradients are the loop's in every mode, checkpointed
    or not (before: off by up to 7e2 in lanes/parallel and under checkpoint)."""
    torch.manual_seed(0)
    experts = [_MutatesSaved() for _ in range(3)]
    xs = [torch.randn(2, 4, dtype=torch.float64, requires_grad=True) for _ in experts]
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        want = torch.autograd.grad(sum(e(x).sum() for e, x in zip(experts, xs)), xs)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        outs = parallel_apply(experts, xs, mode=mode, checkpoint=checkpoint)
        got = torch.autograd.grad(sum(o.sum() for o in outs), xs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("mode", ["inline", "lanes", "parallel"])
def test_disable_saved_tensors_hooks_computes_as_the_loop(mode: str, checkpoint: bool) -> None:
    """(issue 46) Under ``disable_saved_tensors_hooks(message)`` the loop
    registers no hook and computes; so do the calls, run as the loop (before:
    the user's message was raised from the runtime's own hooks, naming no
    call)."""
    torch.manual_seed(0)
    experts = [nn.Linear(4, 4).double() for _ in range(3)]
    xs = [torch.randn(2, 4, dtype=torch.float64, requires_grad=True) for _ in experts]
    want = torch.autograd.grad(sum(e(x).sum() for e, x in zip(experts, xs)), xs)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        outs = parallel_apply(experts, xs, mode=mode, checkpoint=checkpoint)
        got = torch.autograd.grad(sum(o.sum() for o in outs), xs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("mode", ["inline", "lanes", "parallel"])
def test_a_parameter_frozen_between_forward_and_backward_gets_no_gradient(
        mode: str, checkpoint: bool) -> None:
    """(issue 46) ``requires_grad_(False)`` on an expert's weights after the
    forward: the loop computes and leaves their ``.grad`` None; so do the
    calls (before: torch's "One of the differentiated Tensors does not
    require grad", naming no call)."""
    torch.manual_seed(0)
    experts = [nn.Linear(4, 4).double() for _ in range(3)]
    loop = copy.deepcopy(experts)
    xs = [torch.randn(2, 4, dtype=torch.float64, requires_grad=True) for _ in experts]
    lxs = [x.detach().clone().requires_grad_() for x in xs]
    want = [e(x) for e, x in zip(loop, lxs)]
    outs = parallel_apply(experts, xs, mode=mode, checkpoint=checkpoint)
    for e in [*experts, *loop]:
        e.weight.requires_grad_(False)
    sum(o.sum() for o in outs).backward()
    sum(o.sum() for o in want).backward()
    for ours, theirs in zip(experts, loop):
        assert ours.weight.grad is None and theirs.weight.grad is None
        assert torch.equal(ours.bias.grad, theirs.bias.grad)
    assert all(torch.equal(x.grad, lx.grad) for x, lx in zip(xs, lxs))


class _Tagged(torch.Tensor):
    """A ``__torch_function__`` subclass that only tags its results."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


class _ViewOf(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x[:, :2]


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        y = self.lin(x)
        return y, y * 2


@pytest.mark.parametrize("mode", ["inline", "lanes", "parallel"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_tensor_subclass_argument_runs_as_the_loop(mode: str, checkpoint: bool) -> None:
    """(issue 46) Tensor subclass arguments (a ``__torch_function__``
    subclass): the calls run as the loop, on the caller, so outputs keep the
    subclass, an input returned as a view stays attached to it, and an
    expert that returns ``y, y * 2`` computes (before: plain outputs, a
    detached view with its gradient lost, an internal error)."""
    torch.manual_seed(0)
    experts: List[nn.Module] = [nn.Linear(4, 4), _ViewOf(), _Twice()]
    ref = copy.deepcopy(experts)
    xs = [torch.randn(2, 4).as_subclass(_Tagged).requires_grad_() for _ in experts]
    lxs = [x.detach().clone().as_subclass(_Tagged).requires_grad_() for x in xs]
    want = [e(x) for e, x in zip(ref, lxs)]
    outs = parallel_apply(experts, xs, mode=mode, checkpoint=checkpoint)
    flat = [outs[0], outs[1], *outs[2]]
    flat_want = [want[0], want[1], *want[2]]
    assert [type(o) for o in flat] == [type(w) for w in flat_want]
    assert all(o.requires_grad for o in flat)
    sum(o.sum() for o in flat).backward()
    sum(w.sum() for w in flat_want).backward()
    assert all(torch.equal(x.grad, lx.grad) for x, lx in zip(xs, lxs))
    for e, r in zip(experts, ref):
        for p, q in zip(e.parameters(), r.parameters()):
            assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_a_shared_experts_full_backward_hooks_fire_in_the_loops_order(mode: str) -> None:
    """(issue 46) One module called four times, with a full backward hook:
    its calls' backwards run in the loop's order (later calls first), so the
    hook sees the loop's sequence every time (before: in whichever order the
    workers finished, in about a third of the runs)."""
    for trial in range(20):
        shared = nn.Linear(4, 4)
        fired: list = []
        shared.register_full_backward_hook(
            lambda m, gi, go: fired.append(round(float(go[0].sum()), 4)))

        def inputs() -> list:
            return [torch.randn(2, 4, generator=torch.Generator().manual_seed(trial * 10 + k),
                                requires_grad=True) * (k + 1) for k in range(4)]
        outs = parallel_apply([shared] * 4, inputs(), mode=mode)
        sum((o * (k + 1)).sum() for k, o in enumerate(outs)).backward()
        ours = list(fired)
        fired.clear()
        sum((shared(x) * (k + 1)).sum() for k, x in enumerate(inputs())).backward()
        assert ours == fired, (trial, ours, fired)
