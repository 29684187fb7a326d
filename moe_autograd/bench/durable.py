"""Benchmarks of durable expert state (issue 44): what a snapshot every N
steps costs a training expert, how fast a state travels to a new replica,
how many steps a crash loses with a live replica, and what a crash does to
the demo task's final loss.

The first two rows run in this process: an
:class:`~moe_autograd.remote.ExpertServer` answered through the whole wire
(seal, encode, open, decode) by an in-process transport, no engine.
``durable/save-overhead`` is the time of 10 training steps (forward,
backward, the server's Adam step) with a snapshot every 10 steps against the
same without a state directory. ``durable/peer-transfer`` is
``remote_snapshot()`` (the server copies the state, seals it, the client
opens and checks it) against sending the same number of bytes over a
loopback TCP connection (a raw copy: the floor of any transfer on this
machine).

The last two run elastic worlds on loopback, through the public API only
(:class:`~moe_autograd.remote.Fleet`, :class:`~moe_autograd.remote.FleetExpert`,
:class:`~moe_autograd.remote.ElasticServer` with its default ``recover``):
a trainer process and server processes forked from a forkserver that
imported torch once, each world with a job secret of its own handed over in
start arguments; a server is killed with SIGKILL by its pid.

* ``durable/recovery-steps-lost`` (:func:`_recovery_row`): one training
  expert, two replicas at a time, the older killed at a random instant of a
  pass while the other serves; steps lost = the trainer's steps minus the
  survivor's step count (goal 0), and the survivor's weights against the
  same steps trained with no crash. It measures whatever replicas of a
  training expert do (each its own copy, or every replica every step).
* ``durable/loss-after-crash`` (:func:`_loss_row`): the elastic demo's task
  and model with no crash, with one server crash and a replacement that
  resumes from its snapshots, and with a replacement from fresh weights;
  the final losses' ratio (goal <= 1.02).
"""
import os
import random
import shutil
import signal
import statistics
import socket
import tempfile
import threading
import time
from typing import Any, Dict, List, Sequence, Tuple, cast

import torch
from torch import nn

from ..remote import ExpertServer, JobSecret, RemoteExpert
from ..remote.loopback import InProcess
from ..remote.mirrored import MIRROR_GRACE_S
from .measure import Plan, Row, compare, measure, row
from .processes import forkserver_context, result_of

__all__ = ["bench_durable"]

WIDTH, HIDDEN, ROWS = 256, 1024, 64


def _expert() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))


def _socket_copy(nbytes: int) -> Any:
    """A step that sends ``nbytes`` over a loopback TCP connection and
    receives them whole; and a function that closes the connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()
    payload = bytes(nbytes)
    sink = bytearray(nbytes)

    def step() -> None:
        thread = threading.Thread(target=sender.sendall, args=(payload,))
        thread.start()
        view, got = memoryview(sink), 0
        while got < nbytes:
            got += receiver.recv_into(view[got:], nbytes - got)
        thread.join()

    def close() -> None:
        sender.close()
        receiver.close()
    return step, close


def bench_durable(quick: bool) -> List[Row]:
    """The group's four rows (see the module docstring)."""
    rows = _in_process_rows(quick)
    rows.extend(_recovery_rows(quick))
    rows.append(_loss_row(quick))
    return rows


def _in_process_rows(quick: bool) -> List[Row]:
    """``durable/save-overhead`` and ``durable/peer-transfer``."""
    plan = Plan.pick(quick, Plan(warmup=2, reps=15), Plan(warmup=1, reps=3))
    secret = JobSecret.generate()
    transport = InProcess("bench")
    directory = tempfile.mkdtemp(prefix="moe-bench-durable-")
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    servers = [ExpertServer({"plain": _expert()}, optimizer=adam, secret=secret,
                            transport=transport),
               ExpertServer({"durable": _expert()}, optimizer=adam, secret=secret,
                            transport=transport, state_dir=directory, save_every=10)]
    close_socket = None
    try:
        experts = {name: RemoteExpert("here", name, transport=transport, secret=secret)
                   for name in ("plain", "durable")}
        x = torch.randn(ROWS, WIDTH)

        def steps(expert: RemoteExpert) -> Any:
            def run() -> None:
                for _ in range(10):
                    expert(x).square().mean().backward()
            return run
        samples = measure({name: steps(e) for name, e in experts.items()}, plan.reps,
                          plan.warmup)
        state_mb = sum(os.path.getsize(os.path.join(directory, "durable", f))
                       for f in os.listdir(os.path.join(directory, "durable"))
                       if f.endswith(".snap")) / 1e6 / max(1, len(
                           [f for f in os.listdir(os.path.join(directory, "durable"))
                            if f.endswith(".snap")]))
        rows = [compare("durable/save-overhead", samples, "plain", "durable", 1.05,
                        f"10 training steps of a {WIDTH}-{HIDDEN}-{WIDTH} MLP with Adam on its "
                        f"server (in process, the whole wire), a {state_mb:.1f} MB snapshot "
                        "every 10 steps (written and fsynced within the step that made it "
                        "due) vs no state directory")]
        nbytes = int(state_mb * 1e6)
        copy, close_socket = _socket_copy(nbytes)
        durable = experts["durable"]
        def transfer() -> None:
            durable.remote_snapshot()
        samples = measure({"socket": copy, "transfer": transfer}, plan.reps, plan.warmup)
        mbps = nbytes / 1e3 / sorted(samples["transfer"])[len(samples["transfer"]) // 2]
        raw = nbytes / 1e3 / sorted(samples["socket"])[len(samples["socket"]) // 2]
        rows.append(compare("durable/peer-transfer", samples, "socket", "transfer", None,
                            f"remote_snapshot() of the same expert ({state_mb:.1f} MB: copied "
                            f"under its lock, sealed, opened and checked; in process, no "
                            f"engine): {mbps:.0f} MB/s, vs {raw:.0f} MB/s for the same bytes "
                            "over a loopback TCP connection"))
        return rows
    finally:
        if close_socket is not None:
            close_socket()
        for server in servers:
            server.close()
        shutil.rmtree(directory, ignore_errors=True)


# -- durable/recovery-steps-lost ------------------------------------------------------------
R_WIDTH, R_HIDDEN, R_ROWS = 16, 32, 8
R_LATENCY = 0.005  # seconds a replica's forward sleeps: a pass long enough to be killed in
R_EXPERT = "dur"
_PRELOAD = ["torch", "torch.distributed.rpc", "moe_autograd.remote", "moe_autograd.moe",
            "moe_autograd.demo_task", __name__]


class _Slow(nn.Module):
    """The training expert of the recovery row: an MLP that sleeps
    :data:`R_LATENCY` in forward (GIL free), as a heavier expert would."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(R_WIDTH, R_HIDDEN), nn.Tanh(),
                                 nn.Linear(R_HIDDEN, R_WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(R_LATENCY)
        return self.net(x)  # type: ignore[no-any-return]


def _slow_expert(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _Slow()


def _adam_r(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def _r_batch(step: int) -> torch.Tensor:
    return torch.randn(R_ROWS, R_WIDTH, generator=torch.Generator().manual_seed(1000 + step))


def _reference(steps: int) -> Dict[str, torch.Tensor]:
    """The expert after ``steps`` training steps with no crash: trained here,
    from the first replica's weights, on the same batches."""
    module = _slow_expert(0)
    optimizer = _adam_r(module.parameters())
    for step in range(steps):
        module(_r_batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in module.state_dict().items()}


def _wait_go(go: Any, parent: int) -> None:
    while not go.wait(0.5):
        try:
            os.kill(parent, 0)
        except ProcessLookupError:  # the benchmark died: do not linger
            os._exit(1)


def _replica(port: int, name: str, seed: int, go: Any, joined: Any, parent: int,
             secret: str) -> None:
    """A replica of :data:`R_EXPERT` (Adam, a step after every backward):
    waits for ``go``, joins (taking a live replica's state, if any: the
    default ``recover``), reports where its state came from, serves until
    the stop, SIGTERM or SIGKILL."""
    from ..remote import ElasticServer, ExpertServer, JobSecret, set_job_secret
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    set_job_secret(JobSecret.from_hex(secret))
    server = ExpertServer({R_EXPERT: _slow_expert(seed)}, optimizer=_adam_r)
    elastic = ElasticServer(server, name, options=backend_options(port, rpc_timeout=30.0),
                            linger=0.1)
    signal.signal(signal.SIGTERM, lambda *_: elastic.stop("SIGTERM"))
    _wait_go(go, parent)
    elastic.join()
    joined.put((name, dict(elastic.recovered)))
    elastic.serve()
    os._exit(0)


def _recovery_train(port: int, quick: bool, go: Dict[str, Any], joined: Any,
                    pids: Dict[str, int]) -> Dict[str, Any]:
    """The trainer's side of the recovery row (see :func:`_recovery_row`)."""
    from ..remote import Fleet, RemoteExpert
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    lead, both, alone = (5, 8, 3) if quick else (10, 15, 5)
    names = list(go)
    rng = random.Random(44)
    fleet = Fleet.start("trainer", options=backend_options(port, rpc_timeout=30.0),
                        dead_after=0.5)
    try:
        expert = fleet.expert(R_EXPERT, forward_timeout=10.0, backward_timeout=10.0,
                              attempt_timeout=3.0)
        done, retried, kills = 0, 0, []
        timed: Dict[int, List[float]] = {1: [], 2: []}  # step seconds, by live replicas

        def train(count: int, replicas: int = 0) -> None:
            nonlocal done, retried
            for _ in range(count):
                started = time.perf_counter()
                for attempt in range(5):  # a failed step is taken again, on the same batch
                    try:
                        expert(_r_batch(done)).square().mean().backward()
                        break
                    except Exception:  # noqa: BLE001 - the killed replica's call
                        if attempt == 4:
                            raise
                        retried += 1
                        time.sleep(0.05)
                if replicas:
                    timed[replicas].append(time.perf_counter() - started)
                done += 1

        def join(name: str, others: List[str]) -> Dict[str, str]:
            go[name].set()
            who, recovered = joined.get(timeout=120)
            if who != name:
                raise RuntimeError(f"{who} joined, not {name}")
            deadline = time.monotonic() + 60
            while sorted(fleet.replicas(R_EXPERT)) != sorted(others + [name]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the fleet does not resolve {others + [name]}: "
                                       f"{fleet.replicas(R_EXPERT)}")
                time.sleep(fleet.poll)
            return recovered  # type: ignore[no-any-return]

        join(names[0], [])
        train(lead, 1)
        sources = []
        handoffs: List[float] = []
        for old, new in zip(names, names[1:]):
            sources.append(f"{new} from {join(new, [old])[R_EXPERT] or 'nothing'}")
            train(1)  # (the first call brings the new replica into sync: not timed)
            train(both - 1, 2)
            # the alternative model's hand-off: the writer's whole state to a follower
            started = time.perf_counter()
            RemoteExpert(new, R_EXPERT, transport=fleet.transport, secret=fleet.secret,
                         forward_timeout=30.0).restore_remote(
                RemoteExpert(old, R_EXPERT, transport=fleet.transport, secret=fleet.secret,
                             forward_timeout=30.0).remote_snapshot())
            handoffs.append(time.perf_counter() - started)
            delay = rng.uniform(0.0, 3 * R_LATENCY)  # within the next pass
            timer = threading.Timer(delay, os.kill, (pids[old], signal.SIGKILL))
            timer.start()
            train(1)
            timer.join()
            train(alone, 1)
            state = RemoteExpert(new, R_EXPERT, transport=fleet.transport, secret=fleet.secret,
                                 forward_timeout=30.0).remote_snapshot()
            kills.append({"killed": old, "survivor": new, "at_ms": round(delay * 1e3, 1),
                          "trainer_steps": done, "survivor_steps": state.steps})
        reference = _reference(done)
        diff = max(float((state.module[k].float() - reference[k].float()).abs().max())
                   for k in reference)
        equal = all(torch.equal(state.module[k], reference[k]) for k in reference)
        return {"kills": kills, "trainer_steps": done, "survivor_steps": state.steps,
                "retried": retried, "equal": equal, "max_diff": diff, "sources": sources,
                "phases": (lead, both, alone), "one": timed[1], "two": timed[2],
                "handoffs": handoffs}
    finally:
        fleet.shutdown(timeout=10.0)


def _in_trainer(work: Any, results: Any, secret: str, *args: Any) -> None:
    """A trainer process: ``work(*args)``'s result on ``results``."""
    from ..remote import JobSecret, set_job_secret

    set_job_secret(JobSecret.from_hex(secret))
    try:
        results.put(("ok", work(*args)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        import traceback
        results.put(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    results.close()
    results.join_thread()  # the result is in the pipe: leave without the teardown
    os._exit(0)


def _world(servers: Dict[str, Tuple[Any, Tuple[Any, ...]]], trainer: Any,
           trainer_args: Tuple[Any, ...], who: str) -> Any:
    """Starts ``servers`` (name -> (target, args before ``go, joined,
    parent, secret``)), each waiting for its ``go``, then the trainer
    ``trainer(port, *trainer_args, go, joined, pids)`` in a process of its
    own; returns its result, after every process ended."""
    from ..remote import JobSecret
    from ..remote.loopback import free_port, stop_processes

    ctx = forkserver_context(_PRELOAD)
    port = free_port()
    secret = JobSecret.generate().hex()  # the world's job: passed in start arguments only
    joined, results = ctx.Queue(), ctx.Queue()
    go = {name: ctx.Event() for name in servers}
    started: List[Any] = []
    pids: Dict[str, int] = {}
    status, value = "error", cast(Any, "not started")
    try:
        for name, (target, args) in servers.items():
            process = ctx.Process(target=target, name=f"bench-durable-{name}", daemon=True,
                                  args=(port, *args, go[name], joined, os.getpid(), secret))
            process.start()
            started.append(process)
            pids[name] = process.pid
        process = ctx.Process(target=_in_trainer, name="bench-durable-trainer", daemon=True,
                              args=(trainer, results, secret, port, *trainer_args, go, joined,
                                    pids))
        process.start()
        started.insert(0, process)
        status, value = result_of(results, process, 240, "trainer")
    finally:
        stop_processes(started, timeout=20.0)
    if status != "ok":
        raise RuntimeError(f"bench durable ({who}) failed in the trainer: {value}")
    return value


def _recovery_rows(quick: bool) -> List[Row]:
    """``durable/recovery-steps-lost``: a trainer steps one training expert
    (Adam on its server, a step after every backward) through a fleet; a
    second replica joins (it takes the first's live state), both serve for a
    while, and the older one is killed with SIGKILL at a random instant of
    a pass; training goes on on the survivor (a failed step is taken again
    on the same batch). Once (quick) or three times in a chain (r0 .. r3).
    Steps lost: the trainer's steps minus the survivor's step count; its
    weights are compared with the same number of steps trained with no
    crash (locally, from the first replica's weights, on the same batches:
    what every replica of a name should hold)."""
    kills = 1 if quick else 3
    servers = {f"r{k}": (_replica, (f"r{k}", 0 if k == 0 else 7 + k)) for k in range(kills + 1)}
    result = _world(servers, _recovery_train, (quick,), "recovery-steps-lost")
    lost = int(result["trainer_steps"]) - int(result["survivor_steps"])
    lead, both, alone = result["phases"]
    each = "; ".join(f"{k['killed']} killed {k['at_ms']} ms into step "
                     f"{k['trainer_steps'] - alone - 1}: survivor {k['survivor']} at step "
                     f"{k['survivor_steps']} of the trainer's {k['trainer_steps']}"
                     for k in result["kills"])
    r = row("durable/recovery-steps-lost", float(result["trainer_steps"]),
            float(result["survivor_steps"]), float(lost), "<= 0",
            f"{kills} replica(s) killed with SIGKILL mid-pass, each while a live replica "
            f"served (balance='latency', the fleet's default): {lead} steps on r0, then each "
            f"time a new replica joins ({', '.join(result['sources'])}), {both} steps on both, "
            f"the kill, {alone} steps on the survivor; {each}; steps retried after a failed "
            f"call {result['retried']}; the survivor's weights "
            f"{'equal' if result['equal'] else 'differ from'} those of {result['trainer_steps']} "
            f"steps without a crash (max |diff| {result['max_diff']:.2g}); baseline = the "
            f"trainer's steps, ours = the survivor's step count, ratio = steps lost",
            unit="steps")
    r.met = lost == 0 and bool(result["equal"])
    one, two = statistics.median(result["one"]), statistics.median(result["two"])
    handoff = statistics.median(result["handoffs"])
    cost = row("durable/mirror-cost", one * 1e3, two * 1e3, two / one, "reported",
               f"the consistency model's price, from the same run: the median training step "
               f"with two replicas of the expert (every replica applies every backward: "
               f"one answer and the other within {MIRROR_GRACE_S:g} s), n={len(result['two'])}, "
               f"against one replica, n={len(result['one'])}; the alternative, one writer "
               f"handing its whole state (weights and Adam's moments) to a follower, measured "
               f"here at {handoff * 1e3:.1f} ms a hand-off, would cost {handoff / 10 * 1e3:.1f} "
               f"ms a step every 10 steps and lose up to 10 steps when the writer dies",
               unit="ms")
    return [r, cost]


# -- durable/loss-after-crash ---------------------------------------------------------------
DIM, CLASSES, D_WIDTH, D_LR, D_BATCH = 8, 4, 32, 3e-3, 256
SAVE_EVERY = 5


def _demo_server(port: int, name: str, experts: Sequence[str], seed: int, state_dir: str,
                 go: Any, joined: Any, parent: int, secret: str) -> None:
    """A server of the demo's experts (:class:`~moe_autograd.demo_task.Expert`,
    Adam on the server) that keeps their state in ``state_dir`` (a save
    every :data:`SAVE_EVERY` steps; resumed from there if it holds
    snapshots): waits for ``go``, builds its server (resumed), joins,
    reports, serves."""
    from ..demo_task import Expert
    from ..remote import ElasticServer, ExpertServer, JobSecret, set_job_secret
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    set_job_secret(JobSecret.from_hex(secret))
    _wait_go(go, parent)  # a replacement opens the folder once its predecessor is dead
    torch.manual_seed(seed)
    server = ExpertServer({e: Expert(D_WIDTH) for e in experts},
                          optimizer=lambda params: torch.optim.Adam(params, lr=D_LR),
                          state_dir=state_dir, save_every=SAVE_EVERY)
    elastic = ElasticServer(server, name, options=backend_options(port, rpc_timeout=30.0),
                            linger=0.3)
    signal.signal(signal.SIGTERM, lambda *_: elastic.stop("SIGTERM"))
    elastic.join()
    joined.put((name, dict(elastic.recovered)))
    elastic.serve()
    os._exit(0)


def _crash_train(port: int, steps: int, crash: bool, state_dir: str, go: Dict[str, Any],
                 joined: Any, pids: Dict[str, int]) -> Dict[str, Any]:
    """The trainer's side of the loss row (see :func:`_loss_row`): the demo's
    model and task, ``steps`` steps, with or without ``server_b``'s crash
    (``state_dir``: its state folder)."""
    from ..demo_task import (Expert, Model, RegionTask, resumed_steps, evaluate, said_steps,
                             steps_of, train_step)
    from ..remote import Fleet
    from ..remote.durable import snapshot_paths
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    torch.manual_seed(0)
    task = RegionTask(DIM, CLASSES, 0)
    fleet = Fleet.start("trainer", options=backend_options(port, rpc_timeout=30.0),
                        dead_after=0.5)
    try:
        for name in ("server_a", "server_b"):
            go[name].set()
        names = [f"expert{i}" for i in range(4)]
        fleet.wait_for(names, timeout=120)
        remote = fleet.experts(names, forward_timeout=2.0, backward_timeout=5.0)
        local: List[nn.Module] = [Expert(D_WIDTH) for _ in range(2)]
        model = Model(DIM, D_WIDTH, CLASSES, [*local, *remote], k=2, k_min=1,
                      forward_timeout=2.2, backward_timeout=6.0, allow_zero_outputs=True)
        opt = torch.optim.Adam(model.parameters(), lr=D_LR)
        kill_at = steps // 2 + SAVE_EVERY // 2  # between two saves
        said: Dict[str, Any] = {}
        for step in range(steps):
            if crash and step == kill_at:
                before = steps_of(fleet, "server_b", names[2:])
                said["killed"] = said_steps(before)
                os.kill(pids["server_b"], signal.SIGKILL)
                said["snapshots"] = ", ".join(
                    f"{e} at step {(snapshot_paths(state_dir, e) or [(0, '')])[0][0]}"
                    for e in names[2:])
                started = time.monotonic()
                go["server_c"].set()  # the replacement starts at once; training waits for it
                deadline = started + 60
                while any(fleet.replicas(e) != ["server_c"] for e in names[2:]):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the replacement did not serve within 60 s: "
                                           f"{fleet.servers()}")
                    time.sleep(fleet.poll)
                # as the demo: its resumed state is the experts' for this trainer now
                said["adopted"] = resumed_steps(fleet, remote[2:], "server_c", before)
                said["waited_s"] = time.monotonic() - started
            train_step(model, opt, task, D_BATCH)
        totals = model.moe.expert_stats.totals()
        loss, acc = evaluate(model, task)
        return dict(said, loss=loss, acc=acc, masked=int(totals["failures"] + totals["timeouts"]),
                    kill_at=kill_at)
    finally:
        fleet.shutdown(timeout=10.0)


def _loss_row(quick: bool) -> Row:
    """``durable/loss-after-crash``: the elastic demo's task and model (2
    local experts and 4 remote ones by name, k = 2; servers with Adam and a
    state directory, a save every :data:`SAVE_EVERY` steps; no emulated
    latency, which changes no number), trained three times for the same
    steps on the same batches: with no crash; with ``server_b`` (expert2,
    expert3) killed by SIGKILL between two steps just past half the run
    (between two of its saves) and a replacement started at once on its
    state folder (it resumes from the newest snapshots), training waiting
    until the fleet resolves the two experts to it, as a job that needs all
    its experts would (the trainer goes on from the replacement's resumed
    state by itself: no replica at its version lives,
    :mod:`~moe_autograd.remote.mirrored`); and the same with a replacement on an empty folder
    (fresh weights: what the crash costs without durable state). Ratio: the
    final loss (on 4096 fresh examples) with the crash and the resumed
    replacement over without the crash."""
    steps = 120 if quick else 400
    runs: Dict[str, Dict[str, Any]] = {}
    for run in ("plain", "resumed", "fresh"):
        directory = tempfile.mkdtemp(prefix="moe-bench-durable-")
        try:
            folder = os.path.join(directory, "server_b")
            servers = {"server_a": (_demo_server, ("server_a", ["expert0", "expert1"], 1,
                                                   os.path.join(directory, "server_a"))),
                       "server_b": (_demo_server, ("server_b", ["expert2", "expert3"], 2,
                                                   folder))}
            if run != "plain":
                servers["server_c"] = (_demo_server, (
                    "server_c", ["expert2", "expert3"], 3,
                    folder if run == "resumed" else os.path.join(directory, "server_c")))
            runs[run] = _world(servers, _crash_train, (steps, run != "plain", folder),
                               "loss-after-crash")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    plain, resumed, fresh = runs["plain"], runs["resumed"], runs["fresh"]
    ratio = resumed["loss"] / plain["loss"]

    return row("durable/loss-after-crash", plain["loss"], resumed["loss"], ratio, "<= 1.02",
               f"the elastic demo's task and model, {steps} steps of batch {D_BATCH} on the "
               f"same batches: server_b (expert2, expert3) killed with SIGKILL before step "
               f"{resumed['kill_at']} ({resumed.get('killed', '?')}), a replacement started at "
               f"once on its state folder resumed from the snapshots "
               f"({resumed.get('snapshots', '?')}; a save every {SAVE_EVERY} steps; the trainer "
               f"went on from them: {resumed.get('adopted', '?')}) and training waited "
               f"{resumed.get('waited_s', float('nan')):.1f} s for it "
               f"({resumed['masked']} calls masked), vs no crash ({plain['masked']} masked); "
               f"final loss on 4096 examples, accuracy {resumed['acc']:.1%} vs "
               f"{plain['acc']:.1%}; the same crash with a replacement from fresh weights: "
               f"loss {fresh['loss']:.3f}, ratio {fresh['loss'] / plain['loss']:.3f}, accuracy "
               f"{fresh['acc']:.1%}; baseline = loss without the crash, ours = with it",
               unit="")
