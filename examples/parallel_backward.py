"""Expert calls whose forward AND backward overlap.

A plain loop runs every call's forward, then autograd runs every call's
backward, one after another on one thread. When the calls mostly wait (a
remote expert, an accelerator, I/O) that wastes the waits. Here each expert
sleeps in forward and in backward (the GIL is free meanwhile), and we time
forward + backward of:

* ``parallel_apply(modules, inputs)``: for ``nn.Module`` experts;
* ``map_with_parallel_backward(Function, *args_per_call)``: for a custom
  ``torch.autograd.Function`` called once per input.

Both give the loop's outputs and gradients; only the time differs.

    python examples/parallel_backward.py            # 16 experts, 20 ms waits
    python examples/parallel_backward.py --small    # what the tests run
"""
import argparse
import time
from typing import Any, Callable, List, Tuple

import torch
from torch import Tensor, nn

from moe_autograd import map_with_parallel_backward, parallel_apply


class SlowLinear(torch.autograd.Function):
    """``x @ weight.T`` that waits ``delay`` seconds in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, delay: float) -> Tensor:
        time.sleep(delay)  # e.g. a network round trip
        ctx.save_for_backward(x, weight)
        ctx.delay = delay
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, Tensor, None]:
        time.sleep(ctx.delay)
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x, None  # no gradient for `delay`


class SlowExpert(nn.Module):
    def __init__(self, width: int, delay: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.delay = delay

    def forward(self, x: Tensor) -> Tensor:
        return SlowLinear.apply(x, self.weight, self.delay)


def timed(step: Callable[[], List[Tensor]], repeats: int = 3) -> float:
    """Best seconds of forward + backward through ``step``'s outputs, after a
    warm-up run (the first runs pay one-time imports and allocations).
    Gradients accumulate over the runs, the same in every variant."""
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        sum((o.square().sum() for o in step()), torch.zeros(())).backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="4 experts, 5 ms waits")
    args = parser.parse_args()
    n, delay, width = (4, 0.005, 16) if args.small else (16, 0.02, 64)
    torch.manual_seed(0)
    experts = [SlowExpert(width, delay) for _ in range(n)]
    xs = [torch.randn(32, width, requires_grad=True) for _ in range(n)]
    print(f"{n} experts, each waits {delay * 1e3:.0f} ms in forward and in backward "
          f"(a loop needs >= {2 * n * delay * 1e3:.0f} ms)")

    def grads() -> List[Tensor]:
        # Gradients of every input and parameter, then reset for the next run.
        leaves = xs + [e.weight for e in experts]
        found = [t.grad.clone() for t in leaves]  # type: ignore[union-attr]
        for t in leaves:
            t.grad = None
        return found

    # 1. nn.Module experts: a loop vs parallel_apply.
    loop_s = timed(lambda: [e(x) for e, x in zip(experts, xs)])
    loop_grads = grads()
    par_s = timed(lambda: parallel_apply(experts, xs))
    assert all(torch.equal(a, b) for a, b in zip(loop_grads, grads())), "gradients differ"
    print(f"modules:   loop {loop_s * 1e3:6.1f} ms   parallel_apply             "
          f"{par_s * 1e3:6.1f} ms   ({loop_s / par_s:.1f}x, same gradients)")

    # 2. An autograd.Function: apply() in a loop vs map_with_parallel_backward.
    calls = [(x, e.weight, delay) for x, e in zip(xs, experts)]
    loop_s = timed(lambda: [SlowLinear.apply(*c) for c in calls])
    loop_grads = grads()
    par_s = timed(lambda: [outs[0] for outs in map_with_parallel_backward(SlowLinear, *calls)])
    assert all(torch.equal(a, b) for a, b in zip(loop_grads, grads())), "gradients differ"
    print(f"Function:  loop {loop_s * 1e3:6.1f} ms   map_with_parallel_backward "
          f"{par_s * 1e3:6.1f} ms   ({loop_s / par_s:.1f}x, same gradients)")


if __name__ == "__main__":
    main()
