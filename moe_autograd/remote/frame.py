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
    64 + 8 n  16    MAC: GMAC under the session's MAC key (plain), or the AES-256-GCM
                    tag (encrypted), over all of the above, the body, the buffers
    80 + 8 n  ...   the body (msgpack, :mod:`.wire`; its ciphertext if encrypted)

The MAC field is 16 bytes, the tag of GMAC and of GCM (version 1 had
32, HMAC-SHA256's). An encrypted message's lengths are its plaintext's (GCM
is a stream mode: ciphertext and plaintext have one length).

A refusal is the header alone (no body, no buffers, a zero MAC): a server that
cannot authenticate a request has nothing it may say with the job's key.

Invariants:

* :func:`parse` reads a header without trusting it: every length is checked
  against the bytes that actually arrived, and against :data:`MAX_BODY_BYTES`
  and :data:`MAX_BUFFERS`, before anything else reads the frame.
* ``Frame.label`` is local only (it never travels): what the message is, for
  diagnostics and fault injection (``"forward"``, ``"backward"``, ...); so is
  ``Frame.owned`` (the receiver's own buffers, which an encrypted message is
  decrypted into, :mod:`.auth`).
"""
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ["Frame", "Header", "FrameError", "parse", "buffer_lengths", "build_head", "refusal", "buffer_view",
           "plain_tensors",
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
_Tensor = torch.Tensor
_uint8 = torch.uint8


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
    #: The buffers are the receiver's own (an engine set it on a frame it
    #: built from bytes it received, never shared with a sender or kept by
    #: anyone else): an encrypted frame's buffers may then be decrypted in
    #: place (:mod:`.auth`), and hold the plaintext, or garbage if the tag
    #: failed, once opened. Local only, like ``label``.
    owned: bool = False


class Header:
    """A parsed header (see the module docstring); read-only by convention
    (a slotted class, not a frozen dataclass: :func:`parse` makes one per
    message, and a frozen dataclass's ``__init__`` costs a microsecond per
    three fields)."""

    __slots__ = ("kind", "code", "key_id", "session", "seq", "sent_ms", "body_start",
                 "body_len", "lengths", "_views", "flags", "boot", "tensors")

    def __init__(self, kind: int, code: int, key_id: bytes, session: bytes, seq: int,
                 sent_ms: int, body_start: int, body_len: int, lengths: List[int],
                 views: Optional[List[memoryview]], flags: int = 0,
                 boot: bytes = bytes(BOOT_BYTES), tensors: Optional[Sequence[Any]] = None
                 ) -> None:
        self.kind, self.code, self.key_id, self.session = kind, code, key_id, session
        self.seq, self.sent_ms, self.body_start, self.body_len = seq, sent_ms, body_start, body_len
        self.lengths = lengths  # each buffer's length
        self._views = views
        self.flags = flags
        self.boot = boot  # a reply's: the boot id of the process that sealed it
        #: The buffers, where every one is a plain 1-D uint8 CPU tensor
        #: (:func:`plain_tensors`; their views are then made when asked for).
        self.tensors = tensors

    @property
    def views(self) -> List[memoryview]:
        """The buffers' bytes (checked against ``lengths``)."""
        if self._views is None:
            self._views = [memoryview(t.numpy()) for t in self.tensors or ()]
        return self._views

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

    def __repr__(self) -> str:
        return (f"Header(kind={self.kind}, code={self.code}, key_id={self.key_id.hex()}, "
                f"session={self.session.hex()}, seq={self.seq}, sent_ms={self.sent_ms}, "
                f"body_len={self.body_len}, lengths={list(self.lengths)}, flags={self.flags})")


def plain_tensors(buffers: Sequence[Any]) -> Optional[List[int]]:
    """The lengths of ``buffers`` if every one is a plain 1-D contiguous
    uint8 CPU tensor (what the codec makes, what torch RPC delivers), else
    ``None``: their bytes are then one ``numpy()`` each, without a
    :func:`buffer_view` each."""
    lengths = []
    for buffer in buffers:
        if type(buffer) is not _Tensor or buffer.dtype is not _uint8 or buffer.dim() != 1 \
                or not buffer.is_cpu or not buffer.is_contiguous():
            return None
        lengths.append(buffer.numel())
    return lengths


def buffer_view(buffer: Any) -> memoryview:
    """The bytes of one buffer, without a copy."""
    if type(buffer) is _Tensor:  # (the common case first: the codec's 1-D uint8 tensors)
        view = memoryview(buffer.numpy() if not buffer.requires_grad  # type: ignore[arg-type]
                          else buffer.detach().numpy())
    elif isinstance(buffer, (bytes, bytearray, memoryview)):
        view = memoryview(buffer)
    elif hasattr(buffer, "numpy") and hasattr(buffer, "dtype"):  # a torch tensor (subclass)
        view = memoryview(buffer.numpy() if not buffer.requires_grad
                          else buffer.detach().numpy())
    else:
        view = memoryview(buffer)  # a NumPy array, or anything with the buffer protocol
    if view.ndim == 1 and view.format == "B":
        if view.c_contiguous:
            return view
        raise FrameError("a buffer is not contiguous")
    if not view.contiguous:
        raise FrameError("a buffer is not contiguous")
    return view.cast("B")


def _lengths_struct(n: int) -> struct.Struct:
    """The ``n`` buffer lengths' format (made once per count)."""
    found = _LENGTHS.get(n)
    if found is None:
        found = struct.Struct(f"<{n}Q")
        if len(_LENGTHS) < 1024:
            _LENGTHS[n] = found
    return found


def _head_struct(n: int) -> struct.Struct:
    """The header up to the MAC with ``n`` (at most :data:`_PACKED_HEADS`)
    buffers, in one format (made once per count)."""
    found = _HEADS.get(n)
    if found is None:
        found = _HEADS[n] = struct.Struct(_FIXED.format + "Q" * n)
    return found


_PACKED_HEADS = 256  # buffer counts up to this have a header format of their own
_LENGTHS: Dict[int, struct.Struct] = {}
_HEADS: Dict[int, struct.Struct] = {}


def build_head(kind: int, key_id: bytes, session: bytes, seq: int, sent_ms: int,
               body_len: int, lengths: Sequence[int], code: int = 0, flags: int = 0,
               boot: bytes = bytes(BOOT_BYTES)) -> bytes:
    """The header up to (not including) the MAC."""
    n = len(lengths)
    if n <= _PACKED_HEADS:
        return _head_struct(n).pack(MAGIC, VERSION, kind, code, flags, key_id, session, seq,
                                    sent_ms, boot, body_len, n, *lengths)
    return _FIXED.pack(MAGIC, VERSION, kind, code, flags, key_id, session, seq, sent_ms, boot,
                       body_len, n) + _lengths_struct(n).pack(*lengths)


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
    return list(_lengths_struct(n).unpack_from(head, _FIXED.size))


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
    lengths = list(_lengths_struct(n).unpack_from(head, _FIXED.size)) if n else []
    found = plain_tensors(buffers)
    if found is not None:  # (torch RPC's, the codec's: no view made until one is asked for)
        for k, length in enumerate(found):
            if length != lengths[k]:
                raise FrameError(f"buffer {k} has {length} bytes, the header says {lengths[k]}")
        return Header(kind, code, key_id, session, seq, sent_ms, body_start, body_len, lengths,
                      None, flags, boot, buffers)
    views = []
    k = 0
    for buffer in buffers:
        try:
            view = buffer_view(buffer)
        except Exception as error:  # noqa: BLE001 - whatever an engine handed over
            raise FrameError(f"buffer {k} is not a byte buffer ({type(buffer).__name__}: "
                             f"{error})") from error
        if view.nbytes != lengths[k]:
            raise FrameError(f"buffer {k} has {view.nbytes} bytes, the header says {lengths[k]}")
        views.append(view)
        k += 1
    return Header(kind, code, key_id, session, seq, sent_ms, body_start, body_len, lengths, views,
                  flags, boot)
