"""``python -m moe_autograd demo --elastic --engine ray``: the elastic demo on Ray.

The story of :mod:`.demo_elastic` (servers join, one dies, a replacement and a
replica join, one leaves with drain), told on Ray's own membership instead of
torch RPC's dynamic world. What it shows, on one machine with no arguments:

1. It starts a local Ray cluster of real nodes on loopback: a head node (the
   GCS; this process is its driver, taking no CPU) and worker nodes that
   advertise custom resources (``demo_server_a`` on ``node_a``, ...). The
   expert servers are named actors
   (:class:`~moe_autograd.remote.RayExpertServer`) asking for their
   resource, so Ray places each on its node. The cluster requires Ray's
   token authentication (a token of its own; it and Ray's files live in a
   private directory, removed at exit: :func:`~.bench.ray_remote.local_ray`),
   and the demo is one job: a new job secret, which the actors read from a
   private file (mode 600).
2. It trains ``embed -> MixtureOfExperts -> head`` on the demos' region task
   (:mod:`.demo_task`); the remote experts are names (``expert0`` ..
   ``expert3``, :class:`~moe_autograd.remote.FleetExpert`) that a
   :class:`~moe_autograd.remote.RayFleet` resolves from the cluster's named
   actors at every call: ``server_a`` on ``node_a`` hosts expert0 and
   expert1, ``server_b`` on ``node_b`` expert2 and expert3.
3. Every server keeps its experts' state (weights, Adam's state, steps) in
   a folder of its own under ``--state-dir`` (default: ``state`` in the
   cluster's private directory, removed at exit), saved every
   ``--save-every`` optimizer steps and at a clean leave.
   During training: ``node_b`` is removed without grace (its raylet and
   worker processes SIGKILLed, as when a machine loses power; the demo reads
   its experts' step counts just before): calls to
   expert2 and expert3 are masked within their deadline (the actor answers
   for about a second more, then calls to it fail or time out; a call whose
   backward it no longer answers is a constant, ``backward_k_min=0``; Ray's
   health checks declare the node dead some seconds later, about 15 s with
   Ray's defaults, and remove its names). ``node_c`` joins with ``server_c``
   (*replacement* experts 2 and 3 on ``server_b``'s state folder: they
   resume from its newest snapshots, which the demo names with their steps),
   used from the step after its join was seen: with no replica at its
   version left, the trainer goes on from their resumed state (a WARNING
   says the steps lost; the demo says them against the killed server's),
   and ``server_d`` (replicas of experts 0 and 1, on a folder of their own:
   fresh weights, which the trainer brings to ``server_a``'s state at its
   next call, copying it from ``server_a``); then
   ``server_a`` leaves with drain
   (:meth:`~moe_autograd.remote.RayExpertServer.leave`: no longer chosen,
   calls in flight and held states served, then ended) and ``node_a``
   leaves the cluster.
4. The report lists every churn event with its step (the fleet's own
   events: ``joined``, ``left``, ``lost``, ``gone``), the masked calls and
   median step per phase, the training loss just before the kill against
   just after the replacement, and whether accuracy reached its target.

Pacing: the kill is due at 25 % of ``--steps``, node_c's join at 45 %,
server_a's leave at 65 % once server_c served a call and server_d serves;
training goes on until the leave is done, so ``--steps`` is a minimum (on a
small machine under training load a server's start, mostly its ``import
torch``, takes seconds to tens of seconds); a join or a leave that takes
more than ``--ray-timeout`` seconds ends the wait (reported, exit status 1).
Every loop is bounded.

Why ``ray.cluster_utils.Cluster``: a node that dies must be a node that
leaves the cluster (its raylet gone, Ray's failure detection at work), not
just a killed process; ``Cluster`` is Ray's documented utility for a
multi-node cluster on one machine ("Tips for testing Ray programs"),
importable from the public ``ray`` package (not ``ray._private``). Its node
objects are only handed back to it. Nothing else here uses anything but
Ray's public API.

Threads: ``Cluster`` starts a node's processes bound to the life of the
thread that started them (Linux ``PR_SET_PDEATHSIG``) and sets this
process's SIGTERM handler, so every change to the cluster runs on the main
thread, between steps: adding a node pauses training about a second here
(outside the timed steps; on a real cluster the node starts on its own
machine). Only waits run on threads of their own: a server's readiness and
a leave's drain; training reads what they saw from a queue, and what the
fleet saw from its events. This process's SIGTERM handler (Ctrl-C's
clean-up) is set again after every node start.

Clean-up, on every exit (an error, Ctrl-C, SIGTERM): the fleet's thread
stops, the server actors are killed, the driver disconnects
(``ray.shutdown``), every node is removed (``Cluster.shutdown``: raylets,
GCS, their workers) and then the private directory (Ray's token and files,
the job's secret file); Ray's own reaper and ``atexit`` hooks remove the
nodes if this process dies before that.
"""
import argparse
import contextlib
import functools
import os
import queue
import re
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .demo_task import (ChurnLog, Expert, Model, RegionTask, resumed_steps, evaluate,
                        loss_at_replacement, print_churn_report, said_steps, steps_of, train_step)

__all__ = ["run", "make_experts", "NAMESPACE"]

NAMESPACE = "moe_autograd_demo"  # the Ray namespace of the demo's servers
#: server -> (node, experts, seed, state folder under the state directory)
LAYOUT: Dict[str, Tuple[str, Tuple[str, ...], int, str]] = {
    "server_a": ("node_a", ("expert0", "expert1"), 1, "server_a"),
    "server_b": ("node_b", ("expert2", "expert3"), 2, "server_b"),
    # replaces server_b's experts: on its folder, resumed from their snapshots
    "server_c": ("node_c", ("expert2", "expert3"), 3, "server_b"),
    # replicas of server_a's (a live server_a holds its folder: one of their own)
    "server_d": ("node_c", ("expert0", "expert1"), 4, "server_d"),
}


def make_experts(names: Sequence[str], seed: int, width: int, latency: float
                 ) -> Dict[str, nn.Module]:
    """The experts factory of a demo server (runs in its Ray actor)."""
    torch.manual_seed(seed)
    return {name: Expert(width, latency) for name in names}


def _resource(server: str) -> str:
    """The custom resource that places ``server`` (its node advertises it)."""
    return f"demo_{server}"


class _RayDemo(ChurnLog):
    """The cluster, its nodes and servers, and the demo's log. Its methods
    run on the main thread (see the module's threads)."""

    def __init__(self, args: argparse.Namespace, here: Any, state_dir: str) -> None:
        super().__init__(args.quiet)
        self.args = args
        self.here = here  # the LocalRay: its cluster, its node arguments, the secret file
        self.state_dir = state_dir  # each server's folder is state_dir/<LAYOUT's folder>
        self.cluster = here.cluster
        self.nodes: Dict[str, Any] = {}
        self.servers: Dict[str, Any] = {}
        self.threads: List[threading.Thread] = []
        self.notes: "queue.Queue[str]" = queue.Queue()  # from the threads, noted by take_notes
        self.failed: Dict[str, str] = {}

    def start_server(self, server: str) -> str:
        """Adds a node for ``server`` and starts the server actor on it (not
        waited for: a thread of its own checks its readiness, the fleet sees
        its join); returns what happened."""
        from .remote import RayExpertServer

        a = self.args
        node, experts, seed, folder = LAYOUT[server]
        started = time.monotonic()
        if node not in self.nodes:
            self.nodes[node] = self.cluster.add_node(**self.here.node_args(
                wait=False, num_cpus=0,
                resources={_resource(s): 1 for s, spec in LAYOUT.items() if spec[0] == node}))
            _catch_sigterm()  # the node set its own handler
        self.servers[server] = RayExpertServer(
            server, functools.partial(make_experts, experts, seed, a.width, a.latency),
            namespace=NAMESPACE, resources={_resource(server): 1}, num_cpus=0,
            ready_timeout=a.ray_timeout, wait=False, secret_file=self.here.secret_file,
            optimizer=functools.partial(torch.optim.Adam, lr=a.lr),
            state_dir=os.path.join(self.state_dir, folder), save_every=a.save_every)

        def check() -> None:
            try:
                self.servers[server].wait_ready()
            except Exception as error:  # noqa: BLE001 - reported; the wait gives up
                self.failed[server] = str(error)
                self.notes.put(f"{server} did not start: {error}")

        self._thread(check, f"demo-ready-{server}")
        return f"{time.monotonic() - started:.1f} s to start it"

    def snapshots(self, server: str, secret: Any) -> str:
        """Where ``server``'s experts resume from: the newest snapshot of each
        in its state folder that checks (what its server will load), with
        its step, or fresh weights."""
        from .remote.durable import SnapshotError, read_snapshot, snapshot_paths

        _, experts, _, folder = LAYOUT[server]
        said = []
        for expert in experts:
            for _, path in snapshot_paths(os.path.join(self.state_dir, folder), expert):
                try:
                    _, state = read_snapshot(path, secret)
                except SnapshotError:
                    continue
                said.append(f"{expert} from {os.path.relpath(path, self.state_dir)} (step "
                            f"{state.steps})")
                break
            else:
                said.append(f"{expert} from fresh weights (no snapshot)")
        return ", ".join(said)

    def kill_node(self, node: str) -> None:
        """Removes ``node`` without grace (SIGKILL of its raylet and workers)."""
        self.cluster.remove_node(self.nodes.pop(node), allow_graceful=False)

    def leave(self, server: str) -> threading.Event:
        """``server`` leaves with drain, on a thread of its own (the drain takes
        seconds); the event is set once it ended (its node is then removed
        by :meth:`remove_node`, on the main thread)."""
        done = threading.Event()

        def drain() -> None:
            try:
                left = self.servers.pop(server).leave(drain_timeout=self.args.drain_timeout,
                                                      linger=0.5)
                self.notes.put(f"{server} drained and ended (left undrained: "
                               f"{left['in_flight']} calls in flight, {left['live']} states)")
            except Exception as error:  # noqa: BLE001 - reported
                self.failed[server] = str(error)
                self.notes.put(f"leave of {server} failed: {error}")
            finally:
                done.set()

        self._thread(drain, f"demo-leave-{server}")
        return done

    def remove_node(self, node: str) -> None:
        """``node`` leaves the cluster (its processes get SIGTERM first)."""
        self.cluster.remove_node(self.nodes.pop(node), allow_graceful=True)

    def _thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, daemon=True, name=name)
        thread.start()
        self.threads.append(thread)

    def take_notes(self) -> None:
        while True:
            try:
                self.note(self.notes.get_nowait())
            except queue.Empty:
                return

    def teardown(self, interrupted: bool) -> None:
        """Kills the servers (bounded waits); :func:`_local_cluster` then
        disconnects and removes every node."""
        for server in list(self.servers.values()):
            server.kill()
        for thread in self.threads:
            thread.join(1.0 if interrupted else 10.0)


def _local_cluster(secret: Any) -> Any:
    """The demo's cluster (:func:`~.bench.ray_remote.local_ray`: token
    authentication, a private directory, loopback), its head node as
    'ray start --head --num-cpus=0 --include-dashboard=false
    --include-log-monitor=false' (the driver needs no CPU, logs stay in
    files), this process its driver; ``secret`` saved for the actors."""
    from .bench.ray_remote import local_ray

    return local_ray(cluster=True, head_node_args={"num_cpus": 0}, secret=secret,
                     namespace=NAMESPACE)


class _RayMessages:
    """This process's stdout while the demo runs. What Ray's driver prints
    (the GCS's messages about nodes: "Raylet is terminated", "marked dead
    because the detector has missed too many heartbeats", each followed by a
    dump of the raylet's last log lines; from its own threads, or from the
    main thread as ``ray.shutdown`` flushes them) is cut to its first line,
    prefixed ``[ray]``; everything else passes as is."""

    _ANSI = re.compile(r"\x1b\[[0-9;]*m")
    _RAY = ("(raylet)", "(autoscaler)", "(pid=", "(gcs_server)")

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        plain = self._ANSI.sub("", text)
        if threading.current_thread() is threading.main_thread() \
                and not plain.startswith(self._RAY):
            return int(self._stream.write(text))
        first = plain.strip().splitlines()[:1]
        if first:
            self._stream.write(f"  [ray] {first[0][:160]}\n")
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _raise_interrupt(signum: int, frame: Optional[FrameType]) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _catch_sigterm() -> None:
    """SIGTERM tears down as Ctrl-C does (main thread only; Ray's nodes set
    their own handler when they start, so this is set again after each)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)


def run(args: argparse.Namespace) -> int:
    """Runs the demo with the options of :mod:`.demo_elastic` (``--engine ray``)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        print("the Ray demo needs Ray: pip install -e '.[ray]'", file=sys.stderr)
        return 2
    from .remote import JobSecret, RayFleet, set_job_secret

    args.drain_timeout = 10.0
    secret = JobSecret.generate()  # the demo's job: this process and its actors
    set_job_secret(secret)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    dim, classes = 8, 4
    task = RegionTask(dim, classes, args.seed)
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the Ray demo runs on the main thread (Ray's nodes set signal "
                           "handlers when they start)")
    previous = signal.getsignal(signal.SIGTERM)
    _catch_sigterm()
    stdout = sys.stdout
    sys.stdout = _RayMessages(stdout)  # type: ignore[assignment]
    demo: Optional[_RayDemo] = None
    fleet: Optional[Any] = None
    interrupted = False
    ray_up = contextlib.ExitStack()
    try:
        started = time.monotonic()
        print("starting a local Ray cluster (a head node, node_a and node_b) ...", flush=True)
        here = ray_up.enter_context(_local_cluster(secret))
        _catch_sigterm()
        state_dir = os.path.abspath(args.state_dir) if args.state_dir \
            else os.path.join(here.dir, "state")  # (removed with the private directory)
        demo = _RayDemo(args, here, state_dir)
        for server in ("server_a", "server_b"):
            demo.start_server(server)
        fleet = RayFleet(NAMESPACE, poll=0.2, suspect_for=2.0, info_timeout=2.0)
        names = [f"expert{i}" for i in range(4)]
        try:
            fleet.wait_for(names, timeout=args.ray_timeout)
        finally:
            demo.take_notes()
        print(f"cluster up in {time.monotonic() - started:.1f} s: server_a (expert0, expert1) "
              f"on node_a and server_b (expert2, expert3) on node_b serve", flush=True)
        remote = fleet.experts(names, forward_timeout=args.forward_timeout, backward_timeout=5.0)
        local: List[nn.Module] = [Expert(args.width, args.latency)
                                  for _ in range(args.local_experts)]
        model = Model(dim, args.width, classes, [*local, *remote], k=2, k_min=1,
                      forward_timeout=args.forward_timeout + 0.2, backward_timeout=6.0,
                      backward_k_min=0,  # a node that dies between forward and backward
                      allow_zero_outputs=True, detect_anomalies=True)  # (a constant call)
        print(f"model: embed -> MixtureOfExperts({len(local)} local + {len(remote)} remote "
              f"experts by name, k=2) -> head; at least {args.steps} steps", flush=True)
        result = _train(demo, fleet, model, task, secret, remote)
        loss, acc = evaluate(model, task)
        reached = print_churn_report(demo, result["times"], result["masked"], result["phases"],
                                     loss, acc, args.target, model.moe.expert_stats.totals())
        print(loss_at_replacement(result["losses"], result["kill_at"], result["resumed_at"]))
        return 0 if reached and not result["gave_up"] else 1
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        try:
            try:
                if fleet is not None:
                    fleet.shutdown(timeout=2.0)
                if demo is not None:
                    demo.teardown(interrupted)
            finally:
                ray_up.close()  # disconnect, remove every node and the private files
        finally:
            signal.signal(signal.SIGTERM, previous)
            sys.stdout = stdout


def _train(demo: _RayDemo, fleet: Any, model: Model, task: RegionTask, secret: Any,
           remote: List[Any]) -> Dict[str, Any]:
    """Trains through the churn (see the module's pacing); returns step
    times, masked calls and losses per step, the phases, the kill's step and
    the first step served by the replacement from its start, and whether a
    wait gave up. ``secret``: the job's (it checks the snapshots named)."""
    args = demo.args
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    book = model.moe.expert_stats
    kill_at, replace_at, replica_at = (int(args.steps * f) for f in (0.25, 0.45, 0.65))
    stage = "before the kill"
    stage_since = time.monotonic()
    leave_done: Optional[threading.Event] = None
    times: List[float] = []
    masked: List[int] = []
    losses: List[float] = []
    killed_at: Dict[str, Optional[int]] = {}  # expert2/3's steps when node_b was killed
    adopted = False
    seen: set = set()  # the servers the fleet resolved at the step before
    gave_up = ""
    step = 0
    while step < args.steps or stage != "done":
        demo.step = step
        waited = time.monotonic() - stage_since
        if stage == "before the kill" and step >= kill_at:
            kill_at = step
            killed_at = steps_of(fleet, "server_b", ["expert2", "expert3"])
            demo.kill_node("node_b")
            demo.note(f"kill node_b (SIGKILL of its raylet and workers; "
                      f"{said_steps(killed_at)}): server_b is gone, expert2 and expert3 have "
                      "no server now")
            stage, stage_since = "killed", time.monotonic()
        elif stage == "killed" and step >= replace_at:
            resumes = demo.snapshots("server_c", secret)
            took = demo.start_server("server_c")
            took_d = demo.start_server("server_d")
            demo.note(f"node_c joins with server_c (replacement expert2 and expert3 on "
                      f"server_b's state folder, resumed: {resumes}; {took}) and server_d "
                      f"(replicas of expert0 and expert1, fresh weights; {took_d})")
            stage, stage_since = "replacing", time.monotonic()
        elif stage == "replacing" and step >= replica_at \
                and fleet.first_served("server_c") is not None \
                and "server_d" in seen:  # the trainer called it: in sync by now
            leave_done = demo.leave("server_a")
            demo.note("server_a leaves with drain (server_d serves its experts)")
            stage, stage_since = "leaving", time.monotonic()
        elif stage == "leaving" and leave_done is not None and leave_done.is_set():
            demo.remove_node("node_a")
            demo.note("node_a left the cluster")
            stage = "done"
        elif stage in ("replacing", "leaving") and \
                (waited > args.ray_timeout or demo.failed):
            gave_up = (f"{stage} did not complete within {args.ray_timeout:g} s "
                       f"({demo.failed or 'no failure reported'})")
            demo.note(f"gave up waiting: {gave_up}")
            stage = "done"
        if not adopted and "server_c" in fleet.servers():
            adopted = True  # (the trainer goes on from it: no replica at its version lives)
            demo.note("server_c serves expert2 and expert3 as they resumed: "
                      + resumed_steps(fleet, remote[2:], "server_c", killed_at))
        seen = set(fleet.servers())
        before = book.totals()
        seconds, _, _, loss = train_step(model, opt, task, args.batch)
        times.append(seconds)
        after = book.totals()
        masked.append(int(after["failures"] + after["timeouts"]
                          - before["failures"] - before["timeouts"]))
        losses.append(loss.item())
        demo.take_notes()
        demo.follow(fleet, step)
        demo.progress(step, args.steps, losses[-1])
        step += 1
    end = len(times)
    c_join = demo.first("server_c joined")
    c_from = min(c_join + 1, end) if c_join >= 0 else end  # noted after its step
    leave_at = demo.first("server_a leaves")
    leave_from = max(leave_at, c_from) if leave_at >= 0 else end
    phases = [("before the kill", 0, kill_at),
              ("no server for expert2/3", kill_at, c_from),
              ("after the replacement", c_from, leave_from),
              ("server_a leaving/gone", leave_from, end)]
    served = demo.first("server_c served its first call")
    return {"times": times, "masked": masked, "phases": [p for p in phases if p[2] > p[1]],
            "gave_up": gave_up, "losses": losses, "kill_at": kill_at,
            "resumed_at": served + 1 if served >= 0 else end}
