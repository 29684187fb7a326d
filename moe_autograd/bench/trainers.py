"""Benchmark: many trainers calling one expert server, with and without
batching across calls (:mod:`moe_autograd.remote.gather`).

Setting (loopback RPC, one run): one server process hosting the same expert
twice, ``batched`` (``batch_across_calls``) and ``plain`` (without), and
:data:`TRAINERS` trainer processes, each its own member of the job (its own
session). A trainer's step is one forward + backward of ``ROWS`` x ``WIDTH``
rows through a :class:`~moe_autograd.remote.RemoteExpert` (stateless server:
the backward recomputes the forward).

The expert stands for a model on ONE accelerator whose kernels are
launch-bound: ``tanh(Linear(x))`` followed by a "kernel" that takes
:data:`L_S` = 5 ms whatever its rows, and that runs one at a time on the
device (a lock, as kernels of one CUDA stream serialise; on a CPU, torch's
intra-op pool does the same for large kernels). A step of one trainer costs
three such kernels (forward; recomputation and backward). Without batching,
``k`` trainers queue for the device: throughput grows only by the share of
a step the device was idle. With batching (``batch_window`` = one kernel,
:data:`WINDOW_S`), the calls of the trainers run as one kernel: a group
waits for the trainers that called it lately (see
:mod:`moe_autograd.remote.gather`).

Rows (``ratio`` = throughput of ``k`` trainers over one trainer's, on the
same server; higher is better): ``remote/clients-2-throughput``,
``remote/clients-4-throughput`` (goal >= 2.5), and
``remote/clients-4-unbatched`` (the same without batching: the device-bound
reference). Each repetition runs every variant once, in rotating order; in
a variant all its trainers start at the same instant (a ``time.monotonic``
deadline, the clock every process shares on Linux), run :data:`STEPS` steps,
and the variant's time is from that instant to the last trainer's end.

``python -m moe_autograd.bench.trainers [--quick]`` prints the rows alone.
"""
import multiprocessing
import os
import queue as queue_module
import statistics
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .measure import Plan, Row, quartiles, row

__all__ = ["run", "bench_trainers", "OneDeviceExpert", "main"]

L_S = 0.005            # one kernel on the emulated device
WIDTH, ROWS = 64, 8    # a trainer's call: 8 rows of 64
TRAINERS = 4
STEPS = 16             # steps per trainer per sample
WINDOW_S = 0.005       # the server's batch_window: one kernel (2 ms was too short here
                       # under load: a trainer's turn-around between calls is longer)
SERVER = "trainers-srv"
_device = threading.Lock()  # the server process's one device


class _Kernel(torch.autograd.Function):
    """Holds the device for ``seconds`` in forward and again in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        with _device:
            time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        with _device:
            time.sleep(ctx.seconds)
        return grad, None


class OneDeviceExpert(nn.Module):
    """``tanh(Linear(x))`` then a launch-bound kernel of ``seconds`` on the
    process's one device (row-wise: batching across calls is exact in shape)."""

    def __init__(self, width: int = WIDTH, seconds: float = L_S) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        return _Kernel.apply(torch.tanh(self.lin(x)), self.seconds)


def _setup() -> List[Any]:
    """The server process: ``batched`` and ``plain``, the same expert."""
    from ..remote import ExpertServer

    torch.manual_seed(0)
    module = OneDeviceExpert()
    plain = OneDeviceExpert()
    plain.load_state_dict(module.state_dict())
    return [ExpertServer({"batched": module}, batch_across_calls=True, batch_window=WINDOW_S),
            ExpertServer({"plain": plain})]


def _trainer_main(port: int, rank: int, world: int, secret: str, commands: Any,
                  results: Any) -> None:
    """A trainer process: runs the steps each command asks for, from its start instant."""
    from torch.distributed import rpc

    from ..remote import JobSecret, RemoteExpert, set_job_secret, start_rpc
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    set_job_secret(JobSecret.from_hex(secret))
    start_rpc(f"trainer-{rank}", rank, world, backend_options(port, rpc_timeout=60.0))
    try:
        experts = {name: RemoteExpert(SERVER, name, forward_timeout=30, backward_timeout=30)
                   for name in ("batched", "plain")}
        torch.manual_seed(rank)
        x = torch.randn(ROWS, WIDTH, requires_grad=True)
        while True:
            command = commands.get(timeout=600)
            if command is None:
                break
            if command[0] == "stats":
                results.put((rank, experts["batched"].remote_stats()))
                continue
            _, name, steps, start_at = command
            expert = experts[name]
            while time.monotonic() < start_at:
                time.sleep(min(0.001, max(0.0, start_at - time.monotonic())))
            for _ in range(steps):
                expert(x).sum().backward()
            results.put((rank, time.monotonic()))
    except BaseException as error:  # noqa: BLE001 - reported to the coordinator
        results.put((rank, f"{type(error).__name__}: {error}"))
    finally:
        rpc.shutdown()


class _World:
    """The server and trainer processes, and the queues that drive them."""

    def __init__(self) -> None:
        from ..remote import JobSecret
        from ..remote.loopback import free_port, serve_in_process
        from .remote import _context

        ctx = _context()
        port, world = free_port(), 1 + TRAINERS
        secret = JobSecret.generate().hex()
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(TRAINERS)]
        self.processes = [ctx.Process(target=serve_in_process, name="expert-server-trainers",
                                      daemon=True,
                                      args=(port, 0, world, SERVER, f"{__name__}:_setup"),
                                      kwargs={"secret": secret})]
        self.processes += [ctx.Process(target=_trainer_main, name=f"bench-trainer-{k}",
                                       daemon=True, args=(port, k, world, secret,
                                                          self.commands[k - 1], self.results))
                           for k in range(1, world)]
        for process in self.processes:
            process.start()

    def _gather(self, n: int, timeout: float = 120.0) -> List[Any]:
        got: List[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            try:
                rank, value = self.results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [p.name for p in self.processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"bench.trainers: no answer (dead: {dead})") from None
                continue
            if isinstance(value, str):
                raise RuntimeError(f"bench.trainers: trainer {rank} failed: {value}")
            got.append(value)
        return got

    def sample(self, name: str, k: int, steps: int) -> float:
        """Seconds for ``k`` trainers to run ``steps`` steps each, from one instant."""
        start_at = time.monotonic() + 0.05
        for queue in self.commands[:k]:
            queue.put(("run", name, steps, start_at))
        return max(self._gather(k)) - start_at

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system, all threads) of the server and trainers so far."""
        total = 0
        for process in self.processes:
            try:
                with open(f"/proc/{process.pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
            except (OSError, IndexError, ValueError):
                return float("nan")  # not Linux: no CPU figures
        return total / os.sysconf("SC_CLK_TCK")

    def stats(self) -> Dict[str, Any]:
        self.commands[0].put(("stats",))
        return dict(self._gather(1)[0])

    def close(self) -> None:
        from ..remote.loopback import stop_processes

        for queue in self.commands:
            queue.put(None)
        stop_processes(self.processes[::-1], timeout=15.0)


VARIANTS: Tuple[Tuple[str, str, int], ...] = (
    ("1", "batched", 1), ("2", "batched", 2), ("4", "batched", 4),
    ("1-plain", "plain", 1), ("4-plain", "plain", 4))


def _measure(quick: bool) -> Tuple[Dict[str, List[float]], Dict[str, Any]]:
    """Steps per second of every variant (all its trainers together), per
    repetition, in rotating order; the server's batch counts after; and the
    CPU milliseconds per step (every process of the world) of each variant."""
    plan = Plan.pick(quick, Plan(warmup=2, reps=12), Plan(warmup=1, reps=3))
    world = _World()
    try:
        for _ in range(plan.warmup):
            for label, name, k in VARIANTS:
                world.sample(name, k, 2)
        samples: Dict[str, List[float]] = {label: [] for label, _, _ in VARIANTS}
        cpu: Dict[str, float] = {label: 0.0 for label, _, _ in VARIANTS}
        counts: Dict[str, Any] = {label: {} for label, name, _ in VARIANTS if name == "batched"}
        for r in range(plan.reps):
            shift = r % len(VARIANTS)
            for label, name, k in VARIANTS[shift:] + VARIANTS[:shift]:
                before = world.stats() if label in counts else {}
                spent = world.cpu_seconds()
                samples[label].append(k * STEPS / world.sample(name, k, STEPS))
                cpu[label] += (world.cpu_seconds() - spent) * 1e3 / (k * STEPS * plan.reps)
                if label in counts:  # this variant's batches (stats read outside the timing)
                    after = world.stats()
                    for key in ("batches", "batched_calls", "unbatched_calls"):
                        counts[label][key] = counts[label].get(key, 0) + after[key] - before[key]
    finally:
        world.close()
    counts["cpu_ms"] = cpu
    return samples, counts


def _throughput_row(name: str, samples: Dict[str, List[float]], base: str, ours: str,
                    goal: Any, note: str) -> Row:
    ratios = [o / b for o, b in zip(samples[ours], samples[base])]
    lo, hi = quartiles(ratios)
    return row(name, statistics.median(samples[base]), statistics.median(samples[ours]),
               statistics.median(ratios), goal,
               f"{note}; ratio IQR {lo:.2f}-{hi:.2f}, n={len(ratios)}", unit="steps/s")


def bench_trainers(quick: bool = False) -> List[Row]:
    samples, counts = _measure(quick)
    pair = counts["2"]
    two = (f"{pair['batched_calls']} of {pair['batched_calls'] + pair['unbatched_calls']} "
           "calls batched")
    four = counts["4"]
    calls = four["batched_calls"] + four["unbatched_calls"]
    per_batch = four["batched_calls"] / four["batches"] if four["batches"] else 0.0
    cpu = counts["cpu_ms"]
    cpu_note = (f"CPU per step, all processes: {cpu['1']:.1f} ms with 1 trainer, "
                f"{cpu['4']:.1f} ms with 4 batched, {cpu['4-plain']:.1f} ms with 4 unbatched "
                f"({os.cpu_count()} cores)")
    world = (f"trainer processes each stepping fwd+bwd of {ROWS}x{WIDTH} rows on one "
             f"stateless server whose expert's kernels take L = {L_S * 1e3:g} ms each, one at "
             "a time (one device, launch-bound; 3 kernels a step)")
    return [
        _throughput_row("remote/clients-2-throughput", samples, "1", "2", None,
                        f"2 trainers' steps/s over 1's, batch_across_calls ({two}); {world}"),
        _throughput_row("remote/clients-4-throughput", samples, "1", "4", ">= 2.5",
                        f"4 trainers' steps/s over 1's, same server, batch_across_calls "
                        f"(batch_window {WINDOW_S:g} s); {four['batched_calls']} of its {calls} "
                        f"calls batched, {per_batch:.2f} calls per batch; "
                        f"{cpu_note}"),
        _throughput_row("remote/clients-4-unbatched", samples, "1-plain", "4-plain", None,
                        "the same without batching: the device serialises the calls"),
    ]


def run(quick: bool = False) -> List[Dict[str, Any]]:
    return [{"name": r.name, "baseline_ms": r.baseline, "ours_ms": r.ours, "ratio": r.ratio,
             "goal": r.goal, "note": r.note} for r in bench_trainers(quick)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    for r in bench_trainers(quick="--quick" in args):
        print(f"{r.name:30} {r.baseline:8.1f} {r.ours:8.1f} steps/s  ratio {r.ratio:.2f}  "
              f"{r.goal or '-'}  {r.note}")
    return 0


if __name__ == "__main__":
    multiprocessing.freeze_support()
    raise SystemExit(main())
