"""Wire compression (:mod:`moe_autograd.remote.compression`): the codecs'
error bounds under adversarial inputs (each Rule of the module's docstring
named by the test that checks it), a wire that refuses malformed payloads
(counted as refusals), and compressed calls on both engines: outputs and
gradients equal, bit for bit, to the same module run locally on what the
codec delivers, in both directions and both passes."""
import math
import struct
from typing import Any, Iterator, List, Tuple

import pytest
import torch
from torch import nn

import remote_experts as rx
from moe_autograd import parallel_apply
from moe_autograd.remote import Compression, ExpertServer, FleetExpert, RemoteAuthError, \
    RemoteExpert, security_stats
from moe_autograd.remote import endpoint, wire
from moe_autograd.remote.auth import Caller, session_for
from moe_autograd.remote.channel import Opened
from moe_autograd.remote.compression import BLOCK, CODECS, Compressed, compress
from moe_autograd.remote.frame import Frame
from wiring import SECRET, Backend

pytestmark = pytest.mark.timeout(60)
ME = "compression-unit"


def round_trip(t: torch.Tensor, codec: str) -> torch.Tensor:
    """What arrives for ``t`` sent under ``codec``."""
    body, buffers = wire.encode([Compressed(t, codec)])
    return wire.decode(body, [b.clone() for b in buffers])[0]


def wire_bytes(value: Any) -> int:
    return sum(b.numel() for b in wire.encode(value)[1])


def adversarial(dtype: torch.dtype, low: int, high: int, n: int = 4099) -> torch.Tensor:
    """Signed values whose exponents span ``[low, high)``, zeros and the
    extremes of the range, shuffled into blocks of every dynamic range."""
    g = torch.Generator().manual_seed(0)
    exps = torch.empty(n, dtype=torch.float64).uniform_(low, high, generator=g)
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    x = (signs * torch.exp2(exps)).to(dtype)
    x[::97] = 0.0
    return x


# -- Rules 1 and 2: the bounds, what is compressed, non-finite values ---------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp16_relative_bound(dtype: torch.dtype) -> None:
    x = adversarial(dtype, -30, 15)  # below fp16's subnormals up to 32768
    got = round_trip(x, "fp16")
    assert got.dtype == dtype and got.shape == x.shape
    err = (got - x).abs().double()
    r = 1.0 if dtype == torch.float32 else 1 + 2.0 ** -12  # float64: rounded through float32
    bound = torch.maximum(x.abs().double() * 2.0 ** -11 * r, torch.full_like(err, 2.0 ** -25))
    assert bool((err <= bound).all()), float((err / bound).max())
    assert wire_bytes([Compressed(x, "fp16")]) == 2 * x.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bf16_relative_bound(dtype: torch.dtype) -> None:
    x = adversarial(dtype, -140, 127)  # fp32's subnormals up to near its max
    got = round_trip(x, "bf16")
    err = (got - x).abs().double()
    r = 1.0 if dtype == torch.float32 else 1 + 2.0 ** -15
    bound = torch.maximum(x.abs().double() * 2.0 ** -8 * r, torch.full_like(err, 2.0 ** -134))
    assert bool((err <= bound).all()), float((err / bound).max())


def _int8_bound(x: torch.Tensor) -> torch.Tensor:
    """absmax of each element's block (logical order) / 254 * (1 + 2**-14) + 2**-140."""
    flat = x.double().reshape(-1)
    n = flat.numel()
    pad = torch.zeros((-n) % BLOCK, dtype=torch.float64)
    absmax = torch.cat([flat.abs(), pad]).view(-1, BLOCK).amax(1)
    return absmax.repeat_interleave(BLOCK)[:n] / 254 * (1 + 2.0 ** -14) + 2.0 ** -140


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int8_blockwise_bound_with_huge_dynamic_range(dtype: torch.dtype) -> None:
    x = adversarial(dtype, -140, 120)  # blocks mixing 1e-42 and 1e36: the bound is per block
    x[:BLOCK] = 0.0                      # a block of zeros: scale 0, arrives as zeros
    x[BLOCK:2 * BLOCK] = 1e-44           # a block of subnormals
    x[2 * BLOCK:3 * BLOCK] = torch.linspace(-1, 1, BLOCK, dtype=dtype)  # round-half cases
    got = round_trip(x, "int8")
    assert got.dtype == dtype and x.numel() % BLOCK  # (a partial last block)
    err = (got.double() - x.double()).abs().reshape(-1)
    bound = _int8_bound(x)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(got[:BLOCK], x[:BLOCK])
    n = x.numel()
    assert wire_bytes([Compressed(x, "int8")]) == n + 4 * math.ceil(n / BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int8_bound_holds_at_rounding_midpoints_and_on_transposed_tensors(
        dtype: torch.dtype) -> None:
    """(issue 46) Values next to the quantisation's midpoints, where the
    float32 roundings of ``s``, ``x / s`` and ``q * s`` add up (measured up to
    1.0000258 of ``absmax / 254`` for float64: past the old ``1 + 2**-16``),
    stay within the stated ``1 + 2**-14``; and the blocks are formed in
    logical order: a transposed tensor's bound is its ``reshape(-1)``'s."""
    g = torch.Generator().manual_seed(5)
    worst = 0.0
    for _ in range(10):
        a = 1.0 + float(torch.rand(1, generator=g, dtype=torch.float64))
        q = torch.randint(-126, 126, (BLOCK * 500,), generator=g).double()
        jitter = (torch.rand(q.shape, generator=g, dtype=torch.float64) - 0.5) * 1e-5
        x = (q + 0.5 + jitter) * (a / 127)
        x.view(-1, BLOCK)[:, 0] = a
        x = x.to(dtype)
        err = (round_trip(x, "int8").double() - x.double()).abs()
        assert bool((err <= _int8_bound(x)).all())
        worst = max(worst, float((err / (_int8_bound(x) - 2.0 ** -140) * (1 + 2.0 ** -14)).max()))
    assert worst > 1.0  # (the midpoints were reached: the plain half step is exceeded)
    t = torch.randn(BLOCK, 3, generator=g, dtype=dtype) * torch.logspace(0, 6, 3, dtype=dtype)
    xt = t.t()  # not contiguous: its blocks are rows of the transposed view
    err = (round_trip(xt, "int8").double() - xt.double()).abs().reshape(-1)
    assert bool((err <= _int8_bound(xt.contiguous())).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_of_16_bit_tensors(dtype: torch.dtype) -> None:
    x = torch.randn(3, 100).to(dtype)
    got = round_trip(x, "int8")
    assert got.dtype == dtype
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    err = (got.double() - x.double()).abs().reshape(-1)
    assert bool((err <= _int8_bound(x) + x.double().abs().reshape(-1) * rounding).all())


@pytest.mark.parametrize("codec", CODECS)
def test_rule1_other_dtypes_travel_raw(codec: str) -> None:
    values = [torch.arange(10), torch.tensor([True, False]), torch.randn(4, dtype=torch.complex64),
              torch.empty(0, 3)]
    if codec != "int8":
        values += [torch.randn(5).half(), torch.randn(5).bfloat16()]
    for t in values:
        got = round_trip(t, codec)
        assert got.dtype == t.dtype and torch.equal(got, t), (codec, t.dtype)
        assert wire_bytes([Compressed(t, codec)]) == t.numel() * t.element_size()


@pytest.mark.parametrize("codec", CODECS)
def test_rule2_non_finite_values_arrive_as_sent(codec: str) -> None:
    x = torch.randn(300)
    x[[3, 77, 200]] = torch.tensor([math.inf, -math.inf, math.nan])
    got = round_trip(x, codec)
    assert torch.equal(torch.isnan(got), torch.isnan(x))
    assert torch.equal(torch.isinf(got) & (got > 0), torch.isinf(x) & (x > 0))
    assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(x) & (x < 0))
    if codec == "int8":  # the whole tensor travelled raw
        assert torch.equal(got.nan_to_num(), x.nan_to_num())


def test_rule2_fp16_overflow_travels_raw() -> None:
    x = torch.tensor([1.0, 65504.0, 65519.0])  # all within fp16 after rounding
    assert compress(x, "fp16") is not None
    y = torch.tensor([1.0, 65520.0, -1e6])  # would arrive as inf: raw instead
    assert compress(y, "fp16") is None
    assert torch.equal(round_trip(y, "fp16"), y)
    z = torch.tensor([1.0, 1e300], dtype=torch.float64)
    assert compress(z, "bf16") is None and torch.equal(round_trip(z, "bf16"), z)


def test_rule4_deterministic_and_shared() -> None:
    x = torch.randn(70, 9)
    for codec in CODECS:
        a, b = wire.encode([Compressed(x, codec)]), wire.encode([Compressed(x, codec)])
        assert a[0] == b[0] and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))
    one = Compressed(x, "int8")
    got = wire.decode(*wire.encode([one, one, x]))
    assert got[0] is got[1] and torch.equal(got[2], x)  # used twice: travels once


def test_compression_spellings() -> None:
    assert RemoteExpert("w", "e", compression=Compression.INT8).compression == "int8"
    assert RemoteExpert("w", "e", compression="BF16").compression == "bf16"
    assert RemoteExpert("w", "e", compression="none").compression is None
    with pytest.raises(ValueError, match="compression of RemoteExpert 'e'"):
        RemoteExpert("w", "e", compression="zstd")
    with pytest.raises(TypeError, match="compression"):
        RemoteExpert("w", "e", compression=8)  # type: ignore[arg-type]


# -- Rule 3: malformed payloads are refused -------------------------------------------
def _packed(codec: str, n: int = 130) -> Tuple[bytes, List[torch.Tensor]]:
    body, buffers = wire.encode([Compressed(torch.randn(n), codec)])
    return body, [b.clone() for b in buffers]


def _patch_descriptor(body: bytes, offset: int, fmt: str, value: int) -> bytes:
    """``body`` with a field of its (only) compressed descriptor replaced."""
    start = body.index(b"\xc7\x18\x03") + 3  # msgpack ext 8: 24 bytes (1-D) of type 3
    out = bytearray(body)
    struct.pack_into(fmt, out, start + offset, value)
    return bytes(out)


def _negative_scale(body: bytes, buffers: List[torch.Tensor]) -> Any:
    buffers[1].view(torch.float32)[0] = -1.0
    return body, buffers


def _inf_scale(body: bytes, buffers: List[torch.Tensor]) -> Any:
    buffers[1].view(torch.float32)[1] = math.inf
    return body, buffers


def _minus_128(body: bytes, buffers: List[torch.Tensor]) -> Any:
    buffers[0].view(torch.int8)[5] = -128
    return body, buffers


MALFORMED = {
    "short payload": (lambda b, bs: (b, [bs[0][:-1], bs[1]]), "payload of 129 bytes"),
    "short scales": (lambda b, bs: (b, [bs[0], bs[1][:-4]]), "bytes of scales"),
    "negative scale": (_negative_scale, "negative or non-finite scale"),
    "inf scale": (_inf_scale, "negative or non-finite scale"),
    "int8 -128": (_minus_128, "-128"),
    "unknown codec": (lambda b, bs: (_patch_descriptor(b, 8, "<B", 9), bs), "unknown codec id 9"),
    "codec for ints": (lambda b, bs: (_patch_descriptor(b, 9, "<B", 9), bs), "does not carry"),
    "block zero": (lambda b, bs: (_patch_descriptor(b, 12, "<I", 0), bs), "block size"),
    "scales claimed twice": (lambda b, bs: (_patch_descriptor(b, 4, "<I", 0), bs), "claimed"),
    "scales missing": (lambda b, bs: (b, bs[:1]), "scales in buffer 1"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_rule3_malformed_payloads_are_refused(case: str) -> None:
    tamper, match = MALFORMED[case]
    body, buffers = tamper(*_packed("int8"))
    with pytest.raises(wire.WireError, match=match):
        wire.decode(body, buffers)


def test_rule3_half_payload_lengths_checked() -> None:
    body, buffers = _packed("bf16")
    with pytest.raises(wire.WireError, match="payload of 258 bytes"):
        wire.decode(body, [buffers[0][:-2]])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [BLOCK, 7])
def test_rule3_int8_decodes_a_chunk_at_a_time_to_the_same_values(
        dtype: torch.dtype, block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An int8 payload decodes through CHUNK float32 elements of scratch (not
    a float32 copy of the whole tensor) to exactly what converting the whole
    float32 product gives, across chunk edges and a partial last block."""
    from moe_autograd.remote import compression as cz

    t = adversarial(dtype, -12, 12, n=1000)
    payload, scales = compress(t, "int8", block)
    assert scales is not None
    q = payload.float()
    whole = torch.cat([q[k:k + block] * scales[k // block] for k in range(0, q.numel(), block)])
    monkeypatch.setattr(cz, "CHUNK", 3 * block + 1)  # 3 blocks a chunk: 1000 is 48 chunks
    out = cz.decompress(cz.CODEC_IDS["int8"], dtype, (1000,), payload.view(torch.uint8),
                        scales.view(torch.uint8), block)
    assert out.dtype == dtype and torch.equal(out, whole.to(dtype))


@pytest.fixture()
def served() -> Iterator[None]:
    server = ExpertServer({"compression_unit_lin": nn.Linear(4, 4)}, secret=SECRET)
    try:
        yield
    finally:
        server.close()


def test_a_server_refuses_and_counts_a_malformed_payload(served: None) -> None:
    x = torch.randn(2, 4)
    message = {"op": "forward", "expert": "compression_unit_lin", "call": "c" * 32, "seed": 1,
               "grad": False, "flags": [False], "args": [Compressed(x, "int8")],
               "compression": "int8"}
    body, buffers = wire.encode(message)
    buffers = [b.clone() for b in buffers]
    buffers[1].view(torch.float32)[0] = math.nan
    before = security_stats()["refused"].get("malformed", 0)
    frame, seq = session_for(SECRET).seal(ME, body, buffers, "forward")
    reply = endpoint.serve(frame, ME)
    out_body, out_buffers = session_for(SECRET).open_reply(ME, seq, reply)
    status, text = wire.decode(out_body, out_buffers)["reply"]
    assert status == "error" and "non-finite scale" in text, text
    assert security_stats()["refused"].get("malformed", 0) == before + 1
    # the same request, well formed, runs; the server answers in int8
    body, buffers = wire.encode(message)
    frame, seq = session_for(SECRET).seal(ME, body, buffers, "forward")
    reply = endpoint.serve(frame, ME)
    assert len(reply.buffers) == 2  # the output's payload and scales
    out_body, out_buffers = session_for(SECRET).open_reply(ME, seq, Frame(reply.head,
                                                                          reply.buffers))
    status, value = wire.decode(out_body, out_buffers)["reply"]
    assert status == "ok" and value[0][0].shape == (2, 4)


class _Arrived:
    """A pending request whose reply has arrived: ``frame``."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame

    def done(self) -> bool:
        return True

    def result(self, timeout: Any) -> Frame:
        return self.frame


def test_a_client_rejects_and_counts_a_malformed_reply() -> None:
    session = session_for(SECRET)
    _, seq = session.seal(ME, *wire.encode({"op": "info"}))
    body, buffers = wire.encode({"reply": ["ok", [Compressed(torch.randn(100), "int8")]],
                                 "refused": 0})
    buffers = [b.clone() for b in buffers]
    buffers[0].view(torch.int8)[0] = -128
    reply = endpoint.gate().seal_reply(SECRET, Caller(SECRET.key_id, session.id, seq), ME,
                                       body, buffers)
    before = security_stats()["rejected_replies"].get(ME, 0)
    with pytest.raises(RemoteAuthError, match="unreadable reply: compressed tensor 0: .*-128"):
        Opened(_Arrived(reply), ME, seq, session).result(1.0)  # type: ignore[arg-type]
    assert security_stats()["rejected_replies"].get(ME, 0) == before + 1


# -- both engines: compressed calls equal the local module on what the codec delivers ---------
def _local_copy(expert: RemoteExpert, module: nn.Module) -> nn.Module:
    module.load_state_dict(expert.remote_state_dict())
    return module


def _expected(module: nn.Module, x: torch.Tensor, g: torch.Tensor, codec: str
              ) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """Output, input gradient and parameter gradients the server computes on
    compressed ``x`` and ``g``, each as it arrives back."""
    xc = round_trip(x, codec).requires_grad_()
    out = module(xc)
    out.backward(round_trip(g, codec))
    assert xc.grad is not None
    return (round_trip(out.detach(), codec), round_trip(xc.grad, codec),
            [p.grad for p in module.parameters() if p.grad is not None])


class _CountingTransport:
    """The backend's transport, adding up the request buffers' bytes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.sent = inner, 0
        self.name = getattr(inner, "name", "counting")

    def call(self, worker: str, frame: Any, timeout: Any) -> Any:
        self.sent += sum(memoryview(b).nbytes if not isinstance(b, torch.Tensor) else b.numel()
                         for b in frame.buffers)
        return self.inner.call(worker, frame, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("prefix", ["", "sf_"])
def test_compressed_call_both_directions(backend: Backend, codec: str, prefix: str) -> None:
    transport = _CountingTransport(backend.transport)
    expert = backend.expert("srv-a", prefix + "lin", compression=codec, transport=transport)
    local = _local_copy(expert, nn.Linear(rx.WIDTH, rx.WIDTH))
    expert.zero_grad()
    x = torch.randn(5, rx.WIDTH, requires_grad=True)
    g = torch.randn(5, rx.WIDTH) * 1e3
    out = expert(x)
    out.backward(g)
    want_out, want_dx, want_params = _expected(local, x.detach(), g, codec)
    assert torch.equal(out.detach(), want_out)
    assert x.grad is not None and torch.equal(x.grad, want_dx)
    remote = expert.remote_grads()
    for (name, _), want in zip(local.named_parameters(), want_params):
        got = remote[name]
        assert got is not None and torch.equal(got, want), name
    raw = x.numel() * 4
    assert transport.sent < (2 if prefix else 3) * raw  # x (twice if stateless) and g, compressed


def test_coalesced_calls_and_fleet_expert_compress(backend: Backend) -> None:
    class OneServer:  # the least a FleetExpert needs of a fleet
        transport, secret, compression = backend.transport, None, "bf16"

        def replicas(self, expert: str) -> List[str]:
            return ["srv-b"]

        def refresh_on_miss(self) -> None: ...

        def servers(self) -> Any:
            return {"srv-b": ("lin",)}

        def suspect(self, worker: str, why: str = "") -> None: ...

        def _served(self, worker: str) -> None: ...

    fleet_expert = FleetExpert(OneServer(), "lin")  # type: ignore[arg-type]
    assert fleet_expert.compression == "bf16"
    assert FleetExpert(OneServer(), "lin", compression="none").compression is None  # type: ignore[arg-type]
    direct = backend.expert("srv-a", "lin", compression="int8")
    experts: List[nn.Module] = [direct, fleet_expert]
    locals_ = [_local_copy(direct, nn.Linear(rx.WIDTH, rx.WIDTH)),
               _local_copy(backend.expert("srv-b", "lin"), nn.Linear(rx.WIDTH, rx.WIDTH))]
    for e in (direct, backend.expert("srv-b", "lin")):
        e.zero_grad()
    xs = [torch.randn(3, rx.WIDTH, requires_grad=True) for _ in experts]
    g = torch.randn(3, rx.WIDTH)
    outs = parallel_apply(experts, xs)  # the srv-a call travels in one coalesced request
    sum((o * g).sum() for o in outs).backward()
    for x, out, local, codec in zip(xs, outs, locals_, ("int8", "bf16")):
        want_out, want_dx, _ = _expected(local, x.detach(), g, codec)
        assert torch.equal(out.detach(), want_out), codec
        assert x.grad is not None and torch.equal(x.grad, want_dx), codec
