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


# -- the pipeline library's (torchgpipe's) spellings ---------------------------
def test_torchgpipe_attribute_spellings():
    x, y = torch.tensor(1.0), torch.tensor(2.0)
    b = Batch((x, y))
    assert b.tensors == b.values == (x, y)
    assert b.value == (x, y) and b.tensor_or_tensors == (x, y)
    a = Batch(x)
    assert a.value is x and a.tensor_or_tensors is x
    a.value = (x, y)  # torchgpipe assigns .value
    assert not a.atomic and a.values == (x, y)
    a.value = y
    assert a.atomic and a.tensor is y


def test_error_texts_start_with_torchgpipes():
    with pytest.raises(AttributeError, match="^not atomic batch"):
        Batch((torch.zeros(1),)).tensor
    with pytest.raises(AttributeError, match="^batch is atomic"):
        Batch(torch.zeros(1)).tensors
    with pytest.raises(AttributeError, match="^batch is atomic"):
        Batch(torch.zeros(1)).values
    with pytest.raises(IndexError, match="^atomic batch allows index 0 only"):
        Batch(torch.zeros(1))[1]


def test_atomic_slice_all_replaces_the_tensor():
    b = Batch(torch.zeros(2))
    y = torch.ones(2)
    b[:] = (y,)
    assert b.atomic and b.tensor is y
    with pytest.raises(IndexError, match="^atomic batch cannot be replaced with multiple tensors"):
        b[:] = (y, y)
    with pytest.raises(TypeError):
        b[:] = ("not a tensor",)


def test_call_passes_the_tuple_when_only_that_fits():
    x, y = torch.tensor(1.0), torch.tensor(2.0)
    b = Batch((x, y))
    # torchgpipe's convention: one argument, the tuple
    assert b.call(lambda xs: xs[0] + xs[1]).tensor.item() == 3.0
    assert b.call(torch.stack, unpack=False).tensor.tolist() == [1.0, 2.0]

    class Sum(torch.nn.Module):
        def forward(self, inputs):
            return inputs[0] + inputs[1]

    assert b.call(Sum()).tensor.item() == 3.0
    # this package's convention (and torch.distributed.pipeline's): unpacked
    assert b.call(lambda a, c: a - c).tensor.item() == -1.0
    assert b.call(lambda *xs: xs).values == (x, y)


def test_call_ambiguous_one_value_unpacks_unless_told():
    x = torch.tensor(1.0)
    b = Batch((x,))
    assert b.call(lambda v: v).tensor is x  # fits both: unpacked
    assert b.call(lambda v: v, unpack=False).values == (x,)
    assert b.call(lambda v: v, unpack=True).tensor is x
