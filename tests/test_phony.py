import pytest
import torch

from moe_autograd.phony import get_phony


def test_phony_is_empty_and_cached():
    p = get_phony(torch.device("cpu"), requires_grad=False)
    assert p.numel() == 0 and p.shape == (0,)
    assert p.device == torch.device("cpu")
    assert get_phony(torch.device("cpu"), requires_grad=False) is p
    # device given as a string hits the same cache entry
    assert get_phony("cpu", requires_grad=False) is p


def test_phony_requires_grad_is_separate_leaf():
    p = get_phony(torch.device("cpu"), requires_grad=False)
    q = get_phony(torch.device("cpu"), requires_grad=True)
    assert q is not p
    assert q.requires_grad and not p.requires_grad
    assert q.is_leaf and q.grad_fn is None
    assert get_phony(torch.device("cpu"), requires_grad=True) is q


def test_phony_created_under_grad_mode_is_still_leaf():
    with torch.enable_grad():
        q = get_phony(torch.device("cpu"), requires_grad=True)
    assert q.grad_fn is None
    with torch.no_grad():
        assert get_phony(torch.device("cpu"), requires_grad=True) is q


def test_phony_through_function_gets_grad_fn():
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.detach()

        @staticmethod
        def backward(ctx, g):
            return g

    q = get_phony(torch.device("cpu"), requires_grad=True)
    out = Identity.apply(q)
    assert out.grad_fn is not None and out.numel() == 0
    # the cached phony itself stays untouched
    assert q.grad_fn is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_phony_cuda():
    p = get_phony(torch.device("cuda", 0), requires_grad=False)
    assert p.is_cuda and p.numel() == 0
    assert get_phony(torch.device("cuda:0"), requires_grad=False) is p
    assert get_phony(torch.device("cpu"), requires_grad=False) is not p
