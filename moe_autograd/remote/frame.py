"""A message as the engines carry it: a fixed header, a body, raw buffers.

Why a module of its own: every message our code sends or receives (requests,
replies, collects, releases, control messages, a fleet's challenges) has ONE
shape, whatever the engine (torch RPC, Ray) and whatever it says. The shape
is bytes and buffers, never objects: nothing here or above it unpickles
what arrived. This module knows the layout only; :mod:`.auth` seals and
opens it, :mod:`.wire` writes and reads the body and buffers.

Layout of :attr:`Frame.head` (little-endian)::

    offset    size  field
    --------  ----  -----------------------------------------------------------
    0         4     magic ``b"MoEa"``
    4         1     version (2)
    5         1     kind: 1 request, 2 reply, 3 refusal
    6         1     code: why a refusal refused (0 otherwise)
    7         1     flags: 1 = bound (a request whose MAC covers the server
                    process's boot id too, :mod:`.auth`); 2 = encrypted (the
                    body and the buffers are AES-256-GCM ciphertext, and the
                    MAC field is the GCM tag); 0 otherwise
    8         8     key id: which job secret sealed it (:class:`~.auth.JobSecret`)
    16        16    session: the requesting client's session (a reply echoes it)
    32        8     seq: the request's number in its session (a reply echoes it)
    40        8     sent: the sender's wall clock, ms since the epoch
    48        8     boot: in a reply, the boot id of the server process that
                    sealed it (its share of the reply's keys, :mod:`.auth`);
                    zero in a request and a refusal
    56        4     body length
    60        4     n, the number of buffers
    64        8 n   each buffer's length in bytes
    64 + 8 n  16    MAC: Poly1305 with a one-time key (plain), or the AES-256-GCM
                    tag (encrypted), over all of the above, the body, the buffers
    80 + 8 n  ...   the body (msgpack, :mod:`.wire`; its ciphertext if encrypted)

The MAC field is 16 bytes, the tag of both Poly1305 and GCM (version 1 had
32, HMAC-SHA256's). An encrypted message's lengths are its plaintext's (GCM
is a stream mode: ciphertext and plaintext have one length).

A refusal is the header alone (no body, no buffers, a zero MAC): a server that
cannot authenticate a request has nothing it may say with the job's key.

Invariants:

* :func:`parse` reads a header without trusting it: every length is checked
  against the bytes that actually arrived, and against :data:`MAX_BODY_BYTES`
  and :data:`MAX_BUFFERS`, before anything else reads the frame.
* ``Frame.label`` is local only (it never travels): what the message is, for
  diagnostics and fault injection (``"forward"``, ``"backward"``, ...).
"""
import struct
from dataclasses import dataclass, field
from typing import Any, List, Sequence

__all__ = ["Frame", "Header", "FrameError", "parse", "buffer_lengths", "build_head", "refusal", "buffer_view",
           "MAGIC", "VERSION", "REQUEST", "REPLY", "REFUSAL", "MAC_BYTES", "MAX_BUFFERS",
           "MAX_BODY_BYTES", "KEY_ID_BYTES", "SESSION_BYTES", "BOOT_BYTES", "BOUND", "ENCRYPTED"]

MAGIC = b"MoEa"
VERSION = 2
REQUEST, REPLY, REFUSAL = 1, 2, 3
BOUND = 1  # header flags (see the layout)
ENCRYPTED = 2
KEY_ID_BYTES = 8
SESSION_BYTES = 16
BOOT_BYTES = 8
MAC_BYTES = 16
MAX_BUFFERS = 1 << 16          # tensors one message may carry
MAX_BODY_BYTES = 64 << 20      # the body (schema values, not tensor data)
_FIXED = struct.Struct("<4sBBBB8s16sQQ8sII")  # up to and including the buffer count
_LENGTH = struct.Struct("<Q")


class FrameError(ValueError):
    """A frame's header is malformed (lengths, magic, version)."""


@dataclass
class Frame:
    """One message: ``head`` (header, MAC and body, see the module
    docstring) and ``buffers``, the raw bytes of its tensors (``bytes``,
    ``memoryview``, a 1-D uint8 CPU tensor or NumPy array, as an engine
    carries them)."""

    head: bytes
    buffers: Sequence[Any] = field(default_factory=list)
    label: str = ""


@dataclass(frozen=True)
class Header:
    """A parsed header (see the module docstring)."""

    kind: int
    code: int
    key_id: bytes
    session: bytes
    seq: int
    sent_ms: int
    body_start: int
    body_len: int
    lengths: List[int]
    views: List[memoryview]  # the buffers' bytes (checked against ``lengths``)
    flags: int = 0
    boot: bytes = bytes(BOOT_BYTES)  # a reply's: the boot id of the process that sealed it

    @property
    def bound(self) -> bool:
        """A request bound to the boot id of the server process it was sealed for."""
        return bool(self.flags & BOUND)

    @property
    def encrypted(self) -> bool:
        """The body and buffers are ciphertext (the job encrypts, :mod:`.auth`)."""
        return bool(self.flags & ENCRYPTED)

    @property
    def mac_start(self) -> int:
        return self.body_start - MAC_BYTES


def buffer_view(buffer: Any) -> memoryview:
    """The bytes of one buffer, without a copy."""
    if isinstance(buffer, (bytes, bytearray, memoryview)):
        view = memoryview(buffer)
    elif hasattr(buffer, "numpy") and hasattr(buffer, "dtype"):  # a torch tensor
        view = memoryview(buffer.numpy() if not buffer.requires_grad
                          else buffer.detach().numpy())
    else:
        view = memoryview(buffer)  # a NumPy array, or anything with the buffer protocol
    if not view.contiguous:
        raise FrameError("a buffer is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def build_head(kind: int, key_id: bytes, session: bytes, seq: int, sent_ms: int,
               body_len: int, lengths: Sequence[int], code: int = 0, flags: int = 0,
               boot: bytes = bytes(BOOT_BYTES)) -> bytes:
    """The header up to (not including) the MAC."""
    fixed = _FIXED.pack(MAGIC, VERSION, kind, code, flags, key_id, session, seq, sent_ms, boot,
                        body_len, len(lengths))
    return fixed + struct.pack(f"<{len(lengths)}Q", *lengths) if lengths else fixed


def refusal(code: int) -> Frame:
    """The frame a server answers a request it refused with."""
    head = build_head(REFUSAL, bytes(KEY_ID_BYTES), bytes(SESSION_BYTES), 0, 0, 0, [], code)
    return Frame(head + bytes(MAC_BYTES), [], "refusal")


def buffer_lengths(head: Any) -> List[int]:
    """The buffer lengths a header announces (for an engine that carries the
    buffers as one blob); raises :class:`FrameError` if it cannot tell."""
    if not isinstance(head, (bytes, bytearray)) or len(head) < _FIXED.size:
        raise FrameError("not a frame's head")
    n = _FIXED.unpack_from(head)[-1]
    if n > MAX_BUFFERS or len(head) < _FIXED.size + _LENGTH.size * n:
        raise FrameError("a frame's head too short for its buffer count")
    return list(struct.unpack_from(f"<{n}Q", head, _FIXED.size))


def parse(frame: Frame) -> Header:
    """The header of ``frame``, every length checked against what arrived
    (raises :class:`FrameError`)."""
    head = frame.head
    if not isinstance(head, (bytes, bytearray)):
        raise FrameError(f"a frame's head must be bytes, got {type(head).__name__}")
    if len(head) < _FIXED.size:
        raise FrameError(f"a frame of {len(head)} bytes is shorter than a header")
    magic, version, kind, code, flags, key_id, session, seq, sent_ms, boot, body_len, n = \
        _FIXED.unpack_from(head)
    if magic != MAGIC:
        raise FrameError("not a moe_autograd message (bad magic)")
    if version != VERSION:
        raise FrameError(f"message version {version}, this side speaks {VERSION}")
    if kind not in (REQUEST, REPLY, REFUSAL):
        raise FrameError(f"unknown message kind {kind}")
    if flags & ~(BOUND | ENCRYPTED):
        raise FrameError(f"unknown flags {flags:#x}")
    if n > MAX_BUFFERS or body_len > MAX_BODY_BYTES:
        raise FrameError(f"a message of {n} buffers and a {body_len}-byte body is past the "
                         f"limits ({MAX_BUFFERS} buffers, {MAX_BODY_BYTES} bytes)")
    body_start = _FIXED.size + _LENGTH.size * n + MAC_BYTES
    if len(head) != body_start + body_len:
        raise FrameError(f"a frame's head is {len(head)} bytes, its header says "
                         f"{body_start + body_len}")
    buffers = frame.buffers
    if not isinstance(buffers, (list, tuple)) or len(buffers) != n:
        raise FrameError(f"the header announces {n} buffers, "
                         f"{len(buffers) if isinstance(buffers, (list, tuple)) else '?'} arrived")
    lengths = list(struct.unpack_from(f"<{n}Q", head, _FIXED.size))
    views = []
    for k, (length, buffer) in enumerate(zip(lengths, buffers)):
        try:
            view = buffer_view(buffer)
        except Exception as error:  # noqa: BLE001 - whatever an engine handed over
            raise FrameError(f"buffer {k} is not a byte buffer ({type(buffer).__name__}: "
                             f"{error})") from error
        if view.nbytes != length:
            raise FrameError(f"buffer {k} has {view.nbytes} bytes, the header says {length}")
        views.append(view)
    return Header(kind, code, key_id, session, seq, sent_ms, body_start, body_len, lengths, views,
                  flags, boot)
