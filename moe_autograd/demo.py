"""``python -m moe_autograd demo``: train a small MoE with local and remote experts.

What it shows, on one machine with no arguments:

1. It starts expert server processes on loopback (``torch.distributed.rpc``);
   each hosts experts that apply their own optimizer after every backward.
   The demo is one job: it makes a new job secret and hands it to each
   server through its start arguments; every message is sealed with it.
2. It builds ``embed -> MixtureOfExperts -> head`` whose experts are partly
   local modules and partly :class:`~moe_autograd.remote.RemoteExpert`\\ s; one
   remote expert is flaky (raises now and then) and one is slow (sometimes
   sleeps past the forward deadline).
3. It trains on a task a single expert cannot solve: the input space is cut into
   regions and each region has its own linear labelling rule. The experts are
   linear, so one alone is a linear classifier; the gate learns the regions and
   the mixture becomes piecewise linear.
4. It reports the loss and accuracy reached (and those of a one-expert model
   trained the same way), the step time against the same model run with plain
   sequential autograd, and the failures and timeouts training absorbed.

Every child process is stopped on exit, Ctrl-C included.
"""
import argparse
import logging
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .demo_task import Expert, Model, RegionTask, evaluate, train_step
from .moe import MixtureOfExperts

__all__ = ["main"]


# -- experts -------------------------------------------------------------------
def server_experts(index: int, width: int, latency: float, fail_rate: float,
                   slow_rate: float, slow_for: float) -> Dict[str, nn.Module]:
    """The experts of server ``index``: server 0 hosts the flaky one, server 1
    the slow one."""
    torch.manual_seed(1000 + index)
    experts: Dict[str, nn.Module] = {}
    for j in range(2):
        flaky = index == 0 and j == 0
        slow = index == 1 and j == 0
        experts[f"expert{j}"] = Expert(width, latency, fail_rate if flaky else 0.0,
                                       slow_rate if slow else 0.0, slow_for if slow else 0.0)
    return experts


def _exit_with_parent() -> None:
    """A server whose demo process died (even by SIGKILL) must not linger."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve(rank: int, world_size: int, port: int, args: Dict[str, Any], secret: str) -> None:
    """A server process (rank ``rank``); ``secret``: the job's, in hex."""
    import torch.distributed.rpc as rpc

    from .remote import ExpertServer, JobSecret, set_job_secret, start_rpc
    from .remote.loopback import backend_options

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    # Ctrl-C reaches the whole process group: the demo process shuts the
    # servers down in order, so they must not die on their own first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    set_job_secret(JobSecret.from_hex(secret))
    experts = server_experts(rank - 1, args["width"], args["latency"], args["fail_rate"],
                             args["slow_rate"], args["slow_for"])
    lr = args["lr"]
    # built before joining the world: no request finds it missing
    with ExpertServer(experts, optimizer=lambda params: torch.optim.Adam(params, lr=lr)):
        start_rpc(f"server{rank - 1}", rank, world_size, backend_options(port))
        rpc.shutdown()  # waits until every worker, the client included, is done


# -- the model -----------------------------------------------------------------
class SequentialMixture(nn.Module):
    """The same routing with experts called one after another under plain
    autograd: what the step costs without this project."""

    def __init__(self, moe: MixtureOfExperts) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        moe = self.moe
        logits = moe.gate(x)
        top_logits, top = logits.topk(moe.k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1)
        y = torch.zeros_like(x)
        for e, expert in enumerate(moe.experts):
            rows, slots = (top == e).nonzero(as_tuple=True)
            if len(rows):
                y = y.index_add(0, rows, expert(x[rows]) * weights[rows, slots, None])
        return y, torch.zeros(())


def _train(model: Model, task: RegionTask, steps: int, batch: int, lr: float, label: str,
           quiet: bool) -> List[float]:
    """Trains with the fault-tolerant layer; returns the step times (s)."""
    from tqdm import tqdm  # type: ignore[import-untyped]
    from tqdm.contrib.logging import logging_redirect_tqdm  # type: ignore[import-untyped]

    # Remote experts hold no parameters here: their servers step them.
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    times: List[float] = []
    bar = tqdm(range(steps), desc=label, disable=quiet, ncols=90, file=sys.stdout,
               mininterval=0.5)
    # Log lines (the masked calls of the flaky and the slow expert) go
    # through tqdm.write, above the bar, instead of breaking it.
    with logging_redirect_tqdm(loggers=[logging.getLogger("moe_autograd")]):
        for _ in bar:
            seconds, logits, y, loss = train_step(model, opt, task, batch)
            times.append(seconds)
            acc = (logits.argmax(-1) == y).float().mean().item()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
    return times


def _time_sequential(model: Model, task: RegionTask, steps: int, batch: int
                     ) -> Tuple[List[float], int]:
    """Forward+backward of the same model with plain sequential autograd; returns
    step times and how many steps an expert failure crashed."""
    sequential = SequentialMixture(model.moe)
    times: List[float] = []
    crashed = 0
    for _ in range(steps):
        x, y = task.batch(batch)
        start = time.perf_counter()
        try:
            h, _ = sequential(model.embed(x))
            nn.functional.cross_entropy(model.head(h), y).backward()
        except Exception:  # noqa: BLE001 - an injected expert failure
            crashed += 1
            continue
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return times, crashed


def _median_ms(times: Sequence[float]) -> float:
    return statistics.median(times[2:] or times) * 1000 if times else float("nan")


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_autograd demo", description=__doc__.split("\n")[0])
    p.add_argument("--local-experts", type=int, default=4, help="experts in this process")
    p.add_argument("--servers", type=int, default=2, help="expert server processes (0: none)")
    p.add_argument("--steps", type=int, default=300, help="training steps (the duration)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--latency", type=float, default=0.004,
                   help="seconds every expert call sleeps, emulating a heavier expert")
    p.add_argument("--fail-rate", type=float, default=0.1,
                   help="probability that the flaky remote expert raises")
    p.add_argument("--slow-rate", type=float, default=0.1,
                   help="probability that the slow remote expert stalls")
    p.add_argument("--slow-for", type=float, default=0.5, help="how long a stall lasts (s)")
    p.add_argument("--forward-timeout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    # Shown in -h only: `python -m moe_autograd demo --elastic` runs another
    # module (moe_autograd.__main__ routes it), so this one never imports it.
    p.add_argument("--elastic", action="store_true",
                   help="train while servers join, leave and crash, on torch RPC or "
                        "(--engine ray) Ray (python -m moe_autograd demo --elastic -h for "
                        "its options)")
    args = p.parse_args(argv)
    if args.elastic:
        p.error("--elastic is the elastic demo, run by 'python -m moe_autograd demo --elastic' "
                "(or moe_autograd.demo_elastic.main)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    # torch.distributed's own deprecation chatter, raised inside init_rpc.
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    # TensorPipe's "[W ...] ... EOF" lines of the servers, when the demo shuts
    # the world down with replies of masked calls still on the way: read by
    # torch when the servers import it (this process's own are set already).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # experts overlap on threads; leave the cores to them
    dim, width, classes, lr = 8, 32, 4, 3e-3
    task = RegionTask(dim, classes, args.seed)
    world_size = args.servers + 1
    from .remote import JobSecret, set_job_secret
    from .remote.loopback import free_port

    secret = JobSecret.generate()  # the demo's job: this process and its servers
    set_job_secret(secret)
    port = free_port()
    ctx = mp.get_context("spawn")
    server_args = {"width": width, "latency": args.latency, "fail_rate": args.fail_rate,
                   "slow_rate": args.slow_rate, "slow_for": args.slow_for, "lr": lr}
    servers = [ctx.Process(target=_serve,
                           args=(rank, world_size, port, server_args, secret.hex()),
                           name=f"moe_autograd-demo-server{rank - 1}", daemon=True)
               for rank in range(1, world_size)]
    rpc_up = interrupted = False
    try:
        for proc in servers:
            proc.start()
        remote: List[nn.Module] = []
        if servers:
            from .remote import RemoteExpert, start_rpc
            from .remote.loopback import backend_options

            print(f"starting {len(servers)} expert servers on 127.0.0.1:{port} ...", flush=True)
            start_rpc("client", 0, world_size, backend_options(port))
            rpc_up = True
            remote = [RemoteExpert(f"server{i}", f"expert{j}",
                                   forward_timeout=args.forward_timeout, backward_timeout=5.0)
                      for i in range(len(servers)) for j in range(2)]
        local = [Expert(width, args.latency) for _ in range(args.local_experts)]
        experts = local + remote
        model = Model(dim, width, classes, experts, k=2, k_min=1,
                      forward_timeout=args.forward_timeout, backward_timeout=5.0,
                      allow_zero_outputs=True, detect_anomalies=True)
        print(f"model: embed -> MixtureOfExperts({len(local)} local + {len(remote)} remote "
              f"experts, k=2) -> head; task: {classes} classes, 4 regions with their own rules")
        times = _train(model, task, args.steps, args.batch, lr, "moe_autograd", args.quiet)
        loss, acc = evaluate(model, task)
        sequential_times, crashed = _time_sequential(model, task, min(30, args.steps), args.batch)

        single = Model(dim, width, classes, [Expert(width, 0.0)], k=1)
        _train(single, task, args.steps, args.batch, lr, "one expert  ", args.quiet)
        single_loss, single_acc = evaluate(single, task)

        totals = model.moe.expert_stats.totals()
        ours, seq = _median_ms(times), _median_ms(sequential_times)
        print()
        print(f"accuracy      mixture {acc:6.1%} (loss {loss:.3f})   "
              f"one expert {single_acc:6.1%} (loss {single_loss:.3f})")
        print(f"step time     parallel {ours:7.1f} ms   sequential autograd {seq:7.1f} ms   "
              f"({seq / ours:.1f}x faster)")
        print(f"absorbed      {totals['failures']} expert failures, {totals['timeouts']} "
              f"timeouts, {totals['non_finite']} non-finite outputs, "
              f"{totals['backward_failures'] + totals['backward_timeouts']} backward failures "
              f"over {totals['calls']} expert calls")
        if crashed:
            print(f"              (sequential autograd crashed on {crashed} of "
                  f"{min(30, args.steps)} steps)")
        return 0
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if rpc_up:
            import torch.distributed.rpc as rpc
            # A graceful shutdown waits for every peer: only when all are alive
            # and nothing was interrupted, and even then not forever.
            graceful = not interrupted and all(p.is_alive() for p in servers)
            try:
                rpc.shutdown(graceful=graceful, timeout=10) if graceful else rpc.shutdown(graceful=False)
            except Exception:  # noqa: BLE001 - tearing down anyway
                pass
        for proc in servers:
            proc.join(timeout=10 if not interrupted else 1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
