"""Benchmark: the MoE layer over an elastic fleet while servers churn.

Setting (loopback, one run): a trainer process founds a dynamic world
(:meth:`~moe_autograd.remote.Fleet.start`) and trains a
:class:`~moe_autograd.moe.MixtureOfExperts` whose experts are
:class:`~moe_autograd.remote.FleetExpert`\\ s: four names ``e0``..``e3``, each
a 64-wide ``Linear`` that sleeps ``L`` = 2 ms in forward (GIL released, as a
heavier expert would), hosted by two full replicas at all times; k = 4, 64
tokens. Every process is forked from a forkserver that imported torch once,
and the servers that join later are forked in advance and wait for a signal,
so the rows time the runtime's churn, not interpreter start-up.

Rows:

* ``elastic/churn``: mean step time in blocks of ``BLOCK`` steps during which
  one server joins (with replicas of all four experts) and the oldest server
  leaves cleanly (SIGTERM: drain, RPC leave), against blocks without churn,
  interleaved (no-churn, churn, no-churn, churn, ...); the ratio is the
  median of the per-pair ratios. Goal: <= 1.10 (churn costs at most 10 %).
* ``elastic/join->served``: for a server bringing an expert that no other
  server hosts (``x0``, ``x1``, ...: masked until then), the steps begun after
  its publication (the end of its join) until one was served by it (the
  ratio column: the worst sample; goal <= 2), and the time from publication
  to that first served call (ours) against the median step (baseline). The
  note also gives how long the join itself took in the server.

Every process serves one job: :func:`run` makes a new
:class:`~moe_autograd.remote.JobSecret` and hands it to each process through
its start arguments (never argv or the environment).

``python -m moe_autograd.bench.elastic [--quick]`` prints the rows alone.
"""
import os
import signal
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor, nn

from .processes import forkserver_context, result_of

__all__ = ["run", "main"]

L_S = 0.002
WIDTH, TOKENS = 64, 64
NAMES = ("e0", "e1", "e2", "e3")
BLOCK = 25          # steps per block
_PRELOAD = ["torch", "torch.distributed.rpc", "moe_autograd.remote", "moe_autograd.moe",
            __name__]


class _Sleepy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(L_S)
        return torch.tanh(self.lin(x))



def until_served(fleet: Any, server: str, step: Callable[[], float], published: float,
                 offset: float) -> Tuple[float, int]:
    """Steps until ``server`` (published at wall time ``published``) served a
    call: ms from its publication to its first served call, and the steps
    begun after the publication (``offset``: wall minus monotonic time)."""
    starts: List[float] = []
    for _ in range(200):
        starts.append(time.time())
        step()
        first = fleet.first_served(server)
        if first is not None:
            return ((first + offset - published) * 1e3,
                    sum(1 for t in starts if t >= published))
    raise RuntimeError(f"{server} served nothing within 200 steps of its join")


def fleet_step(fleet: Any, join_samples: int) -> Tuple[Any, List[str], Callable[[], float]]:
    """A MoE layer over the fleet's experts (``NAMES`` and the ``extra``
    names that join later) and its warmed-up training step (seconds), as both
    engines' elastic rows time it: ``(layer, extra, step)``."""
    from ..moe import MixtureOfExperts

    extra = [f"x{k}" for k in range(join_samples)]
    experts = fleet.experts(list(NAMES) + extra, forward_timeout=5.0, backward_timeout=5.0)
    moe = MixtureOfExperts(experts, WIDTH, k=len(experts), k_min=0, allow_zero_outputs=True,
                           forward_timeout=5.5, backward_timeout=6.0)

    def step() -> float:
        x = torch.randn(TOKENS, WIDTH)
        start = time.perf_counter()
        y, aux = moe(x)
        (y.square().mean() + aux).backward()
        return time.perf_counter() - start

    for _ in range(10):  # warm-up
        step()
    return moe, extra, step

def _context() -> Any:
    return forkserver_context(_PRELOAD)


def _server(port: int, name: str, experts: Sequence[str], go: Any, joined: Any,
            parent: int, secret: str) -> None:
    """A server: waits for ``go``, joins, reports ``(name, seconds the join
    took, wall time of publication)``, serves until SIGTERM or the stop.
    ``secret``: the job's, in hex."""
    from ..remote import ElasticServer, ExpertServer, JobSecret, set_job_secret
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    set_job_secret(JobSecret.from_hex(secret))
    server = ExpertServer({e: _Sleepy() for e in experts})
    elastic = ElasticServer(server, name, options=backend_options(port, rpc_timeout=30.0),
                            linger=0.3)
    signal.signal(signal.SIGTERM, lambda *_: elastic.stop("SIGTERM"))
    while not go.wait(0.5):
        try:
            os.kill(parent, 0)
        except ProcessLookupError:  # the benchmark died: do not linger
            os._exit(1)
    start = time.monotonic()
    elastic.join()
    joined.put((name, time.monotonic() - start, time.time()))
    elastic.serve()
    os._exit(0)


def _trainer(port: int, quick: bool, plan: Dict[str, Any], results: Any, secret: str) -> None:
    from ..remote import JobSecret, set_job_secret

    set_job_secret(JobSecret.from_hex(secret))
    try:
        results.put(("ok", _train(port, quick, plan)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        import traceback
        results.put(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def _train(port: int, quick: bool, plan: Dict[str, Any]) -> Dict[str, Any]:
    from ..remote import Fleet, membership
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    torch.manual_seed(0)
    gos, joined, pids = plan["go"], plan["joined"], plan["pids"]
    fleet = Fleet.start("trainer", options=backend_options(port, rpc_timeout=30.0))
    try:
        gos["r0"].set()
        gos["r1"].set()
        for _ in range(2):
            joined.get(timeout=60)
        fleet.wait_for(list(NAMES), timeout=60)
        moe, extra, step = fleet_step(fleet, plan["join_samples"])
        live = ["r0", "r1"]  # replica servers, oldest first
        quiet_blocks: List[float] = []
        churn_blocks: List[float] = []
        churn_steps: List[int] = []
        raw = fleet.registry.raw
        for k in range(plan["pairs"]):
            quiet_blocks.append(statistics.fmean(step() for _ in range(BLOCK)))
            # one join (a fresh replica of e0..e3) and one clean leave (the
            # oldest, once the newcomer serves): the block lasts until both
            # are complete, and at least BLOCK steps
            newcomer, oldest = f"r{k + 2}", live.pop(0)
            gos[newcomer].set()
            times: List[float] = []
            left = False
            deadline = time.monotonic() + 60
            while len(times) < BLOCK or not left or oldest in membership.members(raw):
                if not left and newcomer in fleet.servers():
                    os.kill(pids[oldest], signal.SIGTERM)
                    left = True
                times.append(step())
                if time.monotonic() > deadline:
                    raise RuntimeError(f"churn {oldest} -> {newcomer} did not end within 60 s")
            live.append(newcomer)
            churn_blocks.append(statistics.fmean(times))
            churn_steps.append(len(times))
        for _ in range(plan["pairs"]):
            joined.get(timeout=60)  # the replicas' join reports (not timed here)

        # join -> first served call, for experts nobody else hosts
        samples: List[Tuple[float, int, float]] = []  # (ms, steps, join s)
        step_s = statistics.median(quiet_blocks)
        offset = time.time() - time.monotonic()
        for name in extra:
            gos[name].set()
            server, join_s, published = joined.get(timeout=60)
            served_ms, steps_after = until_served(fleet, server, step, published, offset)
            samples.append((served_ms, steps_after, join_s))
        return {"quiet_ms": [b * 1e3 for b in quiet_blocks],
                "churn_ms": [b * 1e3 for b in churn_blocks], "churn_steps": churn_steps,
                "step_ms": step_s * 1e3, "samples": samples,
                "events": [(e.kind, e.worker) for e in fleet.events],
                "failures": sum(cast(int, s["failures"]) + cast(int, s["timeouts"])
                                for s in moe.stats()[:len(NAMES)])}
    finally:
        fleet.shutdown(timeout=15.0)


def _rows(result: Dict[str, Any], pairs: int) -> List[Dict[str, Any]]:
    quiet, churn = result["quiet_ms"], result["churn_ms"]
    ratios = sorted(c / q for q, c in zip(quiet, churn))
    ratio = statistics.median(ratios)
    samples = result["samples"]
    step_ms = result["step_ms"]
    served_ms = statistics.median(s[0] for s in samples)
    return [
        {"name": "elastic/churn", "baseline_ms": statistics.median(quiet),
         "ours_ms": statistics.median(churn), "ratio": ratio, "goal": "<= 1.10",
         "note": f"{pairs} churn blocks (one join + one clean leave each, from the join's start "
                 f"to the leave's end: {result['churn_steps']} steps) vs {BLOCK}-step blocks "
                 f"without, interleaved; per-pair ratios {min(ratios):.2f}-{max(ratios):.2f} "
                 f"(mean {statistics.fmean(ratios):.2f}); "
                 f"masked calls of replicated experts: {result['failures']}"},
        {"name": "elastic/join->served", "baseline_ms": step_ms, "ours_ms": served_ms,
         "ratio": float(max(s[1] for s in samples)), "goal": "<= 2.0",
         "note": "ratio here = steps (not ours/baseline): steps begun after a server's "
                 "publication until one was served by it "
                 f"(worst of {len(samples)} joins: {[s[1] for s in samples]}); ours: median "
                 "publication to first served call (the step in flight included); baseline: "
                 f"median step; the join itself took "
                 f"{statistics.median(s[2] for s in samples) * 1e3:.0f} ms in the server"},
    ]


def run(quick: bool = False) -> List[Dict[str, Any]]:
    """Starts the world, measures, tears it down; returns the rows (dicts with
    ``name, baseline_ms, ours_ms, ratio, goal, note``)."""
    from ..remote import JobSecret
    from ..remote.loopback import free_port, stop_processes

    pairs = 2 if quick else 4
    join_samples = 2 if quick else 3
    port = free_port()
    ctx = _context()
    secret = JobSecret.generate().hex()  # the world's job: passed in start arguments only
    joined = ctx.Queue()
    results = ctx.Queue()
    servers: Dict[str, Any] = {}
    gos: Dict[str, Any] = {}
    layout = {f"r{k}": list(NAMES) for k in range(pairs + 2)}
    layout.update({f"x{k}": [f"x{k}"] for k in range(join_samples)})
    for name, experts in layout.items():
        gos[name] = ctx.Event()
        servers[name] = ctx.Process(target=_server, name=f"bench-elastic-{name}", daemon=True,
                                    args=(port, name, experts, gos[name], joined, os.getpid(),
                                          secret))
    started: List[Any] = []
    try:
        for process in servers.values():
            process.start()
            started.append(process)
        plan = {"go": gos, "joined": joined, "pairs": pairs, "join_samples": join_samples,
                "pids": {n: p.pid for n, p in servers.items()}}
        trainer = ctx.Process(target=_trainer, args=(port, quick, plan, results, secret),
                              name="bench-elastic-trainer", daemon=True)
        trainer.start()
        started.insert(0, trainer)
        status, value = result_of(results, trainer, 300, "trainer")
    finally:
        stop_processes(started, timeout=20.0)
    if status != "ok":
        raise RuntimeError(f"bench.elastic failed in the trainer: {value}")
    return _rows(value, pairs)


def main(argv: Optional[List[str]] = None) -> int:
    import sys

    from .remote import format_rows

    args = sys.argv[1:] if argv is None else argv
    print(format_rows(run(quick="--quick" in args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
