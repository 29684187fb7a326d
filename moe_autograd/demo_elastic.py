"""``python -m moe_autograd demo --elastic``: train while the expert fleet churns.

What it shows, on one machine with no arguments:

1. This process founds a dynamic RPC world (:meth:`~moe_autograd.remote.Fleet.start`)
   and trains ``embed -> MixtureOfExperts -> head`` on the demo's region task;
   the layer's remote experts are *names* (``expert0`` .. ``expert3``,
   :class:`~moe_autograd.remote.FleetExpert`), resolved to live servers at
   every call.
2. Two servers join (``server_a`` hosts expert0 and expert1, ``server_b``
   expert2 and expert3); training starts once they serve.
3. Every server keeps its experts' state (:mod:`.remote.durable`: weights,
   Adam's state, steps) in a folder of its own under ``--state-dir`` (by
   default a temporary folder, removed at exit), saved every
   ``--save-every`` optimizer steps and at a clean leave.
4. During training: ``server_b`` is killed (SIGKILL): its experts are masked
   like failing ones and the founder reaps it (the demo reads their step
   counts just before the kill); ``server_c`` starts with *replacement*
   experts 2 and 3 on ``server_b``'s state folder, as a replacement on the
   dead server's disk would: they resume from their newest snapshots (each
   server says which snapshot and step; at most ``--save-every`` - 1 steps
   are lost) and are used from the step after it joins: with no replica
   at its version left, the trainer goes on from the replacement's state (a
   WARNING says the steps lost; the demo says them against the killed
   server's); ``server_d`` joins with replicas of experts 0 and 1, which
   take ``server_a``'s live state before they are published
   (:class:`~.remote.ElasticServer`'s ``recover``) and are brought to the
   steps since by the trainer's next call; ``server_a`` then leaves cleanly
   (SIGTERM: it hands its state to any replica behind it, drains, then
   goes) without a masked call, since the replicas take over.
5. The report lists every churn event with its step (where each resumed
   expert came from among them), the masked calls per phase, the step
   times, the training loss just before the kill against just after the
   replacement (no jump: the replacement resumed, it did not start over),
   and whether accuracy reached its target.

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
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from .demo_task import (ChurnLog, Expert, Model, RegionTask, resumed_steps, evaluate,
                        loss_at_replacement, print_churn_report, said_steps, steps_of, train_step)

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


class _Resumes(logging.Handler):
    """Hands the server's "expert ... resumed from ..." lines (a snapshot and
    its step, or a live peer) to the demo process, prefixed with the server's
    name."""

    def __init__(self, name: str, notes: Any) -> None:
        super().__init__(logging.INFO)
        self.server, self.notes = name, notes

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "resumed from" in message:
            self.notes.put(f"{self.server}: {message}")


def _serve(port: int, name: str, experts: Sequence[str], seed: int, width: int,
           latency: float, lr: float, parent: int, secret: str, state_dir: str,
           save_every: int, notes: Any) -> None:
    """A server process: join, serve until SIGTERM or the founder's stop.
    ``secret``: the job's, in hex; ``state_dir``: where it keeps its
    experts' state (resumed from there if it holds a snapshot); ``notes``:
    the queue its resume lines go to."""
    from .remote import ElasticServer, ExpertServer, JobSecret, set_job_secret
    from .remote.loopback import backend_options

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the demo process stops us in order
    _watch_parent(parent)
    set_job_secret(JobSecret.from_hex(secret))
    server_log = logging.getLogger("moe_autograd.remote.server")
    server_log.setLevel(logging.INFO)
    server_log.addHandler(_Resumes(name, notes))
    torch.manual_seed(seed)
    modules = {e: Expert(width, latency) for e in experts}
    server = ExpertServer(modules, optimizer=lambda params: torch.optim.Adam(params, lr=lr),
                          state_dir=state_dir, save_every=save_every)
    elastic = ElasticServer(server, name, options=backend_options(port), linger=0.3)
    signal.signal(signal.SIGTERM, lambda *_: elastic.stop("SIGTERM"))
    elastic.join()
    reason = elastic.serve()
    os._exit(3 if reason == "evicted" else 0)


class _Demo(ChurnLog):
    def __init__(self, args: argparse.Namespace, secret: str, state_dir: str) -> None:
        super().__init__(args.quiet)
        self.args = args
        self.secret = secret  # the job's, in hex: each server's start arguments
        self.state_dir = state_dir  # each server's state folder is state_dir/<folder>
        self.ctx = _context()
        self.processes: Dict[str, Any] = {}
        self.notes = self.ctx.Queue()  # the servers' resume lines, noted by take_notes

    def start_server(self, name: str, experts: Sequence[str], seed: int, port: int,
                     folder: Optional[str] = None) -> None:
        """Starts server ``name`` on the state folder ``folder`` (default: its
        own, ``state_dir/name``)."""
        a = self.args
        state = os.path.join(self.state_dir, folder or name)
        process = self.ctx.Process(target=_serve, name=f"moe_autograd-demo-{name}", daemon=True,
                                   args=(port, name, list(experts), seed, a.width, a.latency,
                                         a.lr, os.getpid(), self.secret, state, a.save_every,
                                         self.notes))
        process.start()
        self.processes[name] = process

    def take_notes(self) -> None:
        """Notes the resume lines the servers sent (snapshot paths shown
        relative to the state directory)."""
        while True:
            try:
                line = self.notes.get_nowait()
            except queue.Empty:
                return
            self.note(str(line).replace(self.state_dir + os.sep, ""))

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
    p.add_argument("--state-dir", metavar="DIR",
                   help="where the servers keep their experts' state, each in DIR/<server> "
                        "(default: a temporary folder, removed at exit)")
    p.add_argument("--save-every", type=int, default=5, metavar="N",
                   help="each server saves an expert's state every N of its optimizer steps "
                        "(and at a clean leave); a killed server's replacement loses at most "
                        "N - 1 steps of each expert (default: 5)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--engine", choices=("rpc", "ray"), default="rpc",
                   help="torch RPC's dynamic world (default) or a local Ray cluster whose "
                        "nodes join, die and leave (moe_autograd.demo_elastic_ray; needs "
                        "pip install -e '.[ray]')")
    p.add_argument("--ray-timeout", type=float, default=120.0,
                   help="with --engine ray: seconds a node start, a join or a leave may take "
                        "before the demo gives up waiting for it")
    args = p.parse_args(argv)
    if args.save_every < 1:
        p.error(f"--save-every must be a positive number of steps, got {args.save_every}")
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
    own_dir = args.state_dir is None
    state_dir = tempfile.mkdtemp(prefix="moe_autograd-demo-") if own_dir \
        else os.path.abspath(args.state_dir)
    demo = _Demo(args, secret.hex(), state_dir)
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
              f"experts by name, k=2) -> head; {args.steps} steps; the servers keep their "
              f"experts' state in {state_dir} (a save every {args.save_every} steps)",
              flush=True)
        result = _train(demo, fleet, model, task, port, remote)
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
        if own_dir:
            shutil.rmtree(state_dir, ignore_errors=True)


def _train(demo: _Demo, fleet: Any, model: Model, task: RegionTask, port: int,
           remote: List[Any]) -> Dict[str, Any]:
    args = demo.args
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    book = model.moe.expert_stats
    kill_at, replace_at, replica_at = (int(args.steps * f) for f in (0.25, 0.45, 0.65))
    schedule = {kill_at: "kill", replace_at: "replace", replica_at: "replica"}
    leave_pending = False
    killed_at: Dict[str, Optional[int]] = {}  # expert2/3's steps when server_b was killed
    adopted = False
    seen: set = set()  # the servers the fleet resolved at the step before
    times: List[float] = []
    masked: List[int] = []
    losses: List[float] = []
    for step in range(args.steps):
        demo.step = step
        action = schedule.get(step)
        if action == "kill":
            killed_at = steps_of(fleet, "server_b", ["expert2", "expert3"])
            os.kill(demo.processes["server_b"].pid, signal.SIGKILL)
            demo.note(f"kill server_b (SIGKILL): expert2 and expert3 have no server now "
                      f"({said_steps(killed_at)})")
        elif action == "replace":
            demo.start_server("server_c", ["expert2", "expert3"], 3, port, folder="server_b")
            demo.note("start server_c with replacement expert2 and expert3 on server_b's "
                      "state folder (they resume from their newest snapshots)")
        elif action == "replica":
            demo.start_server("server_d", ["expert0", "expert1"], 4, port)
            demo.note("start server_d with replicas of expert0 and expert1")
            leave_pending = True
        if not adopted and "server_c" in fleet.servers():
            adopted = True  # (the trainer goes on from it: no replica at its version lives)
            demo.note("server_c serves expert2 and expert3 as they resumed: "
                      + resumed_steps(fleet, remote[2:], "server_c", killed_at))
        if leave_pending and "server_d" in seen:  # the trainer called it: in sync by now
            os.kill(demo.processes["server_a"].pid, signal.SIGTERM)
            demo.note("stop server_a (SIGTERM: a clean leave; it hands its state to any "
                      "replica behind it, and server_d serves its experts)")
            leave_pending = False
        seen = set(fleet.servers())
        before = book.totals()
        seconds, logits, y, loss = train_step(model, opt, task, args.batch)
        times.append(seconds)
        after = book.totals()
        masked.append(int(after["failures"] + after["timeouts"]
                          - before["failures"] - before["timeouts"]))
        losses.append(loss.item())
        demo.take_notes()
        demo.follow(fleet, step)
        demo.progress(step, args.steps, losses[-1])
    demo.take_notes()
    return {"times": times, "masked": masked, "kill_at": kill_at, "replace_at": replace_at,
            "served_after": demo.served_after, "losses": losses}


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
    served = demo.first("server_c served its first call")
    print(loss_at_replacement(result["losses"], kill_at,
                              served + 1 if served >= 0 else len(times)))
    return 0 if reached else 1
