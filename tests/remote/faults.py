"""A fault-injection harness for remote experts (issue 18); not a test module.

In the spirit of torchft's ``EventInjector``: a *plan* is a list of faults
``Fault(server, step, phase, kind)``, and a training loop runs under it while
every step is checked. :mod:`test_fault_plans` runs a fixed set of plans in
the default run, and ``--plans N`` adds N random ones (its seed is printed, so
a failure replays with ``--plans N --plans-seed S``).

The loop
--------
A *trainer* process (a real interpreter, so that its exit is the real exit:
``python -c "import faults; faults.trainer_main(...)"``) founds an elastic
world and starts the servers, on either engine (issue 20: the same plans and
checks on both):

* ``rpc``: :meth:`Fleet.start` (the reaper included), the servers forked
  from a forkserver as :class:`ElasticServer` processes (:class:`_World`);
* ``ray``: a local Ray instance of its own, the servers as named actors
  (:class:`RayExpertServer`) and a :class:`RayFleet` over them
  (:class:`_RayWorld`); a signal goes to the actor's process, a drain is
  ``RayExpertServer.leave()``.

It trains a two-layer model on them::

    h    = x + MoE_remote(x)     # RemoteExperts by worker name: r0, r1 on s0, r2, r3 on s1
    out  = h + MoE_fleet(h)      # FleetExperts by expert name: f0 (s0), f1 (s1), f2 (both)
    loss = out.square().mean() + 0.01 * (aux_remote + aux_fleet)

The first layer routes each token to 3 of its 4 experts with ``k_min=1`` and
``backward_k_min=1``: one server down never leaves a token below quorum, two
do, and the step must then raise ``NotEnoughExperts``; the second routes to 2
of 3 with ``allow_zero_outputs`` and ``backward_k_min=0``: it never raises.
Both have ``forward_timeout`` and ``backward_timeout`` 0.6 s and
``detect_anomalies``; the RemoteExperts on s0 have no deadline of their own
(the layer's cuts them), the FleetExperts 1 s (0.4 s per attempt).
``s0`` is a stateless server, ``s1`` a stateful one; two experts per server
and layer, so calls are coalesced (one request and its collects). Each step
builds both layers afresh from fixed seeds (same gates, same experts), so
every step is reproducible on its own.

Faults
------
=========  ====================================================================
phase      when the fault hits ``server``
=========  ====================================================================
forward    while the step's forward runs (both layers)
backward   while the step's backward runs
between    after the forward returned, before the backward started
drain      the server starts a clean leave (drain) after the forward; the
           kind then hits its backward, which the draining server still serves
=========  ====================================================================

=========  ====================================================================
kind       how
=========  ====================================================================
kill       SIGKILL (30 ms into the phase, the server holding its calls 150 ms)
stop       SIGSTOP the same way, SIGCONT once the phase (the step) is over
slow       the server's experts sleep 1 s in that phase (past the 0.6 s deadline)
raise      the server's experts raise in that phase
nan        the server's experts return NaN outputs / input gradients
drop       the client's transport loses the server's replies of that phase
none       (drain only) a clean drain and nothing else
=========  ====================================================================

A killed or drained server stays down for the rest of its plan; every server
is back (same name, a new process) before the next plan.

Checks, step by step (any breach is a *problem* in the report):

* the step raises nothing, except ``NotEnoughExperts`` where the contract
  says so: exactly where a local replay of the same calls raises it;
* every masked forward and every constant backward is in ``stats()``: each
  expert called once per step iff routed (as in the replay), each call that
  a fault must break is masked in the phase it must be, and each call on a
  healthy server survives both phases;
* the loss, the input's and the gates' gradients equal bit for bit a local
  replay of the same step (the same experts, built from the same seeds, the
  masked calls failing in forward and the constant ones in backward);
* after each plan no state is held (server ``live`` states, kept batches,
  requests in flight; after a GC pass: an error's traceback can hold a call
  record in a reference cycle) and no thread was left behind (client and
  servers);
* at the end the trainer leaves masked stragglers running and calls
  ``sys.exit(7)`` without shutting anything down: it must exit with 7.
"""
import gc
import json
import math
import multiprocessing
import os
import random
import signal
import threading
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

WIDTH = 8
TOKENS = 16
RAY_START_S = 240.0  # wiring.RAY_START_S: an actor's start on 2 loaded cores
SERVERS: Dict[str, str] = {"s0": "stateless", "s1": "stateful"}
HOSTED: Dict[str, Tuple[str, ...]] = {"s0": ("r0", "r1", "f0", "f2"),
                                      "s1": ("r2", "r3", "f1", "f2")}
REMOTE_EXPERTS: Tuple[Tuple[str, str], ...] = (("s0", "r0"), ("s0", "r1"), ("s1", "r2"),
                                               ("s1", "r3"))
FLEET_EXPERTS: Tuple[str, ...] = ("f0", "f1", "f2")
PHASES = ("forward", "backward", "between", "drain")
KINDS = ("kill", "stop", "slow", "raise", "nan", "drop")
KINDS_OF: Dict[str, Tuple[str, ...]] = {"forward": KINDS, "backward": KINDS,
                                        "between": ("kill", "stop"),
                                        "drain": KINDS + ("none",)}
DEADLINE_S = 0.6      # the layers' forward_timeout and backward_timeout
SLOW_S = 1.0          # a slow expert, past the deadline
HOLD_S = 0.15         # a server holds its calls this long when a signal is due
SIGNAL_AFTER_S = 0.03
DEAD_AFTER_S = 2.0    # the fleet's liveness window (a short SIGSTOP is not reaped)
# A draining server serves at least this long: a stateless server holds nothing
# that tells it a backward is still to come, and a step's backward may reach it
# a whole deadline after the drain began (the other layer's backward waiting on
# a stopped or slow server first). With 0.5 s, random plans pairing a clean
# drain with a backward-phase stop elsewhere saw the drained server closed.
LINGER_S = 1.5
DRAIN_TIMEOUT_S = 3.0
EXIT_STATUS = 7


# -- plans ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    server: str
    step: int
    phase: str
    kind: str

    def __post_init__(self) -> None:
        if self.server not in SERVERS or self.phase not in PHASES \
                or self.kind not in KINDS_OF[self.phase]:
            raise ValueError(f"bad fault {self}")


@dataclass
class Plan:
    name: str
    steps: int
    faults: List[Fault] = field(default_factory=list)

    def at(self, step: int) -> List[Fault]:
        return [f for f in self.faults if f.step == step]

    def to_json(self) -> Dict[str, Any]:
        return {"name": self.name, "steps": self.steps, "faults": [asdict(f) for f in self.faults]}

    @staticmethod
    def from_json(data: Dict[str, Any]) -> "Plan":
        return Plan(data["name"], data["steps"], [Fault(**f) for f in data["faults"]])


def _f(server: str, step: int, phase: str, kind: str) -> Fault:
    return Fault(server, step, phase, kind)


#: The plans of the default run: every (phase, kind) pair at least once, on a
#: stateless and a stateful server, with the fleet's backward-after-a-kill
#: (issue 18, item 6) as a plan of its own.
FIXED_PLANS: List[Plan] = [
    Plan("forward-expert-faults", 3, [_f("s0", 0, "forward", "raise"),
                                      _f("s1", 1, "forward", "nan"),
                                      _f("s1", 2, "forward", "slow"),
                                      _f("s0", 2, "forward", "drop")]),
    Plan("backward-expert-faults", 3, [_f("s1", 0, "backward", "raise"),
                                       _f("s0", 1, "backward", "nan"),
                                       _f("s0", 2, "backward", "slow"),
                                       _f("s1", 2, "backward", "drop")]),
    Plan("frozen-servers", 3, [_f("s0", 0, "forward", "stop"), _f("s1", 1, "between", "stop"),
                               _f("s0", 2, "backward", "stop")]),
    Plan("replica-dies-between-forward-and-backward", 2, [_f("s1", 0, "between", "kill")]),
    Plan("killed-in-forward-and-in-backward", 3, [_f("s0", 0, "forward", "kill"),
                                                  _f("s1", 1, "backward", "kill")]),
    Plan("drains", 2, [_f("s1", 0, "drain", "none"), _f("s0", 0, "drain", "raise")]),
    Plan("faults-during-drains", 2, [_f("s0", 0, "drain", "kill"), _f("s1", 0, "drain", "drop")]),
]


def random_plans(seed: int, n: int, steps: int = 3) -> List[Plan]:
    """``n`` random plans: each step, each server gets a fault with
    probability 0.4 (no fault on a server after it was killed or drained)."""
    rng = random.Random(seed)
    plans = []
    for k in range(n):
        faults: List[Fault] = []
        gone: Set[str] = set()
        for step in range(steps):
            for server in SERVERS:
                if server in gone or rng.random() > 0.4:
                    continue
                phase = rng.choice(PHASES)
                kind = rng.choice(KINDS_OF[phase])
                faults.append(Fault(server, step, phase, kind))
                if kind == "kill" or phase == "drain":
                    gone.add(server)
        plans.append(Plan(f"random-{seed}-{k}", steps, faults))
    return plans


# -- the experts, and the faults that servers inject -------------------------------------
_armed: Dict[str, Tuple[str, Set[str]]] = {}  # phase -> (kind, experts yet to hit)
_armed_lock = threading.Lock()
_me = ""


def _take(phase: str, name: str) -> Optional[str]:
    with _armed_lock:
        entry = _armed.get(phase)
        if entry is None or name not in entry[1]:
            return None
        entry[1].discard(name)
        return entry[0]


def _hit(kind: Optional[str]) -> Optional[str]:
    """Sleeps for ``slow``/``hold``; returns the kind the caller must apply."""
    if kind == "slow":
        time.sleep(SLOW_S)
    elif kind == "hold":
        time.sleep(HOLD_S)
    elif kind == "raise":
        raise RuntimeError("injected fault")
    return kind


class _BackwardFault(torch.autograd.Function):
    """Identity; its backward applies the backward-phase fault of its expert."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, name: str) -> Tensor:  # type: ignore[override]
        ctx.name = name
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        if _hit(_take("backward", ctx.name)) == "nan":
            return grad * math.nan, None
        return grad, None


class Expert(nn.Module):
    """``tanh(Linear(x))``, its weights drawn from its name (the same on every
    server and in the trainer's replay); applies the faults armed here."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.lin = nn.Linear(WIDTH, WIDTH)
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) * 0.4)
            self.lin.bias.copy_(torch.randn(WIDTH, generator=g) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        kind = _hit(_take("forward", self.name))
        out = _BackwardFault.apply(torch.tanh(self.lin(x)), self.name)
        return out * math.nan if kind == "nan" else out


def arm(table: Dict[str, str]) -> str:
    """An operation of a server (``"arm"``): arms ``{phase: kind}`` for every
    expert served here (each expert hits it once); clears what was armed
    before."""
    with _armed_lock:
        _armed.clear()
        for phase, kind in table.items():
            _armed[phase] = (kind, set(HOSTED[_me]))
    return _me


def server_report() -> Dict[str, Any]:
    """An operation of a server (``"server_report"``): held states, kept
    batches, threads (pool workers apart)."""
    from moe_autograd.remote import batch_server
    from moe_autograd.remote.server import _experts

    live = sum(int(h.server.stats()["live"]) for h in list(_experts.values()))
    return {"pid": os.getpid(), "live": live, "kept": batch_server.kept_batches(),
            "threads": _thread_kinds()}


OPERATIONS: Dict[str, Callable[..., Any]] = {"arm": arm, "server_report": server_report}


def register_operations() -> None:
    """Lets the trainer call :data:`OPERATIONS` on this server process
    (``call_operation``): code of this module, registered where it runs."""
    from moe_autograd.remote import register_operation

    for name, fn in OPERATIONS.items():
        register_operation(name, fn)


def _thread_kinds() -> List[str]:
    """This process's threads by kind, the pool's workers apart, and Ray's:
    the threads of a Ray actor's own pool show as ``Dummy-N`` once they ran
    Python code, a number that grows with the calls served concurrently."""
    names = [t.name for t in threading.enumerate()
             if not t.name.startswith(("moe_autograd-worker-", "Dummy-"))]
    return sorted(name.rstrip("0123456789").rstrip("-_") for name in names)


def _warm_blas() -> None:
    """One float32 matmul on this thread before the server's workers run any.

    Without it, the first calls of a fresh server process (run at once on
    two or more pool workers) came out different in the last bits from the
    same calls later, in 3 of 10 runs of ``test_fixed_plans_hold_every_contract[rpc]``
    (the same input, weights and thread count; the replay then differs); with
    it, in 0 of 10. A lazy initialisation in the BLAS library raced by
    concurrent first calls is the suspect, not diagnosed further."""
    torch.tanh(torch.nn.functional.linear(torch.randn(16, WIDTH), torch.randn(WIDTH, WIDTH)))


def server_main(port: int, name: str) -> None:
    """A server process: join the world, serve ``HOSTED[name]`` until told to
    drain (SIGUSR1: a clean leave) or terminated (SIGTERM: exit at once)."""
    global _me
    from moe_autograd.remote import ElasticServer, ExpertServer
    from moe_autograd.remote.loopback import backend_options

    _me = name
    torch.set_num_threads(1)
    _warm_blas()
    register_operations()
    server = ExpertServer({e: Expert(e) for e in HOSTED[name]}, backward=SERVERS[name],
                          state_ttl=10.0)
    elastic = ElasticServer(server, name, options=backend_options(port, rpc_timeout=10.0),
                            linger=LINGER_S, drain_timeout=DRAIN_TIMEOUT_S)
    signal.signal(signal.SIGUSR1, lambda *_: elastic.stop("drain"))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    elastic.join()
    reason = elastic.serve()
    os._exit(3 if reason == "evicted" else 0)


def ray_experts(name: str) -> Dict[str, nn.Module]:
    """The experts factory of the server actor ``name`` in a Ray world (its
    ``RayExpertServer`` applies ``SERVERS[name]`` as its backward)."""
    global _me
    _me = name
    torch.set_num_threads(1)
    _warm_blas()
    register_operations()
    return {e: Expert(e) for e in HOSTED[name]}


# -- the client's transport: drops replies ---------------------------------------------
class _Dropped:
    """A reply that never comes: ``result`` waits out the timeout."""

    def __init__(self, timeout: Optional[float]) -> None:
        self.timeout = timeout

    def done(self) -> bool:
        return False

    def result(self, timeout: Optional[float]) -> Any:
        from moe_autograd.remote.transport import TransportTimeout

        wait = timeout if timeout is not None else (self.timeout or 10.0)
        end = time.monotonic() + wait
        while time.monotonic() < end:
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        raise TransportTimeout("the reply was lost (fault injection)")

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        pass  # never called: the deadline watcher ends the calls


class FaultyTransport:
    """The default transport; the replies of ``(server, phase)`` in ``drop``
    are lost (the request reaches the server, which runs it). A message's
    phase is read from its frame's label: ``"forward"``/``"backward"`` for a
    single call, ``"batch:forward"``, ``"collect:backward"``, ... for a
    coalesced one and its collects; other messages (releases, control,
    ``info``, operations) are never dropped."""

    name = "faulty"

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.drop: Set[Tuple[str, str]] = set()
        self.dropped = 0

    @staticmethod
    def _phase(frame: Any) -> Optional[str]:
        op, _, phase = str(getattr(frame, "label", "")).partition(":")
        if op in ("forward", "backward") and not phase:
            return op
        if op in ("batch", "collect") and phase in ("forward", "backward"):
            return phase
        return None

    def call(self, worker: str, frame: Any, timeout: Optional[float]) -> Any:
        phase = self._phase(frame)
        pending = self.inner.call(worker, frame, timeout)
        if phase is not None and (worker, phase) in self.drop:
            self.dropped += 1
            return _Dropped(timeout)
        return pending

    def local_name(self) -> str:
        return str(self.inner.local_name())

    def default_timeout(self) -> Optional[float]:
        return self.inner.default_timeout()  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:  # the rest of the engine's transport
        return getattr(self.inner, name)


# -- the model, and its local replay -----------------------------------------------------
def _gate(seed: int, experts: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(WIDTH, experts)


def _layers(remote: Sequence[nn.Module], fleet: Sequence[nn.Module], seed: int,
            timeouts: bool) -> Tuple[Any, Any]:
    from moe_autograd.moe import MixtureOfExperts

    deadlines: Dict[str, Any] = dict(forward_timeout=DEADLINE_S, backward_timeout=DEADLINE_S) \
        if timeouts else {}
    # k=3 of 4 experts on 2 servers: every token has an expert on each server,
    # so one failing server never leaves a token below quorum; two do.
    first = MixtureOfExperts(remote, WIDTH, k=3, k_min=1, backward_k_min=1,
                             detect_anomalies=True, gate=_gate(2 * seed, len(remote)), **deadlines)
    second = MixtureOfExperts(fleet, WIDTH, k=2, k_min=1, allow_zero_outputs=True,
                              backward_k_min=0, detect_anomalies=True,
                              gate=_gate(2 * seed + 1, len(fleet)),
                              **deadlines)
    return first, second


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        raise RuntimeError("replayed constant")


class _Replay(nn.Module):
    """A local expert that fails where the real call was masked (forward) or
    a constant (backward)."""

    def __init__(self, module: nn.Module, masked: bool, constant: bool) -> None:
        super().__init__()
        self.module, self.masked, self.constant = module, masked, constant

    def forward(self, x: Tensor) -> Tensor:
        if self.masked:
            raise RuntimeError("replayed mask")
        out = self.module(x)
        return _FailBackward.apply(out) if self.constant else out


def _loss(first: Any, second: Any, x: Tensor) -> Tensor:
    """The step's loss: two stacked MoE layers, residual, with their aux losses."""
    y1, aux1 = first(x)
    h = x + y1
    y2, aux2 = second(h)
    return (h + y2).square().mean() + 0.01 * (aux1 + aux2)


def _run(first: Any, second: Any, x: Tensor) -> Dict[str, Any]:
    """One training step; what it raised (and where), or its loss and gradients."""
    from moe_autograd.moe import NotEnoughExperts

    outcome: Dict[str, Any] = {"raised": None}
    try:
        loss = _loss(first, second, x)
    except NotEnoughExperts as error:
        outcome["raised"] = ("forward", type(error).__name__, str(error)[:300])
        return outcome
    outcome["loss"] = loss.detach().clone()
    try:
        loss.backward()
    except NotEnoughExperts as error:
        outcome["raised"] = ("backward", type(error).__name__, str(error)[:300])
        return outcome
    outcome["grads"] = [x.grad, first.gate.weight.grad, first.gate.bias.grad,
                        second.gate.weight.grad, second.gate.bias.grad]
    return outcome


def _masks(stats: List[Dict[str, Any]]) -> Tuple[List[int], List[bool], List[bool]]:
    calls = [int(s["calls"]) for s in stats]
    masked = [int(s["timeouts"]) + int(s["failures"]) > 0 for s in stats]
    constant = [int(s["backward_failures"]) + int(s["backward_timeouts"]) > 0 for s in stats]
    return calls, masked, constant


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(a.shape == b.shape and torch.equal(a, b))


# -- the trainer -------------------------------------------------------------------------
class _World:
    """The trainer's elastic world: the fleet, the servers' processes, the
    faulty transport."""

    def __init__(self, port: int) -> None:
        from moe_autograd.remote import Fleet
        from moe_autograd.remote.loopback import backend_options
        from moe_autograd.remote.transport import get_transport

        self.port = port
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed.rpc", "moe_autograd.remote",
                                    "moe_autograd.moe", "faults"])
        self.ctx = ctx
        self.transport = FaultyTransport(get_transport())
        self.fleet = Fleet.start("trainer", options=backend_options(port, rpc_timeout=10.0),
                                 dead_after=DEAD_AFTER_S, transport=self.transport)
        self.processes: Dict[str, Any] = {}
        self.down: Set[str] = set()
        for name in SERVERS:
            self._start(name)
        self._wait_served(list(SERVERS))

    def _start(self, name: str) -> None:
        process = self.ctx.Process(target=server_main, args=(self.port, name), daemon=True,
                                   name=f"fault-server-{name}")
        process.start()
        self.processes[name] = process

    def _wait_served(self, names: Sequence[str], timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.fleet.refresh()
            servers = self.fleet.servers()
            if all(n in servers for n in names):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"servers {names} not serving after {timeout:g} s: {servers}")
            time.sleep(0.05)

    def signal(self, name: str, sig: int) -> None:
        process = self.processes[name]
        if process.pid is not None and process.is_alive():
            os.kill(process.pid, sig)
            if sig == signal.SIGKILL:
                self.down.add(name)

    def alive(self, name: str) -> bool:
        return bool(self.processes[name].is_alive())

    def drain(self, name: str) -> None:
        """Starts a clean leave of ``name`` (it serves what it holds, then exits)."""
        self.signal(name, signal.SIGUSR1)

    def wait_left(self, name: str, timeout: float) -> None:
        self.processes[name].join(timeout)

    def rpc(self, name: str, operation: str, *args: Any) -> Any:
        """The registered operation ``operation`` (:data:`OPERATIONS`) on ``name``."""
        from moe_autograd.remote import call_operation

        return call_operation(name, operation, *args, timeout=5.0, transport=self.transport.inner)

    def restore(self) -> None:
        """Every server back up: a killed, drained or evicted one is replaced
        by a new process of the same name (once the old one is gone from
        the world)."""
        from moe_autograd.remote import membership

        replace = [n for n, p in self.processes.items()
                   if n in self.down or not p.is_alive() or n not in self.fleet.servers()]
        for name in replace:
            process = self.processes[name]
            if process.is_alive():
                os.kill(process.pid, signal.SIGCONT)
                os.kill(process.pid, signal.SIGKILL)
            process.join(10.0)
        deadline = time.monotonic() + 30.0
        while replace and any(n in membership.members(self.fleet.registry.raw) for n in replace):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{replace} were not reaped within 30 s")
            time.sleep(0.05)
        for name in replace:
            self._start(name)
        if replace:
            self._wait_served(replace)
            time.sleep(0.1)
        self.down.clear()


class _RayWorld:
    """The same world on Ray: a local Ray instance started by the trainer,
    the servers as named actors (``RayExpertServer``: ``s0`` stateless,
    ``s1`` stateful), a :class:`~moe_autograd.remote.RayFleet` over them, the
    faulty transport around a ``RayTransport``. A signal goes to the actor's
    process; a drain is ``RayExpertServer.leave()`` on a thread of its own."""

    NAMESPACE = "moe_autograd_faults"

    def __init__(self) -> None:
        import atexit

        from moe_autograd.remote import RayFleet, RayTransport
        from wiring import init_local_ray, shutdown_local_ray

        # Registered before ray.init, so that it runs after Ray's own exit hook
        # (ray.shutdown): the trainer exits without shutting anything down.
        atexit.register(shutdown_local_ray)
        # a new instance of its own (never a cluster found through RAY_ADDRESS),
        # with token authentication on, its token and files in a private directory
        init_local_ray(python_path=(os.path.dirname(os.path.abspath(__file__)),),
                       num_cpus=2, namespace=self.NAMESPACE)
        self.transport = FaultyTransport(RayTransport(self.NAMESPACE, timeout=10.0))
        self.servers: Dict[str, Any] = {}
        self.down: Set[str] = set()
        self.leaving: Dict[str, threading.Thread] = {}
        self._start(list(SERVERS))
        self.fleet = RayFleet(self.NAMESPACE, poll=0.1, info_timeout=DEAD_AFTER_S,
                              transport=self.transport)
        self._wait_served(list(SERVERS))

    def _start(self, names: Sequence[str], timeout: float = 30.0) -> None:
        import functools

        from moe_autograd.remote import RayExpertServer

        deadline = time.monotonic() + timeout
        for name in names:  # all start at once...
            while True:
                try:  # a dead actor's name is freed a moment after its death
                    self.servers[name] = RayExpertServer(
                        name, functools.partial(ray_experts, name), namespace=self.NAMESPACE,
                        backward=SERVERS[name], state_ttl=10.0, ready_timeout=RAY_START_S,
                        wait=False)
                    break
                except ValueError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        for name in names:  # ...then each is waited for
            self.servers[name].wait_ready()

    def _wait_served(self, names: Sequence[str], timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.fleet.refresh()
            servers = self.fleet.servers()
            if all(n in servers for n in names):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"servers {names} not serving after {timeout:g} s: {servers}")
            time.sleep(0.05)

    def alive(self, name: str) -> bool:
        if name in self.leaving and not self.leaving[name].is_alive():
            return False  # left: its actor was ended
        try:
            os.kill(self.servers[name].pid, 0)
        except ProcessLookupError:
            return False
        return True

    def signal(self, name: str, sig: int) -> None:
        if self.alive(name):
            os.kill(self.servers[name].pid, sig)
            if sig == signal.SIGKILL:
                self.down.add(name)

    def drain(self, name: str) -> None:
        thread = threading.Thread(target=self.servers[name].leave, name="fault-drain",
                                  kwargs=dict(drain_timeout=DRAIN_TIMEOUT_S, linger=LINGER_S),
                                  daemon=True)
        thread.start()
        self.leaving[name] = thread

    def wait_left(self, name: str, timeout: float) -> None:
        self.leaving[name].join(timeout)

    def rpc(self, name: str, operation: str, *args: Any) -> Any:
        """The registered operation ``operation`` (:data:`OPERATIONS`) on ``name``."""
        from moe_autograd.remote import call_operation

        return call_operation(name, operation, *args, timeout=5.0, transport=self.transport.inner)

    def restore(self) -> None:
        """Every server back up: a killed or drained actor is ended and a new
        one of the same name started."""
        replace = [n for n in SERVERS
                   if n in self.down or not self.alive(n) or n not in self.fleet.servers()]
        for name in replace:
            if self.alive(name):
                os.kill(self.servers[name].pid, signal.SIGCONT)
            self.servers[name].kill()
            thread = self.leaving.pop(name, None)
            if thread is not None:
                thread.join(15.0)
        deadline = time.monotonic() + 30.0
        while any(n in self.fleet.servers() for n in replace):  # the fleet saw them go
            if time.monotonic() > deadline:
                raise TimeoutError(f"{replace} still in the fleet 30 s after their end")
            time.sleep(0.05)
        self._start(replace)
        for name in replace:
            self.transport.forget(name)  # its calls look the new actor up
        if replace:
            self._wait_served(replace)
            time.sleep(0.1)
        self.down.clear()


class _Trainer:
    """Runs plans on a :class:`_World`, collecting problems."""

    def __init__(self, world: _World) -> None:
        self.world = world
        self.problems: List[str] = []
        self.client_threads: Optional[List[str]] = None
        self.server_threads: Dict[int, List[str]] = {}
        self.local = {n: Expert(n) for n in
                      [e for _, e in REMOTE_EXPERTS] + list(FLEET_EXPERTS)}

    def problem(self, where: str, text: str) -> None:
        self.problems.append(f"{where}: {text}")

    # -- one step ------------------------------------------------------------------
    def _models(self, seed: int) -> Tuple[Any, Any, List[Any]]:
        from moe_autograd.remote import RemoteExpert

        t = self.world.transport
        remote = [RemoteExpert(w, e, forward_timeout=None if w == "s0" else 2.0, transport=t)
                  for w, e in REMOTE_EXPERTS]
        fleet = [self.world.fleet.expert(e, forward_timeout=1.0, attempt_timeout=0.4,
                                         backward_timeout=1.0) for e in FLEET_EXPERTS]
        first, second = _layers(remote, fleet, seed, timeouts=True)
        return first, second, fleet

    def _arm(self, faults: List[Fault]) -> None:
        tables: Dict[str, Dict[str, str]] = {n: {} for n in SERVERS}
        drop: Set[Tuple[str, str]] = set()
        for f in faults:
            phase = "backward" if f.phase == "drain" else f.phase
            if f.kind in ("kill", "stop") and f.phase in ("forward", "backward"):
                tables[f.server][phase] = "hold"  # the signal lands while it holds the calls
            elif f.kind == "drop":
                drop.add((f.server, phase))
            elif f.kind in ("slow", "raise", "nan"):
                tables[f.server][phase] = f.kind
        for name, table in tables.items():
            if name not in self.world.down:
                self.world.rpc(name, "arm", table)
        self.world.transport.drop = drop

    def _signals(self, faults: List[Fault], phase: str, now: bool) -> List[threading.Timer]:
        """Sends the signals of ``phase``'s faults, at once or 30 ms later."""
        timers = []
        for f in faults:
            if f.phase != phase or f.kind not in ("kill", "stop") or f.server in self.world.down:
                continue
            sig = signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP
            if now:
                self.world.signal(f.server, sig)
            else:
                timer = threading.Timer(SIGNAL_AFTER_S, self.world.signal, (f.server, sig))
                timer.start()
                timers.append(timer)
        return timers

    def step(self, plan: Plan, step: int, seed: int) -> Dict[str, Any]:
        from moe_autograd.moe import NotEnoughExperts

        where = f"plan {plan.name!r} step {step}"
        faults = plan.at(step)
        world = self.world
        for name in SERVERS:
            if not world.alive(name):  # e.g. reaped while stopped, then woken: it left
                world.down.add(name)
        down_before = set(world.down)
        dropped = world.transport.dropped
        replicas = {e: world.fleet.replicas(e) for e in FLEET_EXPERTS}
        self._arm(faults)
        first, second, fleet = self._models(seed)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(TOKENS, WIDTH, generator=g).requires_grad_()
        outcome: Dict[str, Any] = {"raised": None}
        stopped = [f.server for f in faults if f.kind == "stop"]
        timers = self._signals(faults, "forward", now=False)
        served_by: Dict[str, Optional[str]] = {}
        try:
            try:
                loss = _loss(first, second, x)
            except NotEnoughExperts as error:
                outcome["raised"] = ("forward", type(error).__name__, str(error)[:300])
            for timer in timers:
                timer.join()
            served_by = {e.name: e.last_worker for e in fleet}
            if outcome["raised"] is None:
                outcome["loss"] = loss.detach().clone()
                self._signals(faults, "between", now=True)
                for f in faults:
                    if f.phase == "drain":
                        world.drain(f.server)
                if any(f.phase == "drain" and f.kind in ("kill", "stop") for f in faults):
                    time.sleep(0.05)  # the drain has begun: now the fault
                    self._signals([Fault(f.server, f.step, "between", f.kind) for f in faults
                                   if f.phase == "drain" and f.kind in ("kill", "stop")],
                                  "between", now=True)
                timers = self._signals(faults, "backward", now=False)
                try:
                    loss.backward()
                    outcome["grads"] = [x.grad, first.gate.weight.grad, first.gate.bias.grad,
                                        second.gate.weight.grad, second.gate.bias.grad]
                except NotEnoughExperts as error:
                    outcome["raised"] = ("backward", type(error).__name__, str(error)[:300])
                for timer in timers:
                    timer.join()
        except Exception as error:  # noqa: BLE001 - a step must raise nothing else
            self.problem(where, f"raised {type(error).__name__}: {error}\n"
                                f"{traceback.format_exc()[-1500:]}")
            outcome["raised"] = ("?", type(error).__name__, str(error)[:300])
        finally:
            for name in stopped:
                world.signal(name, signal.SIGCONT)
            world.transport.drop = set()
        drained = [f.server for f in faults
                   if f.phase == "drain" and outcome.get("loss") is not None]
        for name in drained:  # it leaves once idle: wait, so that the next step finds it gone
            world.wait_left(name, 15.0)
            world.down.add(name)
        stats = [first.stats(), second.stats()]
        self._check_stats(where, faults, down_before, replicas, served_by, stats, outcome)
        self._check_replay(where, seed, x, stats, outcome)
        return {"step": step, "faults": [asdict(f) for f in faults],
                "raised": outcome["raised"], "stats": [_masks(s) for s in stats],
                "served_by": served_by, "dropped": world.transport.dropped - dropped}

    # -- the checks ------------------------------------------------------------------
    def _check_stats(self, where: str, faults: List[Fault], down: Set[str],
                     replicas: Dict[str, List[str]], served_by: Dict[str, Optional[str]],
                     stats: List[List[Dict[str, Any]]], outcome: Dict[str, Any]) -> None:
        fwd_faulted = {f.server for f in faults if f.phase == "forward"}
        bwd_faulted = {f.server for f in faults if f.phase != "forward"
                       and not (f.phase == "drain" and f.kind == "none")}
        signalled = {f.server for f in faults if f.kind in ("kill", "stop")}
        backward_ran = outcome["raised"] is None or outcome["raised"][0] == "backward"
        layers = [[(w, e) for w, e in REMOTE_EXPERTS],
                  [(None, e) for e in FLEET_EXPERTS]]
        for layer, (experts, layer_stats) in enumerate(zip(layers, stats)):
            for (worker, name), s in zip(experts, layer_stats):
                calls, masked = int(s["calls"]), int(s["timeouts"]) + int(s["failures"])
                constant = int(s["backward_failures"]) + int(s["backward_timeouts"])
                what = f"{where} layer {layer} expert {name!r}"
                if calls > 1 or masked > calls or constant > int(s["backward_calls"]):
                    self.problem(what, f"inconsistent stats {s}")
                    continue
                if not calls:
                    continue
                if backward_ran and int(s["backward_calls"]) != calls - masked:
                    self.problem(what, f"{calls - masked} answered calls but "
                                       f"{s['backward_calls']} backward calls: {s}")
                hosts = {worker} if worker is not None else \
                    {w for w, names in HOSTED.items() if name in names}
                if worker is None and len(hosts) > 1:
                    # replicated: certain only about its forward replica's backward
                    server = served_by.get(name)
                    if not masked and backward_ran and server is not None \
                            and server in bwd_faulted and not constant:
                        self.problem(what, f"its replica {server} had a backward-phase fault, "
                                           f"yet its backward survived: {s}")
                    continue
                host = next(iter(hosts))
                if worker is None and host not in down and not replicas.get(name):
                    continue  # suspected after an earlier fault: it may be back mid-step
                must_mask = host in down or host in fwd_faulted
                if must_mask and not masked:
                    self.problem(what, f"on {host} (down or faulted in forward) yet answered: {s}")
                if not must_mask and masked and host not in signalled:
                    self.problem(what, f"masked on a healthy server {host}: {s}")
                if masked or not backward_ran:
                    continue
                if host in bwd_faulted and not constant:
                    self.problem(what, f"on {host} (faulted after forward) yet its backward "
                                       f"survived: {s}")
                if host not in bwd_faulted and host not in signalled and constant:
                    self.problem(what, f"constant on a healthy server {host}: {s}")

    def _check_replay(self, where: str, seed: int, x: Tensor,
                      stats: List[List[Dict[str, Any]]], outcome: Dict[str, Any]) -> None:
        (calls1, masked1, const1), (calls2, masked2, const2) = _masks(stats[0]), _masks(stats[1])
        remote = [_Replay(self.local[e], m, c) for (_, e), m, c
                  in zip(REMOTE_EXPERTS, masked1, const1)]
        fleet = [_Replay(self.local[e], m, c) for e, m, c in zip(FLEET_EXPERTS, masked2, const2)]
        first, second = _layers(remote, fleet, seed, timeouts=False)
        xr = x.detach().clone().requires_grad_()
        replay = _run(first, second, xr)
        replay_calls = [_masks(first.stats())[0], _masks(second.stats())[0]]
        if [calls1, calls2] != replay_calls:
            self.problem(where, f"calls {[calls1, calls2]} but the replay routes {replay_calls}")
        real_raised = None if outcome["raised"] is None else outcome["raised"][:2]
        replay_raised = None if replay["raised"] is None else replay["raised"][:2]
        if real_raised != replay_raised:
            self.problem(where, f"the step raised {outcome['raised']}, the replay "
                                f"{replay['raised']}")
            return
        if real_raised is not None:
            return
        if not _same(outcome.get("loss"), replay.get("loss")):
            self.problem(where, f"loss {outcome.get('loss')} != replay {replay.get('loss')}")
        names = ["x", "gate1.weight", "gate1.bias", "gate2.weight", "gate2.bias"]
        for name, a, b in zip(names, outcome.get("grads", []), replay.get("grads", [])):
            if not _same(a, b):
                diff = None if a is None or b is None else float((a - b).abs().max())
                self.problem(where, f"gradient of {name} differs from the replay (max {diff})")

    # -- one plan ---------------------------------------------------------------------
    def plan(self, plan: Plan, seed: int) -> Dict[str, Any]:
        from moe_autograd.remote import flush_releases
        from moe_autograd.remote.rpc_engine import in_flight

        start = time.monotonic()
        steps = [self.step(plan, step, seed * 100 + step) for step in range(plan.steps)]
        where = f"plan {plan.name!r}"
        # Nothing held: releases sent, stragglers' messages ended, states freed.
        deadline = time.monotonic() + 6.0
        reports: Dict[str, Any] = {}
        while True:
            gc.collect()  # records in reference cycles (errors' tracebacks) release at a GC
            flush_releases()
            reports = {}
            for name in SERVERS:
                if name in self.world.down or not self.world.alive(name):
                    continue
                try:
                    reports[name] = self.world.rpc(name, "server_report")
                except Exception as error:  # noqa: BLE001
                    reports[name] = {"error": repr(error)}
            held = {n: r for n, r in reports.items() if r.get("live") or r.get("kept")
                    or "error" in r}
            if not held and not in_flight():
                break
            if time.monotonic() > deadline:
                self.problem(where, f"left behind: server states/batches {held}, client "
                                    f"requests in flight {in_flight()}")
                break
            time.sleep(0.1)
        threads = _thread_kinds()
        if self.client_threads is None:
            self.client_threads = threads
        elif threads != self.client_threads:
            self.problem(where, f"client threads {threads} != {self.client_threads} before")
        for name, report in reports.items():
            if "threads" not in report:
                continue
            before = self.server_threads.setdefault(report["pid"], report["threads"])
            if report["threads"] != before:
                self.problem(where, f"server {name} threads {report['threads']} != {before}")
        restoring = time.monotonic()
        self.world.restore()
        return {"name": plan.name, "faults": [asdict(f) for f in plan.faults], "steps": steps,
                "seconds": time.monotonic() - start, "restore_s": time.monotonic() - restoring}

    def exit_with_stragglers(self) -> None:
        """The last act: forwards masked on every server (slow), coalesced
        ones and the fleet's on the pool's workers, still running when the
        script exits with its own status."""
        from moe_autograd.moe import NotEnoughExperts

        self._arm([Fault(name, 0, "forward", "slow") for name in SERVERS])
        first, second, _ = self._models(7)
        x = torch.randn(TOKENS, WIDTH)
        try:
            first(x)
        except NotEnoughExperts:
            pass  # every call masked: below quorum, as the contract says
        second(x)


def trainer_main(argv: List[str]) -> int:
    """``plans.json report.json [rpc|ray]``: runs the plans, writes the report, then
    exits with :data:`EXIT_STATUS` while masked stragglers still run."""
    from moe_autograd.remote.loopback import free_port

    plans_path, report_path = argv[0], argv[1]
    engine = argv[2] if len(argv) > 2 else "rpc"
    spec = json.loads(open(plans_path).read())
    torch.set_num_threads(1)
    started = time.monotonic()
    world: Any = _RayWorld() if engine == "ray" else _World(free_port())
    trainer = _Trainer(world)
    report: Dict[str, Any] = {"seed": spec["seed"], "plans": [], "problems": trainer.problems,
                              "startup_s": time.monotonic() - started}
    try:
        for k, data in enumerate(spec["plans"]):
            report["plans"].append(trainer.plan(Plan.from_json(data), spec["seed"] + k))
        trainer.exit_with_stragglers()
    except Exception:  # noqa: BLE001 - reported, then the exit as planned
        trainer.problems.append(f"the harness failed: {traceback.format_exc()}")
    report["seconds"] = time.monotonic() - started
    with open(report_path, "w") as out:
        json.dump(report, out, default=str)
    print(f"fault plans done in {report['seconds']:.1f} s; exiting with {EXIT_STATUS}",
          flush=True)
    return EXIT_STATUS
