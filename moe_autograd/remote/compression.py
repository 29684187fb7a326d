"""Wire compression of floating tensors: ``fp16``, ``bf16``, ``int8`` (blockwise).

Why: over a real link the bytes of activations and gradients, not the
messages, set a remote call's time (a 4,096 x 4,096 fp32 activation is 64 MiB:
half a second each way on 1 Gb/s). A codec trades precision for bytes where
the caller opts in (``RemoteExpert(..., compression="int8")``, a fleet's
``compression=``); the server answers in the codec the request names, so
both directions and both passes (activations out, outputs back, gradients
both ways) shrink. This module is the codec alone: tensors in, a payload and
its scales out, and back; it imports nothing of the package. :mod:`.wire`
carries a compressed tensor as a descriptor (codec id, dtype, shape, block
size) and one or two raw buffers (the payload, the scales): plain fields of
the frame, never an object.

Codecs (``x'`` is what arrives for ``x``; the bounds hold per element)::

    codec  applies to                    payload    bound on |x - x'|
    -----  ----------------------------  ---------  -----------------------------------------
    fp16   float32, float64              2 B/elem   <= max(2**-11 |x| r, 2**-25)  (round to
                                                    nearest even; 2**-25: fp16's subnormals;
                                                    r = 1 from float32, 1 + 2**-12 from
                                                    float64, rounded through float32)
    bf16   float32, float64              2 B/elem   <= max(2**-8 |x| r, 2**-134)  (r = 1 from
                                                    float32, 1 + 2**-15 from float64)
    int8   float16, bfloat16, float32,   1 B/elem   <= absmax(block) / 254 * (1 + 2**-14)
           float64                       + 4 B per     + 2**-140, where block is the BLOCK
                                         block         (64) consecutive elements x belongs
                                                       to in logical (row-major) order, the
                                                       order of t.reshape(-1), whatever t's
                                                       strides; plus the rounding of x's own
                                                       dtype for 16-bit tensors

Where the bounds come from (issue 46 measured the old ones exceeded by tiny
margins): float64 goes to a 16-bit format through float32, so it is rounded
twice (2**-24 |x| more, hence ``r``); int8 computes ``s``, ``x / s`` and ``q * s``
in float32, three roundings of 2**-24 relative each, on top of the
quantisation's half step (with float64 input, one more, converting ``x`` to
float32): at most ``(1 + 763 * 2**-24)``, stated as ``1 + 2**-14``. Measured
worst (``tests/remote/test_compression.py``'s midpoint cases): 1.0000169 for
float32, 1.0000258 for float64.

int8 is symmetric absmax quantisation: per block ``s = absmax / 127`` (a
float32), ``q = round(x / s)`` in ``[-127, 127]``, ``x' = q * s``; a block of
zeros has ``s = 0`` and arrives as zeros.

Rules (tested, ``tests/remote/test_compression.py``):

* Rule 1 (what is compressed): floating tensors of the dtypes in the table,
  with at least one element. Integer, bool and complex tensors, and the
  others (a float16 tensor under ``fp16``), travel raw, bit for bit.
* Rule 2 (non-finite values): a value arrives non-finite exactly when it
  was. ``fp16`` and ``bf16`` carry ``inf`` and ``nan`` themselves; a tensor
  with a *finite* value the 16-bit format cannot hold (``|x| >= 65520`` for
  fp16, beyond ~3.4e38 for bf16 from float64) travels raw rather than arrive
  as ``inf``. An ``int8`` tensor with any ``inf`` or ``nan`` travels raw (a
  block's scale would be lost). So a server's ``non_finite_grads`` policy sees
  what the client sent.
* Rule 3 (decoding): a payload is accepted only if its lengths match its
  descriptor (``numel * 2`` or ``numel`` bytes; ``ceil(numel / block) * 4``
  bytes of scales), the codec carries its dtype, the block size is in
  ``[1, MAX_BLOCK]``, every scale is finite and ``>= 0`` and no ``int8`` is
  -128 (never produced); anything else raises :class:`CompressionError`
  (a :class:`ValueError`); :func:`check` checks the lengths alone, before
  anything is read or allocated. A decoded tensor is contiguous, in the dtype
  the sender had, and takes at most 8 times its payload's bytes (int8 to
  float64); decoding allocates nothing else but :data:`CHUNK` float32
  elements of scratch (int8 to a dtype other than float32, a chunk at a time:
  the same values as converting the whole), so a receiver that admitted the
  decoded size (``numel * element_size``, :mod:`.wire`) admitted what it
  takes.
* Rule 4 (determinism): the same tensor encodes to the same bytes, so a
  stateless server's recomputation in backward sees exactly the inputs its
  forward saw.
"""
import enum
import math
from typing import Dict, Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = ["Compression", "Compressed", "CompressionError", "CODECS", "CODEC_IDS", "BLOCK",
           "MAX_BLOCK", "CHUNK", "resolve", "applies", "compress", "check", "decompress",
           "payload_itemsize"]


class Compression(str, enum.Enum):
    """The codecs a remote call may use (``compression=`` takes these or
    their strings; ``None`` or ``"none"``: raw)."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"

    def __str__(self) -> str:
        return self.value


CODECS = ("fp16", "bf16", "int8")
#: The codec ids of the wire (a descriptor's codec byte).
CODEC_IDS: Dict[str, int] = {"fp16": 1, "bf16": 2, "int8": 3}
_BY_ID = {code: name for name, code in CODEC_IDS.items()}
BLOCK = 64          # elements per int8 block (one float32 scale each: 6.25 % more bytes)
MAX_BLOCK = 1 << 16
CHUNK = 1 << 20     # float32 elements of scratch an int8 decode to another dtype uses
_WIDE = (torch.float32, torch.float64)
_APPLIES: Dict[str, Tuple[torch.dtype, ...]] = {
    "fp16": _WIDE, "bf16": _WIDE,
    "int8": (torch.float16, torch.bfloat16) + _WIDE}
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CompressionError(ValueError):
    """A compressed payload that does not match its descriptor (Rule 3)."""


def resolve(value: Union[None, str, Compression], where: str) -> Optional[str]:
    """``value`` as a codec name, or ``None`` for raw; raises ``ValueError``
    (``TypeError``) naming ``where`` for anything else."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{where} must be None or one of {('none',) + CODECS}, got "
                        f"{type(value).__name__}")
    name = str(value.value if isinstance(value, Compression) else value).lower()
    if name == "none":
        return None
    if name not in CODECS:
        raise ValueError(f"{where} must be None or one of {('none',) + CODECS}, got {value!r}")
    return name


class Compressed:
    """A tensor that should travel under ``codec`` (what :func:`moe_autograd.remote.wire.encode`
    turns into a compressed descriptor; it arrives as a plain tensor)."""

    __slots__ = ("tensor", "codec")

    def __init__(self, tensor: Tensor, codec: str) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; one of {CODECS}")
        self.tensor, self.codec = tensor, codec

    def __repr__(self) -> str:
        return f"Compressed({self.codec}, {tuple(self.tensor.shape)}, {self.tensor.dtype})"


def applies(dtype: torch.dtype, codec: str) -> bool:
    """Whether ``codec`` compresses tensors of ``dtype`` (Rule 1)."""
    return dtype in _APPLIES[codec]


def payload_itemsize(codec: str) -> int:
    """Payload bytes per element."""
    return 1 if codec == "int8" else 2


def _blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def compress(t: Tensor, codec: str, block: int = BLOCK) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """``(payload, scales)`` of ``t`` (a CPU tensor; ``scales`` float32, or
    ``None`` for fp16/bf16), or ``None`` where ``t`` travels raw (Rules 1, 2)."""
    if not applies(t.dtype, codec) or t.numel() == 0:
        return None
    flat = t.detach().reshape(-1)
    if codec in _HALF:
        half = flat.to(_HALF[codec])
        if bool(torch.isinf(half).any()) and not torch.equal(torch.isinf(half), torch.isinf(flat)):
            return None  # a finite value beyond the format's range: raw, not inf (Rule 2)
        return half, None
    x = flat.float()
    n = x.numel()
    full = (n // block) * block
    parts = []
    if full:
        parts.append(x[:full].view(-1, block).abs().amax(dim=1))
    if full < n:
        parts.append(x[full:].abs().amax().reshape(1))
    absmax = parts[0] if len(parts) == 1 else torch.cat(parts)
    if not bool(torch.isfinite(absmax).all()):
        return None  # inf or nan in the tensor: raw (Rule 2)
    scales = absmax / 127.0
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.empty(n, dtype=torch.int8)
    if full:
        q[:full].view(-1, block).copy_(
            torch.round(x[:full].view(-1, block) / divisor[:full // block, None])
            .clamp_(-127, 127))
    if full < n:
        q[full:].copy_(torch.round(x[full:] / divisor[-1]).clamp_(-127, 127))
    return q, scales


def check(codec_id: int, dtype: torch.dtype, shape: Tuple[int, ...], payload_bytes: int,
          scales_bytes: Optional[int], block: int) -> str:
    """The codec of a compressed descriptor whose buffers have ``payload_bytes``
    and ``scales_bytes`` (``None``: no scales buffer), checked against its
    descriptor (Rule 3's lengths, from the lengths alone: nothing is read or
    allocated); raises :class:`CompressionError` where they do not match."""
    codec = _BY_ID.get(codec_id)
    if codec is None:
        raise CompressionError(f"unknown codec id {codec_id}")
    if not applies(dtype, codec):
        raise CompressionError(f"codec {codec} does not carry {dtype} tensors")
    n = math.prod(shape)
    if payload_bytes != n * payload_itemsize(codec):
        raise CompressionError(f"a {codec} payload of {payload_bytes} bytes for {n} elements "
                               f"(expected {n * payload_itemsize(codec)})")
    if codec in _HALF:
        if scales_bytes is not None or block != 0:
            raise CompressionError(f"a {codec} tensor carries no scales and no block size")
        return codec
    if scales_bytes is None or not 1 <= block <= MAX_BLOCK:
        raise CompressionError(f"an int8 tensor needs scales and a block size in [1, "
                               f"{MAX_BLOCK}], got block {block}")
    nblocks = _blocks(n, block)
    if scales_bytes != nblocks * 4:
        raise CompressionError(f"{scales_bytes} bytes of scales for {nblocks} blocks of "
                               f"{block} (expected {nblocks * 4})")
    return codec


def decompress(codec_id: int, dtype: torch.dtype, shape: Tuple[int, ...], payload: Tensor,
               scales: Optional[Tensor], block: int) -> Tensor:
    """The tensor a compressed descriptor stands for: ``payload`` and
    ``scales`` are the raw bytes (1-D uint8 CPU tensors) of its buffers.
    Raises :class:`CompressionError` where they do not match (Rule 3).
    Allocates the result and, for an int8 payload of another dtype than
    float32, at most :data:`CHUNK` float32 elements of scratch (Rule 3)."""
    codec = check(codec_id, dtype, shape, payload.numel(),
                  None if scales is None else scales.numel(), block)
    n = math.prod(shape)
    if codec in _HALF:
        return _typed(payload, _HALF[codec]).to(dtype).view(shape)
    assert scales is not None  # (check: an int8 tensor has scales)
    s = _typed(scales, torch.float32)
    if s.numel() and not (bool(torch.isfinite(s).all()) and bool((s >= 0).all())):
        raise CompressionError("an int8 tensor with a negative or non-finite scale")
    q = _typed(payload, torch.int8)
    if n and int(q.min()) == -128:  # (a reduction: no tensor of n booleans)
        raise CompressionError("an int8 payload holding -128 (values are in [-127, 127])")
    out = torch.empty(n, dtype=dtype)
    if dtype == torch.float32:
        _int8_into(out, q, s, block)
        return out.view(shape)
    step = max(1, CHUNK // block) * block  # whole blocks per chunk
    scratch = torch.empty(min(n, step), dtype=torch.float32)
    for start in range(0, n, step):
        stop = min(n, start + step)
        part = scratch[:stop - start]
        _int8_into(part, q[start:stop], s[start // block:_blocks(stop, block)], block)
        out[start:stop].copy_(part)  # the same rounding as a whole tensor's .to(dtype)
    return out.view(shape)


def _int8_into(out: Tensor, q: Tensor, s: Tensor, block: int) -> None:
    """``out`` (float32) = ``q`` (int8, starting at a block) times its blocks' scales ``s``."""
    n = q.numel()
    full = (n // block) * block
    if full:
        torch.mul(q[:full].view(-1, block), s[:full // block, None], out=out[:full].view(-1, block))
    if full < n:
        torch.mul(q[full:], s[-1], out=out[full:])


def _typed(raw: Tensor, dtype: torch.dtype) -> Tensor:
    """``raw`` (1-D uint8) viewed as ``dtype`` (copied when misaligned)."""
    if raw.numel() == 0:
        return torch.empty(0, dtype=dtype)
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)
