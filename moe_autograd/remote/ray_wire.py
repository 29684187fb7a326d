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

Packed messages (:func:`pack` / :func:`unpack`): Ray serialises every
argument and result with cloudpickle (a Python subclass of the pickler, its
own msgpack envelope, out-of-band buffers), about 0.15 ms a message on each
end of the bench's requests. A message made only of what plain pickling
carries exactly as cloudpickle does (containers, numbers, strings, tensors,
and objects, functions and classes of ``moe_autograd``, ``torch``,
``numpy`` and the standard library's builtins) travels instead as ONE
``bytes`` object that the standard C pickler wrote (protocol 5; a tensor as
the same window of its storage, its bytes in band, with its dtype's name,
size, strides and ``requires_grad``), which Ray passes on without pickling.
The rules:

* :func:`pack` raises :class:`NotPacked` for anything else: an object,
  function or class of another module (cloudpickle may pickle it by value,
  e.g. from ``__main__``), something plain pickling refuses, or tensors of
  more than :data:`PACKED_MAX_BYTES` in all (big buffers are better out of
  band, as Ray sends them). The caller then sends the message Ray's way
  (:func:`to_wire`), so what arrives is the same either way.
* ``unpack(pack(m))`` equals ``m`` as ``pickle.loads(pickle.dumps(to_wire(m)))``
  does: the same tensors (dtype, shape, strides, values, ``requires_grad``),
  the same aliasing (one object twice arrives once), writable memory.
"""
import io
import pickle
from types import BuiltinFunctionType, FunctionType
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

__all__ = ["to_wire", "pack", "unpack", "NotPacked", "PACKED_MAX_BYTES"]

#: Tensor bytes a packed message carries at most (larger ones go out of band).
PACKED_MAX_BYTES = 1 << 20

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
        window = t.as_strided((_span(t),), (1,), t.storage_offset())
        return _tensor_from_array, (window.numpy(), size, stride, self.tensor.requires_grad)


def _span(t: Tensor) -> int:
    """How many elements of its storage a strided tensor's elements span."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _eligible(t: Tensor) -> bool:
    return (type(t) is Tensor and t.is_cpu and t.layout == torch.strided
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


# -- packed messages ----------------------------------------------------------------------
class NotPacked(Exception):
    """The message holds something :func:`pack` does not carry (see the module docstring)."""


#: Top-level packages whose objects, functions and classes pickle by reference
#: alike under plain pickling and cloudpickle (importable wherever this package is).
_BY_REFERENCE = frozenset({"moe_autograd", "torch", "numpy", "builtins", "copyreg",
                           "collections", "_codecs"})


_DTYPE_NAMES = {dtype: str(dtype).rpartition(".")[2] for dtype in _NUMPY_DTYPES}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def _tensor_from_buffer(buffer: Any, dtype: str, size: Tuple[int, ...], stride: Tuple[int, ...],
                        requires_grad: bool) -> Tensor:
    """A tensor of a packed message again: ``buffer`` holds the window of
    its storage that its elements span (a ``bytearray``, so writable)."""
    kind = _DTYPES[dtype]
    if not isinstance(buffer, bytearray):
        buffer = bytearray(buffer)  # own writable memory, whatever arrived
    flat = torch.frombuffer(buffer, dtype=kind) if buffer else torch.empty(0, dtype=kind)
    tensor = flat.as_strided(size, stride)
    return tensor.requires_grad_() if requires_grad else tensor


def _tensor_bytes(t: Tensor) -> int:
    if t.layout != torch.strided:
        return 0  # its parts (indices, values) are tensors of their own
    return int(t.untyped_storage().nbytes())


class _Pickler(pickle.Pickler):
    """The C pickler with eligible tensors as NumPy windows, and a refusal
    (:class:`NotPacked`) for what cloudpickle might pickle otherwise. Plain
    containers, numbers and strings never reach :meth:`reducer_override`."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.budget = PACKED_MAX_BYTES

    def _spend(self, nbytes: int) -> None:
        self.budget -= nbytes
        if self.budget < 0:
            raise NotPacked(f"tensors of more than {PACKED_MAX_BYTES} bytes")

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            if _eligible(obj):
                t = obj.detach()
                span = _span(t)
                self._spend(span * t.element_size())
                window: Any = t.as_strided((span,), (1,), t.storage_offset()).numpy()
                # The window's bytes in band (the C pickler writes a PickleBuffer
                # itself): one Python call per tensor, none for arrays and dtypes.
                return _tensor_from_buffer, (pickle.PickleBuffer(window), _DTYPE_NAMES[t.dtype],
                                             tuple(t.shape), t.stride(), obj.requires_grad)
            self._spend(_tensor_bytes(obj))
            return NotImplemented  # torch's own pickling, as Ray's path gives it
        if isinstance(obj, (type, FunctionType, BuiltinFunctionType)):
            module = getattr(obj, "__module__", None)  # pickled by reference
        else:
            module = type(obj).__module__
            nbytes = getattr(obj, "nbytes", None) if module.startswith("numpy") else None
            if isinstance(nbytes, int):
                self._spend(nbytes)
        if isinstance(module, str) and module.partition(".")[0] in _BY_REFERENCE:
            return NotImplemented
        raise NotPacked(f"a {type(obj).__name__} of module {module!r}")


def pack(value: Any) -> bytes:
    """``value`` as one ``bytes`` object (see the module docstring); raises
    :class:`NotPacked` when it must travel Ray's way (:func:`to_wire`)."""
    buffer = io.BytesIO()
    try:
        _Pickler(buffer).dump(value)
    except NotPacked:
        raise
    except Exception as error:  # noqa: BLE001 - unpicklable here: Ray's path decides
        raise NotPacked(f"{type(error).__name__}: {error}") from error
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    """The message that :func:`pack` made ``data`` of."""
    return pickle.loads(data)
