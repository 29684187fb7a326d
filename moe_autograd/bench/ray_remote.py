"""Benchmark: remote experts on Ray, against plain Ray actor calls.

Setting (one local Ray instance, ``ray.init(num_cpus=2)``, started and shut
down here): 4 server actors hosting 16 experts in all (4 each), each expert a
64-wide ``Linear`` + ``tanh`` that sleeps ``L`` in forward and again in
backward (:class:`~moe_autograd.bench.remote.SleepyExpert`, as the RPC rows).
16 calls (one per expert, 32 rows each) are timed forward + backward:

* ``ours``: :class:`~moe_autograd.remote.RemoteExpert` calls through
  :func:`moe_autograd.parallel_apply` over :class:`~moe_autograd.remote.RayTransport`
  (:class:`~moe_autograd.remote.RayExpertServer` actors, stateful backward):
  one request per server and pass;
* ``plain``: what a Ray user writes without us: 4 actors hosting the same
  experts (``max_concurrency=16``, like ours), one ``.remote()`` per expert
  call in forward (the actor keeps the graph) and again in backward,
  ``ray.get`` to join each pass.

Goals (issue 20): ours <= 0.5 x plain at L = 5 ms; at L = 50 ms (the
latency-bound case), ours against the 2L limit. The comparison with ours on
torch RPC at L = 50 ms is the ``remote/L50-vs-limit`` row of the ``remote``
group (same experts, same limit): compare the two ``ours`` columns.
``python -m moe_autograd.bench.ray_remote [--quick]`` prints the rows alone;
without ``ray`` installed the group is one "skipped" row.
"""
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .measure import Plan, compare, measure
from .remote import SleepyExpert, format_rows

__all__ = ["run", "main"]

L_S = 0.005
SLOW_L_S = 0.05
WIDTH, BATCH = 64, 32
SERVERS = tuple(f"ray-bench-{k}" for k in range(4))
NAMES = tuple(f"e{k}" for k in range(4))


def _experts() -> Dict[str, nn.Module]:
    torch.manual_seed(0)
    return dict({n: SleepyExpert(WIDTH, L_S) for n in NAMES},
                **{f"slow_{n}": SleepyExpert(WIDTH, SLOW_L_S) for n in NAMES})


def setup() -> Dict[str, nn.Module]:
    """The experts factory of the bench's RayExpertServers."""
    torch.set_num_threads(1)
    return _experts()


class PlainExperts:
    """The plain Ray baseline's actor: forward keeps the graph under a key,
    backward takes it and returns the input gradient."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.experts = _experts()
        self.graphs: Dict[int, Tuple[Tensor, Tensor]] = {}
        self.lock = threading.Lock()

    def ready(self) -> bool:
        return True

    def forward(self, name: str, key: int, x: Tensor) -> Tensor:
        leaf = x.detach().requires_grad_()
        out = self.experts[name](leaf)
        with self.lock:
            self.graphs[key] = (leaf, out)
        return out.detach()

    def backward(self, key: int, grad: Tensor) -> Optional[Tensor]:
        with self.lock:
            leaf, out = self.graphs.pop(key)
        out.backward(grad)
        return leaf.grad


def _measure(quick: bool) -> List[Dict[str, Any]]:
    import ray

    from .. import parallel_apply
    from ..remote import RemoteExpert
    from ..remote.ray_backend import RayTransport, start_servers

    plan = Plan.pick(quick, Plan(warmup=3, reps=30), Plan(warmup=1, reps=5))
    slow_plan = Plan.pick(quick, Plan(warmup=1, reps=8), Plan(warmup=1, reps=3))
    servers = start_servers([(s, "moe_autograd.bench.ray_remote:setup") for s in SERVERS],
                            backward="stateful",
                            ready_timeout=120.0)
    plain_class: Any = ray.remote(PlainExperts)
    plain: List[Any] = [plain_class.options(num_cpus=0, max_concurrency=16).remote() for _ in SERVERS]
    try:
        ray.get([p.ready.remote() for p in plain], timeout=120.0)
        transport = RayTransport()
        pairs = [(k, n) for k in range(len(SERVERS)) for n in NAMES]
        xs = [torch.randn(BATCH, WIDTH, requires_grad=True) for _ in pairs]
        keys = iter(range(1 << 62))

        def ours(prefix: str) -> Callable[[], None]:
            experts = [RemoteExpert(SERVERS[k], prefix + n, transport=transport,
                                    forward_timeout=30, backward_timeout=30) for k, n in pairs]

            def step() -> None:
                outs = parallel_apply(experts, xs)
                sum(o.sum() for o in outs).backward()
            return step

        def plain_calls(prefix: str) -> Callable[[], None]:
            def step() -> None:
                ids = [next(keys) for _ in pairs]
                outs = ray.get([plain[k].forward.remote(prefix + n, key, x.detach())
                                for (k, n), key, x in zip(pairs, ids, xs)])
                grads = [torch.ones_like(o) for o in outs]
                ray.get([plain[k].backward.remote(key, g)
                         for (k, _), key, g in zip(pairs, ids, grads)])
            return step

        fast = measure({"plain": plain_calls(""), "ours": ours("")}, plan.reps, plan.warmup)
        fast["2L"] = [2e3 * L_S] * plan.reps
        slow = measure({"plain": plain_calls("slow_"), "ours": ours("slow_")},
                       slow_plan.reps, slow_plan.warmup)
        slow["2L"] = [2e3 * SLOW_L_S] * slow_plan.reps
    finally:
        for actor in plain:
            ray.kill(actor)
        for server in servers:
            server.kill()
    world = (f"{len(SERVERS) * len(NAMES)} calls fwd+bwd, {len(SERVERS)} Ray actors x "
             f"{len(NAMES)} experts, stateful")
    base = "baseline = plain Ray actor calls (one .remote() per call and pass, ray.get)"
    rows = [
        compare("ray/vs-plain-actors", fast, "plain", "ours", 0.5,
                f"{world}, L = {L_S * 1e3:g} ms; {base}"),
        compare("ray/vs-limit", fast, "2L", "ours", None,
                "same; baseline = physical limit 2L"),
        compare("ray/L50-vs-plain-actors", slow, "plain", "ours", None,
                f"L = {SLOW_L_S * 1e3:g} ms; {base}"),
        compare("ray/L50-vs-limit", slow, "2L", "ours", 1.2,
                "L = 50 ms; baseline = physical limit 2L (compare ours with "
                "remote/L50-vs-limit, the same on torch RPC)"),
    ]
    return [{"name": r.name, "baseline_ms": r.baseline, "ours_ms": r.ours, "ratio": r.ratio,
             "goal": r.goal, "note": r.note} for r in rows]


def run_on_local_ray(name: str, rows: Callable[[], List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """``rows()`` with Ray connected: on a local instance started here (and
    shut down after) unless this process is connected to one; one skipped
    row named ``name`` without ray."""
    try:
        import ray
    except ImportError:
        return [{"name": name, "baseline_ms": None, "ours_ms": None, "ratio": None,
                 "goal": None, "note": "skipped: ray is not installed (pip install "
                 "'moe_autograd[ray]')"}]
    started = not ray.is_initialized()
    if started:
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        old = os.environ.get("PYTHONPATH")
        # Ray's workers inherit the environment of the raylet that ray.init starts.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, old) if p)
        try:
            # address='local': a new instance, never a cluster found through
            # RAY_ADDRESS or /tmp/ray/ray_current_cluster (stale after a hard kill)
            ray.init(address="local", num_cpus=2, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        finally:
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old
    try:
        return rows()
    finally:
        if started:
            ray.shutdown()


def run(quick: bool = False) -> List[Dict[str, Any]]:
    """Measures on a local Ray instance (see :func:`run_on_local_ray`)."""
    return run_on_local_ray("ray", lambda: _measure(quick))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    print(format_rows(run(quick="--quick" in args)))
    return 0


if __name__ == "__main__":  # run the package's module, so that the actors import it by name
    from moe_autograd.bench.ray_remote import main as _main

    sys.exit(_main())
