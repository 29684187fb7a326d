"""The execution modes (moe_autograd.policy): same results in every mode,
forcing works, and auto mode learns inline for tiny calls and keeps waiting
calls fanned out."""
import threading
import time
from typing import Any, Callable, List, Optional, Sequence

import pytest
import torch
from torch import Tensor, nn

from helpers import BackwardBarrier, Square
from moe_autograd import map_with_parallel_backward, parallel_apply, policy

MODES = ["inline", "lanes", "parallel", "auto"]
DT = torch.float64


class Noisy(nn.Module):
    """Linear -> dropout -> tanh: draws random numbers, saves activations."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(6, 6, dtype=DT)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(6, 6, generator=g, dtype=DT))
        self.drop = nn.Dropout(0.3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.drop(self.fc(x)))


def _run(mode: str, checkpoint: Any = False, nested: bool = False) -> List[Tensor]:
    """Outputs, then gradients of every input and parameter, for one seed."""
    torch.manual_seed(0)
    experts: List[Any] = [Noisy(k) for k in range(3)]
    experts.append(experts[0])  # a shared module
    if nested:
        inner = [Noisy(10), Noisy(11)]

        def fan_out(x: Tensor) -> Tensor:
            a, b = parallel_apply(inner, [x, x * 2], mode=mode)
            return a * b
        experts.append(fan_out)
    xs = [torch.randn(5, 6, dtype=DT, requires_grad=True) for _ in experts]
    outs = parallel_apply(experts, xs, checkpoint=checkpoint, mode=mode)
    sum((o * (k + 1)).sum() for k, o in enumerate(outs)).backward()
    params = [p for e in experts if isinstance(e, nn.Module) for p in e.parameters()]
    if nested:
        params += [p for e in inner for p in e.parameters()]
    return [o.detach() for o in outs] + [t.grad for t in xs + params]  # type: ignore[misc]


def _same(a: Sequence[Optional[Tensor]], b: Sequence[Optional[Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y), (x - y).abs().max()  # type: ignore[operator]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", [False, True, [True, False, True, False]],
                         ids=["plain", "checkpoint", "mixed"])
def test_every_mode_gives_the_same_bits(checkpoint: Any) -> None:
    want = _run("parallel", checkpoint)
    for mode in MODES:
        for _ in range(policy.EVIDENCE + 1):  # auto: past the new-site batches
            _same(_run(mode, checkpoint), want)


@pytest.mark.timeout(60)
def test_nested_calls_give_the_same_bits_in_every_mode() -> None:
    want = _run("parallel", nested=True)
    for mode in MODES:
        _same(_run(mode, nested=True), want)


@pytest.mark.timeout(60)
def test_map_gives_the_same_bits_in_every_mode() -> None:
    def run(mode: str) -> List[Tensor]:
        xs = [torch.randn(4, dtype=DT, generator=torch.Generator().manual_seed(k),
                          requires_grad=True) for k in range(6)]
        outs = map_with_parallel_backward(Square, *[(x,) for x in xs], mode=mode)
        shared = torch.ones(4, dtype=DT, requires_grad=True)
        outs2 = map_with_parallel_backward(Square, *[(shared * k,) for k in range(3)], mode=mode)
        (sum(o[0].sum() for o in outs) + sum(o[0].sum() for o in outs2)).backward()
        return [o[0].detach() for o in outs] + [x.grad for x in xs] + [shared.grad]  # type: ignore[misc]
    want = run("parallel")
    for mode in MODES:
        _same(run(mode), want)


class Boom(RuntimeError):
    pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_a_failing_call_raises_its_own_error_in_every_mode(mode: str) -> None:
    def bad(x: Tensor) -> Tensor:
        raise Boom("expert 1 failed")
    with pytest.raises(Boom, match="expert 1 failed") as info:
        parallel_apply([nn.Identity(), bad, nn.Identity()], [torch.ones(2)] * 3, mode=mode)
    assert any("call 1 of 3" in note for note in getattr(info.value, "__notes__", []))


def test_bad_mode_names_the_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        parallel_apply([nn.Identity()], [torch.ones(1)], mode="fast")
    monkeypatch.setenv("MOE_AUTOGRAD_MODE", "sometimes")
    with pytest.raises(ValueError, match="MOE_AUTOGRAD_MODE"):
        parallel_apply([nn.Identity()], [torch.ones(1)])


def _site_stats(name: str) -> dict:
    return next(s for s in policy.execution_stats() if name in s["site"])


@pytest.mark.timeout(60)
def test_auto_runs_tiny_calls_inline_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_AUTOGRAD_MODE", raising=False)
    xs = [torch.randn(4, requires_grad=True) for _ in range(16)]
    threads: List[str] = []

    class Tiny(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
            threads.append(threading.current_thread().name)
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
            return g * 2

    for _ in range(policy.EVIDENCE + 3):
        threads.clear()
        outs = map_with_parallel_backward(Tiny, *[(x,) for x in xs])
        sum(o[0].sum() for o in outs).backward()
    stats = _site_stats("Tiny")
    assert stats["mode"] == "inline", stats
    assert set(threads) == {threading.current_thread().name}
    assert stats["batches"]["parallel"] == policy.EVIDENCE


@pytest.mark.timeout(60)
def test_auto_keeps_waiting_calls_concurrent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls that wait (a few ms, as on a network) stay fanned out, batch
    after batch: a Barrier of all calls in forward and in backward proves it."""
    monkeypatch.delenv("MOE_AUTOGRAD_MODE", raising=False)
    n = 4
    for _ in range(policy.EVIDENCE + 3):
        fwd, bwd = threading.Barrier(n, timeout=10), threading.Barrier(n, timeout=10)

        def meet(x: Tensor, fwd: threading.Barrier = fwd, bwd: threading.Barrier = bwd) -> Tensor:
            time.sleep(0.002)
            fwd.wait()
            return BackwardBarrier.apply(x * 2, bwd)
        outs = parallel_apply([meet] * n, [torch.ones(2, requires_grad=True) for _ in range(n)])
        sum(o.sum() for o in outs).backward()
    assert _site_stats("meet")["mode"] == "parallel"


@pytest.mark.timeout(60)
def test_lanes_run_on_at_most_their_count_of_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "cores", lambda: 2)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # two lanes of one intra-op thread fit two cores
    try:
        names: List[str] = []
        barrier = threading.Barrier(2, timeout=10)

        def call(x: Tensor) -> Tensor:
            names.append(threading.current_thread().name)
            if len(names) <= 2:
                barrier.wait()  # the first two calls run at once: two lanes
            return x + 1
        parallel_apply([call] * 6, [torch.ones(1)] * 6, mode="lanes")
        assert len(set(names)) <= 2
    finally:
        torch.set_num_threads(previous)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_moe_layer_gives_the_same_bits_in_every_mode(checkpoint: bool) -> None:
    from moe_autograd import MixtureOfExperts

    def run(mode: str) -> List[Optional[Tensor]]:
        torch.manual_seed(0)
        moe = MixtureOfExperts([Noisy(k) for k in range(4)], 6, k=2, checkpoint=checkpoint,
                               mode=mode).double()
        x = torch.randn(3, 5, 6, dtype=DT, requires_grad=True)
        y, aux = moe(x)
        (y.square().sum() + aux).backward()
        return [y.detach(), x.grad] + [p.grad for p in moe.parameters()]
    want = run("parallel")
    for mode in MODES:
        for _ in range(policy.EVIDENCE + 1):
            _same(run(mode), want)


def test_moe_layer_with_deadlines_always_fans_out() -> None:
    from moe_autograd import MixtureOfExperts
    moe = MixtureOfExperts([nn.Linear(2, 2) for _ in range(2)], 2, k=1, forward_timeout=5.0,
                           mode="inline")
    assert moe._decide(list(moe.experts))[0].mode == "parallel"
    with pytest.raises(ValueError, match="mode must be one of"):
        MixtureOfExperts([nn.Linear(2, 2)], 2, k=1, mode="fastest")
