"""Checkpointed experts: memory kept for backward, time, early recomputation.

``checkpoint``
    16 experts of 8 x (Linear(512, 512) + ReLU), 256 tokens each, through
    :func:`~moe_autograd.parallel_apply` with ``checkpoint=True`` vs
    ``checkpoint=False``. Memory (see :func:`kept_bytes`): the bytes kept for
    backward between forward and backward, found with public means only.
    Goal: checkpointed <= 1.05 x the inputs' bytes. Time: checkpointed / plain
    forward + backward, goal <= 1.35 (one extra forward costs ~1/3 of a
    forward + backward).
``recompute-early``
    The same checkpointed experts feeding 4 more Linear(512, 512) layers, with
    :func:`~moe_autograd.recompute_early` at the output of the *last* of them,
    just before the loss (recomputation is queued as soon as backward starts,
    so it can overlap the backward of all 4 layers) vs without (it starts
    when the experts' outputs get their gradients). Reports the gain in ms and
    %, against its ceiling: the recomputation's own time, measured in the same
    loop as a no-grad forward of the experts. No goal.
"""
import os
import statistics
from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..parallel import parallel_apply, recompute_early
from .core import backward_all
from .measure import Plan, Row, compare, measure, row

__all__ = ["bench_checkpoint", "bench_recompute_early", "kept_bytes", "deep_experts"]

EXPERTS, DEPTH, WIDTH, TOKENS, HEAD = 16, 8, 512, 256, 4
_MIB = 2.0 ** 20
_DEEP: Dict[str, list] = {}


def deep_experts() -> Tuple[List[nn.Module], List[Tensor]]:
    """16 experts of 8 x (Linear(512, 512) + ReLU) and 256 tokens each, built
    once and shared by the ``checkpoint`` and ``recompute-early`` groups."""
    if not _DEEP:
        torch.manual_seed(0)
        _DEEP["experts"] = [
            nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
            for _ in range(EXPERTS)
        ]
        _DEEP["xs"] = [torch.randn(TOKENS, WIDTH, requires_grad=True) for _ in range(EXPERTS)]
    return _DEEP["experts"], _DEEP["xs"]


def _storages(tensors: Sequence[Tensor]) -> Dict[int, int]:
    """``{data_ptr: nbytes}`` of the tensors' unique storages."""
    found: Dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


def kept_bytes(experts: Sequence[nn.Module], xs: Sequence[Tensor], checkpoint: bool
               ) -> Tuple[int, int]:
    """Runs forward + backward once; returns the bytes kept for backward after
    the forward as ``(saved, inputs)``, unique storages, parameters excluded:

    * ``saved``: the storages autograd saved during ``parallel_apply``, seen
      by a ``saved_tensors_hooks`` pack hook around it (the runtime applies the
      caller's hooks on its workers);
    * ``inputs``: the storages of the caller's inputs not already among them.
      Every call keeps its inputs until backward (a checkpointed one to
      recompute from) as detached views that share the caller's storage, so
      they are counted from the caller's tensors, not read from the runtime.
    """
    params = _storages([p for e in experts for p in e.parameters()])
    saved: Dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()  # dict writes are atomic under the GIL
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = parallel_apply(experts, xs, checkpoint=checkpoint)
    inputs = {ptr: n for ptr, n in _storages(xs).items() if ptr not in saved and ptr not in params}
    backward_all(outs)
    return sum(saved.values()), sum(inputs.values())


def bench_checkpoint(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=1, reps=12), Plan(warmup=0, reps=2))
    experts, xs = deep_experts()
    inputs = sum(_storages(xs).values())
    # The memory passes double as the first warm-up of both variants.
    plain_saved, plain_inputs = kept_bytes(experts, xs, checkpoint=False)
    ckpt_saved, ckpt_inputs = kept_bytes(experts, xs, checkpoint=True)
    plain, ckpt = plain_saved + plain_inputs, ckpt_saved + ckpt_inputs
    warning = ("WARNING: the hooks saw nothing of the plain calls: saved_tensors_hooks did not "
               "reach the workers, so 'saved' is not measured; " if plain_saved == 0 else "")

    def ours() -> None:
        backward_all(parallel_apply(experts, xs, checkpoint=True))

    def base() -> None:
        backward_all(parallel_apply(experts, xs, checkpoint=False))

    s = measure({"ours": ours, "plain": base}, plan.reps, plan.warmup)
    shape = f"{EXPERTS} experts x {DEPTH} x Linear({WIDTH},{WIDTH}), {TOKENS} tokens"
    return [
        row("checkpoint/memory", inputs / _MIB, ckpt / _MIB, ckpt / inputs, 1.05,
            f"{warning}{shape}; kept for backward, unique storages, parameters excluded: "
            f"ours = packed by saved_tensors_hooks around parallel_apply "
            f"{ckpt_saved / _MIB:.1f} MiB + the caller's input storages (each call keeps its "
            f"inputs as detached views, to recompute from) {ckpt_inputs / _MIB:.1f} MiB; "
            f"baseline = inputs' bytes", unit="MiB"),
        row("checkpoint/memory-vs-plain", plain / _MIB, ckpt / _MIB, ckpt / plain, None,
            f"{warning}baseline = checkpoint=False: saved (hooks) {plain_saved / _MIB:.1f} MiB "
            f"+ inputs not saved {plain_inputs / _MIB:.1f} MiB", unit="MiB"),
        compare("checkpoint/time", s, "plain", "ours", 1.35,
                "fwd+bwd; baseline = checkpoint=False"),
    ]


def bench_recompute_early(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=1, reps=12), Plan(warmup=0, reps=2))
    experts, xs = deep_experts()
    torch.manual_seed(1)
    head = [nn.Linear(WIDTH, WIDTH) for _ in range(HEAD)]
    hooked: List[bool] = []

    def step(early: bool) -> None:
        outs = parallel_apply(experts, xs, checkpoint=True)
        h = head[0](torch.cat(outs))
        for layer in head[1:]:
            h = layer(torch.relu(h))
        if early:  # the last layer's output: backward reaches it first
            trigger, h = h, recompute_early(h, outs)
            hooked.append(h is not trigger)
        h.sum().backward()

    def recompute() -> None:  # the recomputation's work: the experts' forward on workers
        with torch.no_grad():
            parallel_apply(experts, xs)

    s = measure({"ours": lambda: step(True), "late": lambda: step(False), "recompute": recompute},
                plan.reps, plan.warmup)
    r = compare("recompute-early", s, "late", "ours", None,
                f"checkpointed experts + {HEAD} Linear({WIDTH},{WIDTH}); trigger = last layer's "
                f"output (before the loss); baseline = no recompute_early")
    if r.baseline is not None and r.ours is not None:
        gain = r.baseline - r.ours
        ceiling = statistics.median(s["recompute"])
        cores = os.cpu_count() or 1
        why = (f"limited: on {cores} cores recompute and backward compete for the same cores "
               f"(see note); " if cores <= 8 else "")
        r.note = (f"gain {gain:+.1f} ms ({gain / r.baseline:+.1%}) of at most ~{ceiling:.0f} ms "
                  f"(recompute alone, {ceiling / r.baseline:.0%} of the step); {why}" + r.note)
    if not all(hooked):
        r.note = ("WARNING: recompute_early returned its trigger unchanged (it found no "
                  "checkpointed calls behind the outputs), so both variants are the same; "
                  + r.note)
    return [r]
