"""Experts and process targets for the remote tests (imported by the server
and client processes that the tests spawn; not a test module)."""
import os
import threading
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_autograd.remote import (ExpertServer, JobSecret, RemoteExpert, job_secret,
                                 register_operation, start_rpc)
from wiring import Counting, ask  # noqa: F401 - Counting: the tests use rx.Counting

WIDTH = 8
_barrier = threading.Barrier(4, timeout=10.0)


def reset_barrier(parties: int) -> None:
    """RPC helper: a fresh barrier for the overlap test."""
    global _barrier
    _barrier = threading.Barrier(parties, timeout=10.0)


class _SleepFn(torch.autograd.Function):
    """Sleeps (and meets the other calls at a barrier) in forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float, meet: bool) -> Tensor:  # type: ignore[override]
        ctx.seconds, ctx.meet = seconds, meet
        if meet:
            _barrier.wait()
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:  # type: ignore[override]
        if ctx.meet:
            _barrier.wait()
        time.sleep(ctx.seconds)
        return grad, None, None


class Sleepy(nn.Module):
    def __init__(self, seconds: float, meet: bool = False, fwd: bool = True, bwd: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.seconds, self.meet, self.fwd, self.bwd = seconds, meet, fwd, bwd

    def forward(self, x: Tensor) -> Tensor:
        if self.fwd and not self.bwd:
            time.sleep(self.seconds)
            return self.lin(x)
        return self.lin(_SleepFn.apply(x, self.seconds, self.meet))


class SlowBackward(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        return _BwdSleep.apply(self.lin(x), self.seconds)


class _BwdSleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class TwoInTwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        h = torch.tanh(self.lin(x))
        return h + y, h * y


class DropScale(nn.Module):
    """y = dropout(x) * w: grad_x = g * w * mask / (1 - p), so with g = 1 the
    gradient equals y / x exactly when forward and recomputation agree."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, 0.5, self.training) * self.w


class Failing(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise ValueError("boom from the expert")


#: The expert name of the replica-choice tests, and the sleep of its slow replica.
BALANCED = "bal"
SLOW_REPLICA_S = 0.05


class Balanced(nn.Module):
    """``tanh(Linear(x))`` with the same weights on every replica (and in the
    test's local reference); sleeps ``seconds`` in forward and again in
    backward: the deterministic server-side delay of a slow replica."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.seconds = seconds
        g = torch.Generator().manual_seed(32)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) * 0.4)
            self.lin.bias.copy_(torch.randn(WIDTH, generator=g) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.lin(x))
        return _SleepFn.apply(y, self.seconds, False) if self.seconds else y


def balanced_experts() -> Dict[str, nn.Module]:
    """A fast replica of :data:`BALANCED` (an experts factory)."""
    return {BALANCED: Balanced()}


def balanced_experts_slow() -> Dict[str, nn.Module]:
    """The slow replica: :data:`SLOW_REPLICA_S` in forward and in backward."""
    return {BALANCED: Balanced(SLOW_REPLICA_S)}


def balanced_calls(expert: nn.Module, calls: int, seed: int = 0) -> Dict[str, Any]:
    """``calls`` forward + backward calls of ``expert`` (a FleetExpert of
    :data:`BALANCED`), one after another, each checked against the local
    reference: the replica of each (``served``) and how many differed."""
    local = Balanced()
    g = torch.Generator().manual_seed(seed)
    served: List[Any] = []
    mismatches = 0
    for _ in range(calls):
        x = torch.randn(3, WIDTH, generator=g).requires_grad_()
        lx = x.detach().clone().requires_grad_()
        out = expert(x)
        out.square().sum().backward()
        ref = local(lx)
        ref.square().sum().backward()
        served.append(getattr(expert, "last_worker", None))
        if not (torch.equal(out.detach(), ref.detach()) and x.grad is not None
                and lx.grad is not None and torch.equal(x.grad, lx.grad)):
            mismatches += 1
    return {"served": served, "mismatches": mismatches}


def mlp_drop() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, WIDTH))


def _family(prefix: str) -> Dict[str, nn.Module]:
    return {f"{prefix}lin": nn.Linear(WIDTH, WIDTH), f"{prefix}two": TwoInTwoOut(),
            f"{prefix}mlp_drop": mlp_drop(), f"{prefix}drop_scale": DropScale(),
            f"{prefix}sleepy": Sleepy(0.3, meet=True)}


def setup_servers() -> List[ExpertServer]:
    """What each server process of the shared world serves."""
    register_test_operations()
    torch.manual_seed(1234 + os.getpid() % 7)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    stateless = dict(_family(""), slow=Sleepy(2.0, fwd=True, bwd=False),
                     slow_bwd=SlowBackward(2.0), failing=Failing(),
                     ms2=Sleepy(0.002, fwd=True, bwd=False),  # test_remote_stragglers.py
                     bal=Balanced())  # BALANCED: test_ray_fleet.py's fast replicas
    return [
        ExpertServer(stateless),
        ExpertServer(_family("sf_"), backward="stateful", state_ttl=30.0),
        ExpertServer({"cap_lin": nn.Linear(WIDTH, WIDTH)}, backward="stateful",
                     state_ttl=1.0, max_states=8),
        ExpertServer({"opt_lin": nn.Linear(WIDTH, WIDTH)}, optimizer=sgd, auto_step=False),
        ExpertServer({"auto_lin": nn.Linear(WIDTH, WIDTH)}, backward="stateful", optimizer=sgd),
        # the integrity tests (test_remote_integrity.py)
        ExpertServer({"quota_lin": nn.Linear(WIDTH, WIDTH)}, backward="stateful",
                     state_ttl=30.0, max_states=8),
        ExpertServer({"small_lin": nn.Linear(WIDTH, WIDTH)}, backward="stateful",
                     state_ttl=30.0, max_request_bytes=1 << 20, max_state_bytes=4 << 20),
        ExpertServer({"skip_lin": nn.Linear(WIDTH, WIDTH)}, optimizer=sgd),
        ExpertServer({"raise_lin": nn.Linear(WIDTH, WIDTH)}, backward="stateful", optimizer=sgd,
                     non_finite_grads="raise"),
        # the coalescing tests (test_remote_batching.py)
        ExpertServer({"gate": Gate()}),
        ExpertServer({"bt_sf_slow": Sleepy(1.0, fwd=True, bwd=False),
                      "bt_sf_lin": nn.Linear(WIDTH, WIDTH)}, backward="stateful", state_ttl=30.0),
        # batching across calls (test_gather.py): two jobs, XB_TRAINERS x XB_ROWS rows a batch
        ExpertServer({"xb_mlp": xb_mlp(), "xb_int": xb_int()}, batch_across_calls=True,
                     batch_window=XB_WINDOW_S, max_batch_rows=XB_TRAINERS * XB_ROWS,
                     secret=[job_secret(), second_job(job_secret())]),
        # a job that encrypts its messages (test_wire_crypto.py)
        ExpertServer({"enc_lin": enc_lin()}, secret=encrypted_job(job_secret())),
    ]


def encrypted_job(secret: JobSecret) -> JobSecret:
    """A job that encrypts (AES-256-GCM), its key derived from the test job's."""
    import hashlib

    return JobSecret(hashlib.sha256(b"the encrypted test job" + secret.hex().encode()).digest(),
                     encrypt=True)


def enc_lin() -> nn.Module:
    """A Linear with weights of a fixed seed (the same on every side)."""
    module = nn.Linear(WIDTH, WIDTH)
    generator = torch.Generator().manual_seed(47)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return module


# -- batching across calls (test_gather.py) ---------------------------------------------
XB_TRAINERS, XB_ROWS = 4, 2
XB_WINDOW_S = 30.0  # a batch closes when all XB_TRAINERS x XB_ROWS rows are there (no timing)


def second_job(secret: JobSecret) -> JobSecret:
    """Another job's secret, derived from the test job's (both ends derive it)."""
    import hashlib

    return JobSecret(hashlib.sha256(b"the second test job" + secret.hex().encode()).digest())


def xb_mlp() -> nn.Module:
    """A row-wise float64 MLP (random weights: rounding may differ when batched)."""
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, WIDTH)).double()


def xb_int() -> nn.Module:
    """A row-wise float64 Linear-ReLU-Linear with small integer weights: on
    integer inputs every sum is exact, so batched results are bit-equal."""
    module = nn.Sequential(nn.Linear(WIDTH, 16), nn.ReLU(), nn.Linear(16, WIDTH)).double()
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randint(-3, 4, p.shape, generator=generator, dtype=torch.float64))
    return module


# -- the coalescing tests: a gate that holds calls on the server ------------------------
_gate = threading.Event()
_gate_lock = threading.Lock()
_gate_waiting = 0


class Gate(nn.Module):
    """Waits (up to 20 s) until :func:`open_gate`; counts the calls waiting."""

    def forward(self, x: Tensor) -> Tensor:
        global _gate_waiting
        with _gate_lock:
            _gate_waiting += 1
        try:
            _gate.wait(20.0)
        finally:
            with _gate_lock:
                _gate_waiting -= 1
        return x * 2


def close_gate() -> None:
    _gate.clear()


def open_gate() -> None:
    _gate.set()


def gate_waiting() -> int:
    return _gate_waiting


def pool_busy() -> int:
    """Calls running on this process's worker pool now."""
    from moe_autograd.executor import get_pool

    return len(get_pool()._running)


def set_linger(seconds: float) -> float:
    """Sets how long a coalesced request's ready answers wait for their
    siblings (LINGER_MIN_S) in this process; returns the old value."""
    from moe_autograd.remote import batch_server

    old, batch_server.LINGER_MIN_S = batch_server.LINGER_MIN_S, seconds
    return old


def kept_batches() -> int:
    from moe_autograd.remote import batch_server

    return batch_server.kept_batches()


# -- another client: these run on a server process, which then calls a peer ----
def release_as_me(worker: str, call_ids: List[str]) -> Any:
    """What a release of ``call_ids`` sent by this process (another session of
    the job) gets from ``worker``."""
    return ask(worker, {"op": "release", "calls": call_ids})


def backward_as_me(worker: str, name: str, call_id: str, grads: List[Tensor]) -> Any:
    """What a stateful backward of ``call_id`` sent by this process gets."""
    return ask(worker, {"op": "backward", "expert": name, "call": call_id, "seed": 0,
                        "flags": [True], "args": None, "grads": grads})


def flood(worker: str, name: str, n: int) -> Dict[str, Any]:
    """Makes ``n`` stateful calls of ``name`` from this worker, all pending at
    once, then drops them; returns the server's stats while they were held."""
    expert = RemoteExpert(worker, name, forward_timeout=10.0)
    outs = [expert(torch.randn(2, WIDTH)) for _ in range(n)]
    stats = expert.remote_stats()
    del outs
    return stats


# -- the fault world (test_remote_faults.py) ----------------------------------------
def fault_servers() -> List[ExpertServer]:
    # The interrupted calls take 3 s, under 10 s deadlines: only the Ctrl-C can
    # end them in time, however late a loaded machine delivers it (with 1 s
    # calls under the 1 s rpc_timeout, a late signal met a timeout instead).
    return [ExpertServer({"lin": nn.Linear(WIDTH, WIDTH), "slow": Sleepy(3.0, fwd=True, bwd=False),
                          "slow_bwd": SlowBackward(3.0)}),
            ExpertServer({"sf_slow": Sleepy(3.0, fwd=True, bwd=False)}, backward="stateful")]


def fault_client(port: int, server_pid: int, queue: Any) -> None:
    """Client (rank 0 of 2, rpc_timeout=1 s) of the fault world: Ctrl-C while
    waiting on remote calls, then calls without a deadline to a stopped
    server. Puts a report ``{case: (outcome, message, seconds)}`` on ``queue``."""
    import signal

    from torch.distributed import rpc

    from moe_autograd import parallel_apply
    from moe_autograd.remote import flush_releases
    from moe_autograd.remote.loopback import backend_options

    report: Dict[str, Any] = {}
    report["diag"] = (str(signal.getsignal(signal.SIGINT)),
                      sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, []))),
                      {k: v for k, v in os.environ.items() if "RAY" in k or "MOE" in k})
    # The script a user runs in a terminal turns Ctrl-C into KeyboardInterrupt.
    # A process started with SIGINT ignored (a background job of a
    # non-interactive shell: `make test &`) inherits SIG_IGN, which Python
    # then keeps: the diagnostics showed handler 1 (SIG_IGN) in the failing
    # full runs. The client is that user's script: restore the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    start_rpc("client", 0, 2, backend_options(port, rpc_timeout=1.0))

    def interrupt(key: str, fn: Any) -> None:
        # SIGINT to this process 0.2 s in; time from the signal to the exception
        sent: List[float] = []

        main = threading.main_thread().ident
        assert main is not None

        def fire() -> None:
            sent.append(time.monotonic())
            # To the main thread, as the kernel hands a terminal's Ctrl-C to it
            # first (os.kill(getpid()) let any thread take it: a full make test
            # saw the call run to its end, no KeyboardInterrupt, 3 runs in 4).
            signal.pthread_kill(main, signal.SIGINT)
        timer = threading.Timer(0.2, fire)
        timer.start()
        try:
            fn()
            report[key] = ("returned", "", 0.0)
        except KeyboardInterrupt:
            report[key] = ("KeyboardInterrupt", "", time.monotonic() - sent[0])
        except Exception as error:  # noqa: BLE001
            report[key] = (type(error).__name__, str(error), 0.0)
        timer.join()

    def attempt(key: str, fn: Any) -> None:
        start = time.monotonic()
        try:
            fn()
            report[key] = ("ok", "", time.monotonic() - start)
        except Exception as error:  # noqa: BLE001
            report[key] = (type(error).__name__, str(error), time.monotonic() - start)

    x = torch.randn(2, WIDTH, requires_grad=True)
    try:
        attempt("warm", lambda: RemoteExpert("fault-srv", "lin")(x).sum().backward())
        long = {"forward_timeout": 10.0, "backward_timeout": 10.0}
        sf_slow = RemoteExpert("fault-srv", "sf_slow", **long)
        stored = sf_slow.remote_stats()["stored"]
        interrupt("forward", lambda: RemoteExpert("fault-srv", "slow", **long)(x))
        interrupt("stateful_forward", lambda: sf_slow(x))
        out = RemoteExpert("fault-srv", "slow_bwd", **long)(x)
        interrupt("backward", lambda: out.sum().backward())
        slow2 = [RemoteExpert("fault-srv", "slow", **long) for _ in range(2)]
        interrupt("parallel_apply", lambda: parallel_apply(slow2, [x, x]))
        time.sleep(3.0)  # the interrupted calls finish on the server; their replies are dropped
        flush_releases()
        time.sleep(0.3)
        stats = sf_slow.remote_stats()
        report["sf_stats"] = (stats["live"], stats["stored"] - stored)
        attempt("after_interrupts", lambda: RemoteExpert("fault-srv", "lin")(x).sum().backward())
        os.kill(server_pid, signal.SIGSTOP)
        _wait_stopped(server_pid)
        try:
            attempt("stopped_none", lambda: RemoteExpert("fault-srv", "lin")(x))
            attempt("stopped_inf", lambda: RemoteExpert("fault-srv", "lin",
                                                        forward_timeout=float("inf"))(x))
        finally:
            os.kill(server_pid, signal.SIGCONT)
        attempt("resumed", lambda: RemoteExpert("fault-srv", "lin", forward_timeout=5.0)(x))
    finally:
        queue.put(report)
        rpc.shutdown(graceful=True)


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Waits until ``pid`` is stopped (state T): SIGSTOP takes effect only
    when the process leaves an uninterruptible wait, which a loaded machine
    can make last (once, a call made right after the kill was answered)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        time.sleep(0.005)


def cli_experts() -> Dict[str, nn.Module]:
    """The factory the CLI servers of the failure world load."""
    return {"lin": nn.Linear(4, 4), "slow": Sleepy(5.0, fwd=True, bwd=False)}


def failure_client(port: int, kill_pid: int, term_pid: int, queue: Any) -> None:
    """Client process of the failure world (rank 0 of 3, with two CLI servers
    'srv-k' and 'srv-t'): reports what each failure looked like."""
    import signal

    from torch.distributed import rpc

    from moe_autograd.remote.loopback import backend_options

    report: Dict[str, Any] = {}

    def attempt(key: str, fn: Any) -> None:
        start = time.monotonic()
        try:
            fn()
            report[key] = ("ok", "", time.monotonic() - start)
        except Exception as error:  # noqa: BLE001
            report[key] = (type(error).__name__, str(error), time.monotonic() - start)

    start_rpc("client", 0, 3, backend_options(port))
    try:
        x = torch.randn(2, 4, requires_grad=True)
        attempt("before", lambda: RemoteExpert("srv-k", "lin")(x).sum().backward())
        threading.Timer(0.5, os.kill, (kill_pid, signal.SIGKILL)).start()
        slow = RemoteExpert("srv-k", "slow", forward_timeout=10.0)  # sleeps 5 s
        attempt("killed_mid_call", lambda: slow(torch.randn(2, WIDTH)))
        attempt("dead", lambda: RemoteExpert("srv-k", "lin", forward_timeout=3.0)(x))
        attempt("term_before", lambda: RemoteExpert("srv-t", "lin")(x))
        os.kill(term_pid, signal.SIGTERM)
        time.sleep(1.0)
        attempt("term_after", lambda: RemoteExpert("srv-t", "lin", forward_timeout=3.0)(x))
    finally:
        queue.put(report)
        rpc.shutdown(graceful=False)


# -- masked stragglers at exit (test_remote_stragglers.py) ------------------------------
def straggler_servers() -> List[ExpertServer]:
    return [ExpertServer({"lin": nn.Linear(WIDTH, WIDTH), "slow": Sleepy(3.0, fwd=True, bwd=False),
                          "slow_bwd": SlowBackward(3.0)})]


def cpu_seconds() -> float:
    """RPC helper: this process's CPU seconds (user + system, all threads)."""
    times = os.times()
    return times.user + times.system


# -- a killed server, on either backend (test_conformance.py) ----------------------------
def kill_experts() -> Dict[str, nn.Module]:
    """What the doomed server of the kill case serves ("lin" on the live one too)."""
    register_test_operations()
    return {"lin": nn.Linear(WIDTH, WIDTH), "k_slow": Sleepy(5.0, fwd=True, bwd=False)}


def killed_server_steps(transport: Any, live: str, doomed: str, kill: Any,
                        deadline: float = 3.0) -> Dict[str, Any]:
    """Two ``MixtureOfExperts`` steps over experts on ``live`` and ``doomed``:
    ``kill()`` kills ``doomed`` 0.5 s into the first (its ``k_slow`` call is
    running then, its ``lin`` answered), the second runs with it dead. Reports
    per step: (seconds, forward failures + timeouts per expert, output finite,
    input gradient finite)."""
    from moe_autograd.moe import MixtureOfExperts

    experts = [RemoteExpert(live, "lin", transport=transport),
               RemoteExpert(doomed, "lin", transport=transport),
               RemoteExpert(doomed, "k_slow", transport=transport)]
    moe = MixtureOfExperts(experts, WIDTH, k=3, k_min=1, backward_k_min=1,
                           forward_timeout=deadline, backward_timeout=deadline)
    report: Dict[str, Any] = {}
    for step in ("killed_mid_step", "dead"):
        x = torch.randn(8, WIDTH, requires_grad=True)
        timer = threading.Timer(0.5, kill) if step == "killed_mid_step" else None
        start = time.monotonic()
        if timer is not None:
            timer.start()
        y, aux = moe(x)
        (y.sum() + aux).backward()
        elapsed = time.monotonic() - start
        if timer is not None:
            timer.join()
        masked = [int(s["failures"]) + int(s["timeouts"]) for s in moe.stats()]
        report[step] = (elapsed, masked, bool(torch.isfinite(y).all()),
                        x.grad is not None and bool(torch.isfinite(x.grad).all()))
    return report


def kill_world_client(port: int, doomed_pid: int, queue: Any) -> None:
    """Client (rank 0 of 3) of the RPC kill world: :func:`killed_server_steps`
    with servers 'srv-l' (live) and 'srv-k' (killed with SIGKILL)."""
    import signal

    from torch.distributed import rpc

    from moe_autograd.remote.loopback import backend_options
    from moe_autograd.remote import RpcTransport

    start_rpc("client", 0, 3, backend_options(port))
    report: Dict[str, Any] = {}
    try:
        report = killed_server_steps(RpcTransport(), "srv-l", "srv-k",
                                     lambda: os.kill(doomed_pid, signal.SIGKILL))
    except Exception as error:  # noqa: BLE001 - reported to the test
        report = {"error": f"{type(error).__name__}: {error}"}
    finally:
        queue.put(report)
        rpc.shutdown(graceful=False)


def fleet_experts() -> Dict[str, nn.Module]:
    """The replicas of the Ray fleet test: the same parameters on every server."""
    torch.manual_seed(0)
    return {"f_lin": nn.Linear(WIDTH, WIDTH)}


def register_test_operations() -> None:
    """The operations the tests call on a server (``call_operation``): code
    of this module, registered in the server's process."""
    for fn in (reset_barrier, close_gate, open_gate, gate_waiting, pool_busy, set_linger,
               kept_batches, release_as_me, backward_as_me, flood, cpu_seconds, time.sleep):
        register_operation(fn.__name__, fn)  # time.sleep is "sleep"
