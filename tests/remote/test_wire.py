"""The body codec (moe_autograd/remote/wire.py): what arrives is what was sent,
what cannot travel is refused by name, and the decoder never crashes and
never allocates beyond what arrived, whatever the bytes (a fixed-seed fuzz of
random and mutated messages: ``make test`` runs :data:`FUZZ_CASES` of them);
and the frame around it (moe_autograd/remote/frame.py): a header read
without trusting it, a refusal that says its code only."""
import math
import os
import random
import re
import struct
import warnings
from fractions import Fraction
from typing import Any, Callable, List

import msgpack
import pytest
import torch

from moe_autograd.remote import auth, frame, wire
from moe_autograd.remote import compression as cz
from moe_autograd.remote.compression import CODECS, Compressed
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


# -- what a caller's value may hold, and where check_value says it fails ----------------------
class _Sub(torch.Tensor):
    """A tensor subclass (its methods could run code on the receiving side)."""


def _exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def _allowed() -> List[Any]:
    """One of every kind a message carries, at the edges of its range."""
    return [None, True, 1.5, "s", b"b", -(1 << 63), -(1 << 63) + 1, (1 << 63) - 1,
            torch.ones(2), torch.nn.Parameter(torch.ones(2)),
            Compressed(torch.ones(2), "int8"), [], (), {}]


def test_every_kind_the_schema_carries_passes_the_check() -> None:
    wire.check_value(_allowed(), "argument 0")
    for value in _allowed():
        wire.check_value(value, "argument 0")
    wire.check_value({"k": _allowed(), "t": tuple(_allowed())}, "argument 0")


@pytest.mark.parametrize("bad, message", [
    (1 << 63, "x[0] is an int outside 64 bits (9223372036854775808)"),
    (-(1 << 63) - 1, "x[0] is an int outside 64 bits (-9223372036854775809)"),
    (Compressed(5, "fp16"),  # type: ignore[arg-type]
     "x[0] is a Compressed of a int, not a tensor"),
    (torch.ones(2).as_subclass(_Sub), "x[0] is a tensor subclass (_Sub): only plain tensors "
                                      "travel"),
    (torch.ones(2).to_sparse(), "x[0] is a torch.sparse_coo tensor: only dense tensors travel"),
    (Compressed(torch.ones(2).to_sparse(), "fp16"),
     "x[0] is a torch.sparse_coo tensor: only dense tensors travel"),
    (torch.ones(2, dtype=torch.float8_e4m3fn),
     "x[0] is a tensor of dtype torch.float8_e4m3fn; the wire carries " + str(sorted(wire.DTYPES))),
    (1 + 2j, "x[0] is a builtins.complex, which cannot travel: messages carry tensors, numbers, "
             "strings, bytes, bools, None and lists, tuples and str-keyed dicts of them"),
    ({1: 2}, "x[0] has a key 1 of type int: dict keys must be str"),
])
def test_check_value_names_the_bad_part_past_the_good_ones(bad: Any, message: str) -> None:
    """The bad part is first in the list and checked last: after every good kind."""
    with pytest.raises(WireTypeError, match=_exactly(message)):
        wire.check_value([bad] + _allowed(), "x")


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():  # (a prototype API)
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # (a deprecated API)
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(2), 0.5, 0, torch.qint8)


@pytest.mark.parametrize("make", [_nested, _quantized])
def test_nested_and_quantized_tensors_are_not_dense(make: Callable[[], torch.Tensor]) -> None:
    dense = make()
    with pytest.raises(WireTypeError, match=_exactly("x is a torch.strided tensor: only dense "
                                                     "tensors travel")):
        wire.check_value(dense, "x")


@pytest.mark.parametrize("container", ["list", "tuple", "dict"])
def test_nesting_is_checked_to_max_depth(container: str) -> None:
    def nest(levels: int) -> Any:
        value: Any = torch.ones(1)
        for _ in range(levels):
            value = {"k": value} if container == "dict" else [value] if container == "list" \
                else (value,)
        return value

    wire.check_value(nest(wire.MAX_DEPTH), "x")  # containers at depths 0 to MAX_DEPTH - 1
    step = "['k']" if container == "dict" else "[0]"
    with pytest.raises(WireTypeError, match=_exactly(
            f"x{step * wire.MAX_DEPTH} is nested more than {wire.MAX_DEPTH} levels deep")):
        wire.check_value(nest(wire.MAX_DEPTH + 1), "x")


def test_tensor_nbytes_counts_every_element_materialised() -> None:
    assert wire.tensor_nbytes(torch.ones(3, dtype=torch.float64)) == 24
    assert wire.tensor_nbytes(torch.ones(1, dtype=torch.int16).expand(5, 7)) == 70
    assert wire.tensor_nbytes(torch.ones(0, 4)) == 0
    assert type(wire.tensor_nbytes(torch.ones(2, dtype=torch.uint8))) is int


# -- compressed tensors (extension type 3) ----------------------------------------------------
@pytest.mark.parametrize("codec, dtype", [
    (codec, dtype) for codec in CODECS for dtype in wire.DTYPES.values()
    if cz.applies(dtype, codec)])
@pytest.mark.parametrize("shape", [(), (3,), (2, 65), (1,) * wire.MAX_DIMS])
def test_compressed_tensors_arrive_plain_in_their_dtype_and_shape(codec: str, dtype: torch.dtype,
                                                                  shape: Any) -> None:
    t = (torch.arange(math.prod(shape), dtype=torch.float64) - 3).reshape(shape).to(dtype)
    leaf = t.clone().requires_grad_()
    out = roundtrip([Compressed(t, codec), Compressed(leaf, codec)])
    for sent, got in zip((t, leaf), out):
        assert type(got) is torch.Tensor and got.dtype == dtype and got.shape == shape
        assert got.is_contiguous() and got.requires_grad == sent.requires_grad
        assert torch.allclose(got.detach().double(), sent.detach().double(), rtol=0.02,
                              atol=0.5)  # the codec's own bounds: tests/remote/test_compression.py


def test_each_compressed_tensor_travels_once_and_arrives_as_itself() -> None:
    a, b = torch.randn(8), torch.randn(8)
    same_a = Compressed(a, "fp16")
    body, buffers = encode([same_a, Compressed(b, "fp16"), same_a, Compressed(a, "fp16"),
                            Compressed(a, "int8")])
    assert [x.numel() for x in buffers] == [16, 16, 8, 4]  # a, b, a as int8 and its scales
    out = decode(body, buffers)
    assert out[0] is out[2] is out[3] and out[1] is not out[0] and out[4] is not out[0]
    assert torch.allclose(out[1], b, rtol=1e-3) and torch.allclose(out[0], a, rtol=1e-3)


@pytest.mark.parametrize("bad, error, message", [
    (Compressed(5, "fp16"), WireTypeError,  # type: ignore[arg-type]
     "Compressed holds a int, not a tensor"),
    (Compressed(torch.ones(2).to_sparse(), "fp16"), WireTypeError,
     "a torch.sparse_coo tensor cannot travel: only dense (strided) tensors"),
    (Compressed(_nested(), "int8"),
     WireTypeError, "a torch.strided tensor cannot travel: only dense (strided) tensors"),
    (Compressed(torch.ones(2).as_subclass(_Sub), "bf16"), WireTypeError,
     "a tensor subclass (_Sub) cannot travel: send a plain torch.Tensor"),
    (Compressed(torch.ones((1,) * (wire.MAX_DIMS + 1)), "fp16"), WireTypeError,
     f"a tensor of {wire.MAX_DIMS + 1} dimensions cannot travel (at most {wire.MAX_DIMS})"),
])
def test_a_compressed_tensor_that_cannot_travel_is_named(bad: Any, error: type,
                                                         message: str) -> None:
    with pytest.raises(error, match=_exactly(message)):
        encode([bad])


def packed(index: int, scales: int = 0xFFFFFFFF, codec: str = "fp16", dtype: Any = torch.float32,
           shape: Any = (1,), requires_grad: int = 0, block: int = 0,
           ndim: Any = None) -> msgpack.ExtType:
    """A compressed tensor's extension type, as a sender (honest or not) writes it."""
    code = CODES[dtype] if isinstance(dtype, torch.dtype) else dtype
    ndim = len(shape) if ndim is None else ndim
    data = struct.pack("<IIBBBBI", index, scales, cz.CODEC_IDS[codec], code, requires_grad, ndim,
                       block)
    return msgpack.ExtType(3, data + struct.pack("<" + "Q" * len(shape), *shape))


HALF = b"\x00\x3c"  # 1.0 in float16
INT8 = (packed(0, 1, "int8", block=64), b"\x01", struct.pack("<f", 2.0))  # 2.0


def test_a_compressed_descriptor_repeated_is_one_tensor() -> None:
    out = decode(_message([packed(0), packed(0)]), [HALF])
    assert out[0] is out[1] and torch.equal(out[0], torch.ones(1))
    out = decode(_message([INT8[0], INT8[0]]), list(INT8[1:]))
    assert out[0] is out[1] and torch.equal(out[0], torch.full((1,), 2.0))


@pytest.mark.parametrize("items, buffers, message", [
    ([msgpack.ExtType(3, bytes(15))], [], "a compressed tensor's descriptor shorter than its "
                                          "header"),
    ([packed(0, shape=(1,), ndim=2)], [HALF], "a compressed tensor's malformed descriptor"),
    ([packed(0, shape=(1,) * 33)], [HALF], "a compressed tensor's malformed descriptor"),
    ([packed(0, shape=(1,) * 33, ndim=33)], [HALF], "a compressed tensor's malformed descriptor"),
    ([packed(1)], [HALF], "a compressed tensor of buffer 1, of 1 (or claimed twice)"),
    ([INT8[0], packed(1)], list(INT8[1:]), "a compressed tensor of buffer 1, of 2 (or claimed "
                                           "twice)"),
    ([packed(0), packed(0, shape=(1, 1))], [HALF], "buffer 0 claimed by two different tensors"),
    ([packed(0), ref(0, dtype=torch.float16)], [HALF], "buffer 0 claimed by two different "
                                                       "tensors"),
    ([ref(0), packed(1, 0, "int8", block=64)], [bytes(4), b"\x01"],
     "compressed tensor 1: scales in buffer 0, of 2 (or claimed twice)"),
    ([packed(0, 2, "int8", block=64), packed(1, 2, "int8", block=64)],
     [b"\x01", b"\x01", bytes(4)], "compressed tensor 1: scales in buffer 2, of 3 (or claimed "
                                   "twice)"),
    ([packed(0, 0, "int8", block=64)], [b"\x01"], "compressed tensor 0: scales in buffer 0, of 1 "
                                                  "(or claimed twice)"),
    ([packed(0, 1, "int8", block=64)], [b"\x01"], "compressed tensor 0: scales in buffer 1, of 1 "
                                                  "(or claimed twice)"),
    ([packed(0, dtype=200)], [HALF], "compressed tensor 0: a malformed descriptor"),
    ([packed(0, requires_grad=2)], [HALF], "compressed tensor 0: a malformed descriptor"),
    ([packed(0, shape=(1 << 48,))], [HALF], "compressed tensor 0: a size past 2**48"),
    ([packed(0, shape=(1 << 47, 1 << 47))], [HALF],
     f"compressed tensor 0: more than {wire.MAX_ELEMENTS} elements"),
    ([packed(0, dtype=torch.int32)], [HALF], "compressed tensor 0: codec fp16 does not carry "
                                             "torch.int32 tensors"),
])
def test_malformed_compressed_descriptors_are_refused_by_name(items: List[Any],
                                                              buffers: List[bytes],
                                                              message: str) -> None:
    with pytest.raises(WireError, match=_exactly(message)):
        decode(_message(items), buffers)


# -- frames: a refusal, and the buffer lengths a head announces ------------------------------
def test_a_refusal_says_its_code_and_nothing_else() -> None:
    """Unsealed, it names no job, session, request or clock: the same bytes
    for every request refused for one reason."""
    for code in auth.REASONS:
        refused = frame.refusal(code)
        header = frame.parse(refused)
        assert (header.kind, header.code, header.key_id, header.session, header.seq,
                header.sent_ms, header.body_len, header.lengths) == \
            (frame.REFUSAL, code, bytes(8), bytes(16), 0, 0, 0, [])
        assert refused.head[header.mac_start:] == bytes(frame.MAC_BYTES)
        assert refused.buffers == [] and refused.label == "refusal"


def test_a_client_reads_a_refusal_by_its_code_alone() -> None:
    """Whatever else an (unauthenticated) refusal's header says."""
    session = auth.Session(auth.JobSecret.generate())
    head = frame.build_head(frame.REFUSAL, session.secret.key_id, session.id, 7, 123456, 0, [],
                            code=5)
    with pytest.raises(auth.Refused, match="^replay: "):
        session.open_reply("srv", 1, frame.Frame(head + bytes(frame.MAC_BYTES)))
    with pytest.raises(auth.Refused, match="^malformed: "):  # a code it does not know
        session.open_reply("srv", 1, frame.refusal(200))


@pytest.mark.parametrize("lengths", [[], [5], [0, 1 << 40, 3], [1] * frame.MAX_BUFFERS])
def test_buffer_lengths_reads_what_a_head_announces(lengths: List[int]) -> None:
    head = frame.build_head(frame.REQUEST, bytes(8), bytes(16), 1, 2, 0, lengths)
    assert frame.buffer_lengths(head) == lengths
    assert frame.buffer_lengths(bytearray(head) + bytes(frame.MAC_BYTES) + b"body") == lengths


def test_buffer_lengths_refuses_what_it_cannot_tell() -> None:
    head = frame.build_head(frame.REQUEST, bytes(8), bytes(16), 1, 2, 0, [4, 4])
    for bad in (None, "head", memoryview(head), head[:frame._FIXED.size - 1], b""):
        with pytest.raises(frame.FrameError, match=_exactly("not a frame's head")):
            frame.buffer_lengths(bad)
    too_many = frame.build_head(frame.REQUEST, bytes(8), bytes(16), 1, 2, 0,
                                [0] * (frame.MAX_BUFFERS + 1))
    for bad in (head[:-1], head[:frame._FIXED.size], too_many):
        with pytest.raises(frame.FrameError,
                           match=_exactly("a frame's head too short for its buffer count")):
            frame.buffer_lengths(bad)


def _head(kind: int = frame.REQUEST, n: int = 0, body_len: int = 0, version: int = 2,
          magic: bytes = b"MoEa") -> bytes:
    """A header up to the MAC, as a sender (honest or not) writes it."""
    return struct.pack("<4sBBBB8s16sQQ8sII", magic, version, kind, 0, 0, bytes(8), bytes(16), 1,
                       2, bytes(8), body_len, n)


def test_build_head_lays_out_the_documented_fields() -> None:
    head = frame.build_head(frame.REPLY, b"k" * 8, b"s" * 16, 3, 4, 5, [6, 7], flags=2,
                            boot=b"b" * 8)
    assert head == (b"MoEa\x02\x02\x00\x02" + b"k" * 8 + b"s" * 16
                    + struct.pack("<QQ", 3, 4) + b"b" * 8 + struct.pack("<II", 5, 2)
                    + struct.pack("<QQ", 6, 7))
    assert frame.build_head(frame.REFUSAL, bytes(8), bytes(16), 0, 0, 0, [], code=9)[4:8] == \
        b"\x02\x03\x09\x00"
    header = frame.parse(frame.Frame(head + bytes(frame.MAC_BYTES) + b"12345",
                                     [b"x" * 6, b"y" * 7]))
    assert (header.boot, header.encrypted, header.bound, header.body_start) == \
        (b"b" * 8, True, False, 64 + 16 + 16)


SEALED = _head(n=1, body_len=3) + struct.pack("<Q", 2) + bytes(frame.MAC_BYTES) + b"abc"


@pytest.mark.parametrize("head, buffers, message", [
    (memoryview(SEALED), [b"xy"], "a frame's head must be bytes, got memoryview"),
    (SEALED[:63], [b"xy"], "a frame of 63 bytes is shorter than a header"),
    (_head(), [], "a frame's head is 64 bytes, its header says 80"),
    (_head(magic=b"MoEb") + bytes(16), [], "not a moe_autograd message (bad magic)"),
    (_head(version=1) + bytes(16), [], "message version 1, this side speaks 2"),
    (_head(kind=4) + bytes(16), [], "unknown message kind 4"),
    (_head(n=frame.MAX_BUFFERS + 1), [], "a message of 65537 buffers and a 0-byte body is past "
                                         "the limits (65536 buffers, 67108864 bytes)"),
    (_head(body_len=frame.MAX_BODY_BYTES + 1), [], "a message of 0 buffers and a 67108865-byte "
                                                   "body is past the limits (65536 buffers, "
                                                   "67108864 bytes)"),
    (_head(n=frame.MAX_BUFFERS), [], "a frame's head is 64 bytes, its header says 524368"),
    (_head(body_len=frame.MAX_BODY_BYTES), [], "a frame's head is 64 bytes, its header says "
                                               "67108944"),
    (SEALED, [], "the header announces 1 buffers, 0 arrived"),
    (SEALED, None, "the header announces 1 buffers, ? arrived"),
    (SEALED, iter([b"xy"]), "the header announces 1 buffers, ? arrived"),
    (SEALED, [b"xyz"], "buffer 0 has 3 bytes, the header says 2"),
    (SEALED, [memoryview(b"xyzw")[::2]], "buffer 0 is not a byte buffer (memoryview: a buffer is "
                                         "not contiguous)"),
])
def test_parse_names_what_is_wrong_with_a_frame(head: Any, buffers: Any, message: str) -> None:
    with pytest.raises(frame.FrameError, match=_exactly(message)):
        frame.parse(frame.Frame(head, buffers))


def test_parse_names_a_buffer_that_is_no_byte_buffer() -> None:
    with pytest.raises(frame.FrameError, match=r"^buffer 0 is not a byte buffer \(object: "):
        frame.parse(frame.Frame(SEALED, [object()]))
    header = frame.parse(frame.Frame(SEALED, [b"xy"]))
    assert (header.body_start, header.body_len, header.lengths) == (88, 3, [2])


@pytest.mark.parametrize("buffer, data", [
    (b"ab", b"ab"), (bytearray(b"ab"), b"ab"), (memoryview(b"abcd")[1:3], b"bc"),
    (torch.tensor([1, 255], dtype=torch.uint8), b"\x01\xff"),
    (torch.tensor([-1, 2], dtype=torch.int8), b"\xff\x02"),
    (torch.ones(2, requires_grad=True), struct.pack("<ff", 1, 1)),
    (torch.arange(6, dtype=torch.uint8).reshape(2, 3), bytes(range(6))),
    (torch.ones(2, 2, dtype=torch.float64).numpy(), struct.pack("<4d", 1, 1, 1, 1)),
])
def test_buffer_view_is_the_flat_bytes_of_any_buffer(buffer: Any, data: bytes) -> None:
    view = frame.buffer_view(buffer)
    assert (view.format, view.ndim, len(view), view.tobytes()) == ("B", 1, len(data), data)


def test_a_non_contiguous_buffer_is_refused() -> None:
    with pytest.raises(frame.FrameError, match=_exactly("a buffer is not contiguous")):
        frame.buffer_view(memoryview(b"abcd")[::2])


# -- encoding and decoding at the edges ---------------------------------------------------------
def test_tensors_of_no_dimensions_and_of_max_dims_travel() -> None:
    value = [torch.tensor(2.5), torch.ones((1,) * wire.MAX_DIMS),
             torch.randn((2,) + (1,) * 30 + (3,)).transpose(0, 31)]
    assert same(roundtrip(value), value)
    with pytest.raises(WireTypeError, match=_exactly(
            f"a tensor of {wire.MAX_DIMS + 1} dimensions cannot travel (at most {wire.MAX_DIMS})")):
        encode(torch.ones((1,) * (wire.MAX_DIMS + 1)))


@pytest.mark.parametrize("bad, message", [
    (object(), "a builtins.object cannot travel: messages carry tensors, numbers, strings, bytes, "
               "bools, None and lists, tuples and str-keyed dicts of them"),
    (Fraction(1, 3), "a fractions.Fraction cannot travel: messages carry tensors, numbers, "
                     "strings, bytes, bools, None and lists, tuples and str-keyed dicts of them"),
    (torch.ones(2, dtype=torch.float8_e4m3fn),
     "a tensor of dtype torch.float8_e4m3fn cannot travel; the wire carries "
     + str(sorted(wire.DTYPES))),
    (torch.ones(2).to_sparse(), "a torch.sparse_coo tensor cannot travel: only dense (strided) "
                                "tensors"),
    ("\ud800", "cannot encode the message: 'utf-8' codec can't encode character '\\ud800' in "
               "position 0: surrogates not allowed"),
])
def test_encode_names_what_cannot_travel(bad: Any, message: str) -> None:
    with pytest.raises(WireTypeError, match=_exactly(message)):
        encode([bad])


def test_a_tensor_without_data_cannot_travel() -> None:
    """A meta tensor (shapes only) is refused like every other value that
    cannot travel, not with the NotImplementedError of copying it out."""
    meta = torch.ones(3, 2, device="meta")
    with pytest.raises(WireTypeError, match=_exactly("argument 0[1] is a meta tensor: it has no "
                                                     "data to send")):
        wire.check_value([1, meta], "argument 0")
    for value in (meta, Compressed(meta, "fp16"), Compressed(meta, "int8")):
        with pytest.raises(WireTypeError, match=_exactly("a meta tensor cannot travel: it has "
                                                         "no data to send")):
            encode([value])


def test_empty_tensors_keep_their_dtype_and_allocate_nothing() -> None:
    for dtype in (torch.int64, torch.float64, torch.bool):
        out = roundtrip(torch.empty(0, 3, dtype=dtype))
        assert out.dtype == dtype and out.shape == (0, 3) and out.untyped_storage().nbytes() == 0
    # any strides span nothing when there are no elements
    out = decode(_message([ref(0, dtype=torch.int32, shape=(3, 0), strides=(7, 5))]), [b""])
    assert out[0].shape == (3, 0) and out[0].dtype == torch.int32


def test_a_buffer_is_viewed_in_place_where_aligned_and_copied_where_not() -> None:
    storage = torch.arange(16, dtype=torch.uint8)
    aligned = decode(_message([ref(0)]), [storage[4:8]])[0]
    assert aligned.data_ptr() == storage[4:8].data_ptr()  # no copy
    misaligned = decode(_message([ref(0)]), [storage[5:9]])[0]
    assert torch.equal(misaligned.view(torch.uint8), storage[5:9])
    assert misaligned.data_ptr() != storage[5:9].data_ptr()


@pytest.mark.parametrize("buffer", [
    torch.zeros(1, dtype=torch.float32), torch.zeros(2, 2, dtype=torch.uint8),
    torch.zeros(8, dtype=torch.uint8)[::2], torch.zeros(4, dtype=torch.uint8).as_subclass(_Sub)])
def test_a_buffer_tensor_must_be_flat_bytes(buffer: torch.Tensor) -> None:
    with pytest.raises(WireError, match=_exactly("a buffer tensor must be a contiguous 1-D uint8 "
                                                 "CPU tensor")):
        decode(_message([ref(0)]), [buffer])


def test_the_largest_element_count_and_sizes_are_the_limits() -> None:
    big = decode(_message([ref(0, shape=(1 << 24, 1 << 24), strides=(0, 0))]), [bytes(4)])[0]
    assert big.numel() == wire.MAX_ELEMENTS
    for shape, strides in (((1 << 48,), (0,)), ((1,), (1 << 48,))):
        with pytest.raises(WireError, match=_exactly("tensor 0: a size or stride past 2**48")):
            decode(_message([ref(0, shape=shape, strides=strides)]), [bytes(4)])
    with pytest.raises(WireError, match=_exactly(
            "compressed tensor 0: a fp16 payload of 2 bytes for 281474976710656 elements "
            "(expected 562949953421312)")):
        decode(_message([packed(0, shape=(1 << 24, 1 << 24))]), [HALF])


@pytest.mark.parametrize("items, buffers, message", [
    ([msgpack.ExtType(1, bytes(6))], [], "a tensor descriptor shorter than its header"),
    ([ref(5, shape=(2,), strides=(1,), ndim=3)], [], "tensor 5: a malformed descriptor"),
    ([ref(1)], [bytes(4)], "a tensor of buffer 1, of 1"),
    ([ref(0, dtype=len(wire.DTYPES))], [bytes(4)], "tensor 0: a malformed descriptor"),
    ([packed(0, dtype=len(wire.DTYPES))], [HALF], "compressed tensor 0: a malformed descriptor"),
    ([INT8[0], ref(1)], list(INT8[1:]), "buffer 1 claimed by a tensor and as scales"),
    ([ref(0)], [bytes(4), bytes(4)], "2 buffers arrived for 1 tensors"),
    ([INT8[0]], list(INT8[1:]) + [b"", b""], "4 buffers arrived for 1 tensors and 1 scales"),
    ([msgpack.ExtType(2, msgpack.packb(5))], [], "a tuple must hold an array"),
])
def test_decode_names_what_does_not_add_up(items: List[Any], buffers: List[Any],
                                           message: str) -> None:
    with pytest.raises(WireError, match=_exactly(message)):
        decode(_message(items), buffers)


def test_a_body_with_bytes_left_over_is_malformed() -> None:
    with pytest.raises(WireError, match=r"^malformed message body: ExtraData: "):
        decode(_message(1) + b"\x01", [])


def test_tuples_nest_to_max_depth_and_keep_their_items() -> None:
    def nest(levels: int) -> Any:
        value: Any = ("s", b"b")
        for _ in range(levels - 1):
            value = (value,)
        return value

    value = [(), (("x",),), nest(wire.MAX_DEPTH)]  # siblings first: the depth is given back
    assert same(roundtrip(value), value)
    with pytest.raises(WireError, match=_exactly(f"tuples nested more than {wire.MAX_DEPTH} deep")):
        roundtrip([(), (("x",),), nest(wire.MAX_DEPTH + 1)])
    inner = msgpack.packb([{1: 2}])  # in a tuple as anywhere: map keys are str
    with pytest.raises(WireError, match=r"^malformed message body: ValueError: "):
        decode(_message(msgpack.ExtType(2, inner)), [])


# -- limits before work (issue 45, item 4): wire.Limits -----------------------------------------
def test_limits_for_a_budget_bound_the_body_by_a_share_of_it() -> None:
    assert wire.Limits.for_budget(None) == wire.Limits()
    assert wire.Limits() == wire.Limits(None, frame.MAX_BODY_BYTES, wire.FREE_CONTAINERS,
                                        wire.MAX_DEPTH + 16)
    mib = 1 << 20
    for budget, body in ((16 * mib, mib), (256 * mib, 8 * mib), (1 << 40, frame.MAX_BODY_BYTES)):
        limits = wire.Limits.for_budget(budget)
        assert (limits.tensor_bytes, limits.body_bytes) == (budget, body)
        assert budget * wire.BODY_AMPLIFICATION // wire.BODY_SHARE <= budget  # objects fit it


def test_a_body_past_its_bound_is_refused_before_it_is_read() -> None:
    junk = b"\xc1" * 101  # never valid msgpack: reading it would say "malformed"
    with pytest.raises(wire.TooLarge, match=_exactly(
            "a body of 101 bytes, more than the 100 bytes this request's body may take")):
        decode(junk, [], wire.Limits(body_bytes=100))
    with pytest.raises(WireError, match="^malformed message body"):
        decode(junk[:100], [], wire.Limits(body_bytes=100))


@pytest.mark.parametrize("empty", [b"\x80", b"\x90", msgpack.packb(msgpack.ExtType(2, b"\x90"))])
def test_containers_are_bounded_by_the_bodys_length(empty: bytes) -> None:
    """Empty maps, lists or tuples (70 bytes and more in memory each, one or a
    few on the wire): at most FREE_CONTAINERS, and one per
    BODY_BYTES_PER_CONTAINER bytes of body beyond them."""
    def body(k: int) -> bytes:
        return b"\xdc" + struct.pack(">H", k) + empty * k

    def fits(k: int) -> bool:
        return k + 1 <= wire.FREE_CONTAINERS + len(body(k)) // wire.BODY_BYTES_PER_CONTAINER

    most = max(k for k in range(1000, 1 << 16) if fits(k))
    assert len(decode(body(most), [])) == most
    limit = wire.FREE_CONTAINERS + len(body(most + 1)) // wire.BODY_BYTES_PER_CONTAINER
    with pytest.raises(wire.TooLarge, match=_exactly(
            f"a body holding more than {limit} lists, tuples and dicts (at most "
            f"{wire.FREE_CONTAINERS} and one per {wire.BODY_BYTES_PER_CONTAINER} bytes of "
            "body)")):
        decode(body(most + 1), [])


@pytest.mark.parametrize("container", ["list", "dict", "tuple", "mixed"])
def test_nesting_of_every_container_is_bounded(container: str) -> None:
    """A value check_value lets through (MAX_DEPTH containers) in the deepest
    message around it decodes; past MAX_BODY_DEPTH, whatever the kinds, the
    body is refused (lists 1,000 deep included: msgpack's own stack is 1,024)."""
    def nest(levels: int) -> Any:
        value: Any = torch.ones(1)
        for k in range(levels):
            kind = container if container != "mixed" else ("list", "dict", "tuple")[k % 3]
            value = {"k": value} if kind == "dict" else [value] if kind == "list" else (value,)
        return value

    deepest = {"op": "batch", "jobs": [{"args": [nest(wire.MAX_DEPTH)]}]}
    wire.check_value(deepest["jobs"][0]["args"][0], "x")  # type: ignore[index]
    assert same(roundtrip(deepest), deepest)
    if container != "tuple":  # (tuples stop at MAX_DEPTH themselves)
        assert same(roundtrip(nest(wire.MAX_BODY_DEPTH)), nest(wire.MAX_BODY_DEPTH))
        with pytest.raises(wire.TooLarge, match=_exactly(
                f"lists, tuples and dicts nested more than {wire.MAX_BODY_DEPTH} deep")):
            roundtrip(nest(wire.MAX_BODY_DEPTH + 1))
    with pytest.raises(wire.TooLarge, match="nested more than"):
        decode(b"\x91" * 1000 + b"\xc0", [])


def test_compressed_sizes_are_admitted_before_any_is_decoded(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """Their decoded bytes (numel * element_size, 8 per int8 payload byte
    for float64), all together, against Limits.tensor_bytes: refused before
    the first is decoded (decompress is never called)."""
    a, b = torch.randn(1000, dtype=torch.float64), torch.randn(10, 100, dtype=torch.float64)
    body, buffers = encode([Compressed(a, "int8"), torch.ones(3), Compressed(b, "int8")])
    assert sum(t.numel() for t in buffers) < 2500  # 16,000 bytes once decoded
    with monkeypatch.context() as patch:
        patch.setattr(cz, "decompress", lambda *a: pytest.fail("decoded before admitted"))
        with pytest.raises(wire.TooLarge, match=_exactly(
                "compressed tensor 3 (torch.float64, shape [10, 100]) takes 8000 bytes once "
                "decoded; with the 8000 bytes of the compressed tensors before it, more than "
                "the 15999 bytes this request may declare")):
            decode(body, buffers, wire.Limits(tensor_bytes=15999))
    out = decode(body, buffers, wire.Limits(tensor_bytes=16000))
    assert same(out, roundtrip([Compressed(a, "int8"), torch.ones(3), Compressed(b, "int8")]))
    assert out[0].dtype == torch.float64 and out[2].shape == (10, 100)
    # malformed lengths are named before the limit is (nothing of them read either)
    with pytest.raises(WireError, match=_exactly(
            "compressed tensor 0: a fp16 payload of 2 bytes for 281474976710656 elements "
            "(expected 562949953421312)")):
        decode(_message([packed(0, shape=(1 << 24, 1 << 24))]), [HALF], wire.Limits(tensor_bytes=1))


def test_measured_body_amplification_is_within_its_constant() -> None:
    """BODY_AMPLIFICATION is what msgpack's objects take per body byte at
    most within the limits: two-character strings (3 bytes each on the
    wire), the worst of the leaves, and empty containers at their bound."""
    import sys as _sys

    strings = [chr(65 + k % 26) + chr(97 + k // 26 % 26) for k in range(3000)]
    body = _message(strings)
    taken = _sys.getsizeof(strings) + sum(_sys.getsizeof(s) for s in strings)
    assert taken / len(body) <= wire.BODY_AMPLIFICATION
    per_container = _sys.getsizeof({}) + 16  # (and its GC header)
    assert per_container / wire.BODY_BYTES_PER_CONTAINER + 8 <= wire.BODY_AMPLIFICATION
