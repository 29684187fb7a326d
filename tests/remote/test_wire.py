"""The body codec (moe_autograd/remote/wire.py): what arrives is what was sent,
what cannot travel is refused by name, and the decoder never crashes and
never allocates beyond what arrived, whatever the bytes (a fixed-seed fuzz of
random and mutated messages: ``make test`` runs :data:`FUZZ_CASES` of them)."""
import math
import os
import random
import struct
from typing import Any, List

import msgpack
import pytest
import torch

from moe_autograd.remote import wire
from moe_autograd.remote.wire import WireError, WireTypeError, decode, encode

pytestmark = pytest.mark.timeout(120)
FUZZ_CASES = int(os.environ.get("MOE_AUTOGRAD_WIRE_FUZZ_CASES", "20000"))


def roundtrip(value: Any) -> Any:
    body, buffers = encode(value)
    return decode(body, buffers)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and a.requires_grad == b.requires_grad
                and torch.equal(a.detach(), b.detach()))
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


@pytest.mark.parametrize("dtype", sorted(wire.DTYPES.values(), key=str))
def test_every_dtype_roundtrips_bit_for_bit(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 5) * 100).to(dtype) if dtype != torch.bool else torch.rand(3, 5) > 0.5
    out = roundtrip([t, t.t(), t[:, 1], t[1:, ::2], t[:2]])
    assert same(out[0], t) and same(out[1], t.t()) and same(out[4], t[:2])
    for k in (2, 3):  # sparse windows of a larger storage travel dense: values equal
        assert torch.equal(out[k], [t[:, 1], t[1:, ::2]][k - 2]) and out[k].is_contiguous()


def test_strides_expansion_aliasing_and_requires_grad_are_kept() -> None:
    x = torch.randn(4, 6)
    expanded = torch.ones(1, 3).expand(5, 3)
    leaf = torch.randn(2, requires_grad=True)
    body, buffers = encode([x, x, x.t(), expanded, leaf, torch.empty(0, 4)])
    assert sum(b.numel() for b in buffers) == (24 + 24 + 3 + 2) * 4  # x once; 3 of 15
    out = decode(body, buffers)
    assert out[0] is out[1]  # one object twice arrives as one
    assert out[2].stride() == (1, 6) and out[3].stride() == (0, 1)
    assert out[4].requires_grad and out[4].is_leaf
    assert out[5].shape == (0, 4)
    # decoded tensors own writable memory: computing in place is fine
    out[0].add_(1)


def test_values_and_containers_keep_their_types() -> None:
    value = {"none": None, "b": True, "i": -(1 << 63), "f": 1.5, "nan": float("nan"),
             "s": "é", "bytes": b"\x00\xff", "list": [1, [2]], "tuple": (1, (2, [3])),
             "empty": (), "t": (torch.ones(2),)}
    assert same(roundtrip(value), value)


@pytest.mark.parametrize("bad, where", [
    (object(), "argument 0 is a builtins.object"),
    ({1: 2}, "has a key 1 of type int"),
    (1 << 70, "an int outside 64 bits"),
    ([[[lambda: 0]]], "argument 0[0][0][0] is a builtins.function"),
    (torch.ones(2).to_sparse(), "is a torch.sparse_coo tensor"),
    (torch.ones(2, dtype=torch.uint16) if hasattr(torch, "uint16") else object(), "argument 0 is"),
    (1 + 2j, "argument 0 is a builtins.complex"),
])
def test_what_cannot_travel_is_named(bad: Any, where: str) -> None:
    with pytest.raises(WireTypeError, match=where.replace("[", r"\[").replace("]", r"\]")):
        wire.check_value(bad, "argument 0")
    if isinstance(bad, dict):  # encoded, and refused by the receiver
        body, buffers = encode(bad)
        with pytest.raises(WireError):
            decode(body, buffers)
        return
    with pytest.raises(WireTypeError):
        encode(bad)


def test_tensors_off_the_cpu_and_with_conj_bits_travel_as_values() -> None:
    z = torch.randn(3, dtype=torch.complex64)
    out = roundtrip([z.conj(), -z])
    assert torch.equal(out[0], z.conj().resolve_conj()) and not out[0].is_conj()
    assert torch.equal(out[1], -z)


# -- decoding refuses what does not add up ---------------------------------------------------
CODES = {dtype: code for code, dtype in enumerate(wire.DTYPES.values())}


def ref(index: int, dtype: Any = torch.float32, shape: Any = (1,), strides: Any = (1,),
        requires_grad: int = 0, ndim: Any = None) -> msgpack.ExtType:
    """A tensor's extension type, as a sender (honest or not) writes it."""
    code = CODES[dtype] if isinstance(dtype, torch.dtype) else dtype
    ndim = len(shape) if ndim is None else ndim
    data = struct.pack("<IBBB", index, code, requires_grad, ndim)
    data += struct.pack("<" + "Q" * (len(shape) + len(strides)), *shape, *strides)
    return msgpack.ExtType(1, data)


def _message(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


@pytest.mark.parametrize("tensor, buffer, match", [
    (ref(0, shape=(2, 3), strides=(3, 1)), b"\x00" * 20, "span 24 bytes, its buffer has 20"),
    (ref(0, dtype=200), b"\x00" * 4, "malformed descriptor"),
    (ref(0, shape=(1 << 50,), strides=(1,)), b"", "past 2\\*\\*48"),
    (ref(0, dtype=torch.int64, requires_grad=1), b"\x00" * 8, "cannot require grad"),
    (ref(0, requires_grad=2), b"\x00" * 4, "malformed descriptor"),
    (ref(0, shape=(1 << 47, 1 << 47), strides=(0, 0)), b"\x00" * 4, "elements, more than"),
    (ref(0, shape=(1,) * 40, strides=(1,) * 40), b"\x00" * 4, "malformed descriptor"),
    (ref(0, shape=(2,), strides=(1,), ndim=3), b"\x00" * 8, "malformed descriptor"),
    (msgpack.ExtType(1, b"\x00\x00"), b"\x00" * 4, "shorter than its header"),
])
def test_bad_descriptors_are_refused_before_any_tensor_is_made(tensor: Any, buffer: bytes,
                                                               match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode(_message([tensor]), [buffer])


def test_references_and_counts_must_match() -> None:
    with pytest.raises(WireError, match="2 buffers arrived for 1 tensors"):
        decode(_message([ref(0)]), [b"\x00" * 4, b"\x00" * 4])
    with pytest.raises(WireError, match="a tensor of buffer 3, of 1"):
        decode(_message([ref(3)]), [b"\x00" * 4])
    with pytest.raises(WireError, match="claimed by two different tensors"):
        decode(_message([ref(0), ref(0, dtype=torch.int32)]), [b"\x00" * 4])
    twice = decode(_message([ref(0), ref(0)]), [b"\x00" * 4])
    assert twice[0] is twice[1]
    with pytest.raises(WireError, match="unknown extension type 9"):
        decode(_message(msgpack.ExtType(9, b"")), [])
    with pytest.raises(WireError, match="malformed message body"):
        decode(_message(1) + b"\x01", [])  # bytes left over
    deep = msgpack.ExtType(2, msgpack.packb([]))
    for _ in range(wire.MAX_DEPTH + 1):
        deep = msgpack.ExtType(2, msgpack.packb([deep], use_bin_type=True))
    with pytest.raises(WireError, match="nested"):
        decode(_message(deep), [])


def test_an_expanded_tensor_is_made_without_allocating_it() -> None:
    """A descriptor may claim 2**40 elements of stride 0 over one element:
    the decoder makes a view (no allocation); what a server would
    materialise is counted by moe_autograd.remote.sizes before anything runs."""
    from moe_autograd.remote.sizes import materialised_bytes

    out = decode(_message([ref(0, shape=(1 << 20, 1 << 20), strides=(0, 0))]), [b"\x00" * 4])
    assert out[0].untyped_storage().nbytes() == 4
    assert materialised_bytes(out) == 4 << 40


# -- the fuzz ---------------------------------------------------------------------------------
def _seeds() -> List[Any]:
    x = torch.randn(3, 4)
    return [encode({"op": "forward", "expert": "lin", "call": "ab" * 16, "seed": 7, "grad": True,
                    "flags": [True, False], "args": [x, x.t(), (1, "s", None)]}),
            encode({"op": "batch", "batch": "c" * 32,
                    "jobs": [{"op": "backward", "expert": "e", "call": "d" * 32, "seed": 1,
                              "flags": [True], "args": None, "grads": [torch.ones(2, 2)],
                              "answer_by": 1.5}] * 3}),
            encode({"reply": ["ok", [[torch.randn(2, dtype=torch.bfloat16)], True, [True],
                                     "stateful"]], "refused": 0})]


def _check(body: bytes, buffers: List[Any]) -> bool:
    """Decodes a fuzzed message: True if it decoded (and made nothing it should not)."""
    sizes = [len(b) if isinstance(b, (bytes, bytearray)) else b.numel() for b in buffers]
    try:
        value = decode(body, buffers)
    except WireError:
        return False
    tensors: List[torch.Tensor] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    # nothing beyond what arrived: every tensor views (a copy of) its own buffer
    for t in tensors:
        assert t.untyped_storage().nbytes() <= max(sizes, default=0), (t.shape, sizes)
    return True


def test_decoder_fuzz_fixed_seed() -> None:
    rng = random.Random(20261127)
    seeds = _seeds()
    decoded = 0
    for case in range(FUZZ_CASES):
        body, buffers = seeds[case % len(seeds)]
        data = bytearray(body)
        kind = rng.random()
        if kind < 0.6:  # flip, insert or delete a few bytes of a valid body
            for _ in range(rng.randint(1, 6)):
                at = rng.randrange(len(data))
                op = rng.random()
                if op < 0.6:
                    data[at] = rng.randrange(256)
                elif op < 0.8:
                    data.insert(at, rng.randrange(256))
                elif len(data) > 1:
                    del data[at]
        elif kind < 0.8:  # random bytes
            data = bytearray(rng.randbytes(rng.randint(0, 64)))
        else:  # the body intact, buffers of other lengths
            buffers = [bytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.5:
            buffers = [bytes(b.numpy()) if isinstance(b, torch.Tensor) else b for b in buffers]
        decoded += _check(bytes(data), list(buffers))
    assert decoded > FUZZ_CASES // 50  # the mutations reach past the first checks
