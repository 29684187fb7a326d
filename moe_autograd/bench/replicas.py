"""Benchmark: replica choice with one slow replica among three (issue 32).

Setting (loopback, one run): a trainer process founds a dynamic world
(:meth:`~moe_autograd.remote.Fleet.start`) and three servers join it
(:class:`~moe_autograd.remote.ElasticServer`, forked from a forkserver that
imported torch once): ``slow`` first (so it is the oldest replica, the one
``balance="order"`` sticks to), then ``r1`` and ``r2``. Each serves twelve
stateful experts, every one a 64-wide ``Linear`` + ``tanh`` sleeping
``L`` = 5 ms in forward and again in backward
(:class:`~moe_autograd.bench.remote.SleepyExpert`; the sleep stands for a
server's compute or a link's latency): ``a0``..``a3`` everywhere alike, and
``b0``..``b3``, ``c0``..``c3`` sleeping 5 L on ``slow``. A
:class:`~moe_autograd.moe.MixtureOfExperts` (k = 4 of 4 experts, 64 tokens,
64 wide) over :class:`~moe_autograd.remote.FleetExpert` s is timed forward +
backward, three layers interleaved (:func:`.measure.measure`):

* all fast: the layer over ``a0``..``a3`` (``balance="latency"``);
* one slow: over ``b0``..``b3`` (``balance="latency"``, the default);
* one slow, old behaviour: over ``c0``..``c3`` with ``balance="order"``.

Separate names keep the variants' measurements apart (the balancer keys them
by expert and server): each layer's experts learn the slow replica on their
own, explore it once, then re-probe it every
:data:`~moe_autograd.remote.balance.PROBE_AFTER_S` seconds, as a long run
would.

Rows:

* ``remote/replicas-slow-one``: one slow over all fast. Goal: <= 1.2.
* ``remote/replicas-slow-one-order``: the old behaviour over all fast (no
  goal: what the balancer saves).

Every process serves one job: :func:`run` makes a new
:class:`~moe_autograd.remote.JobSecret` and hands it to each process through
its start arguments. ``python -m moe_autograd.bench.replicas [--quick]``
prints the rows alone.
"""
import os
import signal
import statistics
import time
from typing import Any, Dict, List, Optional, cast

import torch

from .measure import Plan, Row, compare, measure
from .processes import forkserver_context, result_of
from .remote import SleepyExpert

__all__ = ["run", "main", "L_S", "SLOWDOWN"]

L_S = 0.005
SLOWDOWN = 5
WIDTH, TOKENS, K = 64, 64, 4
SERVERS = ("slow", "r1", "r2")  # in the order they join: slow is the oldest
_PRELOAD = ["torch", "torch.distributed.rpc", "moe_autograd.remote", "moe_autograd.moe",
            __name__]


def _context() -> Any:
    return forkserver_context(_PRELOAD)


def _experts(slow: bool) -> Dict[str, SleepyExpert]:
    torch.manual_seed(0)  # the same weights on every replica
    experts = {f"a{k}": SleepyExpert(WIDTH, L_S) for k in range(K)}
    for family in ("b", "c"):
        experts.update({f"{family}{k}": SleepyExpert(WIDTH, L_S * (SLOWDOWN if slow else 1))
                        for k in range(K)})
    return experts


def _server(port: int, name: str, go: Any, joined: Any, parent: int, secret: str) -> None:
    """A server: waits for ``go``, joins, reports its name, serves until the
    trainer's stop or SIGTERM."""
    from ..remote import ElasticServer, ExpertServer, JobSecret, set_job_secret
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    set_job_secret(JobSecret.from_hex(secret))
    server = ExpertServer(_experts(name == "slow"), backward="stateful")
    elastic = ElasticServer(server, name, options=backend_options(port, rpc_timeout=30.0),
                            linger=0.1)
    signal.signal(signal.SIGTERM, lambda *_: elastic.stop("SIGTERM"))
    while not go.wait(0.5):
        try:
            os.kill(parent, 0)
        except ProcessLookupError:  # the benchmark died: do not linger
            os._exit(1)
    elastic.join()
    joined.put(name)
    elastic.serve()
    os._exit(0)


def _as_dict(row: Row) -> Dict[str, Any]:
    return {"name": row.name, "baseline_ms": row.baseline, "ours_ms": row.ours,
            "ratio": row.ratio, "goal": row.goal, "note": row.note}


def _train(port: int, quick: bool, go: Dict[str, Any], joined: Any) -> List[Dict[str, Any]]:
    from ..moe import MixtureOfExperts
    from ..remote import Fleet
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    torch.manual_seed(0)
    fleet = Fleet.start("trainer", options=backend_options(port, rpc_timeout=30.0))
    try:
        for name in SERVERS:  # one after another: the join order is the fleet's order
            go[name].set()
            if joined.get(timeout=120) != name:
                raise RuntimeError("the servers joined out of order")
        names = {f: [f"{f}{k}" for k in range(K)] for f in "abc"}
        deadline = time.monotonic() + 60
        while any(fleet.replicas(n) != list(SERVERS) for group in names.values() for n in group):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fleet does not resolve {SERVERS}: {fleet.servers()}")
            time.sleep(fleet.poll)

        def layer(family: str, balance: str) -> Any:
            experts = fleet.experts(names[family], forward_timeout=5.0, backward_timeout=5.0,
                                    balance=balance)
            return MixtureOfExperts(experts, WIDTH, k=K, k_min=0, allow_zero_outputs=True,
                                    forward_timeout=5.5, backward_timeout=6.0)

        def step_of(moe: Any) -> Any:
            def step() -> None:
                y, aux = moe(torch.randn(TOKENS, WIDTH))
                (y.square().mean() + aux).backward()
            return step

        layers = {"fast": layer("a", "latency"), "slow": layer("b", "latency"),
                  "order": layer("c", "order")}
        plan = Plan.pick(quick, Plan(warmup=3, reps=30, inner=5), Plan(warmup=2, reps=6, inner=5))
        start = time.monotonic()
        samples = measure({n: step_of(m) for n, m in layers.items()}, plan.reps, plan.warmup,
                          plan.inner)
        seconds = time.monotonic() - start
        stats = fleet.replica_stats()
        on_slow = {f: sum(stats[n]["slow"]["calls"] for n in names[f]) for f in "bc"}
        probes = sum(stats[n]["slow"]["probes"] for n in names["b"])
        total = {f: sum(s["calls"] for n in names[f] for s in stats[n].values()) for f in "bc"}
        masked = sum(int(s["failures"]) + int(s["timeouts"])
                     for m in layers.values() for s in m.stats())
        means = {n: statistics.fmean(v) for n, v in samples.items()}
        setting = (f"MoE k={K} of {K} FleetExperts, {TOKENS} tokens, 3 replicas each "
                   f"(stateful, L = {L_S * 1e3:g} ms fwd and bwd; the oldest {SLOWDOWN} L), "
                   f"fwd+bwd, {plan.inner} steps per sample, {seconds:.0f} s")
        rows = [
            compare("remote/replicas-slow-one", samples, "fast", "slow", goal="<= 1.20",
                    note=f"{setting}; baseline = all 3 replicas fast; balance='latency'; "
                         f"calls on the slow replica: {on_slow['b']} of {total['b']} "
                         f"({probes} explorations and re-probes, one per "
                         f"{fleet.balancer.probe_after:g} s and expert; "
                         f"{on_slow['b'] - probes} won in draws); ratio of means "
                         f"{means['slow'] / means['fast']:.2f}; masked calls {masked}"),
            compare("remote/replicas-slow-one-order", samples, "fast", "order",
                    note=f"same, balance='order' (before issue 32: the oldest replica, here "
                         f"the slow one): calls on it {on_slow['c']} of {total['c']}"),
        ]
        return [_as_dict(r) for r in rows]
    finally:
        fleet.shutdown(timeout=15.0)


def _trainer(port: int, quick: bool, go: Dict[str, Any], joined: Any, results: Any,
             secret: str) -> None:
    from ..remote import JobSecret, set_job_secret

    set_job_secret(JobSecret.from_hex(secret))
    try:
        results.put(("ok", _train(port, quick, go, joined)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        import traceback
        results.put(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run(quick: bool = False) -> List[Dict[str, Any]]:
    """Starts the world, measures, tears it down; returns the rows (dicts with
    ``name, baseline_ms, ours_ms, ratio, goal, note``)."""
    from ..remote import JobSecret
    from ..remote.loopback import free_port, stop_processes

    port = free_port()
    ctx = _context()
    secret = JobSecret.generate().hex()  # the world's job: passed in start arguments only
    joined, results = ctx.Queue(), ctx.Queue()
    go = {name: ctx.Event() for name in SERVERS}
    started: List[Any] = []
    status, value = "error", cast(Any, "not started")
    try:
        for name in SERVERS:
            process = ctx.Process(target=_server, name=f"bench-replicas-{name}", daemon=True,
                                  args=(port, name, go[name], joined, os.getpid(), secret))
            process.start()
            started.append(process)
        trainer = ctx.Process(target=_trainer, name="bench-replicas-trainer", daemon=True,
                              args=(port, quick, go, joined, results, secret))
        trainer.start()
        started.insert(0, trainer)
        status, value = result_of(results, trainer, 300, "trainer")
    finally:
        stop_processes(started, timeout=20.0)
    if status != "ok":
        raise RuntimeError(f"bench.replicas failed in the trainer: {value}")
    return cast(List[Dict[str, Any]], value)


def main(argv: Optional[List[str]] = None) -> int:
    import sys

    from .remote import format_rows

    args = sys.argv[1:] if argv is None else argv
    print(format_rows(run(quick="--quick" in args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
