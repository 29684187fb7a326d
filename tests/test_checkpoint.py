import threading
import weakref
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import helpers
from moe_autograd.checkpoint import (
    Checkpointing,
    capture_autocast_state,
    checkpoint,
    enable_checkpointing,
    enable_recomputing,
    is_checkpointing,
    is_recomputing,
)
from moe_autograd.dependency import fork, join
from moe_autograd.microbatch import Batch
from moe_autograd.rng import CallRng, ReplayRng


@pytest.mark.timeout(30)
def test_serial_checkpoints():
    """Recompute runs before the gradient passes the output's fork, and each
    checkpoint recomputes only its own lane."""
    timeline = []

    class Log(torch.autograd.Function):
        @staticmethod
        def forward(ctx, name, x):
            ctx.name = name
            timeline.append(f"{name}:forward")
            return x.detach()

        @staticmethod
        def backward(ctx, grad_output):
            timeline.append(f"{ctx.name}:backward")
            return None, grad_output

    a = torch.rand(1, requires_grad=True)
    b = torch.rand(1, requires_grad=True)
    _ = a + 1 + 2 + 3 + 4 + 5  # bump the sequence number

    a = checkpoint(partial(Log.apply, "a"), a)
    a, phony = fork(a)
    b = join(b, phony)
    b = checkpoint(partial(Log.apply, "b"), b)
    out = torch.cat((a, b)).sum()

    timeline.clear()
    out.backward()
    assert timeline == ["b:forward", "b:backward", "a:forward", "a:backward"]


@pytest.mark.timeout(30)
def test_each_lane_recomputes_only_itself():
    counts = {"a": 0, "b": 0}

    def lane(name, x):
        counts[name] += 1
        return x * 2

    xa = torch.rand(3, requires_grad=True)
    xb = torch.rand(3, requires_grad=True)
    ya = checkpoint(partial(lane, "a"), xa)
    yb = checkpoint(partial(lane, "b"), xb)
    assert counts == {"a": 1, "b": 1}

    ya.sum().backward()
    assert counts == {"a": 2, "b": 1}
    assert torch.equal(xa.grad, torch.full((3,), 2.0)) and xb.grad is None

    yb.sum().backward()
    assert counts == {"a": 2, "b": 2}
    assert torch.equal(xb.grad, torch.full((3,), 2.0))


def test_detection_flags():
    log = []

    def f(x):
        log.append((is_checkpointing(), is_recomputing()))
        return x * 2

    assert (is_checkpointing(), is_recomputing()) == (False, False)
    x = torch.rand(2, requires_grad=True)
    y = checkpoint(f, x)
    y.sum().backward()
    assert log == [(True, False), (False, True)]
    assert (is_checkpointing(), is_recomputing()) == (False, False)


def test_flags_are_thread_local_and_nest():
    seen = []
    with enable_checkpointing(), enable_recomputing():
        t = threading.Thread(target=lambda: seen.append((is_checkpointing(), is_recomputing())))
        t.start()
        t.join()
        with enable_checkpointing():
            assert is_checkpointing()
        assert is_checkpointing() and is_recomputing()
    assert seen == [(False, False)]
    assert not is_checkpointing() and not is_recomputing()


def _dropout_net():
    torch.manual_seed(0)
    return nn.Linear(8, 8)


@pytest.mark.timeout(30)
def test_dropout_grads_match_forward_mask():
    lin = _dropout_net()
    masks = []

    def f(x):
        h = lin(x)
        y = F.dropout(h, 0.5)
        if is_checkpointing():
            masks.append(((y != 0) | (h == 0)).detach())
        return y

    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(16, 8)
    y = checkpoint(f, x)
    (y * w).sum().backward()
    grads = (x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone())

    # manual reference from the forward's mask
    (mask,) = masks
    x.grad = None
    lin.zero_grad()
    h = lin(x)
    y_ref = h * mask / 0.5
    assert torch.allclose(y, y_ref)
    (y_ref * w).sum().backward()
    for got, ref in zip(grads, (x.grad, lin.weight.grad, lin.bias.grad)):
        assert torch.allclose(got, ref)


@pytest.mark.timeout(120)
def test_concurrent_checkpoints_with_dropout_under_global_rng_pressure():
    """Lanes checkpointed and backpropagated on separate threads, while another
    thread draws from the global generator, still get the forward's masks."""
    lins = [nn.Linear(32, 32) for _ in range(3)]
    xs = [torch.randn(64, 32, requires_grad=True) for _ in range(3)]
    masks = {}

    def make(i):
        def f(x):
            h = lins[i](x)
            y = F.dropout(h, 0.5)
            if is_checkpointing():
                masks[i] = ((y != 0) | (h == 0)).detach()
            return y
        return f

    stop = threading.Event()
    errors = []
    results = {}

    def hammer():
        while not stop.is_set():
            torch.rand(512)

    def run(i):
        try:
            y = checkpoint(make(i), xs[i])
            y.pow(2).sum().backward()
            results[i] = (y.detach(), xs[i].grad.clone(), lins[i].weight.grad.clone())
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    h = threading.Thread(target=hammer)
    h.start()
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        h.join(10)
    assert not errors
    for i in range(3):
        y, gx, gw = results[i]
        x = xs[i].detach().requires_grad_()
        lins[i].zero_grad()
        y_ref = lins[i](x) * masks[i] / 0.5
        assert torch.allclose(y, y_ref)
        y_ref.pow(2).sum().backward()
        assert torch.allclose(gx, x.grad) and torch.allclose(gw, lins[i].weight.grad)


def test_input_without_grad_still_gives_parameter_grads():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    y = checkpoint(lin, x)
    assert y.requires_grad
    y.sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None
    assert torch.allclose(lin.bias.grad, torch.full((4,), 3.0))
    assert x.grad is None


def test_tuple_and_non_tensor_inputs_and_outputs():
    seen = []

    def f(a, n, name, b, none):
        seen.append((n, name, none))
        return a * n + b, name, (a > 0).long(), [1]

    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    out = checkpoint(f, (a, 3, "tag", b, None))
    assert isinstance(out, tuple) and len(out) == 4
    y, name, ints, lst = out
    assert name == "tag" and lst == [1]
    assert ints.dtype == torch.long and not ints.requires_grad
    assert torch.allclose(y, a * 3 + b)
    y.sum().backward()
    assert seen == [(3, "tag", None)] * 2
    assert torch.allclose(a.grad, torch.full((3,), 3.0))
    assert torch.allclose(b.grad, torch.ones(3))


def test_list_output_becomes_tuple_and_unused_output():
    a = torch.randn(3, requires_grad=True)
    out = checkpoint(lambda x: [x * 2, x * 3], a)
    assert isinstance(out, tuple)
    out[1].sum().backward()  # the first output gets no gradient
    assert torch.allclose(a.grad, torch.full((3,), 3.0))


def test_identity_function():
    a = torch.randn(3, requires_grad=True)
    y = checkpoint(lambda x: x, a)
    (y * 2).sum().backward()
    assert torch.allclose(a.grad, torch.full((3,), 2.0))


def test_gradcheck_float64():
    lin = nn.Linear(5, 5).double()

    def f(x, y):
        return torch.tanh(lin(x)) * y, x.sin()

    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y: checkpoint(f, (x, y)), (x, y))
    assert torch.autograd.gradcheck(lambda x: checkpoint(torch.sigmoid, x), (x,))


def test_gradcheck_with_dropout_is_deterministic():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    rng = CallRng(17)

    def g(x):
        chk = Checkpointing(lambda t: F.dropout(t, 0.5) * t, Batch(x), rng=rng)
        out = chk.checkpoint()
        chk.recompute(out)
        return out.tensor

    assert torch.autograd.gradcheck(g, (x,))


def test_checkpointing_class_api_and_cleanup():
    x = torch.randn(3, requires_grad=True)
    chk = Checkpointing(lambda t: t.exp(), Batch(x))
    out = chk.checkpoint()
    assert isinstance(out, Batch) and out.atomic
    chk.recompute(out)
    assert isinstance(chk.rng, ReplayRng) and chk.rng.captured
    assert len(chk.recomputed) == 0
    out.tensor.sum().backward()
    assert len(chk.recomputed) == 0  # consumed by Checkpoint.backward
    assert torch.allclose(x.grad, x.detach().exp())


def test_recomputed_graph_is_freed_after_backward():
    refs = []

    def f(x):
        y = x * 2
        if is_recomputing():
            refs.append(weakref.ref(y))
        return y.sin()

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(f, x)
    y.sum().backward()
    del y
    assert len(refs) == 1 and refs[0]() is None


def test_retain_graph_double_backward():
    counts = [0]

    def f(x):
        counts[0] += 1
        return F.dropout(x, 0.5) * x

    x = torch.randn(50, requires_grad=True)
    y = checkpoint(f, x)
    y.sum().backward(retain_graph=True)
    g1 = x.grad.clone()
    y.sum().backward()
    assert counts[0] == 3
    assert torch.allclose(x.grad, 2 * g1)


def test_seed_forked_from_default_generator():
    torch.manual_seed(3)
    a = checkpoint(lambda t: F.dropout(t, 0.5), torch.ones(100))
    torch.manual_seed(3)
    b = checkpoint(lambda t: F.dropout(t, 0.5), torch.ones(100))
    assert torch.equal(a, b)


def test_nested_checkpoint_recomputes_same_masks():
    masks = []

    def inner(x):
        y = F.dropout(x, 0.5)
        if not is_recomputing():
            masks.append((y != 0).detach())
        return y

    def outer(x):
        return checkpoint(inner, x * 1.0) * 3

    x = torch.randn(200, requires_grad=True)
    y = checkpoint(outer, x)
    y.sum().backward()
    assert torch.allclose(x.grad, masks[0].float() * 3 / 0.5)


def test_autocast_state_capture_and_restore():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = capture_autocast_state()
    assert not torch.is_autocast_enabled("cpu")
    with state.restore():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")

    off = capture_autocast_state()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with off.restore():
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")


def test_checkpoint_under_autocast_recomputes_in_same_precision():
    lin = nn.Linear(4, 4)
    dtypes = []

    def f(x):
        y = lin(x)
        dtypes.append((is_recomputing(), y.dtype))
        return y

    x = torch.randn(2, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint(f, x)
    y.float().sum().backward()  # backward outside autocast
    assert dtypes == [(False, torch.bfloat16), (True, torch.bfloat16)]
    assert lin.weight.grad is not None and x.grad is not None


def test_missing_recompute_raises():
    x = torch.randn(3, requires_grad=True)
    chk = Checkpointing(lambda t: t * 2, Batch(x))
    out = chk.checkpoint()
    with pytest.raises(RuntimeError, match=r"^Checkpoint\.backward ran before its Recompute: "
                                           r"call Checkpointing\.recompute\(\) on the output "
                                           r"batch$"):
        out.tensor.sum().backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(60)
def test_cuda_dropout_checkpoint_matches_mask():
    lin = nn.Linear(16, 16).cuda()
    masks = []

    def f(x):
        h = lin(x)
        y = F.dropout(h, 0.5)
        if is_checkpointing():
            masks.append(((y != 0) | (h == 0)).detach())
        return y

    x = torch.randn(8, 16, device="cuda", requires_grad=True)
    y = checkpoint(f, x)
    y.sum().backward()
    gx = x.grad.clone()
    x.grad = None
    (lin(x) * masks[0] / 0.5).sum().backward()
    assert torch.allclose(gx, x.grad)


# -- torch's contract: a checkpointed call computes what the plain call computes --

RANDOM_FUNCTIONS = {
    "dropout": lambda x: F.dropout(x, 0.5),
    "dropout_module_twice": lambda x: nn.Dropout(0.3)(F.dropout(x, 0.2)),
    "rand": lambda x: x * torch.rand(x.shape),
    "randn": lambda x: x * torch.randn(x.shape),
    "randint": lambda x: x * torch.randint(0, 3, x.shape),
    "rand_like": lambda x: x * torch.rand_like(x),
    "randn_like": lambda x: x * torch.randn_like(x),
    "randperm": lambda x: x[torch.randperm(x.shape[0])],
    "bernoulli": lambda x: x * torch.bernoulli(torch.full(x.shape, 0.5)),
    "multinomial": lambda x: x[torch.multinomial(torch.ones(x.shape[0]), x.shape[0],
                                                 replacement=True)],
    "gumbel_softmax": lambda x: F.gumbel_softmax(x, tau=0.7),
    "normal": lambda x: x * torch.normal(torch.zeros_like(x), 1.0),
}


def _run(f, x, weight, checkpointed):
    """(output, global generator state right after the forward, x.grad)."""
    x.grad = None
    y = checkpoint(f, x) if checkpointed else f(x)
    state = torch.get_rng_state()
    (y * weight).sum().backward()
    return y.detach(), state, x.grad.clone()


@pytest.mark.parametrize("name", sorted(RANDOM_FUNCTIONS))
def test_random_in_checkpoint(name):
    """As torch.utils.checkpoint's test_random_in_checkpoint: same seed, same
    outputs, same gradients, same global generator state afterwards."""
    f = RANDOM_FUNCTIONS[name]
    x = torch.randn(8, 6, requires_grad=True)
    weight = torch.randn(8, 6)
    torch.manual_seed(0)
    plain = _run(f, x, weight, checkpointed=False)
    after_plain = torch.get_rng_state()
    torch.manual_seed(0)
    ckpt = _run(f, x, weight, checkpointed=True)
    after_ckpt = torch.get_rng_state()
    for p, c in zip(plain, ckpt):
        assert torch.equal(p, c)
    assert torch.equal(after_plain, after_ckpt)  # the backward drew nothing either


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(RANDOM_FUNCTIONS))
def test_recomputation_is_exact_while_another_thread_draws(name):
    """Another thread draws from the global generator between the function's
    two random ops, in forward and again in the recomputation (Barriers force
    the order): the checkpointed call still computes the plain call's values
    and gradients."""
    op = RANDOM_FUNCTIONS[name]
    barrier = threading.Barrier(2, timeout=20)
    pause = [False]

    def f(x):
        a = op(x)
        if pause[0]:
            barrier.wait()  # the other thread draws now
            barrier.wait()
        return a + op(x)

    x = torch.randn(8, 6, requires_grad=True)
    weight = torch.randn(8, 6)
    torch.manual_seed(0)
    plain = _run(f, x, weight, checkpointed=False)
    results = {}

    def body(i):
        if i == 0:
            results["ckpt"] = _run(f, x, weight, checkpointed=True)
        else:
            for _ in range(2):  # forward, then recomputation
                barrier.wait()
                torch.rand(64)
                F.dropout(torch.ones(64), 0.5)
                barrier.wait()

    torch.manual_seed(0)
    pause[0] = True
    helpers.run_threads(body, 2)
    out, _, grad = results["ckpt"]
    assert torch.equal(out, plain[0])
    assert torch.equal(grad, plain[2])


def test_checkpoint_inside_a_call_stream_draws_what_the_plain_call_draws():
    """Inside a runtime call (a CallRng active) the call's stream rules: a
    checkpointed function draws from it exactly as the plain function would,
    and leaves it where the plain function would."""
    lin = nn.Linear(6, 6)
    f = lambda x: F.dropout(lin(x), 0.5) * torch.rand_like(x)  # noqa: E731
    x = torch.randn(8, 6, requires_grad=True)

    with CallRng(9).activate():
        y = f(x)
        after = torch.rand(4)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    state = torch.get_rng_state()
    with CallRng(9).activate():
        yc = checkpoint(f, x)
        after_c = torch.rand(4)
    yc.sum().backward()  # recomputes outside the call's activation
    assert torch.equal(y, yc) and torch.equal(after, after_c) and torch.equal(g, x.grad)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator was not touched


def test_checkpoint_given_a_call_rng_draws_from_it():
    x = torch.ones(64, requires_grad=True)
    rng = CallRng(21)
    chk = Checkpointing(lambda t: F.dropout(t, 0.5), Batch(x), rng=rng)
    out = chk.checkpoint()
    chk.recompute(out)
    with CallRng(21).activate():
        expected = F.dropout(torch.ones(64), 0.5)
    assert torch.equal(out.tensor.detach(), expected)
    out.tensor.sum().backward()
    assert torch.equal(x.grad, expected)


def _autocast_net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 16))


def test_checkpoint_under_autocast_gradients_equal_plain():
    """The usual pattern: forward under autocast, backward outside it. The
    recomputation must run in the forward's precision (not the backward's),
    so checkpointed gradients equal plain ones bitwise."""
    net = _autocast_net()
    dtypes = []

    def f(x):
        y = net(x)
        dtypes.append((is_recomputing(), y.dtype))
        return y

    x = torch.randn(8, 16, requires_grad=True)
    results = []
    for checkpointed in (False, True):
        net.zero_grad()
        x.grad = None
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint(f, x) if checkpointed else f(x)
        assert not torch.is_autocast_enabled("cpu")
        y.float().pow(2).sum().backward()
        results.append((y.detach(), x.grad.clone(), *(p.grad.clone() for p in net.parameters())))
    assert dtypes == [(False, torch.bfloat16)] * 2 + [(True, torch.bfloat16)]
    for plain, ckpt in zip(*results):
        assert torch.equal(plain, ckpt)


def test_checkpoint_recomputes_without_autocast_when_backward_runs_under_it():
    net = _autocast_net()
    dtypes = []

    def f(x):
        y = net(x)
        dtypes.append(y.dtype)
        return y

    x = torch.randn(4, 16, requires_grad=True)
    y = checkpoint(f, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y.sum().backward()
    assert dtypes == [torch.float32, torch.float32]


def test_a_function_of_no_tensor_still_gives_its_parameters_gradients():
    # No input tensor: the phony that keeps Checkpoint in the graph lives on
    # the CPU (issue 34: a mutation of that fallback survived).
    lin = nn.Linear(3, 2)
    ref = nn.Linear(3, 2)
    ref.load_state_dict(lin.state_dict())
    out = checkpoint(lambda n, s: lin(torch.ones(n, 3) * s), (4, 2.0))
    out.square().sum().backward()
    ref(torch.ones(4, 3) * 2.0).square().sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    assert torch.equal(lin.bias.grad, ref.bias.grad)


def test_the_recomputation_keeps_the_forwards_autocast_cache_setting():
    seen = []

    def f(t):
        seen.append((is_recomputing(), torch.is_autocast_cache_enabled()))
        return t * 2

    x = torch.randn(3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        y = checkpoint(f, x)
    y.float().sum().backward()  # outside autocast: the cache is on here
    assert seen == [(False, False), (True, False)]


def test_an_output_the_loss_does_not_use_gets_no_gradient_not_a_zero_one():
    # Checkpoint does not materialise missing output gradients: a zero
    # gradient through sqrt at 0 (an infinite derivative) would make x.grad
    # nan where the loop's is 2 (issue 34: a mutation there survived).
    x = torch.zeros(3, requires_grad=True)
    a, b = checkpoint(lambda t: (t * 2, t.sqrt()), (x,))
    a.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
