"""Benchmark: remote experts in ``parallel_apply`` vs torch's distributed autograd.

Setting (loopback, one run): 4 server processes x 4 experts, each expert a
64-wide ``Linear`` + ``tanh`` that sleeps ``L`` = 5 ms in forward and again in
backward (standing in for compute that releases the GIL, like a GPU kernel).
16 calls (one per expert) are timed forward + backward:

* ``ours``: :class:`~moe_autograd.remote.RemoteExpert` calls through
  :func:`moe_autograd.parallel_apply` (stateful servers; a stateless row is
  shown too: it recomputes the forward, so its floor is 3L);
* ``torch``: the same experts called with ``rpc.rpc_async`` inside a
  ``dist_autograd.context()`` and differentiated by
  ``torch.distributed.autograd.backward`` (the engine's own distributed
  backward), on the same RPC world.

Goals: ours <= 0.67 x torch, and ours <= 1.5 x 2L (the limit if all 16 calls
overlap in both passes). The same is measured with L = 50 ms, where the
per-call CPU of the RPC layer is amortised: on a machine with few cores the
L = 5 ms run is CPU-bound (every RPC costs about a millisecond of CPU over
both ends), and the L = 50 ms run shows the latency-bound behaviour. Also the per-call overhead of a tiny expert through
``RemoteExpert`` against a bare ``rpc_sync`` of the same module. Medians of
several repetitions, interleaved (the variants take turns, so a slow moment
of a shared machine hits all alike). The client runs in a child process (a process joins one
RPC world in its life), so :func:`run` can be called from anywhere.
"""
import multiprocessing
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

__all__ = ["run", "format_rows", "main"]

L_S = 0.005
SLOW_L_S = 0.05  # the latency-bound variant: overheads amortised
WIDTH, BATCH = 64, 32
SERVERS = tuple(f"bench-{k}" for k in range(4))
NAMES = tuple(f"e{k}" for k in range(4))
_modules: Dict[str, nn.Module] = {}


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class SleepyExpert(nn.Module):
    """``tanh(Linear(x))`` that sleeps ``seconds`` in forward and in backward."""

    def __init__(self, width: int = WIDTH, seconds: float = L_S) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(torch.tanh(self.lin(x)), self.seconds)


def _setup() -> List[Any]:
    """Server process: stateful e*, stateless sl_e*, stateful slow_e* (10 L),
    and a tiny expert."""
    from .remote import ExpertServer

    stateful = {n: SleepyExpert() for n in NAMES}
    slow = {f"slow_{n}": SleepyExpert(seconds=SLOW_L_S) for n in NAMES}
    _modules.update(stateful, **slow)
    _modules["tiny"] = nn.Linear(4, 4)
    return [ExpertServer(dict(stateful, **slow), backward="stateful"),
            ExpertServer({f"sl_{n}": SleepyExpert() for n in NAMES}),
            ExpertServer({"tiny": _modules["tiny"]})]


def _torch_forward(name: str, x: Tensor) -> Tensor:
    return _modules[name](x)


def _tiny_forward(x: Tensor) -> Tensor:
    with torch.no_grad():
        return _modules["tiny"](x)


def _interleaved_ms(fns: Dict[str, Callable[[], Any]], reps: int, warmup: int = 3) -> Dict[str, float]:
    """Median wall time of each fn, run in rotating order rep after rep, so a
    slow moment of a shared machine hits every variant alike."""
    names = list(fns)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            fns[name]()
            if rep >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _measure(quick: bool) -> List[Dict[str, Any]]:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc

    from . import parallel_apply
    from .remote import RemoteExpert

    reps = 10 if quick else 30
    pairs = [(w, n) for w in SERVERS for n in NAMES]
    xs = [torch.randn(BATCH, WIDTH, requires_grad=True) for _ in pairs]

    def ours(prefix: str) -> Callable[[], None]:
        experts = [RemoteExpert(w, prefix + n, forward_timeout=30, backward_timeout=30)
                   for w, n in pairs]

        def step() -> None:
            outs = parallel_apply(experts, xs)
            sum(o.sum() for o in outs).backward()
        return step

    def torch_dist(prefix: str) -> Callable[[], None]:
        def step() -> None:
            with dist_autograd.context() as ctx:
                futures = [rpc.rpc_async(w, _torch_forward, args=(prefix + n, x))
                           for (w, n), x in zip(pairs, xs)]
                loss = sum(f.wait().sum() for f in futures)
                dist_autograd.backward(ctx, [loss])
        return step

    big = _interleaved_ms({"torch": torch_dist(""), "ours": ours(""), "stateless": ours("sl_")}, reps)
    slow = _interleaved_ms({"torch": torch_dist("slow_"), "ours": ours("slow_")}, 3 if quick else 6, 1)
    tiny, x, chunk = RemoteExpert(SERVERS[0], "tiny"), torch.randn(8, 4), 20

    def bare() -> None:
        for _ in range(chunk):
            rpc.rpc_sync(SERVERS[0], _tiny_forward, args=(x,))

    def ours_no_grad() -> None:
        with torch.no_grad():
            for _ in range(chunk):
                tiny(x)

    def ours_grad() -> None:
        xg = x.requires_grad_()
        for _ in range(chunk):
            tiny(xg)

    small = {k: v / chunk for k, v in _interleaved_ms(
        {"bare": bare, "no_grad": ours_no_grad, "grad": ours_grad}, reps).items()}
    limit = 2 * L_S * 1e3
    t_ours, t_torch, t_sl = big["ours"], big["torch"], big["stateless"]
    return [
        _row("16 calls fwd+bwd: torch.distributed.autograd", t_torch, None, "baseline"),
        _row("16 calls fwd+bwd: ours (stateful) vs torch", t_ours, t_ours / t_torch, "<= 0.67"),
        _row("16 calls fwd+bwd: ours (stateful) vs 2L limit", t_ours, t_ours / limit, "<= 1.5"),
        _row("16 calls fwd+bwd: ours (stateless) vs 3L limit", t_sl, t_sl / (1.5 * limit), "<= 1.5"),
        _row("L=50ms: torch.distributed.autograd", slow["torch"], None, "baseline"),
        _row("L=50ms: ours (stateful) vs torch", slow["ours"], slow["ours"] / slow["torch"], "<= 0.67"),
        _row("L=50ms: ours (stateful) vs 2L limit", slow["ours"],
             slow["ours"] / (2e3 * SLOW_L_S), "<= 1.5"),
        _row("tiny expert: bare rpc_sync, per call", small["bare"], None, "baseline"),
        _row("tiny expert: RemoteExpert no_grad vs rpc_sync", small["no_grad"],
             small["no_grad"] / small["bare"], "<= 1.5"),
        _row("tiny expert: RemoteExpert forward with grad vs rpc_sync", small["grad"],
             small["grad"] / small["bare"], "<= 2.0"),
    ]


def _row(name: str, ms: float, ratio: Optional[float], goal: str) -> Dict[str, Any]:
    met = None if ratio is None else ratio <= float(goal.split()[-1])
    return {"name": name, "ms": round(ms, 3), "ratio": None if ratio is None else round(ratio, 3),
            "goal": goal, "met": met, "cpus": os.cpu_count(), "load1": round(os.getloadavg()[0], 2)}


def _client_main(port: int, quick: bool, queue: Any) -> None:
    from torch.distributed import rpc

    from .remote.loopback import backend_options

    torch.set_num_threads(1)
    rpc.init_rpc("bench-client", rank=0, world_size=1 + len(SERVERS),
                 rpc_backend_options=backend_options(port, rpc_timeout=60.0))
    try:
        queue.put(("ok", _measure(quick)))
    except BaseException as error:  # noqa: BLE001 - report, then leave the world
        queue.put(("error", f"{type(error).__name__}: {error}"))
    finally:
        rpc.shutdown()


def run(quick: bool = False) -> List[Dict[str, Any]]:
    """Starts the loopback world, measures, tears it down; returns the rows."""
    from .remote.loopback import free_port, start_servers, stop_processes

    port = free_port()
    servers = start_servers(port, 1 + len(SERVERS), SERVERS, f"{__name__}:_setup")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    client = ctx.Process(target=_client_main, args=(port, quick, queue), daemon=True)
    client.start()
    try:
        status, value = queue.get(timeout=120)
    finally:
        stop_processes([client, *servers], timeout=15.0)
    if status != "ok":
        raise RuntimeError(f"bench_remote failed in the client process: {value}")
    return value


def format_rows(rows: List[Dict[str, Any]]) -> str:
    lines = [f"(loopback, {rows[0]['cpus']} cpus, load average {rows[-1]['load1']} at the end)",
             f"{'benchmark':56} {'ms':>9} {'ratio':>7}  goal"]
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        mark = "" if r["met"] is None else ("  ok" if r["met"] else "  MISSED")
        lines.append(f"{r['name']:56} {r['ms']:9.3f} {ratio:>7}  {r['goal']}{mark}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else argv
    print(format_rows(run(quick="--quick" in args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
