"""Who may talk to an expert server: job secrets, sealed messages, no replays.

Why: a server runs what its messages ask for, so it must know who asks. A
*job* (a trainer and the servers it admits) shares a secret; every request
and every reply is sealed with it (GMAC over the header, the body and
every tensor buffer, under a key per session and a nonce per message; or, for a job that
encrypts, AES-256-GCM: the body and buffers encrypted, the header
authenticated with them), and a message that fails is dropped before its
body is decoded, counted and logged. The engines' own layers come below this and are
trusted as their documentation says (see the README's "Security": torch RPC
trusts every member of its world, Ray every holder of its cluster token).

Pieces:

* :class:`JobSecret`: 32 random bytes, and whether its job encrypts
  (``encrypt``: ``JobSecret(key, encrypt=True)``, ``generate(encrypt=...)``,
  ``from_file(path, encrypt=...)``, ``MOE_AUTOGRAD_ENCRYPT=1``, ``serve
  --encrypt``); named on the wire by its key id (8 bytes of a hash of the
  key alone, which reveals nothing of it). Made by
  :meth:`JobSecret.generate`, kept in a file only its owner can read
  (:meth:`JobSecret.save`, ``python -m moe_autograd secret``), read back
  with :meth:`JobSecret.from_file` or from the environment
  (``MOE_AUTOGRAD_SECRET_FILE``, or ``MOE_AUTOGRAD_SECRET`` in hex); never
  from a command line. :func:`set_job_secret` sets this process's default.
* :class:`Session`: a client's side. A session is 16 random bytes per
  process and secret; each request carries the next number of its session
  *for its destination*, and the MAC covers the destination's name, so a
  request sealed for one server is refused by every other (and a server
  keeps one window per session and name it serves under).
* :class:`Gate`: a server's side: its job secrets, the replay windows, the
  counters of what it refused.

How a server's gate judges a request (:meth:`Gate.open`), in order::

    step          what must hold                                 refused as
    ------------  ---------------------------------------------  ------------
    header        lengths match what arrived (:mod:`.frame`)     malformed
    kind          a request                                      malformed
    key id        one of this server's job secrets               unknown job
    encryption    the header's flag is the job's ``encrypt``     encryption mismatch
    boot field    zero (a request's)                             malformed
    MAC           GMAC (or GCM's tag) over this server's         bad MAC
                  name (and, for a bound request, this
                  process's boot id), header, body, buffers,
                  under this message's key, equals the one sent
                  (encrypted: the body and buffers decrypted)
    freshness     sent within max_clock_skew of this clock       stale
    replay        (key, session, number) not seen before, and    replay
                  within the last WINDOW numbers of its session
    -> the body may be decoded (:mod:`.wire`)

A reply is sealed with the request's secret, echoes its session and number,
and its MAC covers the server's name: a client accepts it only for the
request it sent, to the server it sent it to (:meth:`Session.open_reply`).

Keys and nonces (issue 47). ``HKDF-SHA256(ikm = the job's key, salt =
session id || boot id, info = "moe_autograd wire keys v2", the direction,
the server's name)`` gives 64 bytes per client session, server name and
direction (:meth:`JobSecret.wire_keys`, cached: per session, not per
message): a MAC key and an encryption key, both AES-256. The two nonces of a session
are the client's session id (16 random bytes per process) and, for
replies, the boot id of the server process, which every reply carries in
its header (a request's boot field is zero: its client may know no boot id
before its first message). A message's 96-bit nonce is its direction and
number (:func:`_nonce`): a session numbers its requests per server, and a
reply echoes its request's number under its server process's own keys, so
no key meets one nonce twice (a request replayed to a restarted process is
answered under that process's keys). Plain: GMAC (NIST SP 800-38D:
AES-256-GCM with nothing to encrypt) under the MAC key and that nonce, with
the label, the header, the body and each buffer as associated data
(:func:`_mac_tag`: a small message in one call, a large one part by part,
no copy). GMAC, not Poly1305 with one-time keys (issue 47's other option):
measured here, with AES-NI, 21.8 GB/s against 12.6 (HMAC-SHA256: 1.5).
Encrypted: one AES-256-GCM message
per frame under the AES key and that nonce, the label and header its
associated data, the body then each buffer its plaintext (each buffer's
ciphertext in a new buffer of its length), the 16-byte tag in the MAC
field. The receiver decrypts into new buffers (or, for a frame whose
buffers are its own, :attr:`~.frame.Frame.owned`, as torch RPC's engine
hands them over, into those buffers: :func:`_decrypt_in_place`) and lets
nothing of them out before the tag verified. Large ciphertext and plaintext
buffers are of huge pages (:func:`_cipher_buffer`). A message whose encryption flag is not its job's
is refused (``encryption mismatch``, a reply rejected), so an encrypting
job's client never has its plaintext taken. :meth:`JobSecret.mac` (fleet
records, :meth:`JobSecret.sign`; durable snapshots' checksums) stays
HMAC-SHA256: not per message, and small or written once.

Invariants:

* Nothing of a request but its header is read before its MAC verifies, and
  the comparison is constant-time (:func:`hmac.compare_digest`, GCM's
  ``finalize``).
* Every refusal is counted (:func:`security_stats`) and logged as a WARNING
  on ``moe_autograd.remote.auth``, at most one line per reason every
  :data:`LOG_EVERY_S` seconds (with the count of those not logged).
* A session forgotten by a server (idle for more than ``max_clock_skew``)
  cannot be replayed: all its messages are stale by then. The windows are
  bounded: at :data:`MAX_SESSIONS` per gate the least recently used go
  first (so one client that opens sessions without end evicts its own idle
  ones, and never locks other clients out), and a *floor* rises to the
  newest request an evicted window accepted: a request of a session the
  gate keeps no window for must be newer than the floor (by the client's
  clock), so no evicted session's request can be replayed either.
* A *bound* request (header flag, covered by the MAC) names the boot id of
  the server process it was sealed for (8 random bytes per process, fork
  included): a client binds its requests to a server once a record signed
  with the job's secret told it the boot id (a fleet's server record, a Ray
  actor's identity: :func:`bind_boot`), so a request captured before a
  server restarted is refused by the new process ("bad MAC"), whatever the
  clocks say. A client whose bound request is refused as "bad MAC" forgets
  the boot id (:func:`unbind_boot`) until a record binds it again.
* The floor starts at the gate's start (the server process's): a request
  sent before a server (re)started opens no window there, so requests
  captured before a restart cannot be replayed to the new process. Known
  limit, for unbound requests only (a static world's, or before a client
  was told the boot id): the comparison is of the client's clock with the
  server's, so requests captured within the clocks' actual difference
  before the restart (milliseconds with NTP; at most ``max_clock_skew``)
  still can, once; and
  a client whose clock is behind the server's has its first requests to a
  just-restarted server refused as stale for that difference.
* A forked child gets sessions of its own (never its parent's numbers).
"""
import binascii
import hashlib
import hmac
import logging
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .frame import (BOUND, ENCRYPTED, KEY_ID_BYTES, MAC_BYTES, REFUSAL, REPLY, REQUEST,
                    SESSION_BYTES, Frame, FrameError, Header, buffer_view, build_head, parse,
                    plain_tensors,
                    refusal)

__all__ = ["JobSecret", "Session", "Gate", "Caller", "Refused", "ReplyRejected",
           "MissingSecretError", "set_job_secret", "job_secret", "resolve_secret", "session_for",
           "security_stats", "note_peer_refusals", "refusal_frame", "refuse", "REASONS",
           "secret_for", "bind_boot", "unbind_boot", "boot_of", "BOOT_BYTES", "ENV_SECRET", "ENV_SECRET_FILE",
           "ENV_ENCRYPT", "encrypt_from_env",
           "WINDOW", "MAX_SESSIONS", "DEFAULT_MAX_CLOCK_SKEW_S", "LOG_EVERY_S"]

ENV_SECRET_FILE = "MOE_AUTOGRAD_SECRET_FILE"
ENV_SECRET = "MOE_AUTOGRAD_SECRET"
ENV_ENCRYPT = "MOE_AUTOGRAD_ENCRYPT"  # "1": the environment's secret encrypts (serve --encrypt)
KEY_BYTES = 32
BOOT_BYTES = 8               # a server process's boot id
_NO_BOOT = bytes(BOOT_BYTES)  # a request's boot field (and a reply key's, never: see _seal)
MAX_WIRE_KEYS = 1 << 14       # per-session wire keys one secret caches (see JobSecret.wire_keys)
WINDOW = 4096                 # request numbers a session may arrive out of order by
MAX_SESSIONS = 1 << 16        # client sessions one gate keeps windows for
EVICT_SHARE = 64              # at MAX_SESSIONS, 1/EVICT_SHARE of them (least recent) go
DEFAULT_MAX_CLOCK_SKEW_S = 300.0
LOG_EVERY_S = 10.0
_MASK = (1 << WINDOW) - 1

#: Refusal codes (a refusal frame's ``code``) and their names.
REASONS: Dict[int, str] = {1: "malformed", 2: "unknown job", 3: "bad MAC", 4: "stale",
                           5: "replay", 6: "too many sessions", 7: "not addressed here",
                           8: "not the owner", 9: "name taken", 10: "too large",
                           11: "other run", 12: "expired", 13: "unidentified",
                           14: "encryption mismatch"}
_CODES = {name: code for code, name in REASONS.items()}
_HELP = {
    "unknown job": "the request was sealed with a secret this server does not have (another "
                   "job's, or none of this server's)",
    "bad MAC": "the request's MAC does not verify: a different secret, a request meant for "
               "another server, or a changed message",
    "stale": "the request is older (or newer) than max_clock_skew: clocks apart, or a replay",
    "replay": "the request's number was seen before (a replay)",
    "too many sessions": "this server tracks too many client sessions",
    "malformed": "the message is not a well-formed request",
    "not addressed here": "the request names another server",
    "not the owner": "the request asks for a call or a batch of another client's session",
    "name taken": "the name is held by a live server of the fleet",
    "too large": "the request's body, or the tensors it declares, is past its job's limits",
    "other run": "a fleet record signed with this job's secret for another run (a copy of "
                 "an earlier run's records)",
    "expired": "a signed fleet record past its expiry",
    "unidentified": "a Ray actor whose name has no identity record signed with the job's "
                    "secret for its actor ID: not called",
    "encryption mismatch": "the request is encrypted and its job is not, or the other way "
                           "round (serve --encrypt, JobSecret(..., encrypt=True): both ends "
                           "of a job must say the same)",
}
_log = logging.getLogger(__name__)


class MissingSecretError(RuntimeError):
    """No job secret was given and none is configured."""


class Refused(Exception):
    """A request a server will not read (see the module docstring's table)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason, self.detail = reason, detail
        self.code = _CODES[reason]
        super().__init__(f"{reason}: {detail or _HELP[reason]}")


class ReplyRejected(Exception):
    """A reply a client will not read (it fails authentication, or answers
    another request)."""


# -- the secret ---------------------------------------------------------------------------
def _nonce(kind: int, seq: int) -> bytes:
    """A message's 96-bit nonce: its direction (kind) and number. Its key is
    per (secret, session, server, direction[, server process]), and a session
    numbers its requests per server, so no key sees one nonce twice."""
    return _NONCE.pack(kind, seq)


_NONCE = struct.Struct("<IQ")


class _WireKeys:
    """One direction's wire keys (:meth:`JobSecret.wire_keys`): the 64
    bytes, the MAC key and its AES-GCM object (made once per session, not
    per message), the encryption key. Two keys, so that no (key, nonce) pair
    is ever used both to authenticate and to encrypt."""

    __slots__ = ("raw", "mac", "gmac", "aes")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.mac = raw[:32]  # GMAC's key (plain messages)
        self.gmac = AESGCM(self.mac)
        self.aes = raw[32:]  # AES-256-GCM's key (encrypted messages)


def encrypt_from_env() -> bool:
    """Whether ``MOE_AUTOGRAD_ENCRYPT`` says the job encrypts (``1``)."""
    return os.environ.get(ENV_ENCRYPT, "").strip().lower() in ("1", "true", "yes")


class JobSecret:
    """A job's shared secret (see the module docstring). ``repr`` shows the
    key id only. ``encrypt``: the job's messages are encrypted (AES-256-GCM),
    not only authenticated; both ends of a job must say the same."""

    __slots__ = ("_key", "key_id", "encrypt", "_inner", "_outer", "_wire", "_wire_lock")

    def __init__(self, key: bytes, encrypt: bool = False) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) < KEY_BYTES:
            raise ValueError(f"a job secret is at least {KEY_BYTES} bytes")
        self._key = bytes(key)
        self.encrypt = bool(encrypt)
        #: (session, server, direction, server boot id) -> its 64 bytes of
        #: wire keys (see :meth:`wire_keys`), oldest first, bounded.
        self._wire: Dict[Tuple[bytes, str, int, bytes], _WireKeys] = {}
        self._wire_lock = threading.Lock()
        self.key_id = hashlib.sha256(b"moe_autograd key id\0" + self._key).digest()[:KEY_ID_BYTES]
        # HMAC-SHA256 (RFC 2104) with its two keyed states made once: a MAC is
        # then two copies and C updates, with no Python frame per part.
        block = self._key if len(self._key) <= 64 else hashlib.sha256(self._key).digest()
        block = block.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    @classmethod
    def generate(cls, encrypt: bool = False) -> "JobSecret":
        """A new random secret."""
        return cls(secrets.token_bytes(KEY_BYTES), encrypt)

    def encrypting(self, encrypt: bool = True) -> "JobSecret":
        """This secret (the same key and key id) with ``encrypt`` set so."""
        return self if self.encrypt == bool(encrypt) else JobSecret(self._key, encrypt)

    @classmethod
    def from_hex(cls, text: str, where: str = "the secret", encrypt: bool = False
                 ) -> "JobSecret":
        try:
            key = binascii.unhexlify(text.strip())
        except (binascii.Error, ValueError) as error:
            raise ValueError(f"{where} must be {2 * KEY_BYTES} or more hex digits") from error
        if len(key) < KEY_BYTES:
            raise ValueError(f"{where} must be {2 * KEY_BYTES} or more hex digits, got "
                             f"{2 * len(key)}")
        return cls(key, encrypt)

    @classmethod
    def from_file(cls, path: Union[str, "os.PathLike[str]"], encrypt: bool = False
                  ) -> "JobSecret":
        """Reads a secret file (hex). Refuses a file that its group or others
        can read or write (``chmod 600`` it), as ssh does with keys. The file
        holds the key only: ``encrypt`` is the job's setting (``serve
        --encrypt``)."""
        path = os.fspath(path)
        try:
            mode = os.stat(path).st_mode
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as error:
            raise MissingSecretError(f"cannot read the job secret file {path!r}: {error}"
                                     ) from error
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(f"the job secret file {path!r} is open to its group or to "
                                  f"others (mode {stat.S_IMODE(mode):o}): run chmod 600 on it")
        # hex is ASCII: a byte outside it makes the file no secret, said as such
        return cls.from_hex(raw.decode("ascii", "replace"), f"the job secret file {path!r}",
                            encrypt)

    @classmethod
    def from_env(cls) -> Optional["JobSecret"]:
        """The secret ``MOE_AUTOGRAD_SECRET_FILE`` names, or
        ``MOE_AUTOGRAD_SECRET`` holds (hex); ``None`` if neither is set. It
        encrypts if ``MOE_AUTOGRAD_ENCRYPT`` is ``1`` (what ``serve
        --encrypt`` sets for the processes it starts)."""
        encrypt = encrypt_from_env()
        path = os.environ.get(ENV_SECRET_FILE)
        if path:
            return cls.from_file(path, encrypt)
        text = os.environ.get(ENV_SECRET)
        if text:
            return cls.from_hex(text, f"${ENV_SECRET}", encrypt)
        return None

    def save(self, path: Union[str, "os.PathLike[str]"]) -> str:
        """Writes the secret (hex) to a new file only its owner can read and
        write; refuses to overwrite one. Returns the path."""
        path = os.fspath(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(self._key.hex() + "\n")
        return path

    def hex(self) -> str:
        """The key in hex, e.g. for ``MOE_AUTOGRAD_SECRET`` in a child's environment."""
        return self._key.hex()

    def wire_keys(self, session: bytes, server: str, kind: int, boot: bytes = _NO_BOOT,
                  keep: bool = True) -> bytes:
        """The 64 bytes of keys of one direction (``kind``: :data:`REQUEST`
        or :data:`REPLY`) of a client ``session`` with the server named
        ``server`` (and, for replies, the server process of boot id
        ``boot``): HKDF-SHA256 (RFC 5869) of the job's key, salt the session
        id and the boot id (both sides' nonces), info the direction and the
        server's name. Bytes 0-32: the GMAC key (plain messages); 32-64: the
        AES-256-GCM key (encrypted ones). Cached (``keep``: the
        gate keeps only those of requests that verified)."""
        return self._wire_keys((session, server, kind, boot), keep).raw

    def _wire_keys(self, index: Tuple[bytes, str, int, bytes], keep: bool) -> "_WireKeys":
        """:meth:`wire_keys` of ``index`` (session, server, direction, boot
        id), with the AEAD its MAC uses made once."""
        found = self._wire.get(index)
        if found is not None:
            return found
        session, server, kind, boot = index
        name = server.encode()
        info = b"moe_autograd wire keys v2\0" + bytes([kind]) + len(name).to_bytes(4, "little") \
            + name
        found = _WireKeys(HKDF(algorithm=hashes.SHA256(), length=64, salt=session + boot,
                               info=info).derive(self._key))
        if keep:
            self.keep_wire_keys(index, found)
        return found

    def keep_wire_keys(self, index: Tuple[bytes, str, int, bytes], keys: "_WireKeys") -> None:
        with self._wire_lock:
            if len(self._wire) >= MAX_WIRE_KEYS:
                del self._wire[next(iter(self._wire))]
            self._wire[index] = keys

    def mac(self, parts: Iterable[Any]) -> bytes:
        """HMAC-SHA256 of the concatenation of ``parts`` (equal to
        ``hmac.new(key, b"".join(parts), "sha256").digest()``): for what is
        not a message (a fleet's records, :meth:`sign`; a durable snapshot's
        checksum, :mod:`.durable`), small or written once, where
        HMAC-SHA256's 1.5 GB/s does not matter. Messages are sealed with
        GMAC or AES-256-GCM (:func:`_seal`)."""
        inner = self._inner.copy()
        for part in parts:
            inner.update(part)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def sign(self, *texts: str) -> str:
        """A hex MAC of ``texts`` (length-prefixed), for records kept outside
        messages (the fleet's registry)."""
        return self.mac(f"{len(t)}:{t}".encode() for t in ("record",) + texts).hex()

    def verify(self, signature: Any, *texts: str) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(signature, self.sign(*texts))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, JobSecret) and hmac.compare_digest(self._key, other._key) \
            and self.encrypt == other.encrypt

    def __hash__(self) -> int:
        return hash(self.key_id)

    def __repr__(self) -> str:
        return f"JobSecret(key_id={self.key_id.hex()}{', encrypt=True' if self.encrypt else ''})"


_default: Optional[JobSecret] = None


def set_job_secret(secret: Optional[JobSecret]) -> Optional[JobSecret]:
    """Sets this process's default secret (``None``: back to the
    environment's); returns the one set before (``None`` if none was), so
    that a caller can put it back."""
    global _default
    if secret is not None and not isinstance(secret, JobSecret):
        raise TypeError(f"set_job_secret expects a JobSecret, got {type(secret).__name__}")
    previous, _default = _default, secret
    return previous


def job_secret() -> JobSecret:
    """The default secret: :func:`set_job_secret`'s, else the environment's;
    raises :class:`MissingSecretError` saying how to make one."""
    if _default is not None:
        return _default
    found = JobSecret.from_env()
    if found is None:
        raise MissingSecretError(
            "no job secret: remote experts authenticate every message with the job's secret. "
            "Create one with 'python -m moe_autograd secret --out job.secret' (mode 600), copy "
            f"it to the trainer and the servers, and set {ENV_SECRET_FILE}=job.secret (or pass "
            "secret=JobSecret.from_file(...), or call moe_autograd.remote.set_job_secret)")
    return found


def resolve_secret(secret: Optional[JobSecret]) -> JobSecret:
    """``secret``, or the default (:func:`job_secret`)."""
    if secret is None:
        return job_secret()
    if not isinstance(secret, JobSecret):
        raise TypeError(f"secret must be a JobSecret, got {type(secret).__name__}")
    return secret


# -- counters and logs --------------------------------------------------------------------
_stats_lock = threading.Lock()
_refused: Dict[str, int] = {}          # a gate's refusals in this process, by reason
_rejected: Dict[str, int] = {}         # replies this process's clients rejected, by worker
_peers: Dict[str, int] = {}            # refusals each server reported in its replies
_logged: Dict[str, Tuple[float, int]] = {}  # reason -> (last logged, not logged since)


def _warn(key: str, message: str) -> None:
    now = time.monotonic()
    with _stats_lock:
        last, held = _logged.get(key, (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            _logged[key] = (last, held + 1)
            return
        _logged[key] = (now, 0)
    more = f" ({held} more like it not logged in the last {LOG_EVERY_S:g} s)" if held else ""
    _log.warning("%s%s", message, more)


def note_peer_refusals(worker: str, total: Any) -> None:
    """A server's reply said it has refused ``total`` requests so far: warns
    (here, in the trainer) when that grew since its last reply."""
    if type(total) is not int or total < 0:
        return
    with _stats_lock:
        before = _peers.get(worker, 0)
        _peers[worker] = total  # a restarted server counts from 0 again
    if total > before:
        _warn(f"peer:{worker}", f"server {worker!r} reports {total} refused request(s) "
              f"({total - before} new): requests without this job's secret, replays, or calls "
              "of another client's session (see the server's log)")


def security_stats() -> Dict[str, Dict[str, int]]:
    """What this process refused or saw refused: ``refused`` (requests its
    servers refused, by reason), ``rejected_replies`` (replies its clients
    rejected, by server) and ``peer_refusals`` (refusals each server called
    here reported, by server)."""
    with _stats_lock:
        return {"refused": dict(_refused), "rejected_replies": dict(_rejected),
                "peer_refusals": {w: n for w, n in _peers.items() if n}}


# -- the client's side --------------------------------------------------------------------
def _now_ms() -> int:
    return int(time.time() * 1000)


def _label(name: str, boot: Optional[bytes]) -> bytes:
    """What a MAC binds a message to: the server's name, and for a bound
    request the boot id of the server process too."""
    return name.encode() if boot is None else name.encode() + b"\0" + boot


def _prefix(label: bytes, head: Any) -> bytes:
    """What a message's MAC (or its GCM associated data) covers before its
    body: the label (length-prefixed) and the header up to the MAC field,
    as one part."""
    return len(label).to_bytes(4, "little") + label + head


def _mac_tag(keys: "_WireKeys", nonce: bytes, parts: Sequence[Any],
             total: Optional[int] = None) -> bytes:
    """GMAC (NIST SP 800-38D: AES-256-GCM with the concatenation of
    ``parts`` as associated data and nothing to encrypt) under the MAC key
    of ``keys`` and ``nonce``. A message of at most :data:`_ONE_CALL_BYTES`
    is joined and tagged in one call; a larger one is fed part by part,
    without a copy (the same tag). ``total``: the parts' length in bytes,
    where the caller knows it."""
    if total is None:
        total = sum(len(p) if isinstance(p, bytes) else memoryview(p).nbytes for p in parts)
    if total <= _ONE_CALL_BYTES:
        return keys.gmac.encrypt(nonce, b"", b"".join(parts))
    encryptor = Cipher(algorithms.AES(keys.mac), modes.GCM(nonce)).encryptor()
    for part in parts:
        encryptor.authenticate_additional_data(part)
    encryptor.finalize()
    return encryptor.tag


_ONE_CALL_BYTES = 1 << 15  # a message this small is joined and tagged in one call (measured:
# a GMAC object and a call per part cost about 4 us more than one call; joining 32 KiB, about
# as much)


def _bytes_of(tensors: Optional[Sequence[Any]], views: Optional[List[memoryview]]
              ) -> List[Any]:
    """What the MAC reads of a message's buffers: ``views``, or, for plain
    1-D uint8 tensors (:func:`~.frame.plain_tensors`), their NumPy arrays
    (one ``numpy()`` each, without a :func:`~.frame.buffer_view`'s checks;
    joining them with one ``torch.cat`` instead was measured slower in a
    training step's pass)."""
    if views is not None:
        return views
    assert tensors is not None
    return [t.numpy() for t in tensors]


def _cipher_buffer(nbytes: int) -> Any:
    """A new 1-D uint8 tensor for ``nbytes`` of GCM output (``update_into``
    may ask for a block more than it writes), as the engines carry buffers.
    One of :data:`_HUGE_BYTES` or more is an anonymous mapping of its own,
    aligned to and advised for huge pages (``MADV_HUGEPAGE``, where the
    kernel has transparent huge pages): GCM writes it at about 9 GB/s, and a
    new buffer of 4 KiB pages cost more than that in page faults (32 MiB:
    about 17 ms of faults against 4 ms of GCM, measured; with huge pages,
    about 3 ms). Private, not shared (shared anonymous memory is shmem, whose
    huge pages are off by default). The mapping lives as long as a tensor or
    view of it does."""
    size = nbytes + 15
    if size < _HUGE_BYTES or _HUGEPAGE is None:
        return torch.empty(size, dtype=torch.uint8)
    mapped = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapped.madvise(_HUGEPAGE)
    except OSError:  # (a kernel without transparent huge pages: 4 KiB pages)
        pass
    array = numpy.frombuffer(mapped, dtype=numpy.uint8)
    start = -array.ctypes.data % _HUGE_PAGE
    return torch.from_numpy(array[start:start + size])


_HUGE_PAGE = 2 << 20
_HUGE_BYTES = 4 << 20  # GCM output this large goes to a buffer of huge pages
_HUGEPAGE: Optional[int] = getattr(mmap, "MADV_HUGEPAGE", None)


def _seal(secret: JobSecret, name: str, kind: int, session: bytes, seq: int, body: bytes,
          buffers: Sequence[Any], boot: Optional[bytes] = None,
          server_boot: bytes = _NO_BOOT) -> Tuple[bytes, List[Any]]:
    """``(head, buffers)`` of a sealed message: a request to ``name`` (bound
    to the server process ``boot`` if given), or a reply of ``name``'s
    process ``server_boot``. Plain: GMAC under this direction's MAC key
    (nonce the message's) over label, header, body and every buffer; the
    buffers travel as given. Encrypted: AES-256-GCM under this direction's wire key, one
    message per frame (nonce the message's), the label and header as
    associated data and the body then every buffer as its plaintext, the
    buffers replaced by their ciphertext."""
    encrypt = secret.encrypt
    found = None if encrypt else plain_tensors(buffers)
    views: Optional[List[memoryview]] = None
    if found is None:
        views = [buffer_view(b) for b in buffers]
        lengths = [v.nbytes for v in views]
    else:
        lengths = found
    flags = (BOUND if boot is not None else 0) | (ENCRYPTED if encrypt else 0)
    head = build_head(kind, secret.key_id, session, seq, _now_ms(), len(body), lengths,
                      flags=flags, boot=server_boot)
    keys = secret._wire_keys((session, name, kind, server_boot), True)
    nonce = _NONCE.pack(kind, seq)
    prefix = _prefix(_label(name, boot), head)
    if not encrypt:
        total = len(prefix) + len(body) + sum(lengths)
        tag = _mac_tag(keys, nonce, [prefix, body, *_bytes_of(buffers, views)], total)
        return head + tag + body, list(buffers)
    encryptor = Cipher(algorithms.AES(keys.aes), modes.GCM(nonce)).encryptor()
    encryptor.authenticate_additional_data(prefix)
    sealed_body = encryptor.update(body)
    out = []
    for view in views or ():
        buffer = _cipher_buffer(view.nbytes)
        written = encryptor.update_into(view, buffer.numpy())
        out.append(buffer[:written])
    sealed_body += encryptor.finalize()
    return head + encryptor.tag + sealed_body, out


def _open(secret: JobSecret, frame: Frame, header: Header, name: str, kind: int,
          boot: Optional[bytes], keep: bool) -> Optional[Tuple[bytes, List[Any]]]:
    """The body and buffers (plaintext) of a message sealed by :func:`_seal`
    for ``name`` (``boot``: the server process a bound request must be
    bound to); ``None`` if its MAC (GCM's tag) does not verify. Nothing of
    an encrypted message's plaintext leaves before its tag verified."""
    head = frame.head
    index = (header.session, name, kind, header.boot)
    keys = secret._wire_keys(index, keep)
    nonce = _NONCE.pack(kind, header.seq)
    body_start = header.body_start
    tag = head[body_start - MAC_BYTES:body_start]
    prefix = _prefix(_label(name, boot), memoryview(head)[:body_start - MAC_BYTES])
    if not header.flags & ENCRYPTED:
        body = head[body_start:]
        total = len(prefix) + len(body) + sum(header.lengths)
        expected = _mac_tag(keys, nonce, [prefix, body, *_bytes_of(
            header.tensors, None if header.tensors is not None else header.views)], total)
        if not hmac.compare_digest(tag, expected):  # (constant-time)
            return None
        opened: Tuple[bytes, List[Any]] = (body, list(frame.buffers))
    else:
        decryptor = Cipher(algorithms.AES(keys.aes), modes.GCM(nonce, tag)).decryptor()
        decryptor.authenticate_additional_data(prefix)
        body = decryptor.update(memoryview(head)[body_start:])
        out = []
        owned = frame.owned
        for view, received in zip(header.views, frame.buffers):
            if owned and view.nbytes >= _IN_PLACE_BYTES and not view.readonly:
                _decrypt_in_place(decryptor, view)
                out.append(received if type(received) is torch.Tensor else view)
                continue
            buffer = _cipher_buffer(view.nbytes)
            written = decryptor.update_into(view, buffer.numpy())
            out.append(buffer[:written])
        try:
            body += decryptor.finalize()  # verifies the tag (constant-time)
        except InvalidTag:
            return None
        opened = (body, out)
    if not keep:
        secret.keep_wire_keys(index, keys)
    return opened


def _decrypt_in_place(decryptor: Any, view: memoryview) -> None:
    """Decrypts the received buffer ``view`` into itself (``cryptography``
    refuses overlapping input and output): a chunk at a time into a
    per-thread scratch buffer that stays in cache, copied back over the chunk
    it came from (GCM is a stream mode: each chunk's plaintext has its
    length). Saves a new buffer, whose page faults cost more than GCM."""
    scratch = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = memoryview(bytearray(_CHUNK_BYTES + 16))
    n = view.nbytes
    at = 0
    while at < n:
        end = min(n, at + _CHUNK_BYTES)
        written = decryptor.update_into(view[at:end], scratch)
        if written != end - at:  # (GCM writes what it is given, at once)
            raise RuntimeError("GCM held back part of a chunk")
        view[at:end] = scratch[:written]
        at = end


_local = threading.local()
_CHUNK_BYTES = 256 << 10  # in-place decryption's chunk (in L2)
_IN_PLACE_BYTES = 1 << 20  # an owned buffer this large is decrypted in place


_process_boot = [secrets.token_bytes(BOOT_BYTES)]  # replies sealed without a gate's boot id


def _new_process_boot() -> None:
    _process_boot[0] = secrets.token_bytes(BOOT_BYTES)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_process_boot)


def _gate_boot(boot: Optional[bytes]) -> bytes:
    if boot is None:
        return _process_boot[0]
    if not (isinstance(boot, bytes) and len(boot) == BOOT_BYTES) or boot == _NO_BOOT:
        raise ValueError(f"a boot id is {BOOT_BYTES} bytes, not all zero")
    return boot


#: worker -> the boot id of its server process, as a signed record said it
#: (a fleet's server record, a Ray actor's identity): requests to it are bound.
_boots: Dict[str, bytes] = {}
_boots_lock = threading.Lock()


def bind_boot(worker: str, boot: bytes) -> None:
    """Binds this process's requests to ``worker`` to its server process's
    ``boot`` id (read from a record signed with the job's secret): a
    restarted process has another, and refuses every request captured before."""
    if not (isinstance(boot, bytes) and len(boot) == BOOT_BYTES):
        raise ValueError(f"a boot id is {BOOT_BYTES} bytes, got {boot!r:.40}")
    with _boots_lock:
        _boots[worker] = boot


def unbind_boot(worker: str) -> None:
    """Forgets ``worker``'s boot id (its requests are unbound until bound again)."""
    with _boots_lock:
        _boots.pop(worker, None)


def boot_of(worker: str) -> Optional[bytes]:
    return _boots.get(worker)


class Session:
    """A client's session under one secret (see the module docstring)."""

    def __init__(self, secret: JobSecret) -> None:
        self.secret = secret
        self.id = secrets.token_bytes(SESSION_BYTES)
        self._seq: Dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def owner(self) -> str:
        """This session as a server names its owner (stateful calls, batches)."""
        return f"{self.secret.key_id.hex()}:{self.id.hex()}"

    def seal(self, worker: str, body: bytes, buffers: Sequence[Any], label: str = ""
             ) -> Tuple[Frame, int]:
        """A request to ``worker`` and its number."""
        with self._lock:
            seq = self._seq.get(worker, 0) + 1
            self._seq[worker] = seq
        head, sealed = _seal(self.secret, worker, REQUEST, self.id, seq, body, buffers,
                             _boots.get(worker))
        return Frame(head, sealed, label), seq

    def open_reply(self, worker: str, seq: int, frame: Frame) -> Tuple[bytes, Sequence[Any]]:
        """The body and buffers of ``worker``'s reply to request ``seq``;
        raises :class:`Refused` if the server refused the request, and
        :class:`ReplyRejected` (counted, logged) if the reply fails."""
        try:
            header = parse(frame)
        except FrameError as error:
            raise self._reject(worker, f"malformed reply: {error}") from None
        if header.kind == REFUSAL:
            raise Refused(REASONS.get(header.code, "malformed"))
        if header.kind != REPLY or header.key_id != self.secret.key_id \
                or header.session != self.id or header.seq != seq:
            raise self._reject(worker, "a reply that answers no request of this client")
        if header.encrypted != self.secret.encrypt:
            raise self._reject(worker, "an encrypted reply to a job that does not encrypt"
                               if header.encrypted else "a reply in clear to a job that encrypts")
        opened = _open(self.secret, frame, header, worker, REPLY, None, keep=True)
        if opened is None:
            raise self._reject(worker, "a reply whose MAC does not verify (not sealed with "
                                       "this job's secret by that server)")
        return opened

    def reject(self, worker: str, why: str) -> ReplyRejected:
        """Counts and logs a reply of ``worker`` this client will not read
        for a reason found above this layer (a body that does not decode)."""
        return self._reject(worker, why)

    def _reject(self, worker: str, why: str) -> ReplyRejected:
        with _stats_lock:
            _rejected[worker] = _rejected.get(worker, 0) + 1
        _warn(f"reply:{worker}", f"rejected {why} from server {worker!r}")
        return ReplyRejected(f"server {worker!r} sent {why}")


_sessions: Dict[bytes, Session] = {}
_sessions_lock = threading.Lock()


def secret_for(key_id: bytes) -> Optional[JobSecret]:
    """The secret of this process's session with ``key_id``, if any (the one
    that sealed a frame it sends)."""
    session = _sessions.get(key_id)
    return session.secret if session is not None else None


def session_for(secret: JobSecret) -> Session:
    """This process's session under ``secret``."""
    session = _sessions.get(secret.key_id)
    if session is None or session.secret != secret:
        with _sessions_lock:
            session = _sessions.get(secret.key_id)
            if session is None or session.secret != secret:
                session = _sessions[secret.key_id] = Session(secret)
    return session


# -- the server's side --------------------------------------------------------------------
class Caller(NamedTuple):
    """Who sent an authenticated request: its job (key id) and session (a
    named tuple: one is made per request)."""

    key_id: bytes
    session: bytes
    seq: int

    @property
    def owner(self) -> str:
        return f"{self.key_id.hex()}:{self.session.hex()}"

    @property
    def job(self) -> str:
        return self.key_id.hex()


class _Window:
    __slots__ = ("high", "bits", "seen", "sent")

    def __init__(self) -> None:
        self.high, self.bits, self.seen = -1, 0, 0.0
        self.sent = 0  # the newest sent time (ms, the client's clock) it accepted

    def accept(self, seq: int, now: float) -> bool:
        if seq > self.high:
            shift = seq - self.high
            self.bits = ((self.bits << shift) | 1) & _MASK if shift < WINDOW else 1
            self.high = seq
        else:
            back = self.high - seq
            if back >= WINDOW or self.bits >> back & 1:
                return False
            self.bits |= 1 << back
        self.seen = now
        return True


class Gate:
    """A server process's judge of requests (see the module docstring)."""

    def __init__(self, max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW_S,
                 started: Optional[float] = None) -> None:
        self.max_clock_skew = float(max_clock_skew)
        self.started = time.time() if started is None else float(started)
        #: This server process's boot id: a bound request's MAC covers it.
        self.boot = secrets.token_bytes(BOOT_BYTES)
        self._keys: Dict[bytes, Tuple[JobSecret, int]] = {}  # key id -> (secret, users)
        #: Replay windows, least recently used first (a dict keeps its order).
        self._windows: Dict[Tuple[bytes, bytes, str], _Window] = {}
        #: A session this gate has no window for must be newer than this (ms,
        #: see :meth:`open`): its start (no request captured before a restart
        #: is taken), then the newest request of a session evicted while live.
        self._floor_ms = int(self.started * 1000)
        self._lock = threading.Lock()

    # -- keys ----------------------------------------------------------------------------
    def admit(self, secrets_: Sequence[JobSecret]) -> None:
        """Accepts requests sealed with ``secrets_`` (one more user each)."""
        with self._lock:
            for secret in secrets_:
                known, users = self._keys.get(secret.key_id, (secret, 0))
                self._keys[secret.key_id] = (known, users + 1)

    def dismiss(self, secrets_: Sequence[JobSecret]) -> None:
        """Undoes one :meth:`admit` of each."""
        with self._lock:
            for secret in secrets_:
                known = self._keys.get(secret.key_id)
                if known is None:
                    continue
                if known[1] <= 1:
                    del self._keys[secret.key_id]
                    for key in [k for k in self._windows if k[0] == secret.key_id]:
                        del self._windows[key]
                else:
                    self._keys[secret.key_id] = (known[0], known[1] - 1)

    def jobs(self) -> List[str]:
        with self._lock:
            return [k.hex() for k in self._keys]

    # -- requests -------------------------------------------------------------------------
    def open(self, frame: Frame, me: str) -> Tuple[Caller, bytes, Sequence[Any], JobSecret]:
        """``(caller, body, buffers, secret)`` of an authenticated request to
        the server named ``me`` (``secret``: the one that opened it, which
        seals its reply); raises :class:`Refused` (counted, logged)."""
        try:
            header = parse(frame)
        except FrameError as error:
            raise self.refuse("malformed", f"a request: {error}") from None
        if header.kind != REQUEST:
            raise self.refuse("malformed", "a message that is not a request")
        known = self._keys.get(header.key_id)  # (one dict read: atomic, no lock)
        if known is None:
            raise self.refuse("unknown job", f"a request sealed with key id "
                                             f"{header.key_id.hex()}, not a job served here")
        secret = known[0]
        if bool(header.flags & ENCRYPTED) != secret.encrypt:
            raise self.refuse("encryption mismatch",
                              f"a request {'encrypted' if header.encrypted else 'in clear'} "
                              f"for job {header.key_id.hex()}, which "
                              f"{'encrypts' if secret.encrypt else 'does not encrypt'} "
                              f"(session {header.session.hex()[:8]})")
        if header.boot != _NO_BOOT:
            raise self.refuse("malformed", "a request with a boot id field")
        opened = _open(secret, frame, header, me, REQUEST,
                       self.boot if header.flags & BOUND else None, keep=False)
        if opened is None:
            raise self.refuse("bad MAC", f"a request whose MAC does not verify (key id "
                                         f"{header.key_id.hex()}, session "
                                         f"{header.session.hex()[:8]})")
        now = time.time()
        skew = abs(now - header.sent_ms / 1000.0)
        if skew > self.max_clock_skew:
            raise self.refuse("stale", f"a request sent {skew:.0f} s from this server's clock "
                                       f"(max_clock_skew={self.max_clock_skew:g} s)")
        with self._lock:
            key = (header.key_id, header.session, me)
            window = self._windows.pop(key, None)
            if window is None and header.sent_ms <= self._floor_ms:
                refused_old = True
            else:
                refused_old = False
                if window is None:
                    if len(self._windows) >= MAX_SESSIONS:
                        self._forget_idle(now)
                    if len(self._windows) >= MAX_SESSIONS:
                        self._evict_least_recent()
                    window = _Window()
                self._windows[key] = window  # (last: the most recently used)
            accepted = window is not None and window.accept(header.seq, now)
            if accepted:
                assert window is not None
                window.sent = max(window.sent, header.sent_ms)
        if refused_old:
            raise self.refuse("stale", f"a request of a session this server keeps no window "
                                       f"for, sent before the server started or before such "
                                       f"windows were evicted (session "
                                       f"{header.session.hex()[:8]})")
        if not accepted:
            raise self.refuse("replay", f"a replayed request ({header.seq} of session "
                                        f"{header.session.hex()[:8]})")
        return Caller(header.key_id, header.session, header.seq), opened[0], opened[1], secret

    def restart(self) -> None:
        """A new process (a forked child): a new boot id, a floor at its start
        and no windows of its parent's."""
        with self._lock:
            self.boot = secrets.token_bytes(BOOT_BYTES)
            self.started = time.time()
            self._floor_ms = int(self.started * 1000)
            self._windows.clear()

    def _forget_idle(self, now: float) -> None:
        idle = [k for k, w in self._windows.items() if now - w.seen > self.max_clock_skew]
        for key in idle:
            del self._windows[key]

    def _evict_least_recent(self) -> None:
        """Makes room at :data:`MAX_SESSIONS` live sessions: the least
        recently used :data:`EVICT_SHARE` of them go, and the floor rises to
        the newest request they accepted, so none of their requests (nor any
        older one) opens a window again. A client that fills the table evicts
        its own idle sessions, not the others' busy ones."""
        count = max(1, len(self._windows) // EVICT_SHARE)
        for key in list(self._windows)[:count]:
            self._floor_ms = max(self._floor_ms, self._windows.pop(key).sent)

    @staticmethod
    def seal_reply(secret: JobSecret, caller: Caller, me: str, body: bytes,
                   buffers: Sequence[Any], boot: Optional[bytes] = None) -> Frame:
        """The reply to ``caller``'s request, sealed with the secret that
        opened it (even if its server closed meanwhile), under keys of the
        server process's ``boot`` id (the gate's :attr:`boot`; default: a
        random id of this process), which the reply's header carries: a
        reply's keys are its server process's own, so a request replayed to
        a restarted process never has two replies under one key and nonce."""
        head, sealed = _seal(secret, me, REPLY, caller.session, caller.seq, body, buffers,
                             server_boot=_gate_boot(boot))
        return Frame(head, sealed, "reply")

    def refuse(self, reason: str, detail: str) -> Refused:
        """Counts and logs a refusal; returns it (to raise)."""
        return refuse(reason, detail)

    @staticmethod
    def refused_total() -> int:
        with _stats_lock:
            return sum(_refused.values())


_once: "Dict[str, None]" = {}  # what refuse(once=...) has counted (oldest first, bounded)


def refuse(reason: str, detail: str, once: Optional[str] = None) -> Refused:
    """Counts and logs a refusal (a request, a registry entry, ...) and
    returns it (to raise). ``once``: a key that is counted only the first
    time (an entry that a poll reads again and again)."""
    with _stats_lock:
        if once is not None:
            if once in _once:
                return Refused(reason, detail)
            _once[once] = None
            if len(_once) > MAX_SESSIONS:
                del _once[next(iter(_once))]
        _refused[reason] = _refused.get(reason, 0) + 1
    _warn(f"refused:{reason}", f"refused {detail} ({reason}); nothing of it was used or run")
    return Refused(reason, detail)


def refusal_frame(reason: str) -> Frame:
    """The (unsealed) frame that answers a refused request."""
    return refusal(_CODES[reason])
