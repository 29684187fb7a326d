"""Each call on a CUDA stream of its own (moe_autograd.call_streams, opt-in):
the calls of a batch run on different streams, forward and backward, after the
caller's work, and hand their results back to the caller's stream; gradients
equal the loop's on the default stream and under a stream of the user's (to
the last bits: cuBLAS promises the same bits only with one stream active,
unless CUBLAS_WORKSPACE_CONFIG is set). Off (the default), every call runs on
the caller's stream, bit-equal to the loop."""
import copy
import os
from typing import Iterator, List

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import MixtureOfExperts, parallel_apply
from moe_autograd import call_streams as streams_module
from moe_autograd.call_streams import call_streams, cuda_devices, hand_back

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MODES = ["inline", "lanes", "parallel"]


STREAMS = 8
#: Bit-equal only where cuBLAS promises it with several streams active.
EXACT = bool(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


@pytest.fixture
def streams_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(streams_module, "CALL_STREAMS", STREAMS)
    yield


def _same(a: Tensor, b: Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def test_off_by_default_and_without_cuda_nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    if "MOE_AUTOGRAD_CUDA_STREAMS" not in os.environ:
        assert streams_module.CALL_STREAMS == 0
    x = torch.randn(3)
    monkeypatch.setattr(streams_module, "CALL_STREAMS", 0)
    assert cuda_devices([x, 1, "a"]) == ()
    with monkeypatch.context() as m:  # off: not even a module on CUDA gets a stream
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        assert cuda_devices([x], torch.device("cuda", 0)) == ()
        m.setattr(streams_module, "CALL_STREAMS", STREAMS)
        assert cuda_devices([x], torch.device("cuda", 0)) == (torch.device("cuda", 0),)
    monkeypatch.setattr(streams_module, "CALL_STREAMS", STREAMS)
    if not torch.cuda.is_initialized():
        assert cuda_devices([x, 1, "a"]) == ()
    assert cuda_devices([x]) == ()  # a CPU tensor is on no CUDA device
    with call_streams((), 0, [x]) as pairs:
        assert pairs == []
    hand_back([], [x])  # nothing to do


class _Recorder(nn.Module):
    """An MLP that records the stream its forward and backward ran on."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
        self.forward_stream: List[int] = []
        self.backward_stream: List[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.forward_stream.append(torch.cuda.current_stream().cuda_stream)
        h = self.net(x)
        if h.requires_grad:
            h.register_hook(lambda g: self.backward_stream.append(
                torch.cuda.current_stream().cuda_stream))
        return h


def _run(mode: str, user_stream: bool, n: int = 10, on: bool = True) -> None:
    experts = [_Recorder(k).cuda().double() for k in range(n)]
    ref = copy.deepcopy(experts)
    torch.manual_seed(1)
    xs = [torch.randn(32, 64, device="cuda", dtype=torch.float64, requires_grad=True)
          for _ in experts]
    xr = [x.detach().clone().requires_grad_() for x in xs]
    stream = torch.cuda.Stream() if user_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    with torch.cuda.stream(stream):
        # Work queued on the caller's stream just before: the calls must wait for it.
        ins = [x * 1.0 for x in xs]
        outs = parallel_apply(experts, ins, mode=mode)
        loss = sum((o * o).sum() for o in outs)
        loss.backward()
        want = sum((e(x * 1.0) ** 2).sum() for e, x in zip(ref, xr))
        want.backward()
    torch.cuda.synchronize()
    exact = EXACT or not on
    _same(loss, want, exact)
    for x, y in zip(xs, xr):
        _same(x.grad, y.grad, exact)
    for e, r in zip(experts, ref):
        for p, q in zip(e.parameters(), r.parameters()):
            _same(p.grad, q.grad, exact)
    caller = stream.cuda_stream
    forward = [e.forward_stream[0] for e in experts]
    if not on:
        assert forward == [caller] * n
    elif not user_stream:  # a user's stream may come from the pool ours come from
        assert caller not in forward
        assert len(set(forward)) == min(n, STREAMS)
    assert all(forward[k] == forward[k % STREAMS] for k in range(n))
    # The engine runs a call's backward ops on its forward's stream.
    assert [e.backward_stream[0] for e in experts] == forward


@cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("user_stream", [False, True], ids=["default_stream", "user_stream"])
def test_calls_run_on_streams_of_their_own_and_equal_the_loop(mode: str, user_stream: bool,
                                                              streams_on: None) -> None:
    _run(mode, user_stream)


@cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("user_stream", [False, True], ids=["default_stream", "user_stream"])
def test_off_every_call_runs_on_the_callers_stream_bit_equal_to_the_loop(
        mode: str, user_stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams_module, "CALL_STREAMS", 0)
    _run(mode, user_stream, on=False)


@cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_calls_on_streams_equal_the_loop(mode: str, streams_on: None) -> None:
    torch.manual_seed(0)
    experts = [nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3), nn.Linear(64, 16)).cuda()
               for _ in range(6)]
    xs = [torch.randn(8, 16, device="cuda", requires_grad=True) for _ in experts]

    def step(checkpoint: bool) -> List[Tensor]:
        for x in xs:
            x.grad = None
        for e in experts:
            e.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        outs = parallel_apply(experts, xs, checkpoint=checkpoint, mode=mode)
        sum(o.sum() for o in outs).backward()
        return [o.detach() for o in outs] + [x.grad for x in xs] + [
            p.grad for e in experts for p in e.parameters()]

    plain, checkpointed = step(False), step(True)
    for a, b in zip(plain, checkpointed):
        _same(a, b, EXACT)


@cuda
@pytest.mark.timeout(120)
def test_many_steps_with_allocation_churn_stay_equal_to_the_loop(streams_on: None) -> None:
    # Memory freed on one stream and reused on another while work on it is
    # still queued would show as wrong values somewhere over many steps.
    torch.manual_seed(0)
    moe = MixtureOfExperts([nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
                            for _ in range(16)], 128, k=2).cuda()
    for step in range(20):
        torch.manual_seed(step)
        x = torch.randn(1024, 128, device="cuda", requires_grad=True)
        y, aux = moe(x)
        grad, = torch.autograd.grad((y.square().mean() + aux), x)
        flat = x.detach().clone().requires_grad_()
        logits = moe.gate(flat)
        top, idx = logits.topk(2, dim=-1)
        weights = top.softmax(-1)
        dense = torch.stack([e(flat) for e in moe.experts], dim=1)
        want = (dense.gather(1, idx[..., None].expand(-1, -1, 128)) * weights[..., None]).sum(1)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
        assert torch.isfinite(grad).all()
