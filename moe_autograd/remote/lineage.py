"""The version of a training expert's state, which its replicas compare.

Why this module exists: a training expert (a server-side optimizer with
``auto_step``) changes at every backward, and a name may have several
replicas. They stay one expert when each applies the same backwards in the
same order from the same state (see :mod:`.mirrored`); what proves it is a
*version* both sides can compute without sending the state:

* ``count``: the backwards the expert applied (optimizer steps, plus steps
  skipped for non-finite gradients: each backward is one or the other);
* ``digest``: its history, :func:`root` of the state it started from (its
  weights and optimizer state, hashed), extended by :func:`after` with the
  call id of every backward applied, in order.

Two replicas at one version hold the same state bit for bit: the same start,
the same backwards in the same order, each computed deterministically from
the call's inputs, gradients and seed. A state restored from a snapshot or a
peer takes that state's version (:attr:`~.durable.ExpertState.lineage`); a
state loaded by ``load_state_dict`` starts a new history (:func:`root` of the
loaded state).

Invariants:

* A digest is 32 hex characters (128 bits of SHA-256): :func:`check_fence`
  refuses anything else by name, before it is compared.
* :func:`root` depends only on the state's names, dtypes, shapes and bytes
  (in sorted key order), never on the process: replicas built from one seed
  agree without talking to each other.
"""
import hashlib
from typing import Any, Iterator, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["DIGEST_CHARS", "root", "after", "check_fence", "Version"]

DIGEST_CHARS = 32
Version = Tuple[int, str]  # (count, digest)


def _leaves(value: Any, at: str) -> Iterator[Tuple[str, Any]]:
    """``(path, leaf)`` of a nested state (dicts in sorted key order)."""
    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            yield from _leaves(value[key], f"{at}/{key!r}")
    elif isinstance(value, (list, tuple)):
        for k, item in enumerate(value):
            yield from _leaves(item, f"{at}/{k}")
    else:
        yield at, value


def root(module: Any, optimizer: Any = None) -> str:
    """The digest of a history that starts at this state (a module's
    ``state_dict`` and an optimizer's, or None)."""
    h = hashlib.sha256(b"moe_autograd lineage\0")
    for path, leaf in _leaves({"module": module, "optimizer": optimizer}, ""):
        h.update(path.encode() + b"\0")
        if isinstance(leaf, Tensor):
            tensor = leaf.detach().cpu().contiguous()
            h.update(f"{tensor.dtype}{list(tensor.shape)}\0".encode())
            h.update(memoryview(tensor.view(-1).view(dtype=torch.uint8).numpy()))  # type: ignore[arg-type]
        else:
            h.update(repr(leaf).encode() + b"\0")
    return h.hexdigest()[:DIGEST_CHARS]


def after(digest: str, change: str) -> str:
    """The digest once ``change`` (a backward's call id) is applied."""
    return hashlib.sha256(b"moe_autograd lineage step\0" + digest.encode() + b"\0"
                          + change.encode()).hexdigest()[:DIGEST_CHARS]


def check_fence(value: Any, where: str) -> Optional[Version]:
    """A request's ``fence`` field (``[count, digest]`` or absent), checked."""
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], int)
            and not isinstance(value[0], bool) and 0 <= value[0] < 1 << 62
            and isinstance(value[1], str) and len(value[1]) == DIGEST_CHARS
            and all(c in "0123456789abcdef" for c in value[1])):
        raise ValueError(f"{where}: field 'fence' must be [count, a {DIGEST_CHARS}-hex digest], "
                         f"got {value!r:.80}")
    return int(value[0]), str(value[1])

