"""Benchmark: remote experts over a rate-limited link, raw and compressed.

Setting: a private network namespace whose loopback carries 100 Mb/s, then
1 Gb/s (:mod:`.netns`: ``ip netns add``, ``tc qdisc ... tbf``; root only,
else the rows are one "skipped" row saying why). Inside it, a torch RPC
world (TensorPipe over TCP on the namespace's 127.0.0.1: the ``uv``
transport and ``basic`` channel, so every tensor byte crosses the link) of
2 servers x 2 experts and a client. Each expert is elementwise
(``tanh(x * w + b)``: bytes, not FLOPs, set the time) and sleeps ``L`` = 5 ms
in forward and again in backward (latency emulated by sleeps, as in the
loopback rows). One step: 4 calls of a 128 x 1024 float32 activation
(512 KiB each) through :func:`moe_autograd.parallel_apply`, forward and
backward, stateful servers: 8 MiB of tensors cross the link per step (x and
y in forward, the output gradient and the input gradient in backward).

Variants at each rate:

* ``raw``: ours, no compression;
* ``int8`` / ``bf16``: ours with ``RemoteExpert(..., compression=...)``
  (both directions, both passes; int8 moves 1 + 4/64 bytes per element);
* ``torch``: the same experts through ``rpc_async`` inside a
  ``dist_autograd.context()``, differentiated by
  ``torch.distributed.autograd.backward`` (the remote group's baseline);
* the limit: the raw step's tensor bytes over the rate, plus 2L. The
  namespace's ``lo`` is one bucket shared by both directions, so the limit
  counts every byte of the step, both ways.

How it runs: :func:`run` (in the bench's process) makes the namespace, runs
``python -m moe_autograd.bench.bandwidth --worker`` inside it (which starts
the world, measures both rates, changing the rate in between with
``tc qdisc replace``, and prints the rows as JSON on its last line), reads
the rows, and deletes the namespace (``finally`` and at exit). The world's
processes are forked from a forkserver, as in :mod:`.remote`.
"""
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

from .measure import Plan, compare, measure
from .processes import forkserver_context
from .remote import _Sleep, _as_dict, _join_job, _run_world

__all__ = ["run", "main", "WireExpert", "RATES", "step_bytes"]

RATES = (100, 1000)  # Mb/s
L_S = 0.005
WIDTH, BATCH = 1024, 128
SERVERS = ("bw-0", "bw-1")
NAMES = ("b0", "b1")
WORKER_TIMEOUT_S = 300.0
_modules: Dict[str, nn.Module] = {}


class WireExpert(nn.Module):
    """``tanh(x * w + b)`` (elementwise: cheap), sleeping ``seconds`` in
    forward and in backward."""

    def __init__(self, width: int = WIDTH, seconds: float = L_S) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width) * 0.1 + 1.0)
        self.b = nn.Parameter(torch.zeros(width))
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(torch.tanh(x * self.w + self.b), self.seconds)


def step_bytes(calls: int = len(SERVERS) * len(NAMES)) -> int:
    """Tensor bytes one raw step moves: x and y forward, dy and dx backward."""
    return calls * 4 * BATCH * WIDTH * 4


def limit_ms(nbytes: int, rate_mbit: float) -> float:
    return nbytes * 8 / (rate_mbit * 1e6) * 1e3 + 2e3 * L_S


def _setup() -> List[Any]:
    from ..remote import ExpertServer

    torch.manual_seed(0)
    experts = {n: WireExpert() for n in NAMES}
    _modules.update(experts)
    return [ExpertServer(experts, backward="stateful", max_request_bytes=None)]


def _torch_forward(name: str, x: Tensor) -> Tensor:
    return _modules[name](x)


def _measure(quick: bool, servers: Sequence[str]) -> List[Dict[str, Any]]:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc

    from .. import parallel_apply
    from ..remote import RemoteExpert
    from .netns import set_rate

    plan = Plan.pick(quick, Plan(warmup=1, reps=6), Plan(warmup=1, reps=2))
    pairs = [(w, n) for w in servers for n in NAMES]
    torch.manual_seed(1)
    xs = [torch.randn(BATCH, WIDTH, requires_grad=True) for _ in pairs]
    # dense output gradients (a loss of o.sum() would send expanded ones: one element each)
    gs = [torch.randn(BATCH, WIDTH) for _ in pairs]

    def ours(codec: Optional[str]) -> Callable[[], None]:
        experts = [RemoteExpert(w, n, forward_timeout=60, backward_timeout=60,
                                compression=codec) for w, n in pairs]

        def step() -> None:
            outs = parallel_apply(experts, xs)
            sum((o * g).sum() for o, g in zip(outs, gs)).backward()
        return step

    def torch_dist() -> None:
        with dist_autograd.context() as ctx:
            futures = [rpc.rpc_async(w, _torch_forward, args=(n, x))
                       for (w, n), x in zip(pairs, xs)]
            loss = sum((f.wait() * g).sum() for f, g in zip(futures, gs))
            dist_autograd.backward(ctx, [loss])

    nbytes = step_bytes(len(pairs))
    mib = nbytes / (1 << 20)
    rows: List[Dict[str, Any]] = []
    for rate in RATES:
        set_rate(rate)
        tag = f"bw{rate}" if rate < 1000 else f"bw{rate // 1000}g"
        speed = f"{rate} Mb/s" if rate < 1000 else f"{rate / 1000:g} Gb/s"
        samples = measure({"raw": ours(None), "int8": ours("int8"), "bf16": ours("bf16"),
                           "torch": torch_dist}, plan.reps, plan.warmup)
        samples["limit"] = [limit_ms(nbytes, rate)] * plan.reps
        world = (f"{speed} loopback in a private netns (tbf), {len(pairs)} calls fwd+bwd of "
                 f"{BATCH}x{WIDTH} fp32 ({mib:g} MiB of tensors per step, both ways), "
                 f"{len(servers)} servers x {len(NAMES)} experts, L = {L_S * 1e3:g} ms, "
                 "stateful")
        goal_limit, goal_int8 = (1.3, 0.6) if rate == 100 else (None, None)
        rows += [_as_dict(r) for r in (
            compare(f"remote/{tag}-vs-limit", samples, "limit", "raw", goal_limit,
                    f"{world}; baseline = limit, bytes / bandwidth + 2L"),
            compare(f"remote/{tag}-int8-vs-raw", samples, "raw", "int8", goal_int8,
                    "same, compression='int8' (blockwise, 64 per scale) vs none"),
            compare(f"remote/{tag}-bf16-vs-raw", samples, "raw", "bf16", None,
                    "same, compression='bf16' vs none"),
            compare(f"remote/{tag}-vs-torch", samples, "torch", "raw", None,
                    "same, no compression; baseline = rpc_async + "
                    "torch.distributed.autograd.backward"),
            compare(f"remote/{tag}-int8-vs-torch", samples, "torch", "int8", None,
                    "same, compression='int8'; baseline = rpc_async + distributed autograd"),
        )]
    return rows


def _client_main(port: int, quick: bool, servers: Sequence[str], queue: Any,
                 secret: str) -> None:
    from torch.distributed import rpc

    from ..remote import start_rpc
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    _join_job(secret)
    start_rpc("bw-client", 0, 1 + len(servers), backend_options(port, rpc_timeout=120.0))
    try:
        queue.put(("ok", _measure(quick, servers)))
    except BaseException as error:  # noqa: BLE001 - report, then leave the world
        queue.put(("error", f"{type(error).__name__}: {error}"))
    finally:
        rpc.shutdown()


_PRELOAD = ["torch", "torch.distributed.rpc", "torch.distributed.autograd",
            "moe_autograd.remote.loopback", "moe_autograd.remote.server",
            "moe_autograd.remote.client", __name__]


def _context() -> Any:
    """The world's start method (:func:`.processes.forkserver_context`)."""
    return forkserver_context(_PRELOAD)


def worker(quick: bool) -> List[Dict[str, Any]]:
    """Inside the namespace: the world, both rates measured; the rows."""
    from ..remote import JobSecret
    from ..remote.loopback import free_port, serve_in_process

    port = free_port()
    ctx = _context()
    secret = JobSecret.generate().hex()
    processes = [ctx.Process(target=serve_in_process, name=f"expert-server-{name}", daemon=True,
                             args=(port, 1 + k, 1 + len(SERVERS), name, f"{__name__}:_setup"),
                             kwargs={"secret": secret})
                 for k, name in enumerate(SERVERS)]
    queue = ctx.Queue()
    processes.append(ctx.Process(target=_client_main,
                                 args=(port, quick, SERVERS, queue, secret),
                                 name="bw-client", daemon=True))
    return _run_world(processes, queue, "bench.bandwidth")  # type: ignore[no-any-return]


def _skipped(why: str) -> List[Dict[str, Any]]:
    return [{"name": "remote/bw", "baseline_ms": None, "ours_ms": None, "ratio": None,
             "goal": None, "note": f"skipped: {why}"}]


def run(quick: bool = False) -> List[Dict[str, Any]]:
    """The bandwidth rows (dicts, as :func:`.remote.run`'s), or one skipped
    row saying why namespaces are not available here."""
    from .netns import NetnsUnavailable, RateLimitedNetns, unavailable

    why = unavailable()
    if why is not None:
        return _skipped(why)
    argv = [sys.executable, "-m", "moe_autograd.bench.bandwidth", "--worker"] + (["--quick"] if quick else [])
    try:
        with RateLimitedNetns(RATES[0]) as ns:
            process = subprocess.Popen(ns.command(argv), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True,
                                       start_new_session=True, env=dict(os.environ))
            try:
                out, err = process.communicate(timeout=WORKER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                out, err = process.communicate()
                return _skipped(f"the worker in the namespace ran past {WORKER_TIMEOUT_S:g} s:"
                                f" {err.strip()[-300:]}")
            finally:  # (interrupted: nothing of the world outlives the namespace's name)
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    except NetnsUnavailable as error:
        return _skipped(f"cannot make a rate-limited namespace here: {error}")
    lines = [line for line in out.splitlines() if line.startswith("[")]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"bench.bandwidth worker failed ({process.returncode}): "
                           f"{err.strip()[-2000:]}")
    rows: List[Dict[str, Any]] = json.loads(lines[-1])
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    from .remote import format_rows

    args = sys.argv[1:] if argv is None else argv
    quick = "--quick" in args
    if "--worker" in args:
        start = time.monotonic()
        rows = worker(quick)
        print(f"worker: {time.monotonic() - start:.1f} s", file=sys.stderr)
        print(json.dumps(rows), flush=True)
        return 0
    print(format_rows(run(quick)))
    return 0


if __name__ == "__main__":  # run the imported module's main: its names are its own
    from moe_autograd.bench.bandwidth import main as _main

    raise SystemExit(_main())
