"""Experts and process targets for the remote tests (imported by the server
and client processes that the tests spawn; not a test module)."""
import os
import threading
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_autograd.remote import ExpertServer, RemoteExpert

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


def mlp_drop() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, WIDTH))


def _family(prefix: str) -> Dict[str, nn.Module]:
    return {f"{prefix}lin": nn.Linear(WIDTH, WIDTH), f"{prefix}two": TwoInTwoOut(),
            f"{prefix}mlp_drop": mlp_drop(), f"{prefix}drop_scale": DropScale(),
            f"{prefix}sleepy": Sleepy(0.3, meet=True)}


def setup_servers() -> List[ExpertServer]:
    """What each server process of the shared world serves."""
    torch.manual_seed(1234 + os.getpid() % 7)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    stateless = dict(_family(""), slow=Sleepy(2.0, fwd=True, bwd=False),
                     slow_bwd=SlowBackward(2.0), failing=Failing())
    return [
        ExpertServer(stateless),
        ExpertServer(_family("sf_"), backward="stateful", state_ttl=30.0),
        ExpertServer({"cap_lin": nn.Linear(WIDTH, WIDTH)}, backward="stateful",
                     state_ttl=1.0, max_states=8),
        ExpertServer({"opt_lin": nn.Linear(WIDTH, WIDTH)}, optimizer=sgd, auto_step=False),
        ExpertServer({"auto_lin": nn.Linear(WIDTH, WIDTH)}, backward="stateful", optimizer=sgd),
    ]


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

    rpc.init_rpc("client", rank=0, world_size=3, rpc_backend_options=backend_options(port))
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
