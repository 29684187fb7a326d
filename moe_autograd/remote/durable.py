"""Durable state of hosted experts: snapshots on disk that a server resumes from.

Why this module exists: an expert that trains on its server (``optimizer=``,
``auto_step``) holds what it learned in that process only; a server that
dies takes it along, and its replacement would start from the factory's
fresh weights. A server given a state directory (``ExpertServer(...,
state_dir=DIR, save_every=N)``, ``serve --state-dir DIR --save-every N``)
writes each expert's state there every ``N`` optimizer steps (or every
``save_interval`` seconds) and when it closes, and a server started on that
directory resumes each expert from its newest complete snapshot.

What a snapshot holds (:class:`ExpertState`): the module's ``state_dict``
(parameters and buffers), the optimizer's ``state_dict`` (its tensors and its
hyperparameters), the optimizer steps applied (``steps``) and skipped for
non-finite gradients (``skipped_steps``). A server draws no random numbers of
its own for an expert: every call's randomness comes from the seed the
client sends with it, so there is no random state to keep.

The file (``DIR/<expert>/step-<steps>.snap``, the name quoted): a magic line,
the header's length (8 bytes, little-endian), the header (JSON: the expert,
its steps, the job's key id, the time, every tensor's name, dtype, shape and
place), the tensors' bytes back to back, and an HMAC-SHA256 of everything
before it keyed by the job's secret. No pickle anywhere: tensors are raw
bytes of the wire's dtypes, everything else JSON.

Invariants:

* A snapshot appears whole or not at all: it is written to a temporary file
  in the same directory, flushed and fsynced, renamed into place, and the
  directory fsynced. A crash mid-write leaves a temporary file that is never
  read (and removed at the next start).
* A snapshot is used only if its length, its header and its MAC check: a
  truncated or altered one (``bad MAC``) or one sealed with another job's
  secret (``unknown job``) is refused with its path and the reason,
  counted and logged (:func:`~.auth.refuse`), and the next older one is
  tried. Nothing of a refused snapshot is loaded.
* One live server writes one expert's snapshots in one directory: the
  expert's folder is locked (``flock``) for as long as the server serves it;
  a second server is refused, naming the directory and the holder's pid.
* A snapshot holds whole steps only, and is on disk before the step that
  made it due returns: :meth:`Snapshots.save` runs in that step, under the
  expert's lock (so a server killed at any instant loses at most the steps
  since its last save, ``save_every`` at most). Its cost is the step's
  (measured: BENCHMARKS.md, ``durable/save-overhead``).
* The newest :data:`KEEP` snapshots are kept; older ones are removed once a
  newer one is in place.
"""
import fcntl
import hmac
import json
import logging
import math
import os
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .auth import JobSecret, refuse
from .wire import DTYPES

__all__ = ["ExpertState", "Snapshots", "SnapshotError", "write_snapshot", "read_snapshot",
           "open_state", "state_bytes", "sealed_parts", "snapshot_paths", "numbered", "MAGIC",
           "KEEP"]

MAGIC = b"moe_autograd snapshot 1\n"
KEEP = 3  # snapshots kept per expert
_DOMAIN = b"moe_autograd snapshot\0"  # MAC domain: never a frame's or a record's
_LENGTH = struct.Struct("<Q")
_TAG_BYTES = 32
_MAX_HEADER = 64 << 20
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_log = logging.getLogger(__name__)


class SnapshotError(ValueError):
    """A snapshot that cannot be used: its path and the reason."""

    def __init__(self, path: str, reason: str, kind: str = "bad MAC") -> None:
        super().__init__(f"snapshot {path}: {reason}")
        self.path, self.reason, self.kind = path, reason, kind


@dataclass
class ExpertState:
    """What a snapshot holds of one expert (see the module docstring)."""

    module: Dict[str, Tensor]
    optimizer: Optional[Dict[str, Any]] = None
    steps: int = 0
    skipped_steps: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)
    #: The digest of the state's history (:mod:`.lineage`); "" where unknown
    #: (computed from the state itself when it is taken).
    lineage: str = ""


# -- JSON with tensors by reference ---------------------------------------------------------
def _encode(value: Any, tensors: List[Tensor], where: str) -> Any:
    if isinstance(value, Tensor):
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return {"f": repr(value)} if not math.isfinite(value) else value
    if isinstance(value, (list, tuple)):
        items = [_encode(v, tensors, f"{where}[{k}]") for k, v in enumerate(value)]
        return {"l": items} if isinstance(value, list) else {"u": items}
    if isinstance(value, dict):
        return {"d": [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")]
                      for k, v in value.items()]}
    raise TypeError(f"{where}: a {type(value).__qualname__} cannot be kept in a snapshot "
                    "(tensors, numbers, strings, bools, None, lists, tuples and dicts of them)")


def _decode(value: Any, tensors: List[Tensor]) -> Any:
    if isinstance(value, dict):
        if "t" in value:
            return tensors[int(value["t"])]
        if "f" in value:
            return float(value["f"])
        if "l" in value:
            return [_decode(v, tensors) for v in value["l"]]
        if "u" in value:
            return tuple(_decode(v, tensors) for v in value["u"])
        if "d" in value:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value["d"]}
        raise ValueError(f"unknown entry {sorted(value)}")
    return value


# -- one file -------------------------------------------------------------------------------
def _raw(tensor: Tensor) -> Tensor:
    data = tensor.detach().cpu().contiguous()
    return data.reshape(-1).view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)


def sealed_parts(expert: str, state: ExpertState, secret: JobSecret) -> List[Any]:
    """The bytes of ``state``'s snapshot, as parts (the tensors' bytes are
    views, not copies): what :func:`write_snapshot` writes and a peer
    transfer sends (:func:`state_bytes`)."""
    tensors: List[Tensor] = []
    body = {"module": _encode(state.module, tensors, "module"),
            "optimizer": _encode(state.optimizer, tensors, "optimizer"),
            "extra": _encode(state.extra, tensors, "extra")}
    raws, index, at = [], [], 0
    for tensor in tensors:
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"a tensor of dtype {tensor.dtype} cannot be kept in a snapshot")
        raw = _raw(tensor)
        raws.append(raw)
        index.append({"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                      "at": at, "bytes": int(raw.numel())})
        at += int(raw.numel())
    header = json.dumps({"format": 1, "expert": expert, "steps": int(state.steps),
                         "skipped_steps": int(state.skipped_steps),
                         "lineage": str(state.lineage),
                         "job": secret.key_id.hex(), "saved_at": time.time(),
                         "tensors": index, "body": body, "payload_bytes": at},
                        separators=(",", ":")).encode()
    length = _LENGTH.pack(len(header))
    views = [memoryview(r.numpy()) for r in raws]  # type: ignore[arg-type]
    tag = secret.mac([_DOMAIN, MAGIC, length, header, *views])
    return [MAGIC, length, header, *views, tag]


def state_bytes(expert: str, state: ExpertState, secret: JobSecret) -> Tensor:
    """``state``'s sealed snapshot as one uint8 tensor (a peer transfer)."""
    parts = sealed_parts(expert, state, secret)
    out = torch.empty(sum(memoryview(p).nbytes for p in parts), dtype=torch.uint8)
    buffer, at = memoryview(out.numpy()), 0  # type: ignore[arg-type]
    for part in parts:
        n = memoryview(part).nbytes
        buffer[at:at + n] = memoryview(part).cast("B")
        at += n
    return out


def write_snapshot(path: str, expert: str, state: ExpertState, secret: JobSecret) -> str:
    """Writes ``state`` to ``path`` atomically (see the module docstring);
    returns ``path``."""
    parts = sealed_parts(expert, state, secret)
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    with open(temporary, "wb") as f:
        for part in parts:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _fsync_directory(directory)
    return path


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_snapshot(path: str, secret: JobSecret) -> Tuple[str, ExpertState]:
    """``(expert, state)`` of the snapshot at ``path``; raises
    :class:`SnapshotError` (path and reason) for anything that does not check."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise SnapshotError(path, f"cannot be read: {error}") from error
    return open_state(data, secret, path)


def open_state(data: Any, secret: JobSecret, where: str) -> Tuple[str, ExpertState]:
    """``(expert, state)`` of a sealed snapshot's bytes (a file's, or a peer
    transfer's: ``where`` names it in errors); raises :class:`SnapshotError`
    for anything that does not check, before anything of it is decoded."""
    path = where
    data = memoryview(data).cast("B")  # bytes, bytearray, a NumPy array: no copy
    fixed = len(MAGIC) + _LENGTH.size
    if len(data) < fixed + _TAG_BYTES or bytes(data[:len(MAGIC)]) != MAGIC:
        raise SnapshotError(path, "not a snapshot, or truncated before its header "
                                  f"({len(data)} bytes)", kind="malformed")
    (size,) = _LENGTH.unpack_from(data, len(MAGIC))
    if size > _MAX_HEADER or fixed + size + _TAG_BYTES > len(data):
        raise SnapshotError(path, f"truncated: its header announces {size} bytes, the file "
                                  f"has {len(data)}", kind="malformed")
    view = data
    end = len(data) - _TAG_BYTES
    tag = secret.mac([_DOMAIN, view[:end]])
    if not hmac.compare_digest(tag, bytes(view[end:])):
        job = _job_of(bytes(data[fixed:fixed + size]))
        if job is not None and job != secret.key_id.hex():
            raise SnapshotError(path, f"sealed for another job (key id {job[:16]}, this job's "
                                      f"is {secret.key_id.hex()})", kind="unknown job")
        raise SnapshotError(path, "its checksum (HMAC-SHA256 with the job's secret) does not "
                                  "verify: altered, corrupt or truncated")
    try:  # sealed by this job: from here on, only a bug of ours could fail
        header = json.loads(bytes(data[fixed:fixed + size]))
        if fixed + size + int(header["payload_bytes"]) != end:
            raise ValueError("the payload's length is not the header's")
        tensors = []
        payload = bytearray(view[fixed + size:end])  # one copy, its own: the tensors view it
        for entry in header["tensors"]:
            dtype = DTYPES[entry["dtype"]]
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=int(entry["bytes"]),
                                   offset=int(entry["at"])) if entry["bytes"] else \
                torch.empty(0, dtype=torch.uint8)
            tensors.append(raw.view(dtype).reshape(entry["shape"]))
        body = header["body"]
        state = ExpertState(_decode(body["module"], tensors), _decode(body["optimizer"], tensors),
                            int(header["steps"]), int(header["skipped_steps"]),
                            _decode(body["extra"], tensors), str(header.get("lineage", "")))
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as error:
        raise SnapshotError(path, f"a malformed body ({type(error).__name__}: "
                                  f"{error})", kind="malformed") from error
    return str(header["expert"]), state


def _job_of(header: bytes) -> Optional[str]:
    """The job key id a header names, if it can be read (only to say why a
    snapshot whose MAC fails was refused: nothing else of it is used)."""
    try:
        job = json.loads(header).get("job")
    except (ValueError, AttributeError):
        return None
    return job if isinstance(job, str) else None


def _folder(directory: str, expert: str) -> str:
    return os.path.join(directory, urllib.parse.quote(expert, safe=""))


def numbered(folder: str, prefix: str, suffix: str = "") -> List[Tuple[int, str]]:
    """``(number, path)`` of the entries of ``folder`` named
    ``<prefix><number><suffix>``, highest number first (none if no folder)."""
    found = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith(prefix) and name.endswith(suffix):
            try:
                found.append((int(name[len(prefix):len(name) - len(suffix)]),
                              os.path.join(folder, name)))
            except ValueError:
                continue
    return sorted(found, reverse=True)


def snapshot_paths(directory: str, expert: str) -> List[Tuple[int, str]]:
    """``(steps, path)`` of ``expert``'s snapshots in ``directory``, newest first."""
    return numbered(_folder(directory, expert), "step-", ".snap")


# -- one server's experts -------------------------------------------------------------------
class Snapshots:
    """The snapshots of one server's experts in ``directory``: locks each
    expert's folder for as long as it lives, loads the newest complete
    snapshot, and saves when a step makes a save due and at :meth:`close`."""

    def __init__(self, directory: str, experts: List[str], secret: JobSecret, *,
                 save_every: Optional[int] = None, save_interval: Optional[float] = None) -> None:
        if save_every is not None and (isinstance(save_every, bool)
                                       or not isinstance(save_every, int) or save_every < 1):
            raise ValueError(f"save_every must be a positive number of steps or None, got "
                             f"{save_every!r}")
        if save_interval is not None and not (isinstance(save_interval, (int, float))
                                              and not isinstance(save_interval, bool)
                                              and 0 < save_interval < math.inf):
            raise ValueError(f"save_interval must be positive seconds or None, got "
                             f"{save_interval!r}")
        self.directory = os.path.abspath(directory)
        self.secret = secret
        self.save_every, self.save_interval = save_every, save_interval
        self._locks: Dict[str, int] = {}
        self._last_save: Dict[str, float] = {}
        self._closed = False
        self._count = threading.Lock()
        self.saved = 0  # snapshots written
        try:
            for expert in experts:
                self._lock(expert)
        except BaseException:
            self._unlock_all()
            raise

    def _lock(self, expert: str) -> None:
        folder = _folder(self.directory, expert)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RuntimeError(f"expert {expert!r}: another live server (pid {holder}) writes "
                               f"its snapshots in {self.directory}; two servers never share "
                               f"one expert's snapshots") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._locks[expert] = fd
        for name in os.listdir(folder):  # partial writes of a process that died
            if name.startswith(".step-") and ".tmp-" in name:
                try:
                    os.remove(os.path.join(folder, name))
                except OSError:
                    pass

    def _unlock_all(self) -> None:
        for fd in self._locks.values():
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self._locks.clear()

    def load(self, expert: str) -> Optional[Tuple[str, ExpertState]]:
        """``(path, state)`` of ``expert``'s newest snapshot that checks, or
        None; every newer one that does not is refused (logged, counted)."""
        for _, path in snapshot_paths(self.directory, expert):
            try:
                name, state = read_snapshot(path, self.secret)
                if name != expert:
                    raise SnapshotError(path, f"holds expert {name!r}, not {expert!r}",
                                        kind="malformed")
            except SnapshotError as error:
                refuse(error.kind, f"{error} (the previous snapshot is tried)")
                continue
            return path, state
        return None

    def due(self, expert: str, steps: int) -> bool:
        """Whether a save is due after ``steps`` optimizer steps."""
        if self.save_every is not None and steps % self.save_every == 0:
            return True
        if self.save_interval is not None:
            last = self._last_save.setdefault(expert, time.monotonic())
            return time.monotonic() - last >= self.save_interval
        return False

    def save(self, expert: str, state: ExpertState) -> Optional[str]:
        """Writes ``state`` as ``expert``'s newest snapshot (call it under the
        expert's lock: one writer per expert) and removes the oldest beyond
        :data:`KEEP`; its path, or None if it could not be written (logged:
        a full disk must not stop serving)."""
        self._last_save[expert] = time.monotonic()
        path = os.path.join(_folder(self.directory, expert), f"step-{state.steps:012d}.snap")
        try:
            write_snapshot(path, expert, state, self.secret)
        except Exception as error:  # noqa: BLE001
            _log.error("expert %r: snapshot %s not written: %s: %s", expert, path,
                       type(error).__name__, error)
            return None
        with self._count:
            self.saved += 1
        for _, old in snapshot_paths(self.directory, expert)[KEEP:]:
            try:
                os.remove(old)
            except OSError:
                pass
        return path

    def close(self) -> None:
        """Unlocks every expert's folder (the caller saved their last states
        first). Idempotent."""
        if not self._closed:
            self._closed = True
            self._unlock_all()
