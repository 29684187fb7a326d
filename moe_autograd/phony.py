"""Phony tensors: size-0 tensors that only carry autograd edges.

A phony holds no data, so passing it between autograd Functions costs nothing,
but the engine still orders the Functions along its edges. ``fork``/``join``
(:mod:`moe_autograd.dependency`) and the portals of :mod:`moe_autograd.skip`
use phonies to add ordering edges to a graph.

Invariant: phonies are cached per ``(device, requires_grad)`` and never
written to, so sharing one object between graphs is safe.
"""
from typing import Dict, Tuple

import torch
from torch import Tensor

__all__ = ["get_phony"]

_phonies: Dict[Tuple[torch.device, bool], Tensor] = {}


def get_phony(device: torch.device, *, requires_grad: bool) -> Tensor:
    """Returns the cached size-0 tensor on ``device``.

    With ``requires_grad=True`` the returned phony is a leaf that needs a
    gradient; pass it through an autograd Function to give it a ``grad_fn``.
    """
    key = (torch.device(device), requires_grad)
    try:
        phony = _phonies[key]
    except KeyError:
        with torch.no_grad():
            phony = torch.empty(0, device=key[0], requires_grad=requires_grad)
        _phonies[key] = phony
    return phony
