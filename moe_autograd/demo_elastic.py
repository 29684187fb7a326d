"""``python -m moe_autograd demo --elastic``: train while the expert fleet churns.

What it shows, on one machine with no arguments:

1. This process founds a dynamic RPC world (:meth:`~moe_autograd.remote.Fleet.start`)
   and trains ``embed -> MixtureOfExperts -> head`` on the demo's region task;
   the layer's remote experts are *names* (``expert0`` .. ``expert3``,
   :class:`~moe_autograd.remote.FleetExpert`), resolved to live servers at
   every call.
2. Two servers join (``server_a`` hosts expert0 and expert1, ``server_b``
   expert2 and expert3); training starts once they serve.
3. During training: ``server_b`` is killed (SIGKILL): its experts are masked
   like failing ones and the founder reaps it; ``server_c`` starts with
   *replacement* experts 2 and 3 (fresh weights) and is used from the step
   after it joins; ``server_d`` joins with replicas of experts 0 and 1, and
   ``server_a`` then leaves cleanly (SIGTERM: drain, then go) without a
   masked call, since the replicas take over.
4. The report lists every churn event with its step, the masked calls per
   phase, the step times, and whether accuracy reached its target.

Servers are forked from a forkserver that imported torch once, so a join
takes a fraction of a second of the trainer's time, not the seconds of a
fresh interpreter. The demo is one job: it makes a new job secret, which
each server gets through its start arguments (servers publish themselves
signed with it, and the fleet admits only those that prove it). Every child
process is stopped on exit, Ctrl-C included.

``--engine ray`` runs the same story on a local Ray cluster whose nodes join,
die and leave (:mod:`.demo_elastic_ray`); this module parses the options of
both and hands them over (that module imports :mod:`.demo_task`, never this
one, so there is no import circle).
"""
import argparse
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from .demo_task import (ChurnLog, Expert, Model, RegionTask, evaluate, print_churn_report,
                        train_step)

__all__ = ["main"]

_PRELOAD = ["torch", "torch.distributed.rpc", "moe_autograd.remote", __name__]


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _watch_parent(parent: int) -> None:
    """A server whose demo process died (even by SIGKILL) must not linger
    (forked by the forkserver, its parent process is not the demo's)."""
    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve(port: int, name: str, experts: Sequence[str], seed: int, width: int,
           latency: float, lr: float, parent: int, secret: str) -> None:
    """A server process: join, serve until SIGTERM or the founder's stop.
    ``secret``: the job's, in hex."""
    from .remote import ElasticServer, ExpertServer, JobSecret, set_job_secret
    from .remote.loopback import backend_options

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the demo process stops us in order
    _watch_parent(parent)
    set_job_secret(JobSecret.from_hex(secret))
    torch.manual_seed(seed)
    modules = {e: Expert(width, latency) for e in experts}
    server = ExpertServer(modules, optimizer=lambda params: torch.optim.Adam(params, lr=lr))
    elastic = ElasticServer(server, name, options=backend_options(port), linger=0.3)
    signal.signal(signal.SIGTERM, lambda *_: elastic.stop("SIGTERM"))
    elastic.join()
    reason = elastic.serve()
    os._exit(3 if reason == "evicted" else 0)


class _Demo(ChurnLog):
    def __init__(self, args: argparse.Namespace, secret: str) -> None:
        super().__init__(args.quiet)
        self.args = args
        self.secret = secret  # the job's, in hex: each server's start arguments
        self.ctx = _context()
        self.processes: Dict[str, Any] = {}

    def start_server(self, name: str, experts: Sequence[str], seed: int, port: int) -> None:
        a = self.args
        process = self.ctx.Process(target=_serve, name=f"moe_autograd-demo-{name}", daemon=True,
                                   args=(port, name, list(experts), seed, a.width, a.latency,
                                         a.lr, os.getpid(), self.secret))
        process.start()
        self.processes[name] = process

    def stop_all(self, timeout: float) -> None:
        for process in self.processes.values():
            process.join(timeout)
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join()


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_autograd demo --elastic",
                                description="Train while expert servers join, leave and crash.")
    p.add_argument("--elastic", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=400,
                   help="training steps (the duration; with --engine ray a minimum: training "
                        "goes on until the churn is complete)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--local-experts", type=int, default=2, help="experts in this process")
    p.add_argument("--latency", type=float, default=0.004,
                   help="seconds every expert call sleeps, emulating a heavier expert")
    p.add_argument("--forward-timeout", type=float, default=0.5)
    p.add_argument("--target", type=float, default=0.65,
                   help="accuracy the mixture must reach (a single expert stays near 0.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--engine", choices=("rpc", "ray"), default="rpc",
                   help="torch RPC's dynamic world (default) or a local Ray cluster whose "
                        "nodes join, die and leave (moe_autograd.demo_elastic_ray; needs "
                        "pip install -e '.[ray]')")
    p.add_argument("--ray-timeout", type=float, default=120.0,
                   help="with --engine ray: seconds a node start, a join or a leave may take "
                        "before the demo gives up waiting for it")
    args = p.parse_args(argv)
    args.width, args.lr = 32, 3e-3
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    # The demo prints the fleet's events itself, at their steps: its loggers
    # would say the same again (masked calls are still logged).
    logging.getLogger("moe_autograd.remote.fleet").setLevel(logging.ERROR)
    logging.getLogger("moe_autograd.remote.ray_fleet").setLevel(logging.ERROR)
    # TensorPipe's "[W ...] ... EOF" lines of the servers (a killed member, a
    # leave): read by torch when the servers import it.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if args.engine == "ray":
        # One way only: demo_elastic_ray imports demo_task, never this module.
        from .demo_elastic_ray import run

        return run(args)
    from .remote import Fleet, JobSecret, set_job_secret
    from .remote.loopback import backend_options, free_port

    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    dim, classes = 8, 4
    task = RegionTask(dim, classes, args.seed)
    secret = JobSecret.generate()  # the demo's job: this process and its servers
    set_job_secret(secret)
    port = free_port()
    demo = _Demo(args, secret.hex())
    fleet: Optional[Any] = None
    interrupted = False
    try:
        fleet = Fleet.start("trainer", options=backend_options(port), dead_after=0.5)
        print(f"founded a dynamic world on 127.0.0.1:{port}; starting server_a and server_b ...",
              flush=True)
        demo.start_server("server_a", ["expert0", "expert1"], 1, port)
        demo.start_server("server_b", ["expert2", "expert3"], 2, port)
        names = [f"expert{i}" for i in range(4)]
        fleet.wait_for(names, timeout=120)
        remote = fleet.experts(names, forward_timeout=args.forward_timeout, backward_timeout=5.0)
        local: List[nn.Module] = [Expert(args.width, args.latency)
                                  for _ in range(args.local_experts)]
        model = Model(dim, args.width, classes, [*local, *remote], k=2, k_min=1,
                      forward_timeout=args.forward_timeout + 0.2, backward_timeout=6.0,
                      allow_zero_outputs=True, detect_anomalies=True)
        print(f"model: embed -> MixtureOfExperts({len(local)} local + {len(remote)} remote "
              f"experts by name, k=2) -> head; {args.steps} steps", flush=True)
        result = _train(demo, fleet, model, task, port)
        return _report(demo, fleet, model, task, result)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if fleet is not None:
            try:
                fleet.shutdown(timeout=2.0 if interrupted else 10.0)
            except Exception:  # noqa: BLE001 - tearing down anyway
                pass
        demo.stop_all(1.0 if interrupted else 10.0)


def _train(demo: _Demo, fleet: Any, model: Model, task: RegionTask, port: int
           ) -> Dict[str, Any]:
    args = demo.args
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    book = model.moe.expert_stats
    kill_at, replace_at, replica_at = (int(args.steps * f) for f in (0.25, 0.45, 0.65))
    schedule = {kill_at: "kill", replace_at: "replace", replica_at: "replica"}
    leave_pending = False
    times: List[float] = []
    masked: List[int] = []
    for step in range(args.steps):
        demo.step = step
        action = schedule.get(step)
        if action == "kill":
            os.kill(demo.processes["server_b"].pid, signal.SIGKILL)
            demo.note("kill server_b (SIGKILL): expert2 and expert3 have no server now")
        elif action == "replace":
            demo.start_server("server_c", ["expert2", "expert3"], 3, port)
            demo.note("start server_c with replacement expert2 and expert3 (fresh weights)")
        elif action == "replica":
            demo.start_server("server_d", ["expert0", "expert1"], 4, port)
            demo.note("start server_d with replicas of expert0 and expert1")
            leave_pending = True
        if leave_pending and "server_d" in fleet.servers():
            os.kill(demo.processes["server_a"].pid, signal.SIGTERM)
            demo.note("stop server_a (SIGTERM: a clean leave; server_d serves its experts)")
            leave_pending = False
        before = book.totals()
        seconds, logits, y, loss = train_step(model, opt, task, args.batch)
        times.append(seconds)
        after = book.totals()
        masked.append(int(after["failures"] + after["timeouts"]
                          - before["failures"] - before["timeouts"]))
        demo.follow(fleet, step)
        demo.progress(step, args.steps, loss.item())
    return {"times": times, "masked": masked, "kill_at": kill_at, "replace_at": replace_at,
            "served_after": demo.served_after}


def _report(demo: _Demo, fleet: Any, model: Model, task: RegionTask,
            result: Dict[str, Any]) -> int:
    args = demo.args
    times, masked = result["times"], result["masked"]
    loss, acc = evaluate(model, task)
    kill_at, replace_at = result["kill_at"], result["replace_at"]
    joined = {n: s for s, t in demo.log for n in ("server_c", "server_d")
              if t.startswith(f"{n} joined")}
    c_join = min(joined.get("server_c", len(times)) + 1, len(times))  # noted after its step
    phases = [("before the kill", 0, kill_at),
              ("no server for expert2/3", kill_at, c_join),
              ("after the replacement", c_join, len(times))]
    reached = print_churn_report(demo, times, masked, phases, loss, acc, args.target,
                                 model.moe.expert_stats.totals())
    return 0 if reached else 1
