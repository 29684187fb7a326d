"""Benchmark: remote experts in ``parallel_apply`` vs torch's distributed autograd.

Setting (loopback, one run): server processes hosting 16 experts in all, each
expert a 64-wide ``Linear`` + ``tanh`` that sleeps ``L`` = 5 ms in forward and
again in backward (standing in for compute that releases the GIL, like a GPU
kernel). 16 calls (one per expert) are timed forward + backward:

* ``ours``: :class:`~moe_autograd.remote.RemoteExpert` calls through
  :func:`moe_autograd.parallel_apply` (stateful servers; a stateless row is
  shown too: it recomputes the forward, so its floor is 3L);
* ``torch``: the same experts called with ``rpc.rpc_async`` inside a
  ``dist_autograd.context()`` and differentiated by
  ``torch.distributed.autograd.backward`` (the engine's own distributed
  backward), on the same RPC world.

Goals (issue 11): ours <= 0.5 x torch, and ours <= 1.5 x 2L (the limit if all
16 calls overlap in both passes; 1.5 x 3L stateless). The same is measured
with L = 50 ms (goal <= 1.1 x 2L), where the per-message CPU of the RPC layer
is amortised: on a machine with few cores the L = 5 ms run is CPU-bound (every
RPC costs about a millisecond of CPU over both ends), and the L = 50 ms run
shows the latency-bound behaviour. Ours sends one request per server and
pass (see :mod:`moe_autograd.remote.batching`); torch one RPC per call and
pass.

Also: the scaling curve, 16, 32 and 64 remote experts (L = 5 ms, stateful)
on the same 4 servers (goal: 64 <= 1.5 x 16, since the messages per step do
not grow with the experts), with torch at 64 for reference; the MoE layer
with 16 remote experts, k = 2, 64 tokens (experts sleeping 0 and 5 ms),
against the same routing through ``rpc_async`` + distributed autograd; and
the per-call overhead of a tiny expert through ``RemoteExpert`` against a
bare ``rpc_sync`` of the same module.

Every row carries both times (``baseline_ms``, ``ours_ms``; a physical limit
is a constant baseline) and is measured by :func:`..measure.measure`, as the
in-process rows are: variants interleaved, medians, paired ratios.

The world is the same in both modes (4 servers x 4 experts: the server
count shapes the torch baseline, whose L = 50 ms time grows by half with 2
servers x 8 experts), ``--quick`` only cuts repetitions. The client runs in a
child process too (a process joins one RPC world in its life), so :func:`run`
can be called from anywhere; the processes are forked from a forkserver that
imported torch once (see :func:`_context`). Every process of a world serves
one job: :func:`run` makes a new :class:`~moe_autograd.remote.JobSecret` and
hands it to each process through its start arguments (never argv or the
environment). ``python -m moe_autograd.bench.remote [--quick]`` prints the
rows alone.

``python -m moe_autograd.bench.remote --straggler`` measures something else
(issue 18, not a row of the table): the CPU seconds a *masked straggler*
costs the client and the server, and the messages the client sends for it,
in a world of its own (one server; see :func:`run_straggler`).
"""
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .measure import Plan, Row, compare, measure
from .processes import forkserver_context, result_of

__all__ = ["run", "format_rows", "main", "SleepyExpert", "run_straggler", "format_straggler"]

L_S = 0.005
SLOW_L_S = 0.05  # the latency-bound variant: overheads amortised
WIDTH, BATCH, CALLS = 64, 32, 16
SERVERS = tuple(f"bench-{k}" for k in range(4))
NAMES = tuple(f"e{k}" for k in range(CALLS // len(SERVERS)))
TINY_CALLS = 20  # tiny-expert calls per timed sample
SCALES = (16, 32, 64)  # remote experts on the same servers (stateful, L)
MOE_TOKENS, MOE_K = 64, 2
_modules: Dict[str, nn.Module] = {}


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class SleepyExpert(nn.Module):
    """``tanh(Linear(x))`` that sleeps ``seconds`` in forward and in backward."""

    def __init__(self, width: int = WIDTH, seconds: float = L_S) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(torch.tanh(self.lin(x)), self.seconds)


def _setup() -> List[Any]:
    """Server process: stateful e*, stateless sl_e*, stateful slow_e* (10 L),
    stateful s* (the scaling rows) and z* (no sleep, the MoE row), and a tiny
    expert."""
    from ..remote import ExpertServer

    stateful = {n: SleepyExpert() for n in NAMES}
    slow = {f"slow_{n}": SleepyExpert(seconds=SLOW_L_S) for n in NAMES}
    scale = {f"s{k}": SleepyExpert() for k in range(max(SCALES) // len(SERVERS))}
    quick = {f"z{k}": SleepyExpert(seconds=0.0) for k in range(len(NAMES))}
    _modules.update(stateful, **slow, **scale, **quick)
    _modules["tiny"] = nn.Linear(4, 4)
    return [ExpertServer(dict(stateful, **slow, **scale, **quick), backward="stateful"),
            ExpertServer({f"sl_{n}": SleepyExpert() for n in NAMES}),
            ExpertServer({"tiny": _modules["tiny"]})]


def _torch_forward(name: str, x: Tensor) -> Tensor:
    return _modules[name](x)


def _tiny_forward(x: Tensor) -> Tensor:
    with torch.no_grad():
        return _modules["tiny"](x)


def _as_dict(row: Row) -> Dict[str, Any]:
    return {"name": row.name, "baseline_ms": row.baseline, "ours_ms": row.ours,
            "ratio": row.ratio, "goal": row.goal, "note": row.note}


def _measure(quick: bool, servers: Sequence[str]) -> List[Dict[str, Any]]:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc

    from .. import parallel_apply
    from ..remote import RemoteExpert

    plan = Plan.pick(quick, Plan(warmup=3, reps=30), Plan(warmup=1, reps=5))
    slow_plan = Plan.pick(quick, Plan(warmup=1, reps=6), Plan(warmup=1, reps=2))
    tiny_plan = Plan.pick(quick, Plan(warmup=2, reps=30, inner=TINY_CALLS),
                          Plan(warmup=1, reps=5, inner=TINY_CALLS))
    pairs = [(w, n) for w in servers for n in NAMES]
    xs = [torch.randn(BATCH, WIDTH, requires_grad=True) for _ in pairs]
    world = f"{len(pairs)} calls fwd+bwd, {len(servers)} servers x {len(NAMES)} experts"

    def ours(prefix: str) -> Callable[[], None]:
        experts = [RemoteExpert(w, prefix + n, forward_timeout=30, backward_timeout=30)
                   for w, n in pairs]

        def step() -> None:
            outs = parallel_apply(experts, xs)
            sum(o.sum() for o in outs).backward()
        return step

    def torch_dist(prefix: str) -> Callable[[], None]:
        def step() -> None:
            with dist_autograd.context() as ctx:
                futures = [rpc.rpc_async(w, _torch_forward, args=(prefix + n, x))
                           for (w, n), x in zip(pairs, xs)]
                loss = sum(f.wait().sum() for f in futures)
                dist_autograd.backward(ctx, [loss])
        return step

    big = measure({"torch": torch_dist(""), "ours": ours(""), "stateless": ours("sl_")},
                  plan.reps, plan.warmup)
    big["2L"] = [2e3 * L_S] * plan.reps
    big["3L"] = [3e3 * L_S] * plan.reps
    slow = measure({"torch": torch_dist("slow_"), "ours": ours("slow_")},
                   slow_plan.reps, slow_plan.warmup)
    slow["2L"] = [2e3 * SLOW_L_S] * slow_plan.reps

    tiny, x = RemoteExpert(servers[0], "tiny"), torch.randn(8, 4)
    xg = x.clone().requires_grad_()

    def bare() -> None:
        rpc.rpc_sync(servers[0], _tiny_forward, args=(x,))

    def ours_no_grad() -> None:
        with torch.no_grad():
            tiny(x)

    def ours_grad() -> None:
        tiny(xg)

    small = measure({"bare": bare, "no_grad": ours_no_grad, "grad": ours_grad},
                    tiny_plan.reps, tiny_plan.warmup, tiny_plan.inner)
    scaled = _measure_scaling(quick, servers)
    moe = _measure_moe(quick, servers)
    torch_note = "baseline = rpc_async + torch.distributed.autograd.backward"
    rows = [
        compare("remote/vs-torch", big, "torch", "ours", 0.5,
                f"{world}, L = {L_S * 1e3:g} ms, stateful; {torch_note}"),
        compare("remote/vs-limit", big, "2L", "ours", 1.5,
                "same, stateful; baseline = physical limit 2L"),
        compare("remote/stateless-vs-limit", big, "3L", "stateless", 1.5,
                "same, stateless (recomputes in backward); baseline = 3L"),
        compare("remote/L50-vs-torch", slow, "torch", "ours", None,
                f"L = {SLOW_L_S * 1e3:g} ms (RPC CPU cost amortised); {torch_note}"),
        compare("remote/L50-vs-limit", slow, "2L", "ours", 1.1,
                "L = 50 ms; baseline = physical limit 2L"),
        compare("remote/scale-32-vs-16", scaled, "16", "32", None,
                f"32 remote experts (8 per server) vs 16, L = {L_S * 1e3:g} ms, stateful, "
                "fwd+bwd; baseline = 16 experts"),
        compare("remote/scale-64-vs-16", scaled, "16", "64", 1.5,
                "64 remote experts (16 per server) vs 16; baseline = 16 experts"),
        compare("remote/scale-64-vs-torch", scaled, "torch64", "64", None,
                f"64 remote experts; {torch_note} (one RPC per call and pass)"),
        compare("remote/moe-16-L0", moe, "torch0", "ours0", None,
                f"MixtureOfExperts, 16 remote experts (4 servers x 4), k = {MOE_K}, "
                f"{MOE_TOKENS} tokens, experts without sleep, fwd+bwd; baseline = the same "
                "routing and combine, experts through rpc_async + distributed autograd"),
        compare("remote/moe-16-L5", moe, "torch5", "ours5", None,
                f"same, experts sleeping L = {L_S * 1e3:g} ms in fwd and bwd"),
        compare("remote/tiny-no-grad", small, "bare", "no_grad", 1.5,
                "per call, Linear(4,4) via RemoteExpert under no_grad; baseline = bare rpc_sync"),
        compare("remote/tiny-grad", small, "bare", "grad", 2.0,
                "per call, forward with grad (no backward); baseline = bare rpc_sync"),
    ]
    return [_as_dict(r) for r in rows]


def _torch_step(pairs: Sequence[Tuple[str, str]], xs: Sequence[Tensor]) -> Callable[[], None]:
    """One call per (worker, expert) through ``rpc_async``, differentiated by
    ``torch.distributed.autograd``."""
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc

    def step() -> None:
        with dist_autograd.context() as ctx:
            futures = [rpc.rpc_async(w, _torch_forward, args=(n, x)) for (w, n), x in zip(pairs, xs)]
            loss = sum(f.wait().sum() for f in futures)
            dist_autograd.backward(ctx, [loss])
    return step


def _measure_scaling(quick: bool, servers: Sequence[str]) -> Dict[str, List[float]]:
    """Step times with 16, 32 and 64 remote experts on the same servers, and
    torch's at 64."""
    from .. import parallel_apply
    from ..remote import RemoteExpert

    plan = Plan.pick(quick, Plan(warmup=2, reps=12), Plan(warmup=1, reps=3))
    variants: Dict[str, Callable[[], None]] = {}
    for n in SCALES:
        pairs = [(w, f"s{k}") for k in range(n // len(servers)) for w in servers]
        xs = [torch.randn(BATCH, WIDTH, requires_grad=True) for _ in pairs]
        experts = [RemoteExpert(w, name, forward_timeout=30, backward_timeout=30)
                   for w, name in pairs]

        def step(experts: List[Any] = experts, xs: List[Tensor] = xs) -> None:
            outs = parallel_apply(experts, xs)
            sum(o.sum() for o in outs).backward()
        variants[str(n)] = step
        if n == max(SCALES):
            variants["torch64"] = _torch_step(pairs, xs)
    return measure(variants, plan.reps, plan.warmup)


def _measure_moe(quick: bool, servers: Sequence[str]) -> Dict[str, List[float]]:
    """The MoE layer over 16 remote experts (``z*``: no sleep, ``e*``: L),
    ours and through ``rpc_async`` + distributed autograd with the same gate."""
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc

    from ..moe import MixtureOfExperts
    from ..moe.gating import load_balancing_loss, route
    from ..remote import RemoteExpert

    plan = Plan.pick(quick, Plan(warmup=2, reps=12), Plan(warmup=1, reps=3))
    tokens = torch.randn(MOE_TOKENS, WIDTH, requires_grad=True)
    variants: Dict[str, Callable[[], None]] = {}
    for tag, names in (("0", [f"z{k}" for k in range(len(NAMES))]), ("5", list(NAMES))):
        pairs = [(w, n) for w in servers for n in names]
        torch.manual_seed(0)
        layer = MixtureOfExperts([RemoteExpert(w, n, forward_timeout=30, backward_timeout=30)
                                  for w, n in pairs], WIDTH, k=MOE_K)

        def ours(layer: MixtureOfExperts = layer) -> None:
            y, aux = layer(tokens)
            (y.sum() + aux).backward()

        def baseline(layer: MixtureOfExperts = layer,
                     pairs: List[Tuple[str, str]] = pairs) -> None:
            with dist_autograd.context() as ctx:
                logits = layer.gate(tokens)
                routing = route(logits, MOE_K)
                weights = torch.softmax(routing.top_logits, dim=-1)
                active = [e for e, t in enumerate(routing.tokens) if len(t)]
                futures = [rpc.rpc_async(pairs[e][0], _torch_forward,
                                         args=(pairs[e][1], tokens[routing.tokens[e]]))
                           for e in active]
                y = tokens.new_zeros(MOE_TOKENS, WIDTH)
                for e, future in zip(active, futures):
                    rows, slots = routing.tokens[e], routing.slots[e]
                    y = y.index_add(0, rows, future.wait() * weights[rows, slots].unsqueeze(-1))
                loss = y.sum() + load_balancing_loss(logits, routing.top_experts)
                dist_autograd.backward(ctx, [loss])
        variants["ours" + tag], variants["torch" + tag] = ours, baseline
    return measure(variants, plan.reps, plan.warmup)


def _join_job(secret: str) -> None:
    """A process of the bench's world: the job's secret (hex, from its start
    arguments) becomes its default."""
    from ..remote import JobSecret, set_job_secret

    set_job_secret(JobSecret.from_hex(secret))


def _client_main(port: int, quick: bool, servers: Sequence[str], queue: Any,
                 secret: str) -> None:
    from torch.distributed import rpc

    from ..remote import start_rpc
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    _join_job(secret)
    start_rpc("bench-client", 0, 1 + len(servers), backend_options(port, rpc_timeout=60.0))
    try:
        queue.put(("ok", _measure(quick, servers)))
    except BaseException as error:  # noqa: BLE001 - report, then leave the world
        queue.put(("error", f"{type(error).__name__}: {error}"))
    finally:
        rpc.shutdown()


# What every process of the world imports: loaded once by the forkserver, which
# forks the server and client processes ready to go (see _context).
_PRELOAD = ["torch", "torch.distributed.rpc", "torch.distributed.autograd",
            "moe_autograd.remote.loopback", "moe_autograd.remote.server",
            "moe_autograd.remote.client", __name__]


def _context() -> Any:
    """The world's start method (:func:`.processes.forkserver_context`)."""
    return forkserver_context(_PRELOAD)


def _result(queue: Any, client: Any, timeout: float) -> Tuple[str, Any]:
    """The client's ``(status, value)``; fails early if it died without one."""
    return result_of(queue, client, timeout)


def run(quick: bool = False) -> List[Dict[str, Any]]:
    """Starts the loopback world, measures, tears it down; returns the rows
    (dicts with ``name, baseline_ms, ours_ms, ratio, goal, note``)."""
    from ..remote import JobSecret
    from ..remote.loopback import free_port, serve_in_process

    servers = SERVERS
    port = free_port()
    ctx = _context()
    secret = JobSecret.generate().hex()  # the world's job: passed in start arguments only
    processes = [ctx.Process(target=serve_in_process, name=f"expert-server-{name}", daemon=True,
                             args=(port, 1 + k, 1 + len(servers), name, f"{__name__}:_setup"),
                             kwargs={"secret": secret})
                 for k, name in enumerate(servers)]
    queue = ctx.Queue()
    processes.append(ctx.Process(target=_client_main,
                                 args=(port, quick, servers, queue, secret),
                                 name="bench-client", daemon=True))
    rows: List[Dict[str, Any]] = _run_world(processes, queue, "bench.remote")
    return rows + _compression_rows(quick)


def _compression_rows(quick: bool) -> List[Dict[str, Any]]:
    """Issue 32's rows: the bandwidth-limited world (:mod:`.bandwidth`, a
    private rate-limited network namespace; one skipped row where that is
    not allowed) and the codecs' training quality (:mod:`.codec_quality`)."""
    from . import bandwidth, codec_quality

    return bandwidth.run(quick) + codec_quality.run(quick)


def _run_world(processes: List[Any], queue: Any, what: str) -> Any:
    """Starts the servers and, last, the client; returns what the client put
    on ``queue``; stops them all, the client first (it ends the world)."""
    from ..remote.loopback import stop_processes
    started: List[Any] = []
    try:
        for process in processes:
            process.start()
            started.append(process)
        status, value = _result(queue, processes[-1], timeout=120.0)
    finally:
        stop_processes(started[::-1], timeout=15.0)
    if status != "ok":
        raise RuntimeError(f"{what} failed in the client process: {value}")
    return value


# -- the CPU cost of a masked straggler (issue 18) ---------------------------------------
STRAGGLER_S = 2.0      # how long the masked expert runs on the server
STRAGGLER_CALLS = 3    # masked calls measured per variant
STRAGGLER_LAYER_S = 0.2  # the MixtureOfExperts' forward_timeout that masks it


class _Straggler(nn.Module):
    """Sleeps (no CPU) ``seconds`` in forward, then a linear map."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        return self.lin(x)


CPU_SECONDS_OP = "bench.cpu_seconds"  # the straggler server's operation: its CPU seconds


def _straggler_setup() -> List[Any]:
    """Server process of the straggler world: a fast and a slow expert, and
    the operation that reads its CPU seconds."""
    from ..remote import ExpertServer, register_operation

    register_operation(CPU_SECONDS_OP, _cpu_seconds)
    return [ExpertServer({"fast": nn.Linear(WIDTH, WIDTH), "slow": _Straggler(STRAGGLER_S)})]


def _cpu_seconds() -> float:
    """This process's CPU seconds (user + system), all threads."""
    times = os.times()
    return times.user + times.system


class _CountingTransport:
    """The default transport, counting the messages (frames) sent."""

    name = "counting"

    def __init__(self, inner: Any) -> None:
        self.inner, self.sent = inner, 0

    def call(self, worker: str, frame: Any, timeout: Any) -> Any:
        self.sent += 1
        return self.inner.call(worker, frame, timeout)

    def local_name(self) -> str:
        return str(self.inner.local_name())

    def default_timeout(self) -> Any:
        return self.inner.default_timeout()


def _measure_straggler(server: str) -> Dict[str, Dict[str, float]]:
    """Per masked call: client and server CPU seconds and messages, for a
    straggler with no deadline of its own and with one longer than the
    layer's (both above the layer's ``forward_timeout``)."""
    from ..moe import MixtureOfExperts
    from ..remote import RemoteExpert, call_operation
    from ..remote.transport import get_transport

    out: Dict[str, Dict[str, float]] = {}
    for label, own in (("none", None), ("own-1.5s", 1.5)):
        transport = _CountingTransport(get_transport())
        experts = [RemoteExpert(server, "fast", forward_timeout=own, transport=transport),
                   RemoteExpert(server, "slow", forward_timeout=own, transport=transport)]
        torch.manual_seed(0)
        layer = MixtureOfExperts(experts, WIDTH, k=2, forward_timeout=STRAGGLER_LAYER_S,
                                 k_min=0, allow_zero_outputs=True)
        x = torch.randn(8, WIDTH)
        with torch.no_grad():
            experts[0](x)  # warm-up: connection, first call on the server
            layer(x)  # (the slow one is masked: wait it out)
        time.sleep(STRAGGLER_S + 0.3)
        sent0, client0 = transport.sent, _cpu_seconds()
        server0 = call_operation(server, CPU_SECONDS_OP)
        start = time.monotonic()
        for _ in range(STRAGGLER_CALLS):
            with torch.no_grad():
                layer(x)
            time.sleep(STRAGGLER_S + 0.3)  # the straggler ends on the server meanwhile
        wall = time.monotonic() - start
        server1 = call_operation(server, CPU_SECONDS_OP)
        client1, sent1 = _cpu_seconds(), transport.sent
        masked = int(str(layer.stats()[1]["timeouts"])) - 1  # the slow one's, less the warm-up's
        n = max(masked, 1)
        out[label] = {"client_cpu_s": (client1 - client0) / n,
                      "server_cpu_s": (server1 - server0) / n,
                      "messages": (sent1 - sent0) / n,
                      "masked": float(masked), "wall_s": wall / n}
    return out


def _straggler_client(port: int, server: str, queue: Any, secret: str) -> None:
    from torch.distributed import rpc

    from ..remote import start_rpc
    from ..remote.loopback import backend_options

    torch.set_num_threads(1)
    _join_job(secret)
    start_rpc("straggler-client", 0, 2, backend_options(port, rpc_timeout=60.0))
    try:
        queue.put(("ok", _measure_straggler(server)))
    except BaseException as error:  # noqa: BLE001 - report, then leave the world
        queue.put(("error", f"{type(error).__name__}: {error}"))
    finally:
        rpc.shutdown()


def run_straggler() -> Dict[str, Dict[str, float]]:
    """The CPU cost of a masked straggler on a loopback world of one server:
    a ``MixtureOfExperts`` (``forward_timeout`` 0.2 s, k = 2) of two remote
    experts of the same server, one answering at once, one sleeping 2 s
    (no CPU of its own); per masked call, the CPU seconds of the client and
    server processes from the layer's call until the straggler ended, and
    the messages the client sent."""
    from ..remote import JobSecret
    from ..remote.loopback import free_port, serve_in_process

    server = "straggler-srv"
    port = free_port()
    ctx = _context()
    queue = ctx.Queue()
    secret = JobSecret.generate().hex()  # the world's job: passed in start arguments only
    processes = [ctx.Process(target=serve_in_process, name="expert-server-straggler", daemon=True,
                             args=(port, 1, 2, server, f"{__name__}:_straggler_setup"),
                             kwargs={"secret": secret}),
                 ctx.Process(target=_straggler_client, args=(port, server, queue, secret),
                             name="straggler-client", daemon=True)]
    return _run_world(processes, queue, "bench.remote straggler")


def format_straggler(result: Dict[str, Dict[str, float]]) -> str:
    """The result of :func:`run_straggler` as a small table."""
    lines = [f"{'straggler deadline':20} {'client CPU s':>13} {'server CPU s':>13} "
             f"{'messages':>9} {'masked':>7}"]
    for label, r in result.items():
        lines.append(f"{label:20} {r['client_cpu_s']:13.3f} {r['server_cpu_s']:13.3f} "
                     f"{r['messages']:9.1f} {r['masked']:7.0f}")
    return "\n".join(lines)


def format_rows(rows: List[Dict[str, Any]]) -> str:
    def ms(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [f"{'benchmark':28} {'baseline ms':>12} {'ours ms':>9} {'ratio':>7}  goal    note"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"{r['name']:28} {ms(r['baseline_ms']):>12} {ms(r['ours_ms']):>9} "
                     f"{ratio:>7}  {r['goal'] or '-':7} {r['note']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else argv
    if "--straggler" in args:
        print(format_straggler(run_straggler()))
        return 0
    print(format_rows(run(quick="--quick" in args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
