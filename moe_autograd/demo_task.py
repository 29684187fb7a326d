"""What the demos share: the task, the experts, the model, one training step,
and the churn report of the elastic demos.

Why a module of its own: ``python -m moe_autograd demo`` (:mod:`.demo`), its
elastic variant on torch RPC (:mod:`.demo_elastic`) and the one on Ray
(:mod:`.demo_elastic_ray`) train the same model on the same task. When these
pieces lived in :mod:`.demo`, the elastic demo imported :mod:`.demo` while
:mod:`.demo` dispatched ``--elastic`` to the elastic demo: an import circle.
Now every demo imports from here, and no demo imports another (the command
line, :mod:`moe_autograd.__main__`, picks the demo; :mod:`.demo_elastic`
picks the engine and imports :mod:`.demo_elastic_ray`, which imports only
this module).

Invariants: importing this module imports torch and the MoE layer only (no
``torch.distributed.rpc`` world, no Ray); the expert servers' processes (RPC
workers forked by a forkserver, Ray actors) import it to build their
:class:`Expert` s, so everything here must be importable by name and cheap.
"""
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .moe import MixtureOfExperts

__all__ = ["RegionTask", "Expert", "Model", "train_step", "evaluate", "ChurnLog",
           "print_churn_report", "loss_at_replacement", "steps_of", "said_steps",
           "resumed_steps"]


# -- the task ------------------------------------------------------------------
class RegionTask:
    """Labels are ``argmax(W_r x)`` where ``r`` is the quadrant of ``(x0, x1)``."""

    def __init__(self, dim: int, classes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dim, self.classes = dim, classes
        self.rules = torch.randn(4, classes, dim, generator=g)
        self.g = g

    def batch(self, size: int) -> Tuple[Tensor, Tensor]:
        x = torch.randn(size, self.dim, generator=self.g)
        region = (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
        logits = torch.einsum("bcd,bd->bc", self.rules[region], x)
        return x, logits.argmax(dim=-1)


# -- experts -------------------------------------------------------------------
class Expert(nn.Module):
    """A small expert; ``latency`` emulates a heavier one (sleeps, GIL free)."""

    def __init__(self, width: int, latency: float = 0.0, fail_rate: float = 0.0,
                 slow_rate: float = 0.0, slow_for: float = 0.0) -> None:
        super().__init__()
        # Linear on purpose: one such expert cannot solve the task, a gated
        # mixture of them (piecewise linear) can.
        self.net = nn.Linear(width, width)
        self.latency, self.fail_rate = latency, fail_rate
        self.slow_rate, self.slow_for = slow_rate, slow_for

    def forward(self, x: Tensor) -> Tensor:
        if self.fail_rate and torch.rand(()).item() < self.fail_rate:
            raise RuntimeError("injected failure")
        delay = self.latency
        if self.slow_rate and torch.rand(()).item() < self.slow_rate:
            delay += self.slow_for
        if delay:
            time.sleep(delay)
        return self.net(x)


# -- the model -----------------------------------------------------------------
class Model(nn.Module):
    """``embed -> MixtureOfExperts(experts) -> head``; returns ``(logits, aux loss)``."""

    def __init__(self, dim: int, width: int, classes: int, experts: Sequence[nn.Module],
                 **moe_options: Any) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, width)
        self.moe = MixtureOfExperts(list(experts), width, **moe_options)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h, aux = self.moe(self.embed(x))
        return self.head(h), aux


def train_step(model: Model, opt: torch.optim.Optimizer, task: RegionTask, batch: int
               ) -> Tuple[float, Tensor, Tensor, Tensor]:
    """One training step on a fresh batch: ``(seconds, logits, labels, loss)``."""
    x, y = task.batch(batch)
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    logits, aux = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    (loss + 0.01 * aux).backward()
    opt.step()
    return time.perf_counter() - start, logits, y, loss


def evaluate(model: Model, task: RegionTask, size: int = 4096) -> Tuple[float, float]:
    """``(loss, accuracy)`` of ``model`` on a fresh batch of ``size``, without gradients."""
    x, y = task.batch(size)
    model.eval()
    with torch.no_grad():
        logits, _ = model(x)
    model.train()
    loss = nn.functional.cross_entropy(logits, y).item()
    return loss, (logits.argmax(-1) == y).float().mean().item()


# -- the elastic demos' report -----------------------------------------------------
class ChurnLog:
    """What happened at which step: ``log`` is ``[(step, text)]``; :meth:`note`
    also prints the line unless ``quiet``."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.step = 0
        self.log: List[Tuple[int, str]] = []
        self._seen = 0  # fleet events noted
        self._joins: Dict[str, int] = {}  # joined server -> step its join was seen
        #: Joined server -> steps until its first served call (see :meth:`follow`).
        self.served_after: Dict[str, int] = {}
        self._last_progress: Optional[float] = None

    def progress(self, step: int, total: int, loss: float, every: float = 10.0) -> None:
        """Prints where training is (``step`` of ``total``, the loss) at most
        every ``every`` seconds (unless ``quiet``): a stretch of steps without
        churn is never silent for long."""
        now = time.monotonic()
        if self._last_progress is None:
            self._last_progress = now
        elif not self.quiet and now - self._last_progress >= every:
            self._last_progress = now
            print(f"  step {step:4d}  ({step + 1}/{total}{'+' if step + 1 >= total else ''} "
                  f"steps, loss {loss:.3f})", flush=True)

    def note(self, text: str) -> None:
        self.log.append((self.step, text))
        if not self.quiet:
            print(f"  step {self.step:4d}  {text}", flush=True)

    def first(self, prefix: str) -> int:
        """The step of the first entry starting with ``prefix`` (-1: none)."""
        return next((step for step, text in self.log if text.startswith(prefix)), -1)

    def follow(self, fleet: Any, step: int) -> None:
        """Notes the fleet's membership events since the last step, and each
        joined server's first served call (``served_after``: the steps after
        its join was seen). Either engine's fleet (``events``, ``first_served``)."""
        events = list(fleet.events)
        for event in events[self._seen:]:
            self.note(f"{event.worker} {event.kind}"
                      f"{' (' + ', '.join(event.experts) + ')' if event.experts else ''}"
                      f"{': ' + event.detail[:100] if event.detail else ''}")
            if event.kind == "joined" and step > 0:
                self._joins[event.worker] = step
        self._seen = len(events)
        for worker, joined_at in list(self._joins.items()):
            if fleet.first_served(worker) is not None:
                self.note(f"{worker} served its first call, {step - joined_at} step(s) "
                          "after its join was seen")
                self.served_after[worker] = step - joined_at
                del self._joins[worker]


def print_churn_report(log: ChurnLog, times: Sequence[float], masked: Sequence[int],
                       phases: Sequence[Tuple[str, int, int]], loss: float, acc: float,
                       target: float, totals: Any) -> bool:
    """Prints the churn events, the masked calls and median step per phase
    (``(label, first step, end step)``), the accuracy against ``target`` and
    what training absorbed; returns whether the target was reached."""
    print()
    print("churn events (step: what happened)")
    for step, text in log.log:
        print(f"  {step:4d}  {text}")
    print("masked expert calls per phase")
    for label, lo, hi in phases:
        print(f"  {label:26s} steps {lo:4d}-{hi - 1:4d}: {sum(masked[lo:hi]):4d} masked, "
              f"median step {statistics.median(times[lo:hi] or [float('nan')]) * 1000:6.1f} ms")
    reached = acc >= target
    print(f"accuracy      {acc:6.1%} (loss {loss:.3f}); target {target:.0%}: "
          f"{'reached' if reached else 'NOT reached'}")
    print(f"absorbed      {totals['failures']} failures and {totals['timeouts']} timeouts over "
          f"{totals['calls']} expert calls; training never stopped ({len(times)} steps)")
    return reached


def loss_at_replacement(losses: Sequence[float], kill_at: int, resumed_at: int,
                        window: int = 10) -> str:
    """The report's line on the loss at a replacement: the mean training loss
    of the ``window`` steps before the kill (``kill_at``: the first step
    without the killed server) against that of the ``window`` steps from
    ``resumed_at`` (the first step the replacement served from its start),
    and their ratio. A replacement that resumed its experts' state continues
    where they were (a ratio near or below 1, training goes on); one that
    started from fresh weights would show a jump."""
    before = list(losses[max(0, kill_at - window):kill_at])
    after = list(losses[resumed_at:resumed_at + window])
    if not before or not after:
        return ("loss          at the replacement: not measured (no step before the kill, or "
                "none after the replacement served)")
    b, a = statistics.fmean(before), statistics.fmean(after)
    return (f"loss          at the replacement: {b:.3f} just before the kill (mean of steps "
            f"{kill_at - len(before)}-{kill_at - 1}) -> {a:.3f} just after the replacement "
            f"(steps {resumed_at}-{resumed_at + len(after) - 1}): ratio {a / b:.2f} "
            f"({'no jump' if a / b <= 1.1 else 'a jump'})")



def steps_of(fleet: Any, server: str, experts: Sequence[str],
             field: str = "expert_steps") -> Dict[str, Optional[int]]:
    """The optimizer steps of ``experts`` on ``server`` as its server counts
    them (``field="expert_resumed_steps"``: the step each resumed at), asked
    through ``fleet``'s transport (either engine's fleet); None for one that
    did not answer or did not resume."""
    from .remote import RemoteExpert

    steps: Dict[str, Optional[int]] = {}
    for name in experts:
        try:
            stats = RemoteExpert(server, name, transport=fleet.transport, secret=fleet.secret,
                                 forward_timeout=5.0).remote_stats()
            value = stats.get(field)
            steps[name] = None if value is None else int(value)
        except Exception:  # noqa: BLE001 - told as unknown, not fatal
            steps[name] = None
    return steps


def said_steps(steps: Dict[str, Optional[int]]) -> str:
    """``"expert2 at step 85, expert3 at step 80"`` (:func:`steps_of`)."""
    return ", ".join(f"{name} at step {'?' if n is None else n}" for name, n in steps.items())


def resumed_steps(fleet: Any, experts: Sequence[Any], server: str,
                  before: Dict[str, Optional[int]]) -> str:
    """What each of ``experts`` (:class:`~.remote.FleetExpert` s) resumed
    at on the replacement ``server``, against ``before`` (the killed
    server's steps): the steps since its last snapshot are lost, and the
    trainer goes on from there by itself (no replica at its version lives:
    :mod:`~moe_autograd.remote.mirrored`, a WARNING naming the steps lost)."""
    steps = steps_of(fleet, server, [expert.name for expert in experts],
                     "expert_resumed_steps")
    said = []
    for name, now in steps.items():
        had = before.get(name)
        lost = "" if had is None or now is None else f" of {had}: {had - now} step(s) lost"
        said.append(f"{name} resumed at step {'?' if now is None else now}{lost}")
    return ", ".join(said)
