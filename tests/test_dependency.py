import weakref

import pytest
import torch

from moe_autograd.dependency import fork, join
from moe_autograd.phony import get_phony



def _logging_identity(timeline):
    """An identity Function ``apply(name, x)`` whose backward appends ``name``
    to ``timeline``."""
    class Log(torch.autograd.Function):
        @staticmethod
        def forward(ctx, name, x):
            ctx.name = name
            return x.detach()

        @staticmethod
        def backward(ctx, grad):
            timeline.append(ctx.name)
            return None, grad
    return Log

@pytest.mark.timeout(30)
def test_fork_join_orders_backward():
    """A Function hung off the fork's phony runs before the gradient of the
    forked tensor passes the fork."""
    timeline = []
    Log = _logging_identity(timeline)

    a = torch.rand(1, requires_grad=True)
    b = torch.rand(1, requires_grad=True)

    a = Log.apply("a", a)
    a, phony = fork(a)
    phony = Log.apply("hung", phony)
    b = Log.apply("b", b)
    b = join(b, phony)

    torch.cat((a, b)).sum().backward()
    # The gradient of `a` waits at the fork until the phony's branch ran.
    assert timeline.index("hung") < timeline.index("a")
    assert timeline.index("b") < timeline.index("hung")


def test_fork_join_values_and_grads_unchanged():
    x = torch.rand(3, requires_grad=True)
    y, phony = fork(x)
    assert torch.equal(y, x)
    assert phony.numel() == 0 and phony.requires_grad
    assert y.data_ptr() == x.data_ptr()  # no copy
    z = join(y, phony)
    assert z.data_ptr() == x.data_ptr()
    (z * 2).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_fork_without_grad_gives_cached_phony():
    x = torch.rand(2)
    y, phony = fork(x)
    assert y is x
    assert phony is get_phony(x.device, requires_grad=False)

    x = torch.rand(2, requires_grad=True)
    with torch.no_grad():
        y, phony = fork(x)
    assert y is x and not phony.requires_grad


def test_join_without_grad_is_noop():
    x = torch.rand(2)
    phony = get_phony(x.device, requires_grad=False)
    assert join(x, phony) is x


def test_join_with_grad_phony_gives_grad_fn():
    x = torch.rand(2)
    phony = get_phony(x.device, requires_grad=True)
    y = join(x, phony)
    assert y.requires_grad and y.grad_fn is not None
    assert torch.equal(y, x)


@pytest.mark.timeout(30)
def test_fork_join_no_ctx_leak():
    leak = None

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.detach()

        @staticmethod
        def backward(ctx, grad):
            nonlocal leak
            leak = weakref.ref(ctx)
            return grad

    x = torch.rand(1, requires_grad=True)
    x = F.apply(x)
    x, phony = fork(x)
    x = join(x, phony)
    x.backward()
    del x, phony
    assert leak is not None and leak() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(60)
def test_fork_join_cuda():
    x = torch.rand(2, device="cuda", requires_grad=True)
    y, phony = fork(x)
    assert phony.is_cuda
    join(y, phony).sum().backward()
    assert torch.equal(x.grad, torch.ones(2, device="cuda"))


def test_public_fork_join_functions_as_in_the_pipeline_library():
    """torchgpipe code calls the Functions directly: Fork.apply / Join.apply."""
    from moe_autograd import dependency
    from moe_autograd.dependency import Fork, Join

    assert dependency._Fork is Fork and dependency._Join is Join  # old spellings kept
    assert {"Fork", "Join", "fork", "join"} <= set(dependency.__all__)
    timeline = []
    Log = _logging_identity(timeline)

    a = torch.rand(1, requires_grad=True)
    b = torch.rand(1, requires_grad=True)
    fa, phony = Fork.apply(Log.apply("a", a))
    joined = Join.apply(Log.apply("b", b), Log.apply("hung", phony))
    torch.cat((fa, joined)).sum().backward()
    assert timeline.index("hung") < timeline.index("a")
    assert torch.equal(a.grad, torch.ones(1)) and torch.equal(b.grad, torch.ones(1))
