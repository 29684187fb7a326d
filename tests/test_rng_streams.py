"""The streams' exact contract (moe_autograd.rng): which seeds a stream gets,
which generator a draw uses, what ``torch.get_rng_state`` /
``torch.set_rng_state`` see inside a stream, and the exact words of every
refusal. test_rng.py checks that replays agree with themselves; these pin the
values against what PyTorch's own generators draw, so a seed derived or drawn
differently shows."""
import threading
import zlib

import pytest
import torch

from moe_autograd import rng as rng_module
from moe_autograd.rng import (CallRng, ReplayRng, active_stream, mark_concurrent,
                              rewind_unrun_draws)

_MASK = (1 << 64) - 1
_CPU = torch.device("cpu")


def _cpu_gen(seed: int) -> torch.Generator:
    """The generator a CallRng with this seed draws from on the CPU."""
    code = zlib.crc32(b"cpu:None")
    return torch.Generator().manual_seed(rng_module._mix64(seed ^ code))


def _int64s(n: int, generator=None):
    return [v & _MASK for v in torch.empty(n, dtype=torch.int64).random_(
        -(1 << 63), None, generator=generator).tolist()]


# -- seeds -----------------------------------------------------------------------------

def test_mix64_is_splitmix64():
    # the first two outputs of splitmix64 seeded with 0 (Vigna's reference code)
    assert rng_module._mix64(0) == 0xE220A8397B1DCDAF
    assert rng_module._mix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    assert 0 <= rng_module._mix64(_MASK) < 1 << 64  # 64 bits in, 64 bits out


@pytest.mark.parametrize("seed", [1, 0xDEADBEEF12345678, _MASK])
def test_a_stream_draws_from_a_generator_seeded_by_its_seed_and_the_device(seed):
    with CallRng(seed).activate():
        got = torch.rand(6)
    assert torch.equal(got, torch.rand(6, generator=_cpu_gen(seed)))


def test_lazy_seeds_are_one_draw_of_the_default_generator():
    torch.manual_seed(7)
    streams = CallRng.fork_many(40)
    state = torch.get_rng_state()
    assert [s._seed for s in streams] == [None] * 40
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn yet
    with streams[3].activate():
        torch.rand(1)
    torch.manual_seed(7)
    expected = _int64s(40)
    assert [s.seed for s in streams] == expected
    assert any(v >= 1 << 63 for v in expected)  # drawn over all 64 bits
    assert repr(CallRng.fork()) == "CallRng(seed not drawn yet)"


def test_forks_inside_a_stream_are_derived_from_its_seed_in_fork_order():
    parent = CallRng(11)
    salt = rng_module._FORK_SALT
    state = torch.get_rng_state()
    with parent.activate():
        one = CallRng.fork()
        many = CallRng.fork_many(3)
        last = CallRng.fork()
    assert parent.drew  # a replay must fork the same seeds again
    assert torch.equal(torch.get_rng_state(), state)
    derived = [rng_module._mix64(11 ^ rng_module._mix64(salt + i)) for i in range(5)]
    assert [one.seed, *(s.seed for s in many), last.seed] == derived


def test_forks_inside_a_replay_stream_draw_from_it():
    for n in (1, 2, 3):
        torch.manual_seed(5)
        with ReplayRng().activate():
            streams = CallRng.fork_many(n)
        assert len(streams) == n
        torch.manual_seed(5)
        if n == 1:  # one stream: CallRng.fork's draw of one 0-dim seed
            expected = [int(torch.empty((), dtype=torch.int64).random_(-(1 << 63), None)) & _MASK]
        else:
            expected = _int64s(n)
        assert [s.seed for s in streams] == expected


def test_fork_from_a_generator_draws_a_64_bit_seed_from_it():
    seeds = [CallRng.fork(torch.Generator().manual_seed(s)).seed for s in range(8)]
    expected = [int(torch.empty((), dtype=torch.int64).random_(
        -(1 << 63), None, generator=torch.Generator().manual_seed(s)).item()) & _MASK
        for s in range(8)]
    assert seeds == expected and any(v >= 1 << 63 for v in seeds)


def test_fork_on_a_new_thread():
    got = []
    t = threading.Thread(target=lambda: got.append(CallRng.fork(torch.Generator().manual_seed(1))))
    t.start()
    t.join(30)
    assert got[0].seed == CallRng.fork(torch.Generator().manual_seed(1)).seed


def test_repr():
    assert repr(CallRng(5)) == "CallRng(seed=0x0000000000000005)"
    assert repr(CallRng(lazy=(rng_module._LazySeeds(1), 0))) == "CallRng(seed not drawn yet)"
    replay = ReplayRng()
    assert replay.drew is None and repr(replay) == "ReplayRng(not recorded)"
    with replay.activate():
        torch.rand(1)
    assert repr(replay) == "ReplayRng(['cpu'])"


def test_lazy_seeds_rewind_once():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    seeds = rng_module._LazySeeds(2)
    seeds.get(1)
    seeds.fail(0)
    seeds.rewind()
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(1)
    moved = torch.get_rng_state()
    seeds.rewind()  # done already: a no-op
    assert torch.equal(torch.get_rng_state(), moved)


def test_lazy_seeds_are_drawn_once_when_two_threads_ask_at_once():
    seeds = rng_module._LazySeeds(2)
    real = seeds.lock
    waiting = threading.Event()

    class Lock:  # says when the thread is about to wait for the lock
        def __enter__(self):
            waiting.set()
            return real.__enter__()

        def __exit__(self, *exc):
            return real.__exit__(*exc)

    seeds.lock = Lock()
    got = []
    with real:  # the first thread, drawing
        thread = threading.Thread(target=lambda: got.append(seeds.get(1)))
        thread.start()
        assert waiting.wait(30)
        seeds.values = [5, 6]
    thread.join(30)
    assert got == [6]


def test_batch_helpers_take_streams_without_lazy_seeds():
    mark_concurrent([CallRng(5), CallRng(6)])
    rewind_unrun_draws([None, CallRng(5), ReplayRng()])


# -- activations ---------------------------------------------------------------------------

def test_an_activation_can_be_entered_again():
    activation = CallRng(3).activate()
    with activation:
        a = torch.rand(4)
    with activation:
        b = torch.rand(4)
    assert torch.equal(a, b)


def test_activations_left_out_of_order():
    a, b, c = CallRng(1), CallRng(2), CallRng(3)
    outer, inner, top = a.activate(), b.activate(), c.activate()
    outer.__enter__()
    inner.__enter__()
    top.__enter__()
    top.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert active_stream() is b and inner.outer is None
    assert torch._C._dispatch_tls_is_dispatch_key_included(rng_module._KEY)
    with b.activate():
        expected = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)  # still drawn from b
    inner.__exit__(None, None, None)
    assert active_stream() is None
    # the state from before either: nothing routed, nothing left over
    assert not torch._C._dispatch_tls_is_dispatch_key_included(rng_module._KEY)
    with pytest.raises(ValueError):
        inner.__exit__(None, None, None)
    outer, inner, top = a.activate(), b.activate(), c.activate()
    for activation in (outer, inner, top):
        activation.__enter__()
    outer.__exit__(None, None, None)  # the one right above takes over
    assert inner.outer is None and top.outer is inner
    top.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    assert not torch._C._dispatch_tls_is_dispatch_key_included(rng_module._KEY)


def test_an_explicit_generator_alone_marks_the_stream_drawn():
    stream = CallRng(4)
    with stream.activate():
        torch.rand(2, generator=torch.Generator())
    assert stream.drew is True


def test_an_explicit_generator_replays_every_draw_of_the_forward():
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    stream = CallRng(4)
    with stream.activate():
        first = [torch.rand(3, generator=g1), torch.rand(3, generator=g2), torch.rand(3, generator=g1)]
    after = (g1.get_state(), g2.get_state())
    with stream.activate():  # a recomputation: private copies, g1 and g2 left alone
        again = [torch.rand(3, generator=g1), torch.rand(3, generator=g2), torch.rand(3, generator=g1)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[2])
    assert torch.equal(g1.get_state(), after[0]) and torch.equal(g2.get_state(), after[1])


def test_a_replay_drawing_from_a_generator_its_forward_did_not_raises():
    stream = CallRng(4)
    with stream.activate():
        first = torch.rand(3, generator=torch.Generator().manual_seed(1))
    with stream.activate():  # a new generator at the state the forward's started at: replayed
        assert torch.equal(torch.rand(3, generator=torch.Generator().manual_seed(1)), first)
        with pytest.raises(RuntimeError) as info:  # at another state: not the forward's draws
            torch.rand(1, generator=torch.Generator().manual_seed(2))
    assert str(info.value) == (
        "a replay of a checkpointed call draws from a torch.Generator that its forward did not "
        "draw from, at a state none of the forward's generators started at: a generator the "
        "expert builds in forward must be seeded the same way every time (or pass one in); "
        "else call it with checkpoint=False")


def test_two_calls_of_a_batch_sharing_a_generator_raise():
    a, b = CallRng.fork_many(2)
    mark_concurrent([a, b])
    g = torch.Generator()
    with a.activate():
        torch.rand(1, generator=g)
    with b.activate():
        with pytest.raises(RuntimeError) as info:
            torch.rand(1, generator=g)
    assert str(info.value) == (
        "this call and call 0 of the batch draw from the same torch.Generator; running at once, "
        "their draws would interleave in no fixed order, where the loop's come in call order: "
        "give each expert a generator of its own, or run the batch with mode='inline'")


def test_an_explicit_generator_inside_a_replay_stream_is_used_as_given():
    g = torch.Generator().manual_seed(9)
    with ReplayRng().activate():
        got = torch.rand(3, generator=g)
    assert torch.equal(got, torch.rand(3, generator=torch.Generator().manual_seed(9)))


def test_owns_the_generators_of_the_activation_and_of_those_it_runs_in():
    g = torch.Generator()
    with CallRng(1).activate():
        torch.rand(1)
        outer = rng_module._local.stack[-1].generators[_CPU]
        with CallRng(2).activate():
            activation = rng_module._local.stack[-1]
            assert not activation._owns(outer.__class__()) and not activation._owns(g)
            torch.rand(1)
            assert activation._owns(activation.generators[_CPU])
            assert activation._owns(outer)
    stream = CallRng(3)
    with stream.activate():
        torch.rand(1, generator=g)
    with stream.activate():
        torch.rand(1, generator=g)
        activation = rng_module._local.stack[-1]
        copy, = activation.copies.values()
        assert activation._owns(copy) and not activation._owns(g)


def test_a_replay_stream_refuses_a_second_activation_while_recording():
    replay = ReplayRng()
    with replay.activate():
        with pytest.raises(RuntimeError) as info:
            with replay.activate():
                pass
    assert str(info.value) == "ReplayRng activated again before its first activation ended"


def test_a_replay_that_draws_on_a_new_device_raises():
    replay = ReplayRng()
    with replay.activate():
        pass
    with pytest.raises(RuntimeError) as info:
        with replay.activate():
            torch.rand(1)
    assert str(info.value) == (
        "a replay of a checkpointed call draws random numbers on cpu, where its forward drew "
        "none: the function is not deterministic given its inputs and its random stream, so it "
        "cannot be recomputed exactly")


def test_default_generator_of_an_unknown_device_raises():
    assert rng_module._default_generator(_CPU) is torch.default_generator
    with pytest.raises(RuntimeError) as info:
        rng_module._default_generator(torch.device("meta"))
    assert str(info.value) == "moe_autograd.rng.ReplayRng: no default generator known for meta"


# -- torch.get_rng_state / torch.set_rng_state -----------------------------------------------

def test_rng_state_in_a_replay_stream_is_torchs():
    with ReplayRng().activate():
        state = torch.get_rng_state()
    assert getattr(state, rng_module._STATE_TAG, None) is None
    assert torch.equal(state, torch.default_generator.get_state())


def test_an_initial_state_set_in_another_stream_draws_from_its_stream():
    first = CallRng(21)
    with first.activate():
        initial = torch.get_rng_state()
        expected = torch.rand(4)
    with CallRng(22).activate():
        torch.set_rng_state(initial)
        again = torch.get_rng_state()  # still the initial state of stream 21
        with CallRng(23).activate():
            torch.set_rng_state(again)
            assert torch.equal(torch.rand(4), expected)
        assert torch.equal(torch.rand(4), expected)


def test_a_drawn_state_set_outside_any_stream_leaves_the_global_generator_alone():
    with CallRng(21).activate():
        torch.rand(1)
        state = torch.get_rng_state()
        expected = torch.rand(4)
    before = torch.default_generator.get_state()
    torch.set_rng_state(state)  # pushes an override activation
    assert torch.equal(torch.default_generator.get_state(), before)
    got = torch.rand(4)
    torch.set_rng_state(before)  # pops it
    assert torch.equal(got, expected)
    assert active_stream() is None
    assert torch.equal(torch.default_generator.get_state(), before)


def test_a_plain_state_set_inside_a_stream_draws_from_it():
    gen = torch.Generator().manual_seed(8)
    with CallRng(21).activate():
        torch.set_rng_state(gen.get_state())
        got = torch.rand(4)
    assert torch.equal(got, torch.rand(4, generator=torch.Generator().manual_seed(8)))


# -- the refusals' words -------------------------------------------------------------------------

def _no_stream_message(op: str) -> str:
    return (f"{op} ran with moe_autograd's random-number routing switched on in PyTorch's "
            "dispatch state, but no stream is active on this Python thread: the thread "
            "inherited the dispatch state (an autograd engine device thread running a backward "
            "started inside CallRng.activate(), or a torch.jit.fork task). Start the backward "
            "outside the activation, or draw on the activating thread.")


class _Named:
    def __init__(self, schema: str, name: str) -> None:
        self._schema = torch._C.parse_schema(schema)
        self._handle = type("Handle", (), {"redispatch_boxed": staticmethod(lambda *a, **k: None)})
        self.name = name

    def __str__(self) -> str:
        return self.name


_KINDS = {
    "route": ("f(Tensor self, *, Generator? generator=None) -> Tensor", rng_module._route,
              (torch.ones(1),)),
    "positional": ("f(Tensor self, Generator? generator=None) -> Tensor", rng_module._route,
                   (torch.ones(1),)),
    "sibling": ("f(SymInt[] size) -> Tensor",
                lambda op: rng_module._sibling(op, lambda *a, **k: None), ([1],)),
    "dropout": ("native_dropout(Tensor input, float p, bool? train) -> (Tensor, Tensor)",
                rng_module._dropout, (torch.ones(2), 0.5, True)),
}


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_no_stream_names_the_op(kind):
    schema, factory, args = _KINDS[kind]
    op = _Named(schema, f"aten::{kind}")
    kernel = factory(op)
    with pytest.raises(RuntimeError) as info:
        kernel(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args)
    assert str(info.value) == _no_stream_message(f"aten::{kind}")


def test_an_unroutable_op_that_would_draw_is_refused_in_words():
    q = torch.randn(1, 1, 4, 8)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with CallRng(1).activate():
        with pytest.raises(RuntimeError) as info:
            op(q, q, q, 0.3)
    assert str(info.value) == (
        f"{op} draws from the global random generator and cannot be routed to the call's random "
        "stream (moe_autograd.rng); its result could not be recomputed exactly. Use a "
        "dropout-free variant inside the call or apply the dropout separately (e.g. F.dropout or "
        "the math attention backend).")
