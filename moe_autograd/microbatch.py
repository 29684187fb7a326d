"""``Batch``: the unit of data that checkpoints and skip trackers manipulate.

A batch is either *atomic* (exactly one tensor, ``.tensor``) or a tuple of
values that may mix tensors and other objects (``.values``). Checkpointing and
portals need to attach ordering edges to "some tensor of the batch";
:meth:`Batch.find_tensor_idx` names the first one, and item assignment lets
them replace it by a joined copy without disturbing the other values.

Compatibility with the pipeline library (torchgpipe): code written against
its ``Batch`` runs unchanged here, and this module's own spellings (PyTorch's
``torch.distributed.pipeline`` ones) keep working:

* ``batch.tensors`` is ``batch.values``; ``batch.value`` and
  ``batch.tensor_or_tensors`` are the tensor or the tuple, whichever it holds;
* ``batch.call(f)`` calls ``f(tensor)`` on an atomic batch. On a tuple,
  torchgpipe calls ``f(values)`` and this module ``f(*values)``: it unpacks
  unless ``f``'s signature takes the tuple as one argument but not the values
  unpacked; ``call(f, unpack=False)`` / ``unpack=True`` decide explicitly
  (a one-value tuple and a one-argument ``f`` fit both: unpacked);
* ``batch[:] = (t,)`` replaces an atomic batch's tensor, as in torchgpipe;
  other slices of an atomic batch raise ``TypeError`` (torchgpipe:
  ``NotImplementedError``); a non-atomic batch takes any slice.

Error texts start with torchgpipe's (``not atomic batch``, ``batch is
atomic``, ``atomic batch allows index 0 only``, ``atomic batch cannot be
replaced with multiple tensors``), so code matching on them still matches.
"""
import inspect
import typing
from typing import Any, Callable, Iterator, List, Optional, Tuple, Union, cast

import torch
from torch import Tensor, nn

__all__ = ["Batch"]

Function = Callable[..., Any]


def _binds(function: Function, args: Tuple[Any, ...]) -> Optional[bool]:
    """Whether ``function(*args)`` fits its signature; None if unknown."""
    target = function.forward if isinstance(function, nn.Module) else function
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


class Batch:
    """A tensor or a tuple of values, with the helpers checkpointing needs."""

    def __init__(self, values: Union[Tensor, Tuple[Any, ...], List[Any]]) -> None:
        self._values: Union[Tensor, Tuple[Any, ...]] = (
            values if isinstance(values, Tensor) else tuple(values)
        )
        self.atomic = isinstance(values, Tensor)

    @property
    def tensor(self) -> Tensor:
        """The tensor of an atomic batch."""
        if not self.atomic:
            raise AttributeError("not atomic batch: use .values (or .tensors)")
        return cast(Tensor, self._values)

    @property
    def values(self) -> Tuple[Any, ...]:
        """The values of a non-atomic batch."""
        if self.atomic:
            raise AttributeError("batch is atomic: it has no .values, use .tensor")
        return cast(Tuple[Any, ...], self._values)

    @property
    def tensors(self) -> Tuple[Any, ...]:
        """The values of a non-atomic batch (torchgpipe's spelling of ``values``)."""
        if self.atomic:
            raise AttributeError("batch is atomic: it has no .tensors, use .tensor")
        return cast(Tuple[Any, ...], self._values)

    @property
    def value(self) -> Union[Tensor, Tuple[Any, ...]]:
        """The tensor (atomic) or the tuple of values, whichever the batch holds."""
        return self._values

    @value.setter
    def value(self, value: Union[Tensor, Tuple[Any, ...], List[Any]]) -> None:
        self._values = value if isinstance(value, Tensor) else tuple(value)
        self.atomic = isinstance(value, Tensor)

    @property
    def tensor_or_tensors(self) -> Union[Tensor, Tuple[Any, ...]]:
        """torchgpipe's name for :attr:`value`."""
        return self._values

    def find_tensor_idx(self) -> int:
        """The index of the first tensor; raises TypeError if there is none."""
        if self.atomic:
            return 0
        for i, value in enumerate(self.values):
            if isinstance(value, Tensor):
                return i
        raise TypeError("the batch holds no tensor")

    def get_device(self) -> torch.device:
        """The device of the first tensor."""
        return cast(Tensor, self[self.find_tensor_idx()]).device

    def call(self, function: Function, *, unpack: Optional[bool] = None) -> "Batch":
        """Calls ``function`` and wraps its result in a :class:`Batch`.

        Atomic: ``function(tensor)``. Non-atomic: ``function(*values)``
        (``unpack=True``) or ``function(values)`` (``unpack=False``,
        torchgpipe's convention). By default the values are unpacked, unless
        ``function``'s signature (a module's ``forward``'s) accepts the tuple
        as one argument but not the values unpacked.
        """
        if self.atomic:
            return Batch(function(self._values))
        values = self.values
        if unpack is None:
            unpack = not (_binds(function, (values,)) and _binds(function, values) is False)
        return Batch(function(*values) if unpack else function(values))

    def __repr__(self) -> str:
        return f"Batch[atomic={self.atomic!r}]({self._values!r})"

    def __iter__(self) -> Iterator[Any]:
        if self.atomic:
            yield self._values
        else:
            yield from self.values

    def __len__(self) -> int:
        return 1 if self.atomic else len(self.values)

    def __getitem__(self, index: int) -> Any:
        if not self.atomic:
            return self.values[index]
        if index != 0:
            raise IndexError("atomic batch allows index 0 only")
        return self._values

    @typing.overload
    def __setitem__(self, index: int, value: Any) -> None: ...

    @typing.overload
    def __setitem__(self, index: slice, value: Tuple[Any, ...]) -> None: ...

    def __setitem__(self, index: Union[int, slice], value: Any) -> None:
        if isinstance(index, slice):
            if self.atomic:
                if not index.start is index.stop is index.step is None:
                    raise TypeError("only slice [:] supported on an atomic batch")
                if len(value) != 1:
                    raise IndexError("atomic batch cannot be replaced with multiple tensors")
                self[0] = value[0]
                return
            values = list(self.values)
            values[index] = value
            self._values = tuple(values)
            return
        if self.atomic:
            if index != 0:
                raise IndexError("atomic batch allows index 0 only")
            if not isinstance(value, Tensor):
                raise TypeError(f"an atomic batch holds a tensor, not {type(value).__name__}")
            self._values = value
            return
        values = list(self.values)
        values[index] = value
        self._values = tuple(values)
