"""The runtime's own rows: latency-bound calls, per-call overhead, compute.

``latency``
    32 calls of an autograd Function that sleeps L = 5 ms in forward and in
    backward, through :func:`~moe_autograd.map_with_parallel_backward`. All
    calls overlap in both passes, so the physical limit of forward + backward
    is 2L; goal: ours <= 1.3 x 2L. For comparison: ``latency/naive-pool`` (a
    ``ThreadPoolExecutor`` forward and one pool round trip per call in
    backward, inside a custom Function, as the seed did: the engine runs those
    backward nodes one after another, ~L + N*L) and ``latency/sequential`` (a
    plain ``apply`` loop, ~2*N*L).
``overhead``
    64 identity calls on tensors of 4 elements: the per-call cost of
    forward + backward through :func:`~moe_autograd.map_with_parallel_backward`
    vs a plain ``apply`` loop and one backward, as users get it (``auto``
    mode: such calls run inline), goal <= 1.5x; and ``overhead/parallel``,
    the fanned-out path forced (``mode="parallel"``), goal <= 2.0x.
``compute``
    16 MLP experts (256 -> 1024 -> ReLU -> 256), 64 tokens each, forward +
    backward through :func:`~moe_autograd.parallel_apply` vs a Python loop,
    goal <= 1.0x; ``compute/loaded`` the same while another process spins one
    core (in both arms), goal <= 1.1x; ``compute/parallel`` forced fan-out;
    ``compute/cold`` the first :data:`COLD_BATCHES` batches of a new site
    (auto mode forgets the site before each sample: its first batch fans out
    and is measured, the rest run in the mode it picks) vs as many loop
    steps, goal <= 1.1x.
"""
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..autograd import map_with_parallel_backward, run_isolated_backward, run_isolated_forward
from ..parallel import parallel_apply
from ..policy import _forget, site_of
from .measure import Plan, Row, compare, measure

__all__ = ["bench_latency", "bench_overhead", "bench_compute", "backward_all",
           "LATENCY_CALLS", "LATENCY_S", "OVERHEAD_CALLS", "COLD_BATCHES"]

LATENCY_CALLS = 32
LATENCY_S = 0.005
OVERHEAD_CALLS = 64
COLD_BATCHES = 8


def backward_all(outs: Sequence[Tensor]) -> None:
    torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])


# -- latency-bound ---------------------------------------------------------------
class _Sleep(torch.autograd.Function):
    """Waits L in forward and in backward, like a remote or I/O-bound expert."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        time.sleep(LATENCY_S)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        time.sleep(LATENCY_S)
        return grad


class _PoolCall(torch.autograd.Function):
    """The seed's scheme: the inner Function's forward runs on the calling
    (pool) thread; its backward is one pool round trip per call, and the
    engine runs these nodes one after another."""

    @staticmethod
    def forward(ctx: Any, func: Any, pool: ThreadPoolExecutor,  # type: ignore[override]
                *args: Tensor) -> Any:
        inner_ctx, outputs = run_isolated_forward(func, *args)
        ctx.inner = (func, inner_ctx, pool)
        return outputs

    @staticmethod
    def backward(ctx: Any,  # type: ignore[override]
                 *grads: Tensor) -> Tuple[Optional[Tensor], ...]:
        func, inner_ctx, pool = ctx.inner
        return (None, None, *pool.submit(run_isolated_backward, func, inner_ctx, *grads).result())


def bench_latency(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=2, reps=15), Plan(warmup=1, reps=2))
    n, limit_ms = LATENCY_CALLS, 2 * LATENCY_S * 1e3
    xs = [torch.randn(8, requires_grad=True) for _ in range(n)]
    grads = [torch.ones(8) for _ in range(n)]
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="bench-naive")

    def ours() -> None:
        outs = [r[0] for r in map_with_parallel_backward(_Sleep, *[(x,) for x in xs])]
        torch.autograd.backward(outs, grads)

    def naive() -> None:
        outs = list(pool.map(lambda x: _PoolCall.apply(_Sleep, pool, x), xs))
        torch.autograd.backward(outs, grads)

    def sequential() -> None:
        outs = [_Sleep.apply(x) for x in xs]
        torch.autograd.backward(outs, grads)

    try:
        variants = {"ours": ours, "naive": naive, "sequential": sequential}
        s = measure(variants, plan.reps, plan.warmup)
    finally:
        pool.shutdown()
    s["limit"] = [limit_ms] * len(s["ours"])
    return [
        compare("latency", s, "limit", "ours", 1.3,
                f"baseline = physical limit 2L; {n} calls, L = {LATENCY_S * 1e3:g} ms"),
        compare("latency/naive-pool", s, "naive", "ours", None,
                "baseline = ThreadPoolExecutor fwd, per-call pool bwd (seed)"),
        compare("latency/sequential", s, "sequential", "ours", None,
                "baseline = plain apply loop"),
    ]


# -- overhead --------------------------------------------------------------------
class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


def bench_overhead(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=20, reps=40, inner=10), Plan(warmup=5, reps=7, inner=5))
    n = OVERHEAD_CALLS
    xs = [torch.randn(4, requires_grad=True) for _ in range(n)]
    grads = [torch.ones(4) for _ in range(n)]

    def ours(mode: Optional[str] = None) -> None:
        outs = [r[0] for r in map_with_parallel_backward(_Identity, *[(x,) for x in xs],
                                                         mode=mode)]
        torch.autograd.backward(outs, grads)

    def plain() -> None:
        outs = [_Identity.apply(x) for x in xs]
        torch.autograd.backward(outs, grads)

    s = measure({"ours": ours, "parallel": lambda: ours("parallel"), "plain": plain},
                plan.reps, plan.warmup, plan.inner)
    return [compare("overhead", s, "plain", "ours", 1.5,
                    f"per call, {n} calls on shape [4]; baseline = apply loop; "
                    f"ours as users get it (auto: {_mode_of(_Identity.__qualname__)})",
                    scale=1 / n),
            compare("overhead/parallel", s, "plain", "parallel", 2.0,
                    f"per call; mode='parallel' forced (every call on a worker)", scale=1 / n)]


def _mode_of(site: str, what: str = "mode") -> str:
    """The mode auto mode ran a site in last (see moe_autograd.policy), or
    another of its ``execution_stats`` entries."""
    from ..policy import execution_stats
    for stats in execution_stats():
        if stats["site"] == site:
            return str(stats[what])
    return "?"


class _Spinner:
    """Another process spinning one core while the block runs."""

    def __enter__(self) -> "_Spinner":
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.kill()
        self.proc.wait()


# -- compute-bound ---------------------------------------------------------------
def _mlp(d_in: int, d_hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_in))


def bench_compute(quick: bool) -> List[Row]:
    plan = Plan.pick(quick, Plan(warmup=3, reps=20), Plan(warmup=1, reps=4))
    torch.manual_seed(0)
    experts = [_mlp(256, 1024) for _ in range(16)]
    xs = [torch.randn(64, 256, requires_grad=True) for _ in experts]

    def ours(mode: Optional[str] = None) -> None:
        backward_all(parallel_apply(experts, xs, mode=mode))

    def loop() -> None:
        backward_all([e(x) for e, x in zip(experts, xs)])

    variants = {"ours": ours, "parallel": lambda: ours("parallel"), "loop": loop}
    s = measure(variants, plan.reps, plan.warmup)
    what = (f"16 MLP experts 256-1024-256 x 64 tokens; baseline = Python loop; "
            f"intra-op threads {torch.get_num_threads()}")
    rows = [compare("compute", s, "loop", "ours", 1.0,
                    f"{what}; auto: {_mode_of('Sequential')}"),
            compare("compute/parallel", s, "loop", "parallel", None,
                    f"{what}; mode='parallel' forced")]
    with _Spinner():
        loaded = measure({"ours": ours, "loop": loop}, plan.reps, plan.warmup)
    rows.append(compare("compute/loaded", loaded, "loop", "ours", 1.1,
                        f"{what}; another process spins one core in both arms; "
                        f"auto: {_mode_of('Sequential')}"))
    rows.append(_bench_cold(quick, experts, ours, loop, what))
    wrapped = [_Wrapped(e) for e in experts]
    rows.append(_bench_cold(
        quick, wrapped, lambda: backward_all(parallel_apply(wrapped, xs)), loop,
        what + "; the same MLPs behind a forward of the user's (a new site whose calls may "
        "wait: its first batch fans out)", name="compute/cold-custom", goal=None))
    return rows


class _Wrapped(nn.Module):
    """The same MLP behind a forward of the user's."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)


def _bench_cold(quick: bool, experts: Sequence[nn.Module], ours: Any, loop: Any,
                what: str, name: str = "compute/cold", goal: Optional[float] = 1.1) -> Row:
    """The first COLD_BATCHES batches of a new site in auto mode (the site
    forgotten before each sample) vs as many loop steps."""
    plan = Plan.pick(quick, Plan(warmup=1, reps=10), Plan(warmup=1, reps=2))
    site = site_of(experts)
    label = type(experts[0]).__name__

    def cold() -> None:
        _forget(site)  # a new site: its first batch fans out and is measured
        for _ in range(COLD_BATCHES):
            ours()

    def loops() -> None:
        for _ in range(COLD_BATCHES):
            loop()

    s = measure({"ours": cold, "loop": loops}, plan.reps, plan.warmup)
    return compare(name, s, "loop", "ours", goal,
                   f"{what}; the first {COLD_BATCHES} batches of a new site, auto, vs "
                   f"{COLD_BATCHES} loop steps; batches by mode in the last sample: "
                   f"{_mode_of(label, 'batches')}")
