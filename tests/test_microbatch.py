import pytest
import torch

from moe_autograd.microbatch import Batch


def test_atomic_batch():
    x = torch.tensor(42.0)
    b = Batch(x)
    assert b.atomic
    assert b.tensor is x
    assert b[0] is x
    assert len(b) == 1
    assert list(b) == [x]
    assert b.find_tensor_idx() == 0
    assert b.get_device() == torch.device("cpu")
    with pytest.raises(AttributeError):
        b.values
    with pytest.raises(IndexError):
        b[1]


def test_atomic_setitem():
    b = Batch(torch.zeros(2))
    y = torch.ones(2)
    b[0] = y
    assert b.tensor is y
    with pytest.raises(IndexError):
        b[1] = y
    with pytest.raises(TypeError):
        b[0] = 3
    with pytest.raises(TypeError):
        b[0:1] = (y,)


def test_atomic_call():
    b = Batch(torch.tensor(1.0))
    out = b.call(lambda t: t + 1)
    assert isinstance(out, Batch) and out.atomic
    assert out.tensor.item() == 2.0

    out = b.call(lambda t: (t, t * 2))
    assert not out.atomic
    assert [v.item() for v in out.values] == [1.0, 2.0]


def test_non_atomic_batch():
    x, y = torch.tensor(1.0), torch.tensor(2.0)
    b = Batch((x, y))
    assert not b.atomic
    assert b.values == (x, y)
    assert b[0] is x and b[1] is y and b[-1] is y
    assert len(b) == 2
    assert list(b) == [x, y]
    with pytest.raises(AttributeError):
        b.tensor


def test_non_atomic_from_list_becomes_tuple():
    x = torch.tensor(1.0)
    b = Batch([x, "a"])
    assert not b.atomic
    assert isinstance(b.values, tuple) and b.values == (x, "a")


def test_non_atomic_setitem_keeps_other_values():
    x, y, z = torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)
    b = Batch((x, "k", y))
    b[2] = z
    assert b.values == (x, "k", z)
    b[0:2] = (y, "m")
    assert b.values == (y, "m", z)
    assert isinstance(b.values, tuple)


def test_non_atomic_call_unpacks():
    b = Batch((torch.tensor(1.0), 5))
    out = b.call(lambda t, n: t * n)
    assert out.atomic and out.tensor.item() == 5.0


def test_find_tensor_idx_and_device():
    x = torch.tensor(1.0)
    b = Batch((None, 3, x, torch.tensor(2.0)))
    assert b.find_tensor_idx() == 2
    assert b.get_device() == torch.device("cpu")

    with pytest.raises(TypeError):
        Batch((1, "a", None)).find_tensor_idx()
    with pytest.raises(TypeError):
        Batch(("no", "tensor")).get_device()


def test_repr():
    assert "atomic=True" in repr(Batch(torch.zeros(1)))
    assert "atomic=False" in repr(Batch((1, 2)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_get_device_cuda():
    b = Batch((1, torch.zeros(1, device="cuda")))
    assert b.get_device().type == "cuda"
