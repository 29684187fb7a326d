"""What the tests need to know about the torch version they run on
(``make test`` runs on the pinned torch, ``make compat`` on the oldest and the
newest supported: see tools/compat.sh and the README's "Behaviour that
depends on the version").

* :data:`TORCH` and :func:`torch_before`: for ``xfail``/``skipif`` conditions
  on the version (their reasons name the versions).
* :func:`install`: called by ``tests/conftest.py`` before any test module is
  imported. On torch 2.12 and older it backports one fix of torch 2.13 to
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: when the
  checkpointed function raises, the frame's saved-tensor hooks stay pushed
  on the thread (its generator is suspended, and lives as long as the
  exception's traceback). Every later forward of the process, the loop's as
  much as the runtime's, would then pack its saved tensors into that dead
  frame, so one case that raises inside a frame would change the cases run
  after it (the differential oracle's sample, run in one process). Torch
  2.13 closes the generator at once (``gen.throw(e)``); so does this
  backport. It changes nothing where the function returns.
"""
import functools
import threading
from typing import Any, List

import torch
from torch.torch_version import TorchVersion

__all__ = ["TORCH", "torch_before", "install"]

#: The torch version the tests run on (compare with tuples: ``TORCH < (2, 13)``).
TORCH = TorchVersion(torch.__version__.split("+")[0])


def torch_before(major: int, minor: int) -> bool:
    """Whether the running torch is older than ``major.minor``."""
    return TORCH < (major, minor)


class _Generators(threading.local):
    def __init__(self) -> None:
        self.stack: List[Any] = []


_installed = False


def install() -> None:
    """Backports torch 2.13's closing of a failed non-reentrant checkpoint
    frame (see the module docstring); a no-op on torch 2.13 and later."""
    global _installed
    if _installed or not torch_before(2, 13):
        return
    import torch.utils.checkpoint as tuc

    made = _Generators()
    make = tuc._checkpoint_without_reentrant_generator

    @functools.wraps(make)
    def generator(*args: Any, **kwargs: Any) -> Any:
        gen = make(*args, **kwargs)
        made.stack.append(gen)
        return gen

    checkpoint = tuc.checkpoint

    @functools.wraps(checkpoint)
    def checkpoint_closing_its_frame(*args: Any, **kwargs: Any) -> Any:
        depth = len(made.stack)
        try:
            return checkpoint(*args, **kwargs)
        except BaseException as error:
            gen = made.stack[depth] if len(made.stack) > depth else None
            if gen is not None and gen.gi_frame is not None:  # suspended: the function raised
                try:
                    gen.throw(error)  # its `with` blocks exit: the hooks are popped
                except BaseException as thrown:
                    if thrown is not error:
                        raise
            raise
        finally:
            del made.stack[depth:]

    tuc._checkpoint_without_reentrant_generator = generator
    tuc.checkpoint = checkpoint_closing_its_frame
    _installed = True
