"""Tensors in the Ray backend's messages travel as NumPy arrays
(:mod:`moe_autograd.remote.ray_wire`): what arrives equals what was sent,
aliasing included, and what NumPy cannot carry exactly takes torch's pickling."""
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from moe_autograd.remote.ray_wire import _WireTensor, to_wire

pytestmark = pytest.mark.timeout(30)


def _travel(value: Any) -> Any:
    return pickle.loads(pickle.dumps(to_wire(value), protocol=5))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex64])
def test_values_dtype_shape_and_requires_grad_arrive(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    t = (torch.randn(3, 5) * 10).to(dtype)
    leaf = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    scalar = torch.tensor(1.5)
    sent = ("ok", [(t, {"leaf": leaf}), scalar, None, "text"])
    wire = to_wire(sent)
    assert isinstance(wire[1][0][0], _WireTensor) and isinstance(wire[1][0][1]["leaf"], _WireTensor)
    got = _travel(sent)
    assert got[0] == "ok" and got[1][2:] == [None, "text"]
    for a, b in [(got[1][0][0], t), (got[1][0][1]["leaf"], leaf), (got[1][1], scalar)]:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.detach())
        assert a.requires_grad == b.requires_grad
    got[1][0][0].add_(1) if dtype != torch.bool else None  # writable memory of its own


def test_aliasing_is_what_torch_pickling_gives() -> None:
    base = torch.randn(4, 4)
    same, view = torch.randn(3), base[1]
    got = _travel([same, same, base, view])
    plain = pickle.loads(pickle.dumps([same, same, base, view], protocol=5))
    assert got[0] is got[1] and plain[0] is plain[1]  # one object twice: one tensor
    for received in (got, plain):  # a view and its base: two tensors of their own
        assert received[2].untyped_storage().data_ptr() != received[3].untyped_storage().data_ptr()
        assert torch.equal(received[3], view)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 3).t(),                          # transposed
    lambda: torch.ones(()).expand(32, 64),                  # an expanded gradient
    lambda: torch.randn(5, 6)[1:4, ::2],                    # a strided view with an offset
    lambda: torch.empty(0, 3),                              # no elements
])
def test_strides_arrive_and_only_the_elements_travel(make: Any) -> None:
    t = make()
    assert isinstance(to_wire((t,))[0], _WireTensor)
    got = _travel((t,))[0]
    assert got.shape == t.shape and got.stride() == t.stride() and torch.equal(got, t)
    assert got.untyped_storage().nbytes() <= t.untyped_storage().nbytes()


@pytest.mark.parametrize("make", [
    lambda: nn.Parameter(torch.randn(2)),                   # a subclass
    lambda: torch.randn(2, 2, dtype=torch.bfloat16),        # no NumPy dtype
    lambda: torch.randn(2, dtype=torch.complex64).conj(),   # a conjugate bit
    lambda: torch.randn(3).to_sparse(),                     # not strided
])
def test_what_numpy_cannot_carry_takes_torch_pickling(make: Any) -> None:
    t = make()
    assert to_wire((t,))[0] is t
    got = _travel((t,))[0]
    assert type(got) is type(t) and got.dtype == t.dtype and got.stride() == t.stride() \
        if t.layout == torch.strided else got.layout == t.layout


def test_a_read_only_array_is_copied() -> None:
    from moe_autograd.remote.ray_wire import _tensor_from_array

    array = torch.arange(4.0).numpy().copy()
    array.flags.writeable = False
    t = _tensor_from_array(array, (4,), (1,), False)
    t.add_(1)
    assert array.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_messages_without_eligible_tensors_are_returned_as_is() -> None:
    message = ("ok", [1, "a", {"b": None}])
    assert to_wire(message) is message
