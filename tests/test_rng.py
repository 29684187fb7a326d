import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import helpers
from torch import nn

from moe_autograd import parallel_apply
from moe_autograd import rng as rng_module
from moe_autograd.rng import CallRng, ReplayRng, active_stream, routed_ops

x4 = torch.randn(4, 6)

RANDOM_OPS = {
    "F.dropout": lambda: F.dropout(x4, 0.5),
    "nn.Dropout": lambda: torch.nn.Dropout(0.3)(x4),
    "dropout1d": lambda: F.dropout1d(x4[None], 0.5),
    "dropout2d": lambda: F.dropout2d(x4[None, None], 0.5),
    "alpha_dropout": lambda: F.alpha_dropout(x4, 0.5, training=True),
    "feature_alpha_dropout": lambda: F.feature_alpha_dropout(x4[None], 0.5, training=True),
    "native_dropout": lambda: torch.native_dropout(x4, 0.5, True),
    "rand": lambda: torch.rand(5),
    "randn": lambda: torch.randn(5, dtype=torch.float64),
    "randint": lambda: torch.randint(10, (5,)),
    "randint_low": lambda: torch.randint(3, 10, (5,)),
    "randperm": lambda: torch.randperm(7),
    "rand_like": lambda: torch.rand_like(x4),
    "randn_like": lambda: torch.randn_like(x4),
    "randint_like": lambda: torch.randint_like(x4, 10),
    "bernoulli": lambda: torch.bernoulli(torch.full((8,), 0.5)),
    "bernoulli_": lambda: torch.empty(8).bernoulli_(0.3),
    "normal_": lambda: torch.empty(5).normal_(),
    "normal": lambda: torch.normal(torch.zeros(5), 1.0),
    "normal_size": lambda: torch.normal(0.0, 1.0, (5,)),
    "uniform_": lambda: torch.empty(5).uniform_(),
    "exponential_": lambda: torch.empty(5).exponential_(),
    "random_": lambda: torch.empty(5).random_(100),
    "multinomial": lambda: torch.multinomial(torch.ones(10), 4),
    "rrelu": lambda: F.rrelu(x4, training=True),
    "gumbel_softmax": lambda: F.gumbel_softmax(x4),
    "poisson": lambda: torch.poisson(torch.ones(5)),
    "distribution": lambda: torch.distributions.Normal(0.0, 1.0).sample((5,)),
    "sdpa_dropout": lambda: F.scaled_dot_product_attention(x4[None, None], x4[None, None], x4[None, None],
                                                           dropout_p=0.5),
}


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _tensors(o)]


def _equal(a, b):
    return all(torch.equal(p, q) for p, q in zip(_tensors(a), _tensors(b)))


@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_activate_replays_and_leaves_global_generator(name):
    op = RANDOM_OPS[name]
    rng = CallRng(1234)
    state = torch.get_rng_state()
    with rng.activate():
        first = op()
    with rng.activate():
        second = op()
    assert _equal(first, second)
    # the global generator was neither read nor advanced
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("name", ["F.dropout", "rand", "randperm", "native_dropout", "multinomial"])
def test_different_seeds_differ(name):
    op = RANDOM_OPS[name]
    with CallRng(1).activate():
        a = op()
    with CallRng(2).activate():
        b = op()
    assert not _equal(a, b)


def test_sequence_within_activation_advances():
    with CallRng(7).activate():
        a, b = torch.rand(16), torch.rand(16)
    assert not torch.equal(a, b)
    with CallRng(7).activate():
        c, d = torch.rand(16), torch.rand(16)
    assert torch.equal(a, c) and torch.equal(b, d)


def test_fork_is_reproducible_under_manual_seed():
    torch.manual_seed(0)
    seeds = [CallRng.fork().seed for _ in range(4)]
    torch.manual_seed(0)
    assert [CallRng.fork().seed for _ in range(4)] == seeds
    assert len(set(seeds)) == 4
    assert all(0 <= s < 2 ** 64 for s in seeds)


def test_fork_from_explicit_generator():
    g1 = torch.Generator().manual_seed(5)
    g2 = torch.Generator().manual_seed(5)
    assert CallRng.fork(g1).seed == CallRng.fork(g2).seed


def test_fork_inside_activation_replays():
    """A call started inside another call gets the same seed on replay."""
    with CallRng(3).activate():
        inner1 = CallRng.fork().seed
    with CallRng(3).activate():
        inner2 = CallRng.fork().seed
    assert inner1 == inner2


def test_forks_inside_a_stream_draw_nothing_and_differ():
    """A fork inside a call's stream derives its seed: the parent's own draws
    are the same with or without the fork, a lazy parent's seed is drawn from
    the global generator only when a child draws, and siblings differ."""
    with CallRng(3).activate():
        plain = torch.rand(4)
    with CallRng(3).activate():
        children = [CallRng.fork(), *CallRng.fork_many(2)]
        forked = torch.rand(4)
    assert torch.equal(plain, forked)
    assert len({c.seed for c in children}) == 3 and 3 not in {c.seed for c in children}
    torch.manual_seed(0)
    before = torch.get_rng_state()
    (lazy,) = CallRng.fork_many(1)
    with lazy.activate():
        (child,) = CallRng.fork_many(1)
    assert torch.equal(torch.get_rng_state(), before)  # nothing drew
    with child.activate():
        torch.rand(1)
    assert not torch.equal(torch.get_rng_state(), before)  # the child's draw needed the seed


def test_seed_is_64_bit_and_repr():
    assert CallRng(-1).seed == 2 ** 64 - 1
    assert "seed=" in repr(CallRng(5))
    with CallRng(2 ** 64 - 1).activate():
        torch.rand(1)


def test_explicit_generator_is_respected():
    g = torch.Generator().manual_seed(11)
    with CallRng(1).activate():
        a = torch.rand(4, generator=g)
        b = F.dropout(torch.ones(4, 4), 0.5)  # routed
    ref = torch.rand(4, generator=torch.Generator().manual_seed(11))
    assert torch.equal(a, ref)
    with CallRng(1).activate():
        c = F.dropout(torch.ones(4, 4), 0.5)
    assert torch.equal(b, c)


def test_nested_activation_innermost_wins():
    with CallRng(1).activate():
        with CallRng(2).activate():
            a = torch.rand(8)
        b = torch.rand(8)
    with CallRng(2).activate():
        a2 = torch.rand(8)
    with CallRng(1).activate():
        b2 = torch.rand(8)
    assert torch.equal(a, a2) and torch.equal(b, b2)


def test_native_dropout_rewrite_semantics():
    x = torch.randn(64, 64)
    with CallRng(9).activate():
        out, mask = torch.native_dropout(x, 0.25, True)
    assert mask.dtype == torch.bool
    assert torch.allclose(out, x * mask / 0.75)
    assert 0.5 < mask.float().mean().item() < 0.95
    with CallRng(9).activate():
        out, mask = torch.native_dropout(x, 0.25, False)
        assert torch.equal(out, x) and bool(mask.all())
        out, mask = torch.native_dropout(x, 1.0, True)
        assert not bool(out.any()) and not bool(mask.any())


def test_unroutable_seeded_op_raises():
    q = torch.randn(1, 1, 4, 8)
    with CallRng(1).activate():
        with pytest.raises(RuntimeError, match="_scaled_dot_product_flash_attention_for_cpu"):
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.3)
        # no dropout: nothing is drawn, so it passes through
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0)
        F.scaled_dot_product_attention(q, q, q)


def test_meta_tensors_pass_through():
    with CallRng(1).activate():
        out = torch.rand(3, device="meta")
        F.dropout(torch.empty(3, 3, device="meta"), 0.5)
    assert out.device.type == "meta"


@pytest.mark.timeout(30)
def test_activation_is_thread_local():
    rng = CallRng(42)
    entered, done = threading.Event(), threading.Event()
    errors = []

    def holder():
        try:
            with rng.activate():
                entered.set()
                done.wait(10)
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert entered.wait(10)
        assert active_stream() is None
        assert not torch._C._dispatch_tls_is_dispatch_key_included(rng_module._KEY)
        torch.manual_seed(123)
        got = torch.rand(6)
        ref = torch.rand(6, generator=torch.Generator().manual_seed(123))
        assert torch.equal(got, ref)  # drawn from the global generator, not rng
    finally:
        done.set()
        t.join(10)
    assert not errors


@pytest.mark.timeout(60)
def test_concurrent_calls_replay_while_global_generator_is_hammered():
    x = torch.ones(256, 64)
    rngs = [CallRng(100), CallRng(200)]
    # reference masks, drawn with nothing else going on
    refs = []
    for rng in rngs:
        with rng.activate():
            refs.append(F.dropout(x, 0.5) != 0)

    stop = threading.Event()
    results = {}
    errors = []

    def hammer():
        while not stop.is_set():
            torch.rand(1024)

    def lane(i):
        try:
            masks = []
            for _ in range(2):
                with rngs[i].activate():
                    for _ in range(20):
                        torch.rand(16)  # other random ops of the call
                    masks.append(F.dropout(x, 0.5) != 0)
            results[i] = masks
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    hammers = [threading.Thread(target=hammer) for _ in range(2)]
    for h in hammers:
        h.start()
    try:
        for _ in range(5):
            lanes = [threading.Thread(target=lane, args=(i,)) for i in range(2)]
            for t in lanes:
                t.start()
            for t in lanes:
                t.join(30)
            assert not errors
            for i in range(2):
                first, second = results[i]
                assert torch.equal(first, second)
            assert not torch.equal(results[0][0], results[1][0])
    finally:
        stop.set()
        for h in hammers:
            h.join(10)
    # the lane's dropout is the 21st draw of its stream, so it differs from the
    # reference (1st draw) but replays identically - check the reference
    # replays too
    for rng, ref in zip(rngs, refs):
        with rng.activate():
            assert torch.equal(F.dropout(x, 0.5) != 0, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["dropout", "rand", "randn_like", "native_dropout", "bernoulli_"])
def test_cuda_replays_and_leaves_global_generator(name):
    x = torch.randn(64, 64, device="cuda")
    ops = {
        "dropout": lambda: F.dropout(x, 0.5),
        "rand": lambda: torch.rand(16, device="cuda"),
        "randn_like": lambda: torch.randn_like(x),
        "native_dropout": lambda: torch.native_dropout(x, 0.5, True),
        "bernoulli_": lambda: torch.empty_like(x).bernoulli_(0.5),
    }
    rng = CallRng(5)
    state = torch.cuda.get_rng_state()
    with rng.activate():
        a = ops[name]()
    with rng.activate():
        b = ops[name]()
    assert _equal(a, b)
    assert torch.equal(torch.cuda.get_rng_state(), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dropout_with_grad_matches_mask():
    x = torch.randn(32, 32, device="cuda", requires_grad=True)
    with CallRng(3).activate():
        y = F.dropout(x, 0.4)
    y.sum().backward()
    mask = y.detach() != 0
    assert torch.allclose(x.grad, mask.float() / 0.6)


def test_activate_records_whether_the_stream_was_drawn_from():
    rng = CallRng(7)
    assert rng.drew is None
    with rng.activate():
        torch.ones(3).mul(2)
    assert rng.drew is False
    with rng.activate():
        torch.nn.functional.dropout(torch.ones(8), 0.5, training=True)
    assert rng.drew is True
    with rng.activate():
        torch.nn.functional.dropout(torch.ones(8), 0.5, training=False)
    assert rng.drew is False


# -- only random ops pay ----------------------------------------------------------

def _rng_frames(fn):
    """Runs ``fn`` and returns the names of moe_autograd.rng's functions that
    ran meanwhile (Python frames seen by a profile hook)."""
    seen = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == rng_module.__file__:
            seen.append(frame.f_code.co_name)

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_ops_that_draw_nothing_never_reach_python():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    rng = CallRng(1)

    def no_random():
        y = torch.relu(lin(x)).softmax(-1)
        y = F.dropout(y, 0.5, training=False)  # dropout that draws nothing
        y.sum().backward()

    def dropout():
        F.dropout(x, 0.5).sum().backward()

    with rng.activate():
        assert _rng_frames(no_random) == []
        kernels = _rng_frames(dropout)
    assert rng.drew is True
    assert kernels.count("kernel") == 1  # one hop: bernoulli_ behind F.dropout


def test_every_seeded_aten_op_has_a_plan():
    plans = routed_ops()
    names = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    seeded = set()
    for qualified in names:
        name, _, overload = qualified[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, name), overload or "default")
        if torch.Tag.nondeterministic_seeded in op.tags:
            seeded.add(qualified)
    assert seeded == set(plans)
    # every plain random op is routed, redirected or decomposes into routed ops
    for qualified, plan in plans.items():
        base = qualified[len("aten::"):].split(".")[0]
        if base.startswith(("rand", "normal", "bernoulli", "uniform", "multinomial", "exponential",
                            "poisson", "binomial", "cauchy", "geometric", "log_normal", "random",
                            "dropout", "native_dropout", "rrelu")):
            assert plan in ("route", "dropout", "composite") or plan.startswith("sibling"), qualified
    assert plans["aten::rand"] == "sibling generator"
    assert plans["aten::randint_like.Tensor"] == "sibling Tensor_generator"
    assert plans["aten::_scaled_dot_product_flash_attention_for_cpu"] == "guard"


def test_activation_restores_dispatch_state_and_stack_even_on_error():
    included = torch._C._dispatch_tls_local_include_set()
    excluded = torch._C._dispatch_tls_local_exclude_set()
    with pytest.raises(ValueError):
        with CallRng(1).activate():
            assert active_stream() is not None
            raise ValueError
    assert active_stream() is None
    assert torch._C._dispatch_tls_local_include_set() == included
    assert torch._C._dispatch_tls_local_exclude_set() == excluded


def test_activation_lifts_an_exclusion_of_the_key():
    """Code that excluded the key (for instance while a kernel runs) can still
    open a stream; leaving it restores the exclusion."""
    key = rng_module._KEY
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(rng_module.DISPATCH_KEY)):
        with CallRng(3).activate():
            a = torch.rand(4)
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    with CallRng(3).activate():
        assert torch.equal(a, torch.rand(4))


def test_inherited_dispatch_state_without_a_stream_raises():
    """A thread that has the key switched on but no stream (as an autograd
    device thread would inherit it) must not draw from the global generator."""
    key = rng_module._KEY
    errors = []

    def body(_):
        torch._C._dispatch_tls_set_dispatch_key_included(key, True)
        try:
            with pytest.raises(RuntimeError, match="no stream is active"):
                torch.rand(3)
            torch.rand(3, generator=torch.Generator())  # explicit generators pass
            torch.ones(3).add(1)
        except BaseException as e:  # pragma: no cover
            errors.append(e)
        finally:
            torch._C._dispatch_tls_set_dispatch_key_included(key, False)

    helpers.run_threads(body, 1)
    assert not errors


def test_dropout_gradient_uses_the_routed_mask():
    x = torch.randn(32, 32, requires_grad=True)
    with CallRng(3).activate():
        y = F.dropout(x, 0.4)
    y.sum().backward()
    mask = y.detach() != 0
    assert torch.allclose(x.grad, mask.float() / 0.6)


def test_positional_generator_ops_keep_their_other_arguments():
    """rrelu_with_noise takes its generator positionally, after defaulted
    arguments the dispatcher may leave out."""
    x = torch.randn(64)
    noise = torch.empty(64)
    with CallRng(4).activate():
        y = torch.ops.aten.rrelu_with_noise(x, noise, 0.1, 0.3, True)
    slopes = (y / x)[x < 0]
    assert bool(((slopes >= 0.1) & (slopes <= 0.3)).all())
    with CallRng(4).activate():  # train=False (the default, left out): no draw
        torch.ops.aten.rrelu_with_noise(x, noise, 0.1, 0.3)


# -- forced interleavings ---------------------------------------------------------

GUARANTEED = {
    "dropout": lambda: F.dropout(torch.ones(16, 16), 0.5),
    "rand": lambda: torch.rand(8),
    "randn": lambda: torch.randn(8),
    "randint": lambda: torch.randint(100, (8,)),
    "randperm": lambda: torch.randperm(8),
    "rand_like": lambda: torch.rand_like(x4),
    "randn_like": lambda: torch.randn_like(x4),
    "bernoulli": lambda: torch.bernoulli(torch.full((16,), 0.5)),
    "multinomial": lambda: torch.multinomial(torch.ones(16), 8),
    "gumbel_softmax": lambda: F.gumbel_softmax(x4, tau=0.5),
}


def _lockstep(mine, other, rounds, mine_first):
    """Runs two threads in lockstep: in each round one of them acts (``mine``
    in even rounds if ``mine_first``, else in odd ones), the other waits at a
    barrier. ``mine(r)`` and ``other(r)`` are called in their rounds; each is
    also given ``None`` once before the first round and after the last (to
    open and close activations on its own thread)."""
    barrier = threading.Barrier(2, timeout=20)

    def run(i):
        act = mine if i == 0 else other
        parity = (0 if mine_first else 1) if i == 0 else (1 if mine_first else 0)
        with act(None):
            for r in range(rounds):
                if r % 2 == parity:
                    act(r)
                barrier.wait()

    helpers.run_threads(run, 2)


class _Steps:
    """Draws ``op`` once per round of its turn, inside one activation of
    ``stream`` (or none)."""

    def __init__(self, op, stream=None):
        self.op, self.stream, self.values = op, stream, []

    def __call__(self, r):
        if r is None:
            return self.stream.activate() if self.stream is not None else _null()
        self.values.append(self.op())


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("other", ["global", "own stream", "replay"])
@pytest.mark.parametrize("mine_first", [True, False])
@pytest.mark.parametrize("name", sorted(GUARANTEED))
def test_stream_values_do_not_depend_on_interleaving(name, mine_first, other):
    op = GUARANTEED[name]
    with CallRng(11).activate():
        expected = [op() for _ in range(3)]
    streams = {"global": None, "own stream": CallRng(12), "replay": ReplayRng()}
    mine = _Steps(op, CallRng(11))
    others = _Steps(op, streams[other])
    _lockstep(mine, others, rounds=6, mine_first=mine_first)
    assert _equal(mine.values, expected)


# -- ReplayRng --------------------------------------------------------------------

def _draws():
    return [F.dropout(torch.ones(8, 8), 0.5), torch.rand(4), torch.randn_like(x4),
            torch.multinomial(torch.ones(10), 3), torch.randperm(6), CallRng.fork().seed]


def _same(a, b):
    return all(torch.equal(p, q) if isinstance(p, torch.Tensor) else p == q for p, q in zip(a, b))


def test_replay_rng_draws_what_the_plain_code_draws_and_replays_it():
    torch.manual_seed(0)
    plain = _draws()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    stream = ReplayRng()
    with stream.activate():
        first = _draws()
    assert _same(first, plain)
    assert torch.equal(torch.get_rng_state(), after)  # advanced as the plain code did
    torch.rand(100)  # the global generator moves on: replays do not care
    moved = torch.get_rng_state()
    with stream.activate():
        again = _draws()
    assert _same(again, plain)
    assert torch.equal(torch.get_rng_state(), moved)  # a replay touches nothing
    assert stream.drew is True and stream.captured


def test_replay_rng_inside_a_call_stream_draws_from_it():
    with CallRng(5).activate():
        plain = [torch.rand(4), torch.rand(4), torch.rand(4)]
    inner = ReplayRng()
    with CallRng(5).activate() as _:
        a = torch.rand(4)
        with inner.activate():
            b = torch.rand(4)
        c = torch.rand(4)
    assert _same([a, b, c], plain)
    with inner.activate():
        assert torch.equal(torch.rand(4), plain[1])


def test_replay_rng_that_drew_nothing_marks_no_draw_and_replay_raises_if_it_draws():
    stream = ReplayRng()
    with stream.activate():
        torch.ones(3).mul(2)
    assert stream.drew is False
    with pytest.raises(RuntimeError, match="drew none"):
        with stream.activate():
            torch.rand(3)


def test_replay_rng_marks_the_enclosing_stream_as_drawn():
    outer = CallRng(2)
    with outer.activate():
        with ReplayRng().activate():
            torch.rand(2)
    assert outer.drew is True


@pytest.mark.timeout(60)
def test_replay_rng_capture_is_exact_while_another_thread_draws_from_global():
    """The capture is paused between its draws while another thread draws
    from the global generator: its values still replay exactly, and the
    global generator keeps the other thread's draws (it is not rewound)."""
    torch.manual_seed(0)
    stream = ReplayRng()
    mine = _Steps(lambda: F.dropout(torch.ones(32), 0.5), stream)
    other = _Steps(lambda: torch.rand(32))
    _lockstep(mine, other, rounds=6, mine_first=True)
    after = torch.get_rng_state()
    with stream.activate():
        replayed = [F.dropout(torch.ones(32), 0.5) for _ in range(3)]
    assert _equal(replayed, mine.values)
    assert torch.equal(torch.get_rng_state(), after)
    # the global generator holds exactly the other thread's draws: the capture
    # neither rewound it nor advanced it a second time
    torch.manual_seed(0)
    for _ in range(3):
        torch.rand(32)
    assert torch.equal(torch.get_rng_state(), after)


def test_graphs_traced_inside_a_stream_route_when_they_run():
    """make_fx (as torch.compile's AOTAutograd) records random ops with
    generator=None, not the generator of the activation that traced them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(t):
        return F.dropout(t, 0.5) + torch.rand_like(t)

    x = torch.randn(4, 8)
    with CallRng(1).activate():
        graph = make_fx(f)(x)
    generators = [n.kwargs.get("generator") for n in graph.graph.nodes if n.op == "call_function"]
    assert all(g is None for g in generators)
    with CallRng(1).activate():
        a = graph(x)
    with CallRng(1).activate():
        b = graph(x)
    with CallRng(1).activate():
        eager = f(x)
    assert torch.equal(a, b) and torch.equal(a, eager)


def test_rng_state_inside_a_stream_is_the_streams():
    """Inside a call's stream torch.get/set_rng_state read and set the
    stream's generator, without drawing a lazy seed or touching the global
    generator; a state taken there and set outside routes the thread's draws
    to it until the state found before is set back (fork_rng's pattern)."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    (stream,) = CallRng.fork_many(1)
    with stream.activate():
        start = torch.get_rng_state()  # no draw yet: no seed needed
        assert torch.equal(torch.get_rng_state(), torch.get_rng_state())
        first = torch.rand(3)
        mid = torch.get_rng_state()
        second = torch.rand(3)
        torch.set_rng_state(mid)
        assert torch.equal(torch.rand(3), second)
        torch.set_rng_state(start)
        assert torch.equal(torch.rand(3), first)
    drawn = torch.get_rng_state()  # the batch's one seed draw, by the first rand
    assert not torch.equal(drawn, before)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(mid)  # a stream's state, outside any activation
        assert torch.equal(torch.rand(3), second)
    assert torch.equal(torch.get_rng_state(), drawn)  # the global generator never moved
    assert active_stream() is None  # the override ended with fork_rng's restore


def test_rng_state_of_an_untouched_stream_draws_no_seed():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    (stream,) = CallRng.fork_many(1)
    with stream.activate():
        state = torch.get_rng_state()
        torch.set_rng_state(state)
    assert torch.equal(torch.get_rng_state(), before)


class _Seeds(nn.Module):
    """Seeds inside its forward (in a fork_rng block, or not), then draws."""

    def __init__(self, k: int, fork: bool) -> None:
        super().__init__()
        torch.manual_seed(k)
        self.lin = nn.Linear(4, 4).double()
        self.k, self.fork = k, fork

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fork:
            with torch.random.fork_rng():
                torch.manual_seed(100 + self.k)
                mask = torch.rand(x.shape, dtype=x.dtype) > 0.5
            return self.lin(x) * mask
        torch.manual_seed(100 + self.k)
        mask = torch.rand(x.shape, dtype=x.dtype) > 0.5
        return torch.nn.functional.dropout(self.lin(x), 0.5) * mask


@pytest.mark.parametrize("fork", [False, True])
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("mode", ["inline", "lanes", "parallel"])
def test_a_seed_set_inside_an_expert_acts_on_that_calls_stream(
        mode: str, checkpoint: bool, fork: bool) -> None:
    """(issue 46, class 4) ``torch.manual_seed`` inside an expert, in a
    ``fork_rng`` block or not: the call draws what the loop's call draws
    after the same seed (values and gradients equal, a checkpointed call's
    recomputation too); the global generator is not reseeded (the loop's
    would be: the README's semantics table says so)."""
    experts = [_Seeds(k, fork) for k in range(3)]
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in experts]
    torch.manual_seed(7)
    want = [e(x) for e, x in zip(experts, xs)]
    loop_after = torch.get_rng_state()  # reseeded by the last expert, unless in fork_rng
    torch.manual_seed(7)
    outs = parallel_apply(experts, [x.detach().requires_grad_() for x in xs], mode=mode,
                          checkpoint=checkpoint)
    if not fork:  # the difference the README states: the global generator is not reseeded
        assert not torch.equal(torch.get_rng_state(), loop_after)
    assert all(torch.equal(a, b) for a, b in zip(outs, want))
    grads = torch.autograd.grad(sum(o.sum() for o in outs), [p for e in experts
                                                              for p in e.parameters()])
    loop = torch.autograd.grad(sum(o.sum() for o in want), [p for e in experts
                                                             for p in e.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(grads, loop))
