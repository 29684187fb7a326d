"""Per-expert checkpointing, and starting the recomputation early.

``parallel_apply(experts, inputs, checkpoint=True)`` keeps only each call's
inputs between forward and backward; in backward every call recomputes its
forward on a worker (dropout masks replayed exactly), then back-propagates.
``recompute_early(trigger, outputs)`` queues those recomputations as soon as
backward reaches ``trigger`` (here the last layer after the experts), so they
overlap the backward of the layers in between instead of waiting for it.

We print the bytes kept for backward with and without checkpointing (the
tensors autograd saves, seen by a ``saved_tensors_hooks`` pack hook, which the
runtime applies to its workers' calls too, plus the inputs every call keeps),
and check that all three variants give the same gradients.

    python examples/checkpointed_experts.py          # 8 experts of 6 layers
    python examples/checkpointed_experts.py --small  # what the tests run
"""
import argparse
import time
from typing import Dict, List

import torch
from torch import Tensor, nn

from moe_autograd import parallel_apply, recompute_early


def make_expert(width: int, depth: int) -> nn.Module:
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)]  # dropout: RNG replayed
    return nn.Sequential(*layers)


def step(experts: List[nn.Module], head: nn.Module, xs: List[Tensor], checkpoint: bool,
         early: bool) -> int:
    """Forward + backward with a fixed seed; returns the bytes kept for backward."""
    kept: Dict[int, int] = {}  # storage pointer -> bytes
    params = {p.untyped_storage().data_ptr() for m in experts for p in m.parameters()}

    forward = [True]  # what is kept from the forward to the backward

    def pack(t: Tensor) -> Tensor:  # called for every tensor autograd saves
        storage = t.untyped_storage()
        if forward[0] and storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = parallel_apply(experts, xs, checkpoint=checkpoint)
    for x in xs:  # every call keeps its inputs (a checkpointed one to recompute from)
        kept[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    h = head(torch.cat(outs))
    if early:
        h = recompute_early(h, outs)  # recompute as soon as backward reaches h
    forward[0] = False  # a recomputation's saves (seen by the hook too) live in backward only
    h.square().mean().backward()
    return sum(kept.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="4 experts of 2 small layers")
    args = parser.parse_args()
    n, depth, width, tokens = (4, 2, 32, 16) if args.small else (8, 6, 256, 256)
    torch.manual_seed(0)
    experts = [make_expert(width, depth) for _ in range(n)]
    head = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    xs = [torch.randn(tokens, width, requires_grad=True) for _ in range(n)]
    params = [p for m in experts + [head] for p in m.parameters()] + xs

    results = {}
    for name, checkpoint, early in (("plain", False, False), ("checkpoint", True, False),
                                    ("checkpoint + recompute_early", True, True)):
        step(experts, head, xs, checkpoint, early)  # warm-up: one-time imports, allocations
        for p in params:
            p.grad = None
        start = time.perf_counter()
        kept = step(experts, head, xs, checkpoint, early)
        elapsed = time.perf_counter() - start
        results[name] = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        print(f"{name:30s} kept for backward {kept / 2 ** 20:7.2f} MiB   "
              f"fwd+bwd {elapsed * 1e3:7.1f} ms")
    for name, grads in results.items():
        assert all(torch.equal(a, b) for a, b in zip(grads, results["plain"])), name
    print("gradients: identical in all three (dropout masks recomputed exactly)")


if __name__ == "__main__":
    main()
