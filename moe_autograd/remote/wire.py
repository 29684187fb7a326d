"""The body of a message: schema values and tensors, and nothing that runs.

Why: a message that can carry a Python object can carry code (pickle's
``__reduce__``), so every message of remote experts is a fixed schema
instead: ``None``, ``bool``, ``int`` (64 bits), ``float``, ``str``,
``bytes``, lists, tuples, dicts with ``str`` keys, and tensors, nested. The
body is msgpack; each tensor travels as a descriptor in the body and one raw
buffer beside it (TensorPipe and Ray move buffers without copying them into
the body). Decoding is msgpack's and ``torch.frombuffer``'s: no path from a
payload to a function.

Body layout: the msgpack of the value, where a tensor is the extension type
1 holding its descriptor (little-endian: buffer index uint32, dtype code
uint8, requires_grad uint8, dimensions uint8, then a uint64 size and a
uint64 stride per dimension; a tensor used twice travels once and arrives as
one object), and a tuple the extension type 2 holding its items, packed the
same way (so tuples stay tuples, lists stay lists). One pass of msgpack's C
decoder reads it all: each tensor is made where its descriptor is met (a
body with compressed tensors is read twice: their sizes first, then their
values).

A compressed tensor (a :class:`~.compression.Compressed` in the value, see
:mod:`.compression`) is the extension type 3: payload buffer index uint32,
scales buffer index uint32 (``0xFFFFFFFF``: none), codec id uint8, dtype
code uint8, requires_grad uint8, dimensions uint8, block size uint32, then a
uint64 size per dimension (it arrives contiguous). Its payload and its scales
are raw buffers like any tensor's; where the codec does not apply
(:mod:`.compression`'s Rules 1 and 2) the tensor travels as the type 1.

Life of a received message (:func:`decode`, within a :class:`Limits`: a
server's endpoint gives each job its own, :func:`Limits.for_budget` of the
job's budget)::

    step                             what is checked or done
    -------------------------------  ---------------------------------------------------
    before anything is read          the body's length: at most ``Limits.body_bytes``
                                     (:class:`TooLarge`)
    body read (msgpack's C decoder,  each list, tuple and dict counted as it is made:
    once)                            at most ``Limits.containers`` + one per
                                     :data:`BODY_BYTES_PER_CONTAINER` bytes of body, nested
                                     at most ``Limits.depth`` deep, tuples at most
                                     :data:`MAX_DEPTH` (:class:`TooLarge`); so the body's
                                     objects take at most about :data:`BODY_AMPLIFICATION`
                                     times its bytes
    descriptor read                  a buffer that exists and that no other descriptor
                                     claimed (a repeated reference must repeat the same
                                     descriptor); dtype in :data:`DTYPES`; at most
                                     :data:`MAX_DIMS` sizes and strides, each in
                                     [0, 2**48); elements at most :data:`MAX_ELEMENTS`; the
                                     bytes its elements span equal its buffer's length;
                                     requires_grad only for floating and complex dtypes;
                                     compressed (type 3): the codec carries the dtype, the
                                     payload and scales lengths match (from the lengths:
                                     nothing read), and its decoded bytes, with those of
                                     the compressed tensors before it, are at most
                                     ``Limits.tensor_bytes`` (:class:`TooLarge`)
    tensor made                      a view of its buffer (``frombuffer``, ``as_strided``):
                                     no allocation but a copy of a read-only buffer, so
                                     nothing beyond what arrived is allocated here; a
                                     compressed tensor is not decoded yet
    body read again (only with       the first reading dropped; every compressed tensor
    compressed tensors)              decoded (scales finite and >= 0, no int8 -128:
                                     :mod:`.compression`, Rule 3), each into the size its
                                     descriptor declared (plus :data:`~.compression.CHUNK`
                                     float32 elements of scratch); the body read again,
                                     each descriptor now its decoded tensor
    value read                       every buffer claimed by a tensor; no bytes left over

What a server materialises from a tensor is ``numel * element_size`` (a
stride-0 expanded tensor arrives as one element, and counts in full):
:mod:`.sizes` counts that, per job, before anything runs.

Invariants:

* ``decode(*encode(v))`` equals ``v``: the same types, tensors with the same
  dtype, shape, strides (where the elements span no more than their number:
  expanded and permuted tensors keep their strides; a sparse window of a
  larger storage travels contiguous), values and ``requires_grad``; a
  :class:`~.compression.Compressed` tensor arrives as a plain contiguous
  tensor of its dtype and shape, its values within the codec's bounds.
* :func:`encode` refuses what msgpack cannot carry with
  :class:`WireTypeError` naming it; :func:`check_value` refuses all that the
  schema does not carry (dict keys other than ``str`` included, which
  ``encode`` leaves to the receiver) and says where it is in a caller's
  value (``argument 1[0]['x']``). Every value that comes from user code
  (an expert's arguments, a control payload, an operation's arguments and
  result) is checked with it before it is encoded.
* :func:`decode` raises only :class:`WireError`, whatever the bytes; past its
  :class:`Limits`, the :class:`WireError` :class:`TooLarge`, naming what was
  too big and the limit, before anything of it is decoded.
* Decoding allocates at most about :data:`BODY_AMPLIFICATION` times the
  body's bytes (its objects, while counted), one copy of the buffers that
  arrived read-only, and the decoded bytes of its compressed tensors, which
  ``Limits.tensor_bytes`` admitted before the first is decoded (a raw tensor
  is a view of its buffer).
"""
import math
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import msgpack  # type: ignore[import-untyped]
import torch
from torch import Tensor

from . import compression as cz
from .frame import MAX_BODY_BYTES, buffer_view

__all__ = ["encode", "decode", "check_value", "WireError", "WireTypeError", "TooLarge", "Limits",
           "DTYPES", "MAX_DIMS", "MAX_DEPTH", "MAX_ELEMENTS", "MAX_INT", "tensor_nbytes",
           "BODY_SHARE", "MIN_BODY_BYTES", "FREE_CONTAINERS", "BODY_BYTES_PER_CONTAINER",
           "MAX_BODY_DEPTH", "BODY_AMPLIFICATION"]

#: Dtypes a message may carry, by their name.
DTYPES: Dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "complex64": torch.complex64, "complex128": torch.complex128,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool}
_BY_CODE: List[torch.dtype] = list(DTYPES.values())  # the code of a dtype is its index
_CODES: Dict[torch.dtype, int] = {dtype: code for code, dtype in enumerate(_BY_CODE)}
MAX_DIMS = 32
MAX_DEPTH = 64
MAX_ELEMENTS = 1 << 48
MAX_INT = (1 << 63) - 1
_DIM_LIMIT = 1 << 48
_TENSOR, _TUPLE, _PACKED = 1, 2, 3
_NO_SCALES = 0xFFFFFFFF
#: A compressed tensor's descriptor per number of dimensions (see the module docstring).
_PACKED_DESCRIPTORS = [struct.Struct("<IIBBBBI" + "Q" * n) for n in range(MAX_DIMS + 1)]
_PACKED_HEAD = _PACKED_DESCRIPTORS[0]
_HEAD = struct.Struct("<IBBB")  # buffer index, dtype code, requires_grad, dimensions
#: A whole descriptor per number of dimensions: the head, then sizes, then strides.
_DESCRIPTORS = [struct.Struct("<IBBB" + "Q" * (2 * n)) for n in range(MAX_DIMS + 1)]
_COMPLEX = frozenset(code for code, dtype in enumerate(_BY_CODE) if dtype.is_complex)
_STRIDED = torch.strided
_UINT8 = torch.uint8


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
def _ext(code_data: Tuple[int, bytes]) -> Any:
    """``msgpack.ExtType(code, data)`` without its ``__new__``'s checks in
    Python (a microsecond a tensor): our codes are 1 to 3 and our data
    bytes, and msgpack's C packer reads the named tuple's two fields."""
    return _new_tuple(msgpack.ExtType, code_data)


_new_tuple = tuple.__new__
_META = "a meta tensor cannot travel: it has no data to send"


class _Encoder:
    __slots__ = ("buffers", "index", "keep")

    def __init__(self) -> None:
        self.buffers: List[Tensor] = []
        self.index: Dict[Any, bytes] = {}  # id(tensor) (or with a codec) -> its descriptor
        self.keep: List[Tensor] = []  # ids stay unique while encoding

    def default(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            if obj.is_meta:
                raise WireTypeError(_META)
            return _ext((_TENSOR, self.tensor(obj)))
        if type(obj) is cz.Compressed:
            if isinstance(obj.tensor, Tensor) and obj.tensor.is_meta:
                raise WireTypeError(_META)
            packed = self.packed(obj)
            return _ext((_TENSOR, self.tensor(obj.tensor))) if packed is None \
                else _ext((_PACKED, packed))
        if type(obj) is tuple:
            return _ext((_TUPLE, self.pack(list(obj))))
        if type(obj) is int:  # msgpack hands over the ints it cannot pack
            raise WireTypeError(f"an int outside 64 bits ({obj}) cannot travel: the wire "
                                f"carries ints from {-MAX_INT - 1} to {MAX_INT}")
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

    def tensor(self, tensor: Tensor) -> bytes:
        key = id(tensor)
        found = self.index.get(key)
        if found is not None:
            return found
        data = tensor.detach()
        if type(data) is not Tensor:
            raise WireTypeError(f"a tensor subclass ({type(tensor).__qualname__}) cannot "
                                "travel: send a plain torch.Tensor")
        code = _CODES.get(data.dtype)  # (quantized dtypes are not among them)
        if data.layout is not _STRIDED or data.is_nested or code is None:
            if code is None:
                raise WireTypeError(f"a tensor of dtype {data.dtype} cannot travel; the wire "
                                    f"carries {sorted(DTYPES)}")
            raise WireTypeError(f"a {data.layout} tensor cannot travel: only dense (strided) "
                                "tensors")
        if not data.is_cpu:
            data = data.cpu()
        if code in _COMPLEX:  # conjugate and negative bits: values, not views, travel
            data = data.resolve_conj().resolve_neg()
        if data.is_contiguous():  # the common case: its elements are its window
            raw = data.reshape(-1).view(torch.uint8) if data.numel() \
                else torch.empty(0, dtype=torch.uint8)
        else:
            span = _span(data)
            if span > data.numel():  # a sparse window of a larger storage: send it dense
                data = data.contiguous()
                span = data.numel()
            raw = data.as_strided((span,), (1,), data.storage_offset()).view(torch.uint8) \
                if span else torch.empty(0, dtype=torch.uint8)
        shape = data.shape
        ndim = len(shape)
        if ndim > MAX_DIMS:
            raise WireTypeError(f"a tensor of {ndim} dimensions cannot travel (at most "
                                f"{MAX_DIMS})")
        payload = _DESCRIPTORS[ndim].pack(len(self.buffers), code, tensor.requires_grad, ndim,
                                          *shape, *data.stride())
        self.buffers.append(raw)
        self.index[key] = payload
        self.keep.append(tensor)
        return payload


    def packed(self, wrapped: cz.Compressed) -> Optional[bytes]:
        """The descriptor of a compressed tensor, or ``None``: it travels raw."""
        tensor, codec = wrapped.tensor, wrapped.codec
        if not isinstance(tensor, Tensor):
            raise WireTypeError(f"Compressed holds a {type(tensor).__qualname__}, not a tensor")
        key = (id(tensor), codec)
        found = self.index.get(key)
        if found is not None:
            return found
        data = tensor.detach()
        if type(data) is not Tensor or data.layout is not _STRIDED or data.is_nested \
                or not cz.applies(data.dtype, codec):
            return None
        if data.dim() > MAX_DIMS:
            raise WireTypeError(f"a tensor of {data.dim()} dimensions cannot travel (at most "
                                f"{MAX_DIMS})")
        if not data.is_cpu:
            data = data.cpu()
        made = cz.compress(data, codec)
        if made is None:
            return None
        payload, scales = made
        index = len(self.buffers)
        self.buffers.append(payload.view(torch.uint8))
        scales_index = _NO_SCALES
        if scales is not None:
            scales_index = len(self.buffers)
            self.buffers.append(scales.view(torch.uint8))
        shape = data.shape
        descriptor = _PACKED_DESCRIPTORS[len(shape)].pack(
            index, scales_index, cz.CODEC_IDS[codec], _CODES[data.dtype], tensor.requires_grad,
            len(shape), cz.BLOCK if scales is not None else 0, *shape)
        self.index[key] = descriptor
        self.keep.append(tensor)
        return descriptor


def encode(value: Any) -> Tuple[bytes, List[Tensor]]:
    """``(body, buffers)`` of ``value`` (see the module docstring); the
    buffers are 1-D uint8 CPU tensors, views where no copy was needed.
    Raises :class:`WireTypeError` for what the schema cannot carry."""
    encoder = _Encoder()
    body = encoder.pack(value)
    return body, encoder.buffers


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
        if kind is cz.Compressed:
            item = item.tensor
            kind = type(item)
            if not isinstance(item, Tensor):
                raise WireTypeError(f"{path} is a Compressed of a {kind.__qualname__}, not a "
                                    "tensor")
        if isinstance(item, Tensor):
            if type(item) is not Tensor and type(item) is not torch.nn.Parameter:
                raise WireTypeError(f"{path} is a tensor subclass ({kind.__qualname__}): "
                                    "only plain tensors travel")
            if item.layout != torch.strided or item.is_quantized or item.is_nested:
                raise WireTypeError(f"{path} is a {item.layout} tensor: only dense tensors "
                                    "travel")
            if item.dtype not in _CODES:
                raise WireTypeError(f"{path} is a tensor of dtype {item.dtype}; the wire "
                                    f"carries {sorted(DTYPES)}")
            if item.is_meta:
                raise WireTypeError(f"{path} is a meta tensor: it has no data to send")
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
def _flat(buffer: Any) -> Tensor:
    """Buffer ``buffer`` as a writable 1-D uint8 tensor (shared, or copied
    when it arrived read-only)."""
    if isinstance(buffer, Tensor):
        if type(buffer) is Tensor and buffer.dtype is _UINT8 and buffer.dim() == 1 \
                and buffer.is_cpu and buffer.is_contiguous():
            return buffer  # (uint8: nothing to detach; every tensor made of it is a new view)
        raise WireError("a buffer tensor must be a contiguous 1-D uint8 CPU tensor")
    view = buffer_view(buffer)
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        return torch.frombuffer(bytearray(view), dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


#: A body's length past which msgpack's objects could take more than the
#: tensors a request may carry: see :meth:`Limits.for_budget`.
BODY_SHARE = 32
MIN_BODY_BYTES = 1 << 20
#: Containers a body may hold whatever its length, and bytes of body per container beyond them.
FREE_CONTAINERS = 1024
BODY_BYTES_PER_CONTAINER = 8
#: How deep a body's containers nest: a value's :data:`MAX_DEPTH` and the message around it.
MAX_BODY_DEPTH = MAX_DEPTH + 16
#: About the most bytes of Python objects msgpack makes per byte of body within
#: these limits (two-character strings: 3 bytes on the wire, 58 in memory; measured,
#: ``tests/remote/test_wire.py``).
BODY_AMPLIFICATION = 24


@dataclass(frozen=True)
class Limits:
    """What decoding one body may take, checked before (or while) it is
    read, never after it is built (see the module docstring's table).

    * ``tensor_bytes``: the compressed tensors' decoded bytes (``numel *
      element_size``), all of them together, checked from their descriptors
      before any is decoded (``None``: no bound but Rule 3's 8 bytes per
      payload byte).
    * ``body_bytes``: the body's length, checked before it is parsed.
    * ``containers``: lists, tuples and dicts in the body, at most
      ``containers + len(body) // BODY_BYTES_PER_CONTAINER``.
    * ``depth``: how deep they nest, all kinds together.
    """

    tensor_bytes: Optional[int] = None
    body_bytes: int = MAX_BODY_BYTES
    containers: int = FREE_CONTAINERS
    depth: int = MAX_BODY_DEPTH

    @classmethod
    def for_budget(cls, budget: Optional[int]) -> "Limits":
        """The limits of a request whose tensors may take ``budget`` bytes
        (``None``: unbounded): its compressed tensors decode to at most that,
        and its body is at most ``budget // BODY_SHARE`` bytes (between
        :data:`MIN_BODY_BYTES` and :data:`MAX_BODY_BYTES`), so its objects
        take at most about ``budget`` * :data:`BODY_AMPLIFICATION` /
        :data:`BODY_SHARE` bytes."""
        if budget is None:
            return cls()
        return cls(tensor_bytes=budget,
                   body_bytes=max(MIN_BODY_BYTES, min(MAX_BODY_BYTES, budget // BODY_SHARE)))


class TooLarge(WireError):
    """A body, or the tensors it declares, past a :class:`Limits`: refused
    before it is built (the message says what, and which limit)."""


class _Pending:
    """A compressed tensor seen, checked and counted, not decoded yet."""

    __slots__ = ("codec", "dtype", "sizes", "payload", "scales", "block", "requires_grad")

    def __init__(self, codec: int, dtype: torch.dtype, sizes: Tuple[int, ...], payload: Tensor,
                 scales: Optional[Tensor], block: int, requires_grad: bool) -> None:
        self.codec, self.dtype, self.sizes = codec, dtype, sizes
        self.payload, self.scales, self.block = payload, scales, block
        self.requires_grad = requires_grad

    def decoded(self) -> Tensor:
        tensor = cz.decompress(self.codec, self.dtype, self.sizes, self.payload, self.scales,
                               self.block)
        if self.requires_grad:
            tensor.requires_grad_()
        return tensor


_LEAVES = frozenset({type(None), bool, int, float, str, bytes, Tensor, _Pending})


class _Decoder:
    """The extension types of one message (its tensors, its tuples), and the
    counts its :class:`Limits` bound. A class rather than a closure: a
    closure that names itself (tuples nest) would be a reference cycle
    holding the message's tensors until a GC pass."""

    __slots__ = ("buffers", "limits", "made", "scales", "depth", "containers", "max_containers",
                 "depths", "pending", "declared")

    def __init__(self, buffers: Sequence[Any], limits: Limits, body_bytes: int) -> None:
        self.buffers = buffers
        self.limits = limits
        # buffer -> (descriptor, tensor; a compressed one _Pending until decoded)
        self.made: Dict[int, Tuple[bytes, Any]] = {}
        self.scales: Set[int] = set()  # buffers claimed as a compressed tensor's scales
        self.depth = 0  # tuples open
        self.max_containers = limits.containers + body_bytes // BODY_BYTES_PER_CONTAINER
        self.containers = 0
        self.depths: Dict[int, int] = {}  # id of a container nesting others -> its depth
        self.pending: List[int] = []  # buffers of compressed tensors to decode
        self.declared = 0  # their decoded bytes

    def parse(self, data: bytes) -> Any:
        """One msgpack value (a body, or a tuple's items), counted."""
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True,
                               ext_hook=self.hook, list_hook=self.counted,
                               object_hook=self.counted_map)

    def counted_map(self, value: Dict[str, Any]) -> Dict[str, Any]:
        self.containers += 1  # (count's first lines, inlined: one per container)
        if self.containers > self.max_containers or value and not _LEAVES.issuperset(
                map(type, value.values())):
            self.containers -= 1
            self.count(value, value.values())
        return value

    def counted(self, value: List[Any]) -> List[Any]:
        self.containers += 1
        if self.containers > self.max_containers or value and not _LEAVES.issuperset(
                map(type, value)):
            self.containers -= 1
            self.count(value, value)
        return value

    def count(self, container: Any, items: Any) -> None:
        """Counts a container msgpack just made (its items before it) against the limits."""
        self.containers += 1
        if self.containers > self.max_containers:
            raise TooLarge(f"a body holding more than {self.max_containers} lists, tuples and "
                           f"dicts (at most {self.limits.containers} and one per "
                           f"{BODY_BYTES_PER_CONTAINER} bytes of body)")
        if not container or _LEAVES.issuperset(map(type, items)):
            return  # depth 1: not noted
        depths = self.depths
        deepest = 1
        for item in items:
            if type(item) in (list, dict, tuple):
                deepest = max(deepest, depths.get(id(item), 1))
        if deepest + 1 > self.limits.depth:
            raise TooLarge(f"lists, tuples and dicts nested more than {self.limits.depth} deep")
        depths[id(container)] = deepest + 1

    def hook(self, code: int, data: bytes) -> Any:
        if code == _TENSOR:
            return self.tensor(data)
        if code == _PACKED:
            return self.packed(data)
        if code == _TUPLE:
            if self.depth >= MAX_DEPTH:
                raise WireError(f"tuples nested more than {MAX_DEPTH} deep")
            self.depth += 1
            try:
                items = self.parse(data)
            finally:
                self.depth -= 1
            if type(items) is not list:
                raise WireError("a tuple must hold an array")
            made = tuple(items)
            depth = self.depths.pop(id(items), None)  # the tuple nests what its list did
            if depth is not None:
                self.depths[id(made)] = depth
            return made
        raise WireError(f"unknown extension type {code}")

    def tensor(self, data: bytes) -> Tensor:
        if len(data) < _HEAD.size:
            raise WireError("a tensor descriptor shorter than its header")
        ndim = data[_HEAD.size - 1]
        if ndim > MAX_DIMS or len(data) != _DESCRIPTORS[ndim].size:
            index = _HEAD.unpack_from(data)[0]
            raise WireError(f"tensor {index}: a malformed descriptor")
        fields = _DESCRIPTORS[ndim].unpack(data)
        index, code, requires_grad = fields[0], fields[1], fields[2]
        made = self.made.get(index)
        if made is not None:  # the same tensor again: the same descriptor, the same object
            if made[0] != data:
                raise WireError(f"buffer {index} claimed by two different tensors")
            return made[1]  # type: ignore[no-any-return]
        if index in self.scales:
            raise WireError(f"buffer {index} claimed by a tensor and as scales")
        if index >= len(self.buffers):
            raise WireError(f"a tensor of buffer {index}, of {len(self.buffers)}")
        if code >= len(_BY_CODE) or requires_grad > 1:
            raise WireError(f"tensor {index}: a malformed descriptor")
        sizes, steps = fields[4:4 + ndim], fields[4 + ndim:]
        if ndim and max(fields[4:]) >= _DIM_LIMIT:
            raise WireError(f"tensor {index}: a size or stride past 2**48")
        dtype = _BY_CODE[code]
        if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
            raise WireError(f"tensor {index}: a {dtype} tensor cannot require grad")
        numel = math.prod(sizes)
        if numel > MAX_ELEMENTS:
            raise WireError(f"tensor {index}: {numel} elements, more than {MAX_ELEMENTS}")
        span = 0 if numel == 0 else 1 + sum([(n - 1) * s for n, s in zip(sizes, steps)])
        itemsize = dtype.itemsize
        flat = _flat(self.buffers[index])
        nbytes = flat.numel()
        if nbytes != span * itemsize:
            raise WireError(f"tensor {index}: its elements span {span * itemsize} bytes, its "
                            f"buffer has {nbytes}")
        if span == 0:
            typed = torch.empty(0, dtype=dtype)
        else:
            if flat.storage_offset() % itemsize:
                flat = flat.clone()
            typed = flat.view(dtype)
        tensor = typed.as_strided(sizes, steps)
        if requires_grad:
            tensor.requires_grad_()
        self.made[index] = (data, tensor)
        return tensor

    def packed(self, data: bytes) -> Any:
        """A compressed tensor (extension type 3): checked and counted against
        :attr:`Limits.tensor_bytes` (a :class:`_Pending`), or, once
        :meth:`inflate` decoded it, the tensor."""
        if len(data) < _PACKED_HEAD.size:
            raise WireError("a compressed tensor's descriptor shorter than its header")
        ndim = data[_PACKED_HEAD.size - 5]
        if ndim > MAX_DIMS or len(data) != _PACKED_DESCRIPTORS[ndim].size:
            raise WireError("a compressed tensor's malformed descriptor")
        fields = _PACKED_DESCRIPTORS[ndim].unpack(data)
        index, scales_index, codec, code, requires_grad, _, block = fields[:7]
        sizes = tuple(fields[7:])
        key = data  # (a plain descriptor of the same buffer differs: made[index][0])
        made = self.made.get(index)
        if made is not None:
            if made[0] != key:
                raise WireError(f"buffer {index} claimed by two different tensors")
            return made[1]
        n = len(self.buffers)
        if index >= n or index in self.scales:
            raise WireError(f"a compressed tensor of buffer {index}, of {n} (or claimed twice)")
        has_scales = scales_index != _NO_SCALES
        if has_scales and (scales_index >= n or scales_index == index
                           or scales_index in self.made or scales_index in self.scales):
            raise WireError(f"compressed tensor {index}: scales in buffer {scales_index}, of "
                            f"{n} (or claimed twice)")
        if code >= len(_BY_CODE) or requires_grad > 1:
            raise WireError(f"compressed tensor {index}: a malformed descriptor")
        if ndim and max(sizes) >= _DIM_LIMIT:
            raise WireError(f"compressed tensor {index}: a size past 2**48")
        numel = math.prod(sizes)
        if numel > MAX_ELEMENTS:
            raise WireError(f"compressed tensor {index}: more than {MAX_ELEMENTS} elements")
        dtype = _BY_CODE[code]
        try:  # the lengths alone: nothing read, copied or allocated yet
            cz.check(codec, dtype, sizes, _nbytes(self.buffers[index]),
                     _nbytes(self.buffers[scales_index]) if has_scales else None, block)
        except cz.CompressionError as error:
            raise WireError(f"compressed tensor {index}: {error}") from None
        decoded = numel * dtype.itemsize
        limit = self.limits.tensor_bytes
        if limit is not None and self.declared + decoded > limit:
            raise TooLarge(f"compressed tensor {index} ({dtype}, shape {list(sizes)}) takes "
                           f"{decoded} bytes once decoded; with the {self.declared} bytes of "
                           f"the compressed tensors before it, more than the {limit} bytes "
                           "this request may declare")
        self.declared += decoded
        pending = _Pending(codec, dtype, sizes, _flat(self.buffers[index]),
                           _flat(self.buffers[scales_index]) if has_scales else None, block,
                           bool(requires_grad))
        self.made[index] = (key, pending)
        self.pending.append(index)
        if has_scales:
            self.scales.add(scales_index)
        return pending

    def inflate(self) -> None:
        """Decodes every compressed tensor seen (their sizes were admitted)."""
        for index in self.pending:
            key, pending = self.made[index]
            try:
                self.made[index] = (key, pending.decoded())
            except cz.CompressionError as error:
                raise WireError(f"compressed tensor {index}: {error}") from None
        self.pending.clear()

    def restart(self) -> None:
        """Counts from zero again (the same body, read a second time)."""
        self.containers = 0
        self.depths.clear()


def _nbytes(buffer: Any) -> int:
    """The length of a buffer, in bytes, without copying it (a tensor checked
    as :func:`_flat` checks it)."""
    if isinstance(buffer, Tensor):
        return _flat(buffer).numel()
    return buffer_view(buffer).nbytes


def decode(body: Any, buffers: Sequence[Any], limits: Optional[Limits] = None) -> Any:
    """The value of a message body whose tensors are ``buffers`` (see the
    module docstring's table), within ``limits`` (default: :class:`Limits`'s
    defaults); raises :class:`TooLarge` past them, :class:`WireError` for
    anything else."""
    limits = _DEFAULT_LIMITS if limits is None else limits
    try:
        size = len(body)
    except TypeError:
        raise WireError(f"a message body must be bytes, got {type(body).__name__}") from None
    if size > limits.body_bytes:
        raise TooLarge(f"a body of {size} bytes, more than the {limits.body_bytes} bytes this "
                       "request's body may take")
    decoder = _Decoder(buffers, limits, size)
    try:
        value = decoder.parse(body)
        if decoder.pending:  # every compressed tensor admitted: decode them, read again
            value = None  # (the first reading's objects go before the tensors come)
            decoder.inflate()
            decoder.restart()
            value = decoder.parse(body)
    except WireError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the bytes: one error type
        raise WireError(f"malformed message body: {type(error).__name__}: {error}") from None
    if len(decoder.made) + len(decoder.scales) != len(buffers):
        raise WireError(f"{len(buffers)} buffers arrived for {len(decoder.made)} tensors"
                        + (f" and {len(decoder.scales)} scales" if decoder.scales else ""))
    return value


_DEFAULT_LIMITS = Limits()
