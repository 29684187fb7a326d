"""What a MixtureOfExperts tells about what it absorbed: each masked call and
each backward treated as a constant is logged as a WARNING naming the
expert, the call and the error (at most one line per expert per period), and
``stats()`` keeps each expert's last error text (moe_autograd/moe/stats.py's
invariants)."""
import logging
import threading
from typing import List

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import MixtureOfExperts

pytestmark = pytest.mark.timeout(60)
LOGGER = "moe_autograd.moe.stats"


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("the disk is on fire\nsecond line of detail")


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        raise RuntimeError("no gradient today")


class BrokenBackward(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return _FailingBackward.apply(super().forward(x))


class Stuck(nn.Linear):
    """Answers only once released (the layer's deadline passes first)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.release = threading.Event()

    def forward(self, x: Tensor) -> Tensor:
        self.release.wait(20)
        return super().forward(x)


def _everyone(experts: List[nn.Module], **options) -> MixtureOfExperts:
    """A layer whose gate sends every token to every expert."""
    moe = MixtureOfExperts(experts, 4, k=len(experts), k_min=0, allow_zero_outputs=True,
                           **options)
    moe.expert_stats._limit.every = 1e9  # held back is held back, however slow the machine
    return moe


def _warnings(caplog: pytest.LogCaptureFixture) -> List[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING]


def test_a_masked_failure_is_logged_with_its_text_and_kept_in_stats(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    moe = _everyone([nn.Linear(4, 4), Broken()])
    for _ in range(3):
        y, aux = moe(torch.randn(5, 4))
        (y.sum() + aux).backward()
    lines = _warnings(caplog)
    assert len(lines) == 1, lines  # one line per expert per period: the rest held back
    assert lines[0] == ("MixtureOfExperts: expert 1 (Broken): forward call 1 masked: "
                        "RuntimeError: the disk is on fire (more in stats()[1]['last_error'])")
    stats = moe.stats()
    assert stats[0]["last_error"] is None
    assert stats[1]["last_error"] == ("forward call 3 masked: RuntimeError: the disk is on "
                                      "fire\nsecond line of detail")
    assert stats[1]["failures"] == 3


def test_the_line_after_a_period_counts_those_held_back(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    moe = _everyone([nn.Linear(4, 4), Broken()])
    for _ in range(3):
        moe(torch.randn(2, 4))
    moe.expert_stats._limit.every = 0.0  # the period is over
    moe(torch.randn(2, 4))
    lines = _warnings(caplog)
    assert len(lines) == 2 and lines[1].startswith("MixtureOfExperts: expert 1 (Broken): "
                                                   "forward call 4 masked")
    assert lines[1].endswith("(2 more like it not logged in the last 0 s)"), lines[1]


def test_a_backward_treated_as_a_constant_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    moe = _everyone([nn.Linear(4, 4), BrokenBackward(4, 4)])
    y, aux = moe(torch.randn(3, 4))
    (y.sum() + aux).backward()
    assert _warnings(caplog) == [
        "MixtureOfExperts: expert 1 (BrokenBackward(in_features=4, out_features=4, bias=True)): "
        "backward call 1 treated as a constant: RuntimeError: no gradient today"]
    assert moe.stats()[1]["last_error"] == ("backward call 1 treated as a constant: "
                                            "RuntimeError: no gradient today")


def test_a_call_past_the_deadline_says_which_deadline(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    stuck = Stuck()
    moe = _everyone([nn.Linear(4, 4), stuck], forward_timeout=0.05)
    try:
        moe(torch.randn(3, 4))
    finally:
        stuck.release.set()
    assert _warnings(caplog) == [
        "MixtureOfExperts: expert 1 (Stuck(in_features=4, out_features=4, bias=True)): forward "
        "call 1 masked: no answer when the layer stopped waiting (forward_timeout=0.05 s)"]
    assert moe.stats()[1]["timeouts"] == 1


def test_a_copied_layer_keeps_its_errors() -> None:
    import copy

    moe = _everyone([nn.Linear(4, 4), Broken()])
    moe(torch.randn(2, 4))
    copied = copy.deepcopy(moe)
    assert copied.stats()[1]["last_error"] == moe.stats()[1]["last_error"] is not None
    copied(torch.randn(2, 4))  # its own lock and limit
    assert copied.stats()[1]["calls"] == 2
