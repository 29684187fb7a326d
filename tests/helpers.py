"""Helpers shared by the runtime tests: user threads, freeing, small Functions."""
import gc
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd import Function


def run_threads(target: Callable[[int], None], count: int, timeout: float = 50.0) -> None:
    """Runs ``target(i)`` on ``count`` threads at once. Fails if a thread is
    still running after ``timeout`` seconds (a deadlock) and re-raises the
    first error a thread raised (assertions included)."""
    errors: List[BaseException] = []

    def run(i: int) -> None:
        try:
            target(i)
        except BaseException as error:  # noqa: B902 - re-raised on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,), name=f"user-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"{alive} still running after {timeout}s: deadlocked?"
    if errors:
        raise errors[0]


def wait_dead(refs: Sequence["weakref.ref[Any]"], timeout: float = 5.0) -> List[bool]:
    """Collects garbage until every ref is dead (a worker may still be dropping
    its last reference to a finished group); returns which are still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [r() is not None for r in refs]
        if any(alive):  # a full collection is slow: only when refcounting did not do
            gc.collect()
            alive = [r() is not None for r in refs]
        if not any(alive) or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


class Square(Function):
    """x * x, with its backward written by hand."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * g


class BackwardBarrier(Function):
    """Identity whose backward waits at ``barrier``: proves backwards overlap."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, barrier: threading.Barrier) -> Tensor:  # type: ignore[override]
        ctx.barrier = barrier
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        ctx.barrier.wait()
        return g, None


class RaisesInBackward(Function):
    """Identity whose backward raises ``ValueError(message)``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, message: str) -> Tensor:  # type: ignore[override]
        ctx.message = message
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        raise ValueError(ctx.message)


# -- small float64 experts and a plain (no moe_autograd) MoE, for the tests of
# -- parameters as node inputs, checkpoint frames, torch.compile and DDP --------

import torch  # noqa: E402
from torch import nn  # noqa: E402


def params_of(modules: Sequence[Any]) -> List[Tensor]:
    """The parameters of the modules among ``modules``, each once, in order."""
    seen: set = set()
    out: List[Tensor] = []
    for m in modules:
        if isinstance(m, nn.Module):
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


class MLP(nn.Module):
    """``fc2(tanh(fc1(x)))`` in float64, initialised from ``seed``."""

    def __init__(self, d_in: int = 4, hidden: int = 8, d_out: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden, dtype=torch.float64)
        self.fc2 = nn.Linear(hidden, d_out, dtype=torch.float64)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=g) * 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def plain_moe(gate: nn.Module, experts: Sequence[nn.Module], k: int, x: Tensor
              ) -> "tuple[Tensor, Tensor]":
    """What ``MixtureOfExperts(experts, ..., k=k)`` computes when every expert
    answers, as a plain loop over the experts: ``y, aux_loss``."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    logits = gate(flat)
    top_logits, top_experts = logits.topk(k, dim=-1)
    weights = torch.softmax(top_logits, dim=-1)
    y = None
    for e, expert in enumerate(experts):
        token, slot = (top_experts == e).nonzero(as_tuple=True)
        if len(token) == 0:
            continue
        out = expert(flat.index_select(0, token))
        out = out * weights[token, slot].to(out.dtype).unsqueeze(-1)
        if y is None:
            y = out.new_zeros((flat.shape[0], *out.shape[1:]))
        y = y.index_add(0, token, out)
    assert y is not None
    num_experts = len(experts)
    probs = torch.softmax(logits, dim=-1).mean(dim=0)
    counts = torch.bincount(top_experts.reshape(-1), minlength=num_experts)
    aux = num_experts * (counts.to(probs.dtype) / top_experts.numel() * probs).sum()
    return y.reshape(*lead, *y.shape[1:]), aux


def bits_equal(a: Any, b: Any) -> bool:
    """Whether two tensors (or two Nones) are equal bit for bit, dtype and shape."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8),
        b.detach().contiguous().reshape(-1).view(torch.uint8))


# -- a collector without RPC (moe_autograd.collect): calls it starts together and
# -- completes from a thread of its own (tests/test_collect.py, tests/test_parallel.py)

from moe_autograd.collect import Complete  # noqa: E402
from moe_autograd.module_call import ModuleCall  # noqa: E402


class Collector:
    """A collector (moe_autograd.collect) without RPC: completes the calls it
    is given from a thread of its own: y = x * scale, dx = g * scale."""

    def __init__(self) -> None:
        self.starts: List[str] = []
        self.deadlines: List[Optional[float]] = []
        self.fail_start = False

    def _later(self, fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, daemon=True).start()

    def start_calls(self, calls: Sequence[Any], complete: Complete,
                    deadline: Optional[float] = None) -> None:
        self.starts.append("forward")
        self.deadlines.append(deadline)
        if self.fail_start:
            raise RuntimeError("the collector broke")

        def run() -> None:
            for k, call in enumerate(calls):
                try:
                    call.finish_forward()
                except Exception as error:  # noqa: BLE001
                    complete(k, None, error)
                    continue
                complete(k, call, None)
        self._later(run)

    def start_applies(self, func: Any, args: Any, complete: Complete) -> None:
        raise NotImplementedError

    def start_backwards(self, calls: Sequence[Any], grads: Sequence[Any], complete: Complete,
                        deadline: Optional[float] = None) -> None:
        self.starts.append("backward")

        def run() -> None:
            for k, (call, g) in enumerate(zip(calls, grads)):
                complete(k, [g[0] * call.module.scale], None)
        self._later(run)


COLLECTOR = Collector()


class CollectedCall(ModuleCall):
    collector: Any = COLLECTOR

    def finish_forward(self) -> None:
        x = self._leaves[0]
        if not torch.isfinite(x).all():
            raise ValueError(f"{self.name}: non-finite input")
        out = (x * self.module.scale).detach()
        self.outputs = [out]
        self._out_leaves, self._out_spec = [out], torch.utils._pytree.tree_flatten(out)[1]
        if self.validate is not None:
            self.validate(self)

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and bool(self.inputs)

    def prepare(self) -> None:
        pass  # no parameters here


class Scaled(nn.Module):
    moe_call_type = CollectedCall

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:  # where it runs here (checkpointed)
        return x * self.scale


def parallel_node(output: torch.Tensor) -> Any:
    """The ``_ParallelNode`` backward node under ``output`` (its ``plan``
    is the node's state)."""
    stack, seen = [output.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "ParallelNode" in type(fn).__name__:
            return fn
        stack.extend(f for f, _ in fn.next_functions)
    raise AssertionError("no parallel node under the output")


def script_result(script: Any, *args: str, timeout: float = 280.0) -> Any:
    """Runs ``script`` (a test scenario of its own processes, e.g.
    tests/remote/peer_recovery.py) with the repository and its folder on
    ``PYTHONPATH``; returns the JSON of its last line (asserts it exited 0,
    with its stderr's end as the message)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(script)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(script.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script), *args], env=env, cwd=str(root),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
