"""How tensors travel in the Ray backend's messages: as NumPy arrays.

Why: Ray pickles a ``torch.Tensor`` argument or result through the tensor's
own ``__reduce_ex__`` (``torch.save``'s legacy path, about 0.2 ms to pickle
and as much to unpickle a 32 x 64 float tensor on the bench machine), where a
NumPy array takes Ray's pickle-5 path with its buffer out of band (about a
tenth of that). A step of 16 remote calls moves 64 tensors (inputs, outputs,
output and input gradients), so this is a fifth of the messages' CPU. The
torch RPC backend needs none of it: TensorPipe moves tensors itself.

:func:`to_wire` walks a message (tuples, lists and dicts, as the ``serve_*``
functions' arguments and replies are) and wraps each eligible tensor in a
:class:`_WireTensor`, whose pickled form is ``(array, requires_grad)``;
unpickling makes the tensor again, so the receiving side needs no pass of
its own.

Invariants:

* What arrives equals what was sent: dtype, shape, strides, values,
  ``requires_grad`` (a tensor travels as the window of its storage that its
  elements span, so an expanded gradient stays one element with zero
  strides, and a view's strides are kept). Only tensors for which that holds
  through NumPy are wrapped: plain ``torch.Tensor`` (not a ``Parameter`` or
  another subclass), on the CPU, strided, without conjugate or negative bits,
  quantization or a ``grad_fn``, of a dtype NumPy has. Anything else takes
  torch's own pickling, unchanged.
* Aliasing within a message is what torch's pickling gives: the same tensor
  object twice arrives as one tensor (pickle's memo); two tensors that share
  a storage (a view and its base) arrive as two tensors of their own, as
  torch's pickling (``torch.save`` of each) makes them too. A view travels as
  its own elements only, not its base's whole storage.
* An arriving array that Ray hands over read-only (a buffer in its object
  store) is copied, so the tensor made from it owns writable memory.
"""
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

__all__ = ["to_wire"]

_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.complex64,
                           torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64,
                           torch.uint8, torch.bool})


def _tensor_from_array(array: Any, size: Tuple[int, ...], stride: Tuple[int, ...],
                       requires_grad: bool) -> Tensor:
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array).as_strided(size, stride)
    return tensor.requires_grad_() if requires_grad else tensor


class _WireTensor:
    """A tensor that pickles as a NumPy array: the window of its storage that
    its elements span, with its size and strides (see the module docstring)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> Any:
        t = self.tensor.detach()
        size, stride = tuple(t.shape), t.stride()
        span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(size, stride))
        window = t.as_strided((span,), (1,), t.storage_offset())
        return _tensor_from_array, (window.numpy(), size, stride, self.tensor.requires_grad)


def _eligible(t: Tensor) -> bool:
    return (type(t) is Tensor and t.device.type == "cpu" and t.layout == torch.strided
            and t.dtype in _NUMPY_DTYPES and t.grad_fn is None
            and not t.is_conj() and not t.is_neg() and not t.is_quantized)


def _tensors(value: Any, out: Dict[int, Tensor]) -> None:
    if isinstance(value, Tensor):
        out[id(value)] = value
    elif type(value) in (tuple, list):
        for item in value:
            _tensors(item, out)
    elif type(value) is dict:
        for item in value.values():
            _tensors(item, out)


def to_wire(value: Any) -> Any:
    """``value`` with its eligible tensors wrapped to travel as NumPy arrays
    (containers rebuilt, everything else as is)."""
    found: Dict[int, Tensor] = {}
    _tensors(value, found)
    wrapped = {key: _WireTensor(t) for key, t in found.items() if _eligible(t)}
    return _wrap(value, wrapped) if wrapped else value


def _wrap(value: Any, wrapped: Dict[int, "_WireTensor"]) -> Any:
    if isinstance(value, Tensor):
        return wrapped.get(id(value), value)
    if type(value) is tuple:
        return tuple(_wrap(item, wrapped) for item in value)
    if type(value) is list:
        items: List[Any] = [_wrap(item, wrapped) for item in value]
        return items
    if type(value) is dict:
        return {key: _wrap(item, wrapped) for key, item in value.items()}
    return value
