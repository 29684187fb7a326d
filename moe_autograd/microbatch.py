"""``Batch``: the unit of data that checkpoints and skip trackers manipulate.

A batch is either *atomic* (exactly one tensor, ``.tensor``) or a tuple of
values that may mix tensors and other objects (``.values``). Checkpointing and
portals need to attach ordering edges to "some tensor of the batch";
:meth:`Batch.find_tensor_idx` names the first one, and item assignment lets
them replace it by a joined copy without disturbing the other values.
"""
import typing
from typing import Any, Callable, Iterator, List, Tuple, Union, cast

import torch
from torch import Tensor

__all__ = ["Batch"]

Function = Callable[[Any], Any]


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
            raise AttributeError("not an atomic batch: use .values")
        return cast(Tensor, self._values)

    @property
    def values(self) -> Tuple[Any, ...]:
        """The values of a non-atomic batch."""
        if self.atomic:
            raise AttributeError("an atomic batch has no .values: use .tensor")
        return cast(Tuple[Any, ...], self._values)

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

    def call(self, function: Function) -> "Batch":
        """Calls ``function`` on the tensor (atomic) or on the unpacked values."""
        if self.atomic:
            return Batch(function(self._values))
        return Batch(function(*self.values))

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
                raise TypeError("an atomic batch cannot be sliced")
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
