"""What the MoE layer keeps after backward, and what leaving the workers frees.

* After backward, the experts' activations die as in a loop, even while the
  layer's output (and so its graph's nodes) lives on: the backward quorum
  check hangs off the graph and must not hold the call records.
* When a site's batches leave the workers (a fanned-out first batch, then
  within the cores), the free memory of the malloc arenas goes back to the
  system, once; a site that stays fanned out never does it. The
  measurements are fed (``policy.record`` patched), so no timing decides.
"""
import weakref
from typing import Any, List

import pytest
import torch
from torch import Tensor, nn

from helpers import wait_dead
from moe_autograd import policy
from moe_autograd.moe import MixtureOfExperts


class Saved:
    """A tensor an expert's graph saved for backward (the graph holds the box)."""

    def __init__(self, t: Tensor) -> None:
        # Detached: a saved output kept with its grad_fn would make a cycle
        # (box -> tensor -> node -> box) that only the node's release breaks.
        self.t = t.detach()

    def unpack(self) -> Tensor:
        return self.t


class Probe(nn.Module):
    """Linear -> tanh; keeps a weak reference to what its graph saves for
    backward."""

    def __init__(self, seed: int, saved: List["weakref.ref[Saved]"]) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(6, 6)
        self.saved = saved

    def forward(self, x: Tensor) -> Tensor:
        def pack(t: Tensor) -> Saved:
            box = Saved(t)
            self.saved.append(weakref.ref(box))
            return box
        with torch.autograd.graph.saved_tensors_hooks(pack, Saved.unpack):
            out = torch.tanh(self.fc(x))  # what both ops save lives in a Saved box
        return out * 1.0


def _layer(saved: List["weakref.ref[Saved]"]) -> MixtureOfExperts:
    return MixtureOfExperts([Probe(e, saved) for e in range(4)], 6, k=2)


@pytest.mark.timeout(60)
def test_activations_die_after_backward_while_the_output_lives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_AUTOGRAD_MODE", raising=False)
    saved: List["weakref.ref[Saved]"] = []
    moe = _layer(saved)
    torch.manual_seed(0)
    for _ in range(3):  # the fanned-out first batch, then the site's mode
        saved.clear()
        y, aux = moe(torch.randn(16, 6))
        (y.square().mean() + aux).backward()
        assert saved and not any(wait_dead(saved)), "a saved activation outlived its backward"
        assert y.grad_fn is not None  # the output, and its graph's nodes, still live


def _feed(monkeypatch: pytest.MonkeyPatch, waits: bool) -> None:
    """Every measured batch says the same: its calls crowd the cores (queued
    for one 60% of their time, on one the rest) or wait (blocked all their
    time, every call)."""
    record = policy.record

    def fed(site: Any, n: int, batch_wall: float, process_cpu: float, call_wall: float,
            call_cpu: float, decision: policy.Decision, call_queued: Any = None,
            least_blocked: Any = None) -> None:
        wall = max(call_wall, 1e-3 * n)  # past INLINE_BELOW_S per call
        cpu, queued = (0.0, 0.0) if waits else (0.4 * wall, 0.6 * wall)
        record(site, n, wall / n, cpu, wall, cpu, decision, queued, 1.0 if waits else 0.0)
    monkeypatch.setattr(policy, "record", fed)


@pytest.mark.timeout(60)
def test_leaving_the_workers_releases_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once, when the site's first batch within the cores starts (after its
    fanned-out, crowded first batch); never for a site that stays fanned out."""
    monkeypatch.delenv("MOE_AUTOGRAD_MODE", raising=False)
    monkeypatch.setattr(policy, "cores", lambda: 1)
    released: List[int] = []
    monkeypatch.setattr(policy, "release_free_memory", lambda: released.append(1) or True)
    for waits, expected in ((True, 0), (False, 1)):
        policy._reset()
        released.clear()
        with monkeypatch.context() as m:
            _feed(m, waits)
            moe = _layer([])
            torch.manual_seed(0)
            for _ in range(3):
                y, aux = moe(torch.randn(16, 6))
                (y.square().mean() + aux).backward()
        assert len(released) == expected, (waits, released)
