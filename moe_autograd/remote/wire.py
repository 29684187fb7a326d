"""The body of a message: schema values and tensors, and nothing that runs.

Why: a message that can carry a Python object can carry code (pickle's
``__reduce__``), so every message of remote experts is a fixed schema
instead: ``None``, ``bool``, ``int`` (64 bits), ``float``, ``str``,
``bytes``, lists, tuples, dicts with ``str`` keys, and tensors, nested. The
body is msgpack; each tensor travels as a descriptor in the body and one raw
buffer beside it (TensorPipe and Ray move buffers without copying them into
the body). Decoding is msgpack's and ``torch.frombuffer``'s: no path from a
payload to a function.

Body layout: a msgpack array ``[descriptors, value]``. ``descriptors[i] =
[dtype, shape, strides, requires_grad]`` describes buffer ``i``; in
``value`` a tensor is the extension type 1 holding its descriptor's index
(little-endian uint32; a tensor used twice is sent once and arrives as one
object), a tuple the extension type 2 holding its items, packed the same way
(so tuples stay tuples, lists stay lists).

Life of a received tensor (:func:`decode`)::

    step                             what is checked or done
    -------------------------------  ---------------------------------------------------
    header parsed (:mod:`.frame`)    buffer count and lengths against what arrived
    descriptors read                 dtype in :data:`DTYPES`; at most :data:`MAX_DIMS`
                                     sizes and strides, each in [0, 2**48); elements at
                                     most :data:`MAX_ELEMENTS`; the bytes its elements
                                     span equal its buffer's length; requires_grad only
                                     for floating and complex dtypes
    tensor made                      a view of its buffer (``frombuffer``, ``as_strided``):
                                     no allocation but a copy of a read-only buffer, so
                                     nothing beyond what arrived is allocated here
    value read                       extension types resolved; nesting at most
                                     :data:`MAX_DEPTH`; no bytes left over

What a server materialises from a tensor is ``numel * element_size`` (a
stride-0 expanded tensor arrives as one element, and counts in full):
:mod:`.sizes` counts that, per job, before anything runs.

Invariants:

* ``decode(*encode(v))`` equals ``v``: the same types, tensors with the same
  dtype, shape, strides (where the elements span no more than their number:
  expanded and permuted tensors keep their strides; a sparse window of a
  larger storage travels contiguous), values and ``requires_grad``.
* :func:`encode` refuses what the schema cannot carry with
  :class:`WireTypeError` naming it; :func:`check_value` says where it is
  in a caller's value (``argument 1[0]['x']``).
* :func:`decode` raises only :class:`WireError`, whatever the bytes.
"""
import math
import struct
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import msgpack
import torch
from torch import Tensor

from .frame import buffer_view

__all__ = ["encode", "decode", "check_value", "WireError", "WireTypeError", "DTYPES",
           "MAX_DIMS", "MAX_DEPTH", "MAX_ELEMENTS", "MAX_INT", "tensor_nbytes"]

#: Dtypes a message may carry, by their name on the wire.
DTYPES: Dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "complex64": torch.complex64, "complex128": torch.complex128,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_DIMS = 32
MAX_DEPTH = 64
MAX_ELEMENTS = 1 << 48
MAX_INT = (1 << 63) - 1
_DIM_LIMIT = 1 << 48
_TENSOR, _TUPLE = 1, 2
_INDEX = struct.Struct("<I")


class WireError(ValueError):
    """A message body that cannot be read (malformed, or past a limit)."""


class WireTypeError(TypeError):
    """A value the wire's schema cannot carry."""


def tensor_nbytes(t: Tensor) -> int:
    """What a tensor takes once materialised: ``numel * element_size``."""
    return t.numel() * t.element_size()


def _span(t: Tensor) -> int:
    """How many elements of its storage a strided tensor's elements span."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


# -- encoding ---------------------------------------------------------------------------
class _Encoder:
    __slots__ = ("descriptors", "buffers", "index", "keep")

    def __init__(self) -> None:
        self.descriptors: List[List[Any]] = []
        self.buffers: List[Tensor] = []
        self.index: Dict[int, int] = {}
        self.keep: List[Tensor] = []  # ids stay unique while encoding

    def default(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            return msgpack.ExtType(_TENSOR, _INDEX.pack(self.tensor(obj)))
        if type(obj) is tuple:
            return msgpack.ExtType(_TUPLE, self.pack(list(obj)))
        raise WireTypeError(f"a {type(obj).__module__}.{type(obj).__qualname__} cannot travel: "
                            "messages carry tensors, numbers, strings, bytes, bools, None and "
                            "lists, tuples and str-keyed dicts of them")

    def pack(self, value: Any) -> bytes:
        try:
            return msgpack.packb(value, default=self.default, strict_types=True,
                                 use_bin_type=True)
        except (WireTypeError, WireError):
            raise
        except (OverflowError, ValueError, TypeError) as error:
            raise WireTypeError(f"cannot encode the message: {error}") from error

    def tensor(self, tensor: Tensor) -> int:
        key = id(tensor)
        found = self.index.get(key)
        if found is not None:
            return found
        data = tensor.detach()
        if type(data) is not Tensor:
            raise WireTypeError(f"a tensor subclass ({type(tensor).__qualname__}) cannot "
                                "travel: send a plain torch.Tensor")
        if data.layout != torch.strided or data.is_quantized or data.is_nested:
            raise WireTypeError(f"a {data.layout} tensor cannot travel: only dense (strided) "
                                "tensors")
        name = _NAMES.get(data.dtype)
        if name is None:
            raise WireTypeError(f"a tensor of dtype {data.dtype} cannot travel; the wire "
                                f"carries {sorted(DTYPES)}")
        if data.device.type != "cpu":
            data = data.cpu()
        if data.is_conj():
            data = data.resolve_conj()
        if data.is_neg():
            data = data.resolve_neg()
        span = _span(data)
        if span > data.numel():  # a sparse window of a larger storage: send it dense
            data = data.contiguous()
            span = data.numel()
        if span:
            raw = data.as_strided((span,), (1,), data.storage_offset()).view(torch.uint8)
        else:
            raw = torch.empty(0, dtype=torch.uint8)
        index = len(self.descriptors)
        self.descriptors.append([name, list(data.shape), list(data.stride()),
                                 bool(tensor.requires_grad)])
        self.buffers.append(raw)
        self.index[key] = index
        self.keep.append(tensor)
        return index


def encode(value: Any) -> Tuple[bytes, List[Tensor]]:
    """``(body, buffers)`` of ``value`` (see the module docstring); the
    buffers are 1-D uint8 CPU tensors, views where no copy was needed.
    Raises :class:`WireTypeError` for what the schema cannot carry."""
    encoder = _Encoder()
    packed = encoder.pack(value)
    descriptors = msgpack.packb(encoder.descriptors, use_bin_type=True)
    return b"\x92" + descriptors + packed, encoder.buffers  # 0x92: an array of 2


# -- checking a caller's value ------------------------------------------------------------
def check_value(value: Any, where: str) -> None:
    """Raises :class:`WireTypeError` naming the place (``where`` and the path
    inside it) of the first part of ``value`` the schema cannot carry."""
    stack: List[Tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        kind = type(item)
        if item is None or kind in (bool, float, str, bytes):
            continue
        if kind is int:
            if not -MAX_INT - 1 <= item <= MAX_INT:
                raise WireTypeError(f"{path} is an int outside 64 bits ({item})")
            continue
        if isinstance(item, Tensor):
            if type(item) is not Tensor and type(item) is not torch.nn.Parameter:
                raise WireTypeError(f"{path} is a tensor subclass ({kind.__qualname__}): "
                                    "only plain tensors travel")
            if item.layout != torch.strided or item.is_quantized or item.is_nested:
                raise WireTypeError(f"{path} is a {item.layout} tensor: only dense tensors "
                                    "travel")
            if item.dtype not in _NAMES:
                raise WireTypeError(f"{path} is a tensor of dtype {item.dtype}; the wire "
                                    f"carries {sorted(DTYPES)}")
            continue
        if depth >= MAX_DEPTH:
            raise WireTypeError(f"{path} is nested more than {MAX_DEPTH} levels deep")
        if kind in (list, tuple):
            stack.extend((x, f"{path}[{k}]", depth + 1) for k, x in enumerate(item))
            continue
        if kind is dict:
            for key, x in item.items():
                if type(key) is not str:
                    raise WireTypeError(f"{path} has a key {key!r} of type "
                                        f"{type(key).__qualname__}: dict keys must be str")
                stack.append((x, f"{path}[{key!r}]", depth + 1))
            continue
        raise WireTypeError(f"{path} is a {kind.__module__}.{kind.__qualname__}, which cannot "
                            "travel: messages carry tensors, numbers, strings, bytes, bools, "
                            "None and lists, tuples and str-keyed dicts of them")


# -- decoding -----------------------------------------------------------------------------
def _int(value: Any, lo: int, hi: int, what: str) -> int:
    if type(value) is not int or not lo <= value < hi:
        raise WireError(f"{what} must be an int in [{lo}, {hi}), got {value!r:.40}")
    return value


def _flat(buffer: Any, nbytes: int) -> Tensor:
    """Buffer ``buffer`` as a writable 1-D uint8 tensor (shared, or copied
    when it arrived read-only)."""
    if isinstance(buffer, Tensor):
        if buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous() \
                and buffer.device.type == "cpu" and type(buffer) is Tensor:
            return buffer.detach()
        raise WireError("a buffer tensor must be a contiguous 1-D uint8 CPU tensor")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    view = buffer_view(buffer)
    if view.readonly:
        return torch.frombuffer(bytearray(view), dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def _tensor(descriptor: Any, buffer: Any, k: int) -> Tensor:
    if type(descriptor) is not list or len(descriptor) != 4:
        raise WireError(f"tensor {k}: a descriptor is [dtype, shape, strides, requires_grad], "
                        f"got {descriptor!r:.80}")
    name, shape, strides, requires_grad = descriptor
    dtype = DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise WireError(f"tensor {k}: dtype {name!r:.40} is not one the wire carries")
    if type(shape) is not list or type(strides) is not list or len(shape) != len(strides) \
            or len(shape) > MAX_DIMS:
        raise WireError(f"tensor {k}: shape and strides must be two lists of at most "
                        f"{MAX_DIMS} ints of the same length")
    sizes = [_int(n, 0, _DIM_LIMIT, f"tensor {k}: a size") for n in shape]
    steps = [_int(s, 0, _DIM_LIMIT, f"tensor {k}: a stride") for s in strides]
    if type(requires_grad) is not bool:
        raise WireError(f"tensor {k}: requires_grad must be a bool")
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise WireError(f"tensor {k}: a {name} tensor cannot require grad")
    numel = math.prod(sizes)
    if numel > MAX_ELEMENTS:
        raise WireError(f"tensor {k}: {numel} elements, more than {MAX_ELEMENTS}")
    span = 0 if numel == 0 else 1 + sum((n - 1) * s for n, s in zip(sizes, steps))
    itemsize = dtype.itemsize
    nbytes = buffer_view(buffer).nbytes if not isinstance(buffer, Tensor) \
        else buffer.numel() * buffer.element_size()
    if nbytes != span * itemsize:
        raise WireError(f"tensor {k}: its elements span {span * itemsize} bytes, its buffer "
                        f"has {nbytes}")
    flat = _flat(buffer, nbytes)
    if span == 0:
        typed = torch.empty(0, dtype=dtype)
    else:
        if flat.storage_offset() % itemsize:
            flat = flat.clone()
        typed = flat.view(dtype)
    tensor = typed.as_strided(sizes, steps)
    return tensor.requires_grad_() if requires_grad else tensor


def _unpacker(size: int, hook: Callable[[int, bytes], Any]) -> Any:
    return msgpack.Unpacker(raw=False, strict_map_key=True, use_list=True, ext_hook=hook,
                            max_buffer_size=max(size, 1))


def decode(body: Any, buffers: Sequence[Any]) -> Any:
    """The value of a message body whose tensors are ``buffers`` (see the
    module docstring's table); raises :class:`WireError` for anything else."""
    tensors: Optional[List[Tensor]] = None
    depth = [0]

    def hook(code: int, data: bytes) -> Any:
        if code == _TENSOR:
            if tensors is None or len(data) != _INDEX.size:
                raise WireError("a tensor reference outside the message's value")
            index = _INDEX.unpack(data)[0]
            if index >= len(tensors):
                raise WireError(f"a reference to tensor {index} of {len(tensors)}")
            return tensors[index]
        if code == _TUPLE:
            if depth[0] >= MAX_DEPTH:
                raise WireError(f"tuples nested more than {MAX_DEPTH} deep")
            depth[0] += 1
            try:
                inner = _unpacker(len(data), hook)
                inner.feed(data)
                items = inner.unpack()
                _no_more(inner)
            finally:
                depth[0] -= 1
            if type(items) is not list:
                raise WireError("a tuple must hold an array")
            return tuple(items)
        raise WireError(f"unknown extension type {code}")

    try:
        data = bytes(body) if not isinstance(body, bytes) else body
        unpacker = _unpacker(len(data), hook)
        unpacker.feed(data)
        if unpacker.read_array_header() != 2:
            raise WireError("a body is an array of two: [descriptors, value]")
        descriptors = unpacker.unpack()
        if type(descriptors) is not list or len(descriptors) != len(buffers):
            raise WireError(f"{len(buffers)} buffers arrived with "
                            f"{len(descriptors) if type(descriptors) is list else '?'} "
                            "tensor descriptors")
        tensors = [_tensor(d, b, k) for k, (d, b) in enumerate(zip(descriptors, buffers))]
        value = unpacker.unpack()
        _no_more(unpacker)
        return value
    except WireError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the bytes: one error type
        raise WireError(f"malformed message body: {type(error).__name__}: {error}") from None


def _no_more(unpacker: Any) -> None:
    try:
        unpacker.unpack()
    except msgpack.OutOfData:
        return
    raise WireError("bytes left over after the message's value")
