"""The router's plans and kernels (moe_autograd.rng), built afresh and called
directly.

The kernels PyTorch dispatches to were built once, at import; these tests
build them again (``_plan``, ``_route``, ``_sibling``, ``_dropout``,
``_guard``) around a recording op and check exactly what each hands on: the
keyset without the router's key, the arguments as given (defaults filled in
where the generator is positional), and the active stream's generator where
the op was left at ``generator=None``. The plans are checked against the ones
built at import (``routed_ops()``), so a plan that changes shows here.
"""
from types import SimpleNamespace

import pytest
import torch

from moe_autograd import rng as rng_module
from moe_autograd.rng import CallRng, ReplayRng, routed_ops

_KEY = rng_module._KEY
_CPU = torch.device("cpu")
_KEYSET = torch._C.DispatchKeySet(rng_module.DISPATCH_KEY) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.CPU)
_BELOW = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class _Op:
    """An op whose redispatch records what it was given (and whether the
    router's key was excluded then)."""

    def __init__(self, schema: str, name: str = "fake") -> None:
        self._schema = torch._C.parse_schema(schema)
        self.calls = []
        self._handle = SimpleNamespace(redispatch_boxed=self._redispatch)
        self.name = name

    def _redispatch(*args, **kwargs):
        self, keyset, *args = args
        self.calls.append((keyset, tuple(args), dict(kwargs)))
        return "redispatched"

    def __call__(*args, **kwargs):  # a sibling is called, not redispatched
        self, *args = args
        excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(_KEY)
        self.calls.append(("called", tuple(args), dict(kwargs), excluded))
        return "sibling"

    def __str__(self) -> str:
        return f"aten::{self.name}"


def _stream_gen(device=_CPU):
    return rng_module._local.stack[-1].generators[device]


def _same(a, b) -> bool:
    return rng_module._identity(a) == rng_module._identity(b)


# -- plans ------------------------------------------------------------------------------

def test_plans_built_again_are_the_plans_built_at_import():
    ops = rng_module._seeded_aten_ops()
    assert len({q for q, _ in ops}) == len(ops)
    for qualified, op in ops:
        assert qualified == f"aten::{op._schema.name[len('aten::'):]}" + (
            f".{op._overloadname}" if op._overloadname != "default" else "")
    rebuilt = {qualified: rng_module._plan(qualified, op)[0] for qualified, op in ops}
    assert rebuilt == routed_ops()
    kinds = set(rebuilt.values())
    assert {"route", "dropout", "guard", "composite", "draws nothing"} <= kinds
    assert any(kind.startswith("sibling ") for kind in kinds)


def test_plans_with_a_kernel_are_exactly_those_intercepted():
    for qualified, op in rng_module._seeded_aten_ops():
        kind, kernel = rng_module._plan(qualified, op)
        assert (kernel is None) == (kind in ("composite", "draws nothing")), qualified
        assert kernel is None or callable(kernel)


def test_tags_of_an_op_and_of_a_name_that_is_none():
    assert torch.Tag.nondeterministic_seeded in rng_module._tags("rand", "")
    assert torch.Tag.nondeterministic_seeded in rng_module._tags("bernoulli_", "float")
    assert torch.Tag.nondeterministic_seeded not in rng_module._tags("add", "Tensor")
    assert rng_module._tags("no_such_op_anywhere", "") == []


def test_tags_fall_back_to_the_op_object(monkeypatch):
    def fail(*args):
        raise RuntimeError("no fast path")
    monkeypatch.setattr(torch._C, "_get_operation_overload", fail)
    assert torch.Tag.nondeterministic_seeded in rng_module._tags("rand", "")
    assert torch.Tag.nondeterministic_seeded in rng_module._tags("bernoulli_", "float")
    assert rng_module._tags("no_such_op_anywhere", "") == []


def test_finding_no_random_ops_is_an_import_error(monkeypatch):
    monkeypatch.setattr(rng_module, "_tags", lambda name, overload: [])
    with pytest.raises(ImportError, match=r"aten::bernoulli_\.float.*aten::uniform_"):
        rng_module._seeded_aten_ops()


def test_register_installs_a_fallthrough_and_one_kernel_per_intercepted_op(monkeypatch):
    made = []

    class Library:
        def __init__(self, ns, kind):
            self.ns, self.kind, self.fallbacks, self.impls = ns, kind, [], []
            made.append(self)

        def fallback(self, fn, key):
            self.fallbacks.append((fn, key))

        def impl(self, op, fn, key, with_keyset=False):
            self.impls.append((op, key, with_keyset, callable(fn)))

    monkeypatch.setattr(rng_module, "Library", Library)
    fallback, lib, plans = rng_module._register()
    assert made == [fallback, lib]
    assert (fallback.ns, fallback.kind) == ("_", "IMPL")
    assert fallback.fallbacks == [(rng_module.fallthrough_kernel, rng_module.DISPATCH_KEY)]
    assert (lib.ns, lib.kind) == ("aten", "IMPL") and lib.fallbacks == []
    assert plans == routed_ops()
    intercepted = {q for q, kind in plans.items() if kind not in ("composite", "draws nothing")}
    assert len(lib.impls) == len(intercepted)
    assert {str(op._schema.name) + ("." + op._overloadname if op._overloadname != "default" else "")
            for op, _, _, _ in lib.impls} == intercepted
    assert {(key, keyset, fn) for _, key, keyset, fn in lib.impls} == {
        (rng_module.DISPATCH_KEY, True, True)}


def test_sibling_needs_the_same_arguments_plus_a_generator():
    rand = torch.ops.aten.rand.default
    assert rng_module._plan("aten::rand", rand)[0] == "sibling generator"
    randint_like = torch.ops.aten.randint_like.Tensor
    assert rng_module._plan("aten::randint_like.Tensor", randint_like)[0] == "sibling Tensor_generator"
    rand_out = torch.ops.aten.rand.out
    assert rng_module._plan("aten::rand.out", rand_out)[0] == "sibling generator_out"
    low = torch.ops.aten.randint.low_out
    assert rng_module._plan("aten::randint.low_out", low)[0] == "sibling low_generator_out"


# -- route: a generator argument --------------------------------------------------------

_KW = "f(Tensor self, float p=0.5, *, Generator? generator=None, Device? device=None) -> Tensor"
_POS = ("f(Tensor self, Tensor noise, Scalar lower=0.125, Scalar upper=0.25, bool training=False, "
        "Generator? generator=None, int after=7) -> Tensor")


def test_route_fills_in_a_keyword_generator_left_out_or_none():
    x = torch.ones(3)
    op = _Op(_KW)
    kernel = rng_module._route(op)
    with CallRng(5).activate():
        assert kernel(_KEYSET, x, 0.3) == "redispatched"
        kernel(_KEYSET, x, generator=None)
        gen = _stream_gen()
        assert rng_module._local.stack[-1].drew
    (ks1, args1, kw1), (ks2, args2, kw2) = op.calls
    assert ks1 == _BELOW and ks2 == _BELOW
    assert args1 == (x, 0.3) and args2 == (x,)
    assert _same(kw1["generator"], gen) and _same(kw2["generator"], gen)
    assert set(kw1) == {"generator"} and set(kw2) == {"generator"}


def test_route_takes_the_device_from_the_device_argument():
    op = _Op(_KW)
    kernel = rng_module._route(op)
    meta = torch.empty(2, device="meta")
    with CallRng(5).activate():
        kernel(_KEYSET, meta, device="cpu")  # the device argument, not the tensor's
        kernel(_KEYSET, meta, device=torch.device("cpu"))
        kernel(_KEYSET, torch.ones(2), device="meta")
        kernel(_KEYSET, torch.ones(2), device=torch.device("meta"))
        kernel(_KEYSET, meta)
        kernel(_KEYSET, input=torch.ones(2))  # a tensor among the keywords
        gen = _stream_gen()
    gens = [kw.get("generator") for _, _, kw in op.calls]
    assert _same(gens[0], gen) and _same(gens[1], gen) and _same(gens[5], gen)
    assert gens[2:5] == [None, None, None]
    assert rng_module._device_of((), {}) == _CPU
    assert rng_module._device_of((1, "a"), {"p": 2}) == _CPU


def test_route_passes_an_explicit_generator_through_the_stream():
    op = _Op(_KW)
    kernel = rng_module._route(op)
    g = torch.Generator().manual_seed(3)
    stream = CallRng(5)
    with stream.activate():
        kernel(_KEYSET, torch.ones(2), generator=g)
    with stream.activate():  # a replay: a private copy at g's state at first use
        kernel(_KEYSET, torch.ones(2), generator=g)
    first, again = op.calls[0][2]["generator"], op.calls[1][2]["generator"]
    assert first is g
    assert not _same(again, g) and torch.equal(again.get_state(), g.get_state())


def test_route_under_tracing_keeps_the_generator_as_given(monkeypatch):
    op = _Op(_KW)
    kernel = rng_module._route(op)
    g = torch.Generator()
    stream = CallRng(5)
    with stream.activate():
        kernel(_KEYSET, torch.ones(2))
    monkeypatch.setattr(rng_module, "_tracing", lambda: True)
    with stream.activate():
        kernel(_KEYSET, torch.ones(2))
        kernel(_KEYSET, torch.ones(2), generator=g)
    assert op.calls[1][2] == {} and op.calls[2][2]["generator"] is g


def test_route_outside_any_stream_raises_naming_the_op():
    kernel = rng_module._route(_Op(_KW, "bernoulli_.float"))
    with pytest.raises(RuntimeError, match=r"aten::bernoulli_\.float ran .* no stream is active"):
        kernel(_KEYSET, torch.ones(2))


def test_route_fills_in_a_positional_generator_and_the_defaults_before_it():
    x, noise = torch.ones(2), torch.zeros(2)
    op = _Op(_POS)
    kernel = rng_module._route(op)
    g = torch.Generator()
    with CallRng(5).activate():
        kernel(_KEYSET, x, noise)
        kernel(_KEYSET, x, noise, 0.5)
        kernel(_KEYSET, x, noise, 0.5, 0.75, True)
        kernel(_KEYSET, x, noise, 0.5, 0.75, True, None, 9)
        kernel(_KEYSET, x, noise, 0.5, 0.75, True, g, 9)
        kernel(_KEYSET, x, noise, p=1)
        gen = _stream_gen()
    args = [a for _, a, _ in op.calls]
    assert all(ks == _BELOW for ks, _, _ in op.calls)
    assert args[0][:5] == (x, noise, 0.125, 0.25, False) and len(args[0]) == 6
    assert args[1][:5] == (x, noise, 0.5, 0.25, False) and len(args[1]) == 6
    assert args[2][:5] == (x, noise, 0.5, 0.75, True) and len(args[2]) == 6
    assert args[3][:5] == (x, noise, 0.5, 0.75, True) and args[3][6:] == (9,)
    assert all(_same(a[5], gen) for a in args[:4])
    assert args[4] == (x, noise, 0.5, 0.75, True, g, 9)
    assert op.calls[5][2] == {"p": 1} and _same(args[5][5], gen)


def test_route_positional_on_meta_or_under_tracing_hands_the_arguments_on(monkeypatch):
    meta = torch.empty(2, device="meta")
    op = _Op(_POS)
    kernel = rng_module._route(op)
    g = torch.Generator()
    with CallRng(5).activate():
        kernel(_KEYSET, meta, meta)
        monkeypatch.setattr(rng_module, "_tracing", lambda: True)
        kernel(_KEYSET, torch.ones(2), meta)
        kernel(_KEYSET, torch.ones(2), meta, 0.5, 0.75, True, g)
    args = [a for _, a, _ in op.calls]
    assert [len(a) for a in args] == [2, 2, 6]  # nothing filled in
    assert args[0] == (meta, meta) and args[1][1] is meta and args[2][1:5] == (meta, 0.5, 0.75, True)
    assert args[2][5] is g


# -- sibling: an overload with a generator ------------------------------------------------

def test_sibling_calls_the_generator_overload_with_the_key_excluded():
    op, sibling = _Op("rand(SymInt[] size) -> Tensor", "rand"), _Op("x() -> ()")
    kernel = rng_module._sibling(op, sibling)
    with CallRng(5).activate():
        assert kernel(_KEYSET, [3], dtype=torch.float64) == "sibling"
        gen = _stream_gen()
        assert not torch._C._dispatch_tls_is_dispatch_key_excluded(_KEY)
    assert op.calls == []
    (_, args, kwargs, excluded), = sibling.calls
    assert args == ([3],) and excluded
    assert set(kwargs) == {"generator", "dtype"} and _same(kwargs["generator"], gen)


def test_sibling_on_meta_or_under_tracing_redispatches_as_given(monkeypatch):
    op, sibling = _Op("rand(SymInt[] size) -> Tensor", "rand"), _Op("x() -> ()")
    kernel = rng_module._sibling(op, sibling)
    with CallRng(5).activate():
        assert kernel(_KEYSET, [3], device="meta") == "redispatched"
        monkeypatch.setattr(rng_module, "_tracing", lambda: True)
        assert kernel(_KEYSET, [3]) == "redispatched"
    assert sibling.calls == []
    assert op.calls == [(_BELOW, ([3],), {"device": "meta"}), (_BELOW, ([3],), {})]


def test_excluded_restores_the_key_when_the_call_raises():
    def boom():
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(_KEY)
        raise ValueError("boom")
    with pytest.raises(ValueError):
        rng_module._excluded(boom)
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(_KEY)
    assert rng_module._excluded(lambda a, b=0: a + b, 1, b=2) == 3


# -- native_dropout -----------------------------------------------------------------------

_DROPOUT = "native_dropout(Tensor input, float p, bool? train) -> (Tensor, Tensor)"


def test_dropout_draws_its_mask_from_the_stream():
    x = torch.randn(16, 16)
    kernel = rng_module._dropout(_Op(_DROPOUT))
    with CallRng(7).activate():
        expected = torch.native_dropout(x, 0.4, True)
    for train in (True, None):
        with CallRng(7).activate():
            out, mask = kernel(_KEYSET, x, 0.4, train)
            assert rng_module._local.stack[-1].drew
        assert torch.equal(out, expected[0]) and torch.equal(mask, expected[1])


def test_dropout_out_form_writes_into_the_outputs_it_is_given():
    x = torch.randn(4, 5)
    op = _Op(_DROPOUT)
    kernel = rng_module._dropout(op)
    out0, out1 = torch.empty(0), torch.empty(0, dtype=torch.bool)
    with CallRng(7).activate():
        got = kernel(_KEYSET, x, 0.5, True, out0=out0, out1=out1)
    with CallRng(7).activate():
        expected = torch.native_dropout(x, 0.5, True)
    assert got[0] is out0 and got[1] is out1
    assert torch.equal(out0, expected[0]) and torch.equal(out1, expected[1])
    assert op.calls == []


def test_dropout_that_draws_nothing_redispatches(monkeypatch):
    x, meta = torch.randn(3), torch.empty(3, device="meta")
    op = _Op(_DROPOUT)
    kernel = rng_module._dropout(op)
    with CallRng(7).activate():
        kernel(_KEYSET, x, 0.5, False)
        kernel(_KEYSET, meta, 0.5, True, out0=meta)
        monkeypatch.setattr(rng_module, "_tracing", lambda: True)
        kernel(_KEYSET, x, 0.5, True)
        assert not rng_module._local.stack[-1].drew
    assert [(ks, a, kw) for ks, a, kw in op.calls] == [
        (_BELOW, (x, 0.5, False), {}), (_BELOW, (meta, 0.5, True), {"out0": meta}),
        (_BELOW, (x, 0.5, True), {})]


def test_native_dropout_rewrite_is_a_bernoulli_mask_scaled_by_the_kept_share():
    x = torch.randn(6, 8).t()  # not contiguous: the mask is
    for p in (0.25, 0.0, 1.0):
        out, mask = rng_module._native_dropout(x, p, torch.Generator().manual_seed(1))
        keep = torch.empty(8, 6).bernoulli_(1 - p, generator=torch.Generator().manual_seed(1))
        assert mask.dtype == torch.bool and mask.is_contiguous()
        assert torch.equal(mask, keep.to(torch.bool))
        scale = 0.0 if p == 1.0 else 1 / (1 - p)
        assert torch.equal(out, x * keep * scale)
    empty = torch.empty(0, 3)
    out, mask = rng_module._native_dropout(empty, 0.5, torch.Generator())
    assert out.shape == (0, 3) and mask.shape == (0, 3)


# -- guard: seeded ops that cannot be routed -----------------------------------------------

_ATTN = ("f(Tensor query, Tensor key, Tensor value, float dropout_p=0.0, bool is_causal=False, *, "
         "Tensor? attn_mask=None, float? scale=None) -> Tensor")


def test_guard_passes_only_what_draws_nothing():
    q = torch.ones(1, 1, 2, 2)
    op = _Op(_ATTN, "attention")
    kernel = rng_module._guard(op)
    with CallRng(1).activate():
        kernel(_KEYSET, q, q, q)
        kernel(_KEYSET, q, q, q, 0.0)
        kernel(_KEYSET, q, q, q, dropout_p=0)
        for args, kwargs in [((q, q, q, 0.1), {}), ((q, q, q), {"dropout_p": 0.5})]:
            with pytest.raises(RuntimeError) as info:
                kernel(_KEYSET, *args, **kwargs)
            assert str(info.value) == (
                "aten::attention draws from the global random generator and cannot be routed to "
                "the call's random stream (moe_autograd.rng); its result could not be recomputed "
                "exactly. Use a dropout-free variant inside the call or apply the dropout "
                "separately (e.g. F.dropout or the math attention backend).")
    assert [(ks, a, kw) for ks, a, kw in op.calls] == [
        (_BELOW, (q, q, q), {}), (_BELOW, (q, q, q, 0.0), {}), (_BELOW, (q, q, q), {"dropout_p": 0})]


def test_draws_nothing():
    cpu, meta = torch.ones(1), torch.empty(1, device="meta")
    draws_nothing = rng_module._draws_nothing
    assert draws_nothing({"train": False, "dropout": 0.5, "x": cpu})
    assert not draws_nothing({"train": True, "dropout": 0.5, "x": cpu})
    assert not draws_nothing({"dropout": 0.5, "x": cpu})
    assert draws_nothing({"dropout_p": 0.0, "x": cpu})
    assert draws_nothing({"dropout": 0, "x": cpu})
    assert not draws_nothing({"dropout_p": 0.0, "dropout": 0.1, "x": cpu})
    assert draws_nothing({"x": meta, "y": meta, "dropout_p": 0.5})
    assert not draws_nothing({"x": meta, "y": cpu, "dropout_p": 0.5})
    assert not draws_nothing({"dropout_p": 0.5})
    assert not draws_nothing({})


def test_bind_names_positional_keyword_and_default_arguments():
    op = _Op(_ATTN)
    q = torch.ones(1)
    assert rng_module._bind(op, (q, q, q), {"scale": 2.0}) == {
        "query": q, "key": q, "value": q, "dropout_p": 0.0, "is_causal": False,
        "attn_mask": None, "scale": 2.0}
    assert rng_module._bind(op, (q, q, q, 0.5, True), {})["dropout_p"] == 0.5


def test_route_positional_replays_an_explicit_generator_from_a_copy():
    x, noise = torch.ones(2), torch.zeros(2)
    op = _Op(_POS)
    kernel = rng_module._route(op)
    g = torch.Generator().manual_seed(3)
    stream = CallRng(5)
    for _ in range(2):  # the forward, then a recomputation
        with stream.activate():
            kernel(_KEYSET, x, noise, 0.5, 0.75, True, g)
    first, again = op.calls[0][1][5], op.calls[1][1][5]
    assert first is g and not _same(again, g)


def test_planned_sibling_kernels_draw_what_the_installed_ones_draw():
    for qualified, op, args in [("aten::rand", torch.ops.aten.rand.default, ([5],)),
                                ("aten::randn_like", torch.ops.aten.randn_like.default,
                                 (torch.ones(3),)),
                                ("aten::randint.low", torch.ops.aten.randint.low, (2, 9, [6]))]:
        kernel = rng_module._plan(qualified, op)[1]
        with CallRng(3).activate():
            expected = op(*args)
        with CallRng(3).activate():
            got = kernel(_KEYSET, *args)
        assert torch.equal(got, expected), qualified
