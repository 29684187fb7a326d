"""``parallel_apply(..., checkpoint=...)`` and ``recompute_early``.

A checkpointed call keeps only its inputs in forward, recomputes on a worker
in backward with its own RNG stream (same dropout mask, whatever other threads
draw meanwhile), and its results and gradients equal a plain run and a plain
sequential loop. ``recompute_early`` starts the recomputation as soon as
backward reaches the trigger tensor.
"""
import copy
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn

from moe_autograd import (is_checkpointing, is_recomputing, parallel_apply, policy,
                          recompute_early)
from helpers import parallel_node, wait_dead

D = 8


class Expert(nn.Module):
    """Linear -> tanh -> Linear -> sin: every step saves an activation."""

    def __init__(self, d: int = D, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d, dtype=dtype)
        self.fc2 = nn.Linear(4 * d, d, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(self.fc2(torch.tanh(self.fc1(x))))


class Recording(nn.Module):
    """Records, on every run, the mode flags and weakrefs to its activations."""

    def __init__(self, d: int = D, hook: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.hook = hook
        self.lock = threading.Lock()
        self.runs: List[Dict[str, Any]] = []

    def forward(self, x: Tensor) -> Tensor:
        a = torch.tanh(self.fc1(x))  # saved by tanh's and fc2's backward
        with self.lock:
            self.runs.append({
                "checkpointing": is_checkpointing(), "recomputing": is_recomputing(),
                "grad": torch.is_grad_enabled(), "thread": threading.current_thread().name,
                "activation": weakref.ref(a),
            })
        if self.hook is not None:
            self.hook()
        return torch.sin(self.fc2(a))


def _grads(params: Sequence[Tensor]) -> List[Optional[Tensor]]:
    return [None if p.grad is None else p.grad.clone() for p in params]


def _zero(params: Sequence[Tensor]) -> None:
    for p in params:
        p.grad = None


# -- memory: a checkpointed forward keeps only its inputs -----------------------
@pytest.mark.timeout(60)
def test_checkpointed_forward_saves_no_activations() -> None:
    torch.manual_seed(0)
    n, rows = 4, 64
    experts = [Recording() for _ in range(n)]
    xs = [torch.randn(rows, D, requires_grad=True) for _ in range(n)]
    input_bytes = sum(x.numel() * x.element_size() for x in xs)
    activation_bytes = rows * 4 * D * 4  # one [rows, 4D] float32 activation

    def run(checkpoint: bool) -> Tuple[int, List[Tensor]]:
        saved = [0]
        lock = threading.Lock()

        def pack(t: Tensor) -> Tensor:
            with lock:  # packs run on the workers
                saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs = parallel_apply(experts, xs, checkpoint=checkpoint)
        return saved[0], outs

    plain_bytes, plain_outs = run(False)
    # The caller's hooks reach the workers: the plain forward's saves are seen.
    assert plain_bytes >= n * activation_bytes
    plain_refs = [e.runs[-1]["activation"] for e in experts]
    assert not any(r() is None for r in plain_refs), "plain call must keep its activations"
    ckpt_bytes, ckpt_outs = run(True)
    assert ckpt_bytes <= input_bytes, f"checkpointed forward saved {ckpt_bytes} bytes"
    ckpt_refs = [e.runs[-1]["activation"] for e in experts]
    assert wait_dead(ckpt_refs) == [False] * n, "checkpointed forward kept an activation"

    for a, b in zip(plain_outs, ckpt_outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    del plain_outs, ckpt_outs


@pytest.mark.timeout(60)
def test_checkpointed_closure_over_a_weight_gets_its_gradient() -> None:
    """A checkpointed call that closes over a leaf weight (not a parameter of a
    module): its forward's graph reaches it, so it is an input of the node,
    and its gradient and hooks are the loop's."""
    torch.manual_seed(0)
    w = torch.randn(D, D, requires_grad=True)
    unused = torch.randn(D, requires_grad=True)
    fired: List[Tensor] = []
    w.register_hook(fired.append)
    unused.register_hook(fired.append)

    def expert(x: Tensor) -> Tensor:
        return torch.tanh(x @ w)
    xs = [torch.randn(3, D, requires_grad=True) for _ in range(3)]
    outs = parallel_apply([expert] * 3, xs, checkpoint=True)
    sum(o.square().sum() for o in outs).backward()
    got = (w.grad, [x.grad for x in xs])
    assert len(fired) == 1 and unused.grad is None  # once, with the sum
    w.grad = None
    rxs = [x.detach().requires_grad_() for x in xs]
    sum(expert(x).square().sum() for x in rxs).backward()
    torch.testing.assert_close(got[0], w.grad, rtol=0, atol=0)
    for a, b in zip(got[1], [x.grad for x in rxs]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_mode_flags_inside_the_expert() -> None:
    torch.manual_seed(0)
    experts = [Recording() for _ in range(3)]
    xs = [torch.randn(5, D, requires_grad=True) for _ in range(3)]

    outs = parallel_apply(experts, xs, checkpoint=[True, False, True])
    for i, e in enumerate(experts):
        assert len(e.runs) == 1
        run = e.runs[0]
        assert run["recomputing"] is False
        assert run["checkpointing"] is (i != 1)
        assert run["grad"] is True  # as in the loop (a checkpointed forward saves nothing)
    assert not is_checkpointing() and not is_recomputing()  # the caller's flags untouched

    sum(o.sum() for o in outs).backward()
    assert [len(e.runs) for e in experts] == [2, 1, 2]
    for i in (0, 2):
        rerun = experts[i].runs[1]
        assert rerun["recomputing"] is True
        assert rerun["checkpointing"] is False
        assert rerun["grad"] is True
    assert not is_checkpointing() and not is_recomputing()


# -- equivalence ----------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", [False, True, [True, False, True, False, True]],
                         ids=["plain", "checkpoint", "mixed"])
def test_matches_sequential_loop(checkpoint: Any) -> None:
    torch.manual_seed(0)
    n = 5
    experts = [Expert(dtype=torch.float64) for _ in range(n)]
    params = [p for e in experts for p in e.parameters()]
    base = torch.randn(n, 6, D, dtype=torch.float64, requires_grad=True)
    g = torch.randn(n, 6, D, dtype=torch.float64)

    def loss_of(outs: Sequence[Tensor]) -> Tensor:
        return (torch.stack(list(outs)) * g).sum()

    ref_outs = [e(base[i] * (i + 1)) for i, e in enumerate(experts)]
    loss_of(ref_outs).backward()
    ref_grads = _grads(params) + [base.grad.clone()]
    _zero(params + [base])

    outs = parallel_apply(experts, [base[i] * (i + 1) for i in range(n)], checkpoint=checkpoint)
    assert len(outs) == n
    for a, b in zip(outs, ref_outs):
        assert a.requires_grad
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    loss_of(outs).backward()
    for a, b in zip(_grads(params) + [base.grad], ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class TupleKwargsExpert(nn.Module):
    """Two positional tensors and keyword arguments; returns a mixed tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, x: Tensor, y: Tensor, *, scale: float, bias: Tensor) -> Tuple[Tensor, int, Tensor]:
        h = torch.tanh(self.fc(x) * y) * scale + bias
        return h, 7, (h * y).sum(dim=-1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", [False, True, [True, False, True]],
                         ids=["plain", "checkpoint", "mixed"])
def test_tuple_and_kwargs_inputs(checkpoint: Any) -> None:
    torch.manual_seed(0)
    n = 3
    experts = [TupleKwargsExpert() for _ in range(n)]
    params = [p for e in experts for p in e.parameters()]
    xs = [torch.randn(4, D, dtype=torch.float64, requires_grad=True) for _ in range(n)]
    ys = [torch.randn(4, D, dtype=torch.float64, requires_grad=True) for _ in range(n)]
    bias = torch.randn(D, dtype=torch.float64, requires_grad=True)
    kwargs = [{"scale": 0.5 * (i + 1), "bias": bias} for i in range(n)]
    leaves = params + xs + ys + [bias]

    def loss_of(results: Sequence[Tuple[Tensor, int, Tensor]]) -> Tensor:
        total = 0
        for i, (h, k, s) in enumerate(results):
            assert k == 7
            total = total + (h * (i + 1)).sum() + (s ** 2).sum()
        return total

    ref = [e(xs[i], ys[i], **kwargs[i]) for i, e in enumerate(experts)]
    loss_of(ref).backward()
    ref_grads = _grads(leaves)
    _zero(leaves)

    results = parallel_apply(experts, [(xs[i], ys[i]) for i in range(n)], kwargs,
                             checkpoint=checkpoint)
    for (h, k, s), (rh, _, rs) in zip(results, ref):
        torch.testing.assert_close(h, rh, rtol=0, atol=0)
        torch.testing.assert_close(s, rs, rtol=0, atol=0)
    loss_of(results).backward()
    for a, b in zip(_grads(leaves), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
def test_shared_module_used_by_several_calls() -> None:
    torch.manual_seed(0)
    n = 6
    expert = Expert(dtype=torch.float64)
    params = list(expert.parameters())
    xs = [torch.randn(3, D, dtype=torch.float64, requires_grad=True) for _ in range(n)]

    ref = [expert(x) * (i + 1) for i, x in enumerate(xs)]
    sum(r.sum() for r in ref).backward()
    ref_grads = _grads(params + xs)
    _zero(params + xs)

    outs = parallel_apply([expert] * n, xs, checkpoint=True)
    for o, r, i in zip(outs, ref, range(n)):
        torch.testing.assert_close(o * (i + 1), r, rtol=0, atol=0)
    sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    for a, b in zip(_grads(params + xs), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
def test_params_only_call_gets_param_grads() -> None:
    """No input requires grad: the checkpointed call must still recompute and
    give its parameters gradients."""
    torch.manual_seed(0)
    experts = [Expert(dtype=torch.float64) for _ in range(3)]
    params = [p for e in experts for p in e.parameters()]
    xs = [torch.randn(4, D, dtype=torch.float64) for _ in range(3)]
    sum(e(x).sum() for e, x in zip(experts, xs)).backward()
    ref = _grads(params)
    _zero(params)
    outs = parallel_apply(experts, xs, checkpoint=True)
    assert all(o.requires_grad for o in outs)
    sum(o.sum() for o in outs).backward()
    for a, b in zip(_grads(params), ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_retain_graph_double_backward(checkpoint: bool) -> None:
    torch.manual_seed(0)
    experts = [Expert(dtype=torch.float64) for _ in range(3)]
    params = [p for e in experts for p in e.parameters()]
    xs = [torch.randn(4, D, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    sum(e(x).sum() for e, x in zip(experts, xs)).backward()
    once = _grads(params + xs)
    _zero(params + xs)

    outs = parallel_apply(experts, xs, checkpoint=checkpoint)
    loss = sum(o.sum() for o in outs)
    loss.backward(retain_graph=True)
    for a, b in zip(_grads(params + xs), once):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    loss.backward(retain_graph=True)
    for a, b in zip(_grads(params + xs), once):
        torch.testing.assert_close(a, 2 * b, rtol=1e-12, atol=1e-12)
    loss.backward()  # the last one frees the graphs
    for a, b in zip(_grads(params + xs), once):
        torch.testing.assert_close(a, 3 * b, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError):
        loss.backward()


@pytest.mark.timeout(90)
def test_gradcheck_through_checkpointed_parallel_apply() -> None:
    torch.manual_seed(0)
    experts = [nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double() for _ in range(3)]

    def f(x0: Tensor, x1: Tensor, x2: Tensor) -> Tuple[Tensor, ...]:
        return tuple(parallel_apply(experts, [x0, x1, x2], checkpoint=[True, True, False]))

    xs = tuple(torch.randn(2, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(f, xs, eps=1e-6, atol=1e-6)


@pytest.mark.timeout(60)
def test_reproducible_under_manual_seed() -> None:
    experts = [nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5)) for _ in range(4)]

    def run(seed: int) -> List[Tensor]:
        torch.manual_seed(seed)
        x = torch.randn(16, D, requires_grad=True)
        outs = parallel_apply(experts, [x] * 4, checkpoint=True)
        sum(o.sum() for o in outs).backward()
        return [o.detach() for o in outs] + [x.grad]

    a, b, c = run(1), run(1), run(2)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not all(torch.equal(u, v) for u, v in zip(a, c))
    # Each call draws its own mask.
    masks = [o != 0 for o in a[:4]]
    assert not torch.equal(masks[0], masks[1])


# -- randomness under concurrency -------------------------------------------------
class DropoutScale(nn.Module):
    """``dropout(x) * w``, meeting the other calls at a barrier in forward and
    in recomputation (which proves the calls overlap in both)."""

    def __init__(self, forward_barrier: threading.Barrier, recompute_barrier: threading.Barrier) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.5)
        self.w = nn.Parameter(torch.rand(D) + 0.5)
        self.forward_barrier, self.recompute_barrier = forward_barrier, recompute_barrier

    def forward(self, x: Tensor) -> Tensor:
        (self.recompute_barrier if is_recomputing() else self.forward_barrier).wait()
        y = self.dropout(x)
        torch.rand(3)  # an extra draw in the call's own stream
        return y * self.w


def _dropout_round(experts: Sequence[DropoutScale], rows: int, errors: List[str]) -> None:
    n = len(experts)
    xs = [(torch.rand(rows, D) + 0.5).requires_grad_() for _ in range(n)]
    gs = [torch.randn(rows, D) for _ in range(n)]
    for e in experts:
        e.w.grad = None
    # Forced: the calls meet at barriers, which only a fan-out can pass (auto
    # mode would learn that these short calls run inline).
    outs = parallel_apply(experts, xs, checkpoint=True, mode="parallel")
    torch.autograd.backward(outs, gs)
    for i, (e, x, g, out) in enumerate(zip(experts, xs, gs, outs)):
        mask = (out.detach() != 0).to(x.dtype)
        if not 0 < int(mask.sum()) < mask.numel():
            errors.append(f"call {i}: degenerate dropout mask")
        expected_x = g * e.w.detach() * mask * 2.0
        expected_w = (g * x.detach() * mask * 2.0).sum(dim=0)
        if not torch.equal(x.grad, expected_x):
            errors.append(f"call {i}: input grad differs from the forward's mask")
        if not torch.allclose(e.w.grad, expected_w, rtol=1e-5, atol=1e-5):
            errors.append(f"call {i}: weight grad differs from the forward's mask")


@pytest.mark.timeout(120)
def test_dropout_recomputes_same_mask_under_concurrent_draws(fresh_pool: Any) -> None:
    fresh_pool(64)  # 2 callers x 8 calls blocked at barriers, plus helpers
    n, reps, rows = 8, 25, 32
    stop = threading.Event()
    errors: List[str] = []

    def hammer() -> None:
        while not stop.is_set():
            torch.rand(64)

    def user(k: int) -> None:
        try:
            fwd, rec = threading.Barrier(n, timeout=10), threading.Barrier(n, timeout=10)
            torch.manual_seed(100 + k)
            experts = [DropoutScale(fwd, rec) for _ in range(n)]
            for _ in range(reps):
                _dropout_round(experts, rows, errors)
        except BaseException as error:  # noqa: B902 - reported by the main thread
            errors.append(f"user {k}: {type(error).__name__}: {error}")

    hammers = [threading.Thread(target=hammer, daemon=True)]
    users = [threading.Thread(target=user, args=(k,), daemon=True) for k in range(2)]
    for t in hammers + users:
        t.start()
    try:
        for t in users:
            t.join(timeout=100)
        assert not any(t.is_alive() for t in users), "a user thread hung"
    finally:
        stop.set()
        for t in hammers:
            t.join(timeout=10)
    assert not errors, errors[:5]


# -- recompute_early ----------------------------------------------------------------
class Signalling(nn.Module):
    """Sets its event when its recomputation starts; logs what runs."""

    def __init__(self, i: int, log: List[str], lock: threading.Lock) -> None:
        super().__init__()
        self.i = i
        self.fc = nn.Linear(D, D)
        self.event = threading.Event()
        self.log, self.lock = log, lock
        self.recomputations = 0
        self.threads: List[str] = []

    def forward(self, x: Tensor) -> Tensor:
        if is_recomputing():
            with self.lock:
                self.log.append(f"recompute {self.i}")
                self.recomputations += 1
                self.threads.append(threading.current_thread().name)
            self.event.set()
        return torch.tanh(self.fc(x))


def _early_setup(n: int, checkpoint: Any = True):
    torch.manual_seed(0)
    log: List[str] = []
    lock = threading.Lock()
    experts = [Signalling(i, log, lock) for i in range(n)]
    head = nn.Linear(D, D)
    tail = nn.Linear(D, D)
    xs = [torch.randn(4, D, requires_grad=True) for _ in range(n)]
    outs = parallel_apply(experts, xs, checkpoint=checkpoint)
    return log, lock, experts, head, tail, xs, outs


@pytest.mark.timeout(60)
def test_recompute_early_starts_recomputation_at_the_trigger() -> None:
    n = 4
    log, lock, experts, head, tail, xs, outs = _early_setup(n)
    seen: List[bool] = []

    def head_backward_hook(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        # The head's backward runs after the trigger's and before the parallel
        # node's: every recomputation must have started (it runs on workers).
        with lock:
            log.append("head backward")
        seen.append(all(e.event.wait(10) for e in experts))

    head.register_full_backward_hook(head_backward_hook)

    def node_prehook(grad_outputs: Any) -> None:
        with lock:
            log.append("parallel node backward")

    parallel_node(outs[0]).register_prehook(node_prehook)
    h = head(torch.stack(outs).sum(dim=0))
    trigger = h
    h = recompute_early(h, outs)
    assert h is not trigger, "recompute_early found no checkpointed call behind the outputs"
    torch.testing.assert_close(h, trigger, rtol=0, atol=0)
    tail(torch.relu(h)).sum().backward()

    assert seen == [True]
    assert [e.recomputations for e in experts] == [1] * n  # not once more in the node
    # The caller's thread was blocked in the hook meanwhile: workers recomputed.
    assert all(t.startswith("moe_autograd-worker-") for e in experts for t in e.threads)
    # Ordered log: every recomputation started before the parallel node's backward.
    node_at = log.index("parallel node backward")
    assert log.index("head backward") < node_at
    assert all(log.index(f"recompute {i}") < node_at for i in range(n)), log
    assert all(x.grad is not None for x in xs)


@pytest.mark.timeout(60)
def test_without_recompute_early_recomputation_waits_for_the_outputs() -> None:
    """The control: without the trigger nothing has started at the head."""
    n = 3
    log, lock, experts, head, tail, xs, outs = _early_setup(n)
    started: List[bool] = []
    head.register_full_backward_hook(
        lambda m, gi, go: started.append(any(e.event.is_set() for e in experts)))
    tail(torch.relu(head(torch.stack(outs).sum(dim=0)))).sum().backward()
    assert started == [False]
    assert [e.recomputations for e in experts] == [1] * n


@pytest.mark.timeout(60)
def test_recompute_early_results_equal_without_it() -> None:
    def run(early: bool) -> List[Tensor]:
        log, lock, experts, head, tail, xs, outs = _early_setup(4, checkpoint=[True, False, True, True])
        h = head(torch.cat(outs))
        if early:
            trigger = h
            h = recompute_early(h, outs)
            assert h is not trigger
        loss = tail(torch.relu(h)).pow(2).sum()
        loss.backward()
        params = [p for m in [*experts, head, tail] for p in m.parameters()]
        # only the checkpointed calls recompute
        assert [e.recomputations for e in experts] == [1, 0, 1, 1]
        return [loss.detach()] + [x.grad for x in xs] + [p.grad for p in params]

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_in_lanes_recompute_early_recomputes_each_call_once() -> None:
    """In lanes a call recomputes in its backward, on its lane, unless
    recompute_early queued it first: then it waits for that one, never runs
    a second."""
    torch.manual_seed(0)
    log: List[str] = []
    lock = threading.Lock()
    experts = [Signalling(i, log, lock) for i in range(3)]
    xs = [torch.randn(4, D, requires_grad=True) for _ in range(3)]
    outs = parallel_apply(experts, xs, checkpoint=True, mode="lanes")
    h = recompute_early(torch.stack(outs).sum(dim=0), outs)
    h.square().sum().backward()
    assert [e.recomputations for e in experts] == [1, 1, 1]
    assert all(x.grad is not None for x in xs)


@pytest.mark.timeout(60)
def test_recompute_early_returns_trigger_when_nothing_to_recompute() -> None:
    _, _, _, head, _, _, outs = _early_setup(2, checkpoint=False)
    h = head(torch.cat(outs))
    assert recompute_early(h, outs) is h
    _, _, _, head, _, _, outs = _early_setup(2, checkpoint=True)
    with torch.no_grad():
        h = head(torch.cat(outs))
    assert recompute_early(h, outs) is h  # the trigger needs no gradient


@pytest.mark.timeout(60)
def test_recompute_early_recomputations_overlap(fresh_pool: Any) -> None:
    """All recomputations started at the trigger meet at one barrier."""
    fresh_pool(32)
    n = 6
    barrier = threading.Barrier(n, timeout=10)

    class Meeting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x: Tensor) -> Tensor:
            if is_recomputing():
                barrier.wait()
            return self.fc(x)

    torch.manual_seed(0)
    experts = [Meeting() for _ in range(n)]
    xs = [torch.randn(3, D, requires_grad=True) for _ in range(n)]
    outs = parallel_apply(experts, xs, checkpoint=True)
    h = recompute_early(torch.stack(outs).sum(dim=0), outs)
    h.sum().backward()
    for x in xs:
        assert x.grad is not None
    assert not barrier.broken


# -- leaks -------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_local_graph_freed_after_backward(checkpoint: bool) -> None:
    torch.manual_seed(0)
    n = 3
    experts = [Recording() for _ in range(n)]
    xs = [torch.randn(4, D, requires_grad=True) for _ in range(n)]
    outs = parallel_apply(experts, xs, checkpoint=checkpoint)
    sum(o.sum() for o in outs).backward()
    # Every activation the expert made (forward and recomputation) dies with
    # backward, while the caller still holds the outputs.
    refs = [run["activation"] for e in experts for run in e.runs]
    assert len(refs) == (2 * n if checkpoint else n)
    assert wait_dead(refs) == [False] * len(refs)
    assert all(o is not None for o in outs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_saved_inputs_freed_after_backward(checkpoint: bool) -> None:
    """The call's copies of its inputs go with backward, even while the caller
    holds the outputs (an input made by an earlier layer is not kept alive)."""
    torch.manual_seed(0)
    n = 3
    experts = [Expert() for _ in range(n)]
    w = torch.randn(D, requires_grad=True)
    xs = [torch.randn(4, D) * w for _ in range(n)]  # intermediates of the caller's graph
    refs = [weakref.ref(x) for x in xs]
    outs = parallel_apply(experts, xs, checkpoint=checkpoint)
    del xs
    sum(o.sum() for o in outs).backward()
    assert wait_dead(refs) == [False] * n
    assert w.grad is not None and len(outs) == n


class _RecordsRecompute(nn.Module):
    def __init__(self, threads: List[str]) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.threads = threads

    def forward(self, x: Tensor) -> Tensor:
        if is_recomputing():
            self.threads.append(threading.current_thread().name)
            time.sleep(0.01)  # time for an idle worker to take a queued recomputation
        return torch.tanh(self.fc(x))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["inline", "lanes"])
def test_a_batch_within_the_cores_recomputes_on_its_lanes(mode: str) -> None:
    """Calls that run within the cores (inline, lanes) recompute in their own
    backward, on the lane that runs it: queued on workers as soon as their
    outputs got gradients, 8 recomputations would crowd the cores (and their
    intra-op teams keep spinning after them)."""
    threads: List[str] = []
    experts = [_RecordsRecompute(threads) for _ in range(8)]
    xs = [torch.randn(4, D, requires_grad=True) for _ in experts]
    outs = parallel_apply(experts, xs, checkpoint=True, mode=mode)
    sum(o.sum() for o in outs).backward()
    lanes = 1 if mode == "inline" else policy._lanes_for(8)
    assert len(threads) == 8 and len(set(threads)) <= lanes, threads


# -- what a checkpointed call refuses to recompute, word for word, and the state
# -- its recomputation runs in -------------------------------------------------

_CHANGED = ("parallel_apply: call 0 of 1: {what} of the checkpointed call was modified in place "
            "after the call; its recomputation would see other values (as a tensor autograd "
            "saved for backward, it must not change before the backward)")


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_an_input_or_parameter_changed_before_the_recomputation_is_refused(mode: str) -> None:
    expert = Expert(dtype=torch.float64)
    x = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    h = x * 1.0
    y = parallel_apply([expert], [h], checkpoint=True, mode=mode)[0]
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError) as info:
        y.sum().backward()
    assert str(info.value) == _CHANGED.format(what="an input")

    y = parallel_apply([expert], [x], checkpoint=True, mode=mode)[0]
    with torch.no_grad():
        expert.fc1.weight.add_(1.0)  # as an optimizer step would
    with pytest.raises(RuntimeError) as info:
        y.sum().backward()
    assert str(info.value) == _CHANGED.format(
        what="a parameter (an optimizer step before the backward?)")


class _WritesData(nn.Module):
    """Writes its weight through ``.data`` in its forward (issue 46, class
    5): ``before`` clips it before use (a second clip changes nothing),
    ``after`` after use, ``halve`` halves it after use; ``count`` adds 1 to
    a parameter no output uses."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(D, D, dtype=torch.float64) * 3)
        self.seen = nn.Parameter(torch.zeros((), dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        if self.how == "before":
            self.w.data.clamp_(-1.0, 1.0)
        y = torch.tanh(x @ self.w)
        if self.how == "after":
            self.w.data.clamp_(-1.0, 1.0)
        elif self.how == "halve":
            self.w.data.mul_(0.5)
        elif self.how == "count":
            self.seen.data.add_(1.0)
        return y


def _data_case(how: str, mode: str, shared: bool) -> Tuple[List[nn.Module], List[nn.Module],
                                                           List[Tensor]]:
    torch.manual_seed(0)
    first = [_WritesData(how) for _ in range(3)]
    loop = [copy.deepcopy(first[0])] * 3 if shared else copy.deepcopy(first)
    ours = [copy.deepcopy(first[0])] * 3 if shared else copy.deepcopy(first)
    return loop, ours, [torch.randn(2, D, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("mode", ["inline", "lanes", "parallel"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("how", ["before", "count"])
def test_a_data_write_in_a_checkpointed_forward_that_replays_the_same_is_the_loops(
        how: str, mode: str, shared: bool) -> None:
    loop, ours, xs = _data_case(how, mode, shared)
    a = [x.clone().requires_grad_() for x in xs]
    b = [x.clone().requires_grad_() for x in xs]
    sum(m(x).square().sum() for m, x in zip(loop, a)).backward()
    sum(y.square().sum() for y in parallel_apply(ours, b, checkpoint=True, mode=mode)).backward()
    for m, n in zip(loop, ours):  # values (the loop's count: once per call) and gradients
        for p, q in zip(m.parameters(), n.parameters()):
            assert torch.equal(p, q) and (p.grad is None) == (q.grad is None)
            assert p.grad is None or torch.equal(p.grad, q.grad)
    assert all(torch.equal(x.grad, y.grad) for x, y in zip(a, b))


@pytest.mark.parametrize("mode", ["inline", "parallel"])
@pytest.mark.parametrize("how", ["after", "halve"])
def test_a_data_write_in_a_checkpointed_forward_that_replays_otherwise_is_refused(
        how: str, mode: str) -> None:
    loop, ours, xs = _data_case(how, mode, shared=False)
    for m in loop:
        m(xs[0])
    ys = parallel_apply(ours, [x.requires_grad_() for x in xs], checkpoint=True, mode=mode)
    with pytest.raises(RuntimeError, match=r"call \d of 3: the checkpointed expert changed its "
                       r"parameters in its forward where autograd does not see it \(through "
                       r"\.data"):
        sum(y.sum() for y in ys).backward()
    for m, n in zip(loop, ours):  # changed once, as the loop's forward did, not twice
        assert torch.equal(m.w, n.w)


def test_a_data_write_between_a_checkpointed_call_and_its_backward_is_refused() -> None:
    expert = _WritesData("none")
    y = parallel_apply([expert], [torch.randn(2, D, dtype=torch.float64, requires_grad=True)],
                       checkpoint=True)[0]
    expert.w.data.mul_(2.0)  # no version counter sees it
    with pytest.raises(RuntimeError, match=r"call 0 of 1: a parameter of the checkpointed call "
                       r"was changed after the call where autograd does not see it"):
        y.sum().backward()


_WORLD: Dict[str, Any] = {}  # state outside the module: what a recomputation cannot replay


class _Changes(nn.Module):
    """Not deterministic given its inputs and module state: what it returns
    (a view of its result, or another leaf's product) depends on flags kept
    outside the module, set between its forward and its recomputation (flags
    kept on the module are replayed as the forward saw them: issue 46)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D, dtype=torch.float64)
        _WORLD.update(other=None, view=True)

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        if _WORLD["other"] is not None:
            y = y * _WORLD["other"]
        return y.view(-1) if _WORLD["view"] else y.reshape(-1).clone()


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_a_recomputation_that_differs_from_its_forward_is_refused(mode: str) -> None:
    x = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    expert = _Changes()
    y = parallel_apply([expert], [x], checkpoint=True, mode=mode)[0]
    _WORLD["other"] = torch.ones(D, dtype=torch.float64, requires_grad=True)  # a new leaf
    with pytest.raises(RuntimeError) as info:
        y.sum().backward()
    assert str(info.value) == (
        "parallel_apply: call 0 of 1: the checkpointed call's recomputation differentiates into "
        "1 tensor(s) that its forward did not reach (neither its inputs nor leaves of its "
        "forward's graph): the expert is not deterministic given its inputs, module state and "
        "random stream, so it cannot be recomputed")

    expert = _Changes()
    y = parallel_apply([expert], [x], checkpoint=True, mode=mode)[0]
    _WORLD["view"] = False
    with pytest.raises(RuntimeError) as info:
        y.sum().backward()
    assert str(info.value) == (
        "parallel_apply: call 0 of 1: the recomputation returned a tensor that is not a view "
        "where the forward returned a view (output 0)")


@pytest.mark.parametrize("mode", ["lanes", "parallel"])
def test_a_recomputation_runs_in_its_forwards_state_not_the_backwards(mode: str) -> None:
    """Under the forward's autocast (its cache off: calls then fan out), and
    in the default state when the forward ran there, even where the backward
    runs inside an autocast: the gradients are the loop's."""
    torch.manual_seed(0)
    experts = [Expert(), Expert()]
    xs = [torch.randn(3, D, requires_grad=True) for _ in experts]

    def grads(outs: List[Tensor], under_autocast: bool) -> List[Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
            return list(torch.autograd.grad(sum(o.float().sum() for o in outs),
                                            xs + [p for e in experts for p in e.parameters()]))

    for forward_autocast, backward_autocast in [(True, False), (False, True)]:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False,
                            enabled=forward_autocast):
            want = [e(x) for e, x in zip(experts, xs)]
            got = parallel_apply(experts, xs, checkpoint=True, mode=mode)
        assert [o.dtype for o in got] == [o.dtype for o in want]
        for a, b in zip(grads(got, backward_autocast), grads(want, backward_autocast)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["inline", "lanes", "parallel"])
def test_the_callers_pack_hooks_see_what_a_checkpointed_call_saves(mode: str) -> None:
    """(issue 46, class 6) A lossy pack (a bf16 round trip) applies to what
    the checkpointed calls' recomputations save, as it does to what the
    loop's calls save: the gradients are the loop's, bit for bit."""
    def lossy(t: Tensor) -> Tensor:
        return t.to(torch.bfloat16)

    def back(t: Tensor) -> Tensor:
        return t.to(torch.float64)
    torch.manual_seed(0)
    experts = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
               for _ in range(3)]
    xs = [torch.randn(2, 4, dtype=torch.float64, requires_grad=True) for _ in experts]
    with torch.autograd.graph.saved_tensors_hooks(lossy, back):
        want = torch.autograd.grad(sum(e(x).sum() for e, x in zip(experts, xs)), xs)
        outs = parallel_apply(experts, xs, mode=mode, checkpoint=True)
        got = torch.autograd.grad(sum(o.sum() for o in outs), xs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    plain = torch.autograd.grad(sum(e(x).sum() for e, x in zip(experts, xs)), xs)
    assert not all(torch.equal(a, b) for a, b in zip(plain, want))  # the pack did something


@pytest.mark.parametrize("mode", ["inline", "parallel"])
def test_a_pack_hook_that_raises_is_called_for_a_checkpointed_call(mode: str) -> None:
    """The caller's pack runs on the caller's (engine's) thread, never on a
    worker, in call order; one that raises fails the backward, naming the
    call."""
    seen: List[Tuple[int, bool]] = []

    def pack(t: Tensor) -> Tensor:
        seen.append((threading.get_ident(), t.dtype == torch.float64))
        if len(seen) == 3:
            raise ValueError("no saving today")
        return t
    experts = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
               for _ in range(3)]
    xs = [torch.randn(2, 4, dtype=torch.float64, requires_grad=True) for _ in experts]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = parallel_apply(experts, xs, mode=mode, checkpoint=True)
    assert seen == []  # the forward saves nothing
    with pytest.raises(ValueError, match="no saving today") as info:
        sum(o.sum() for o in outs).backward()
    assert any("backward: call 0 of 3" in note for note in info.value.__notes__)
    assert {ident for ident, _ in seen} == {threading.get_ident()}  # the engine's: this one


@pytest.mark.parametrize("mode", ["inline", "lanes", "parallel"])
def test_a_generator_built_and_seeded_in_forward_is_replayed(mode: str) -> None:
    """(issue 46) An expert that builds and seeds a ``torch.Generator`` in
    its forward: its checkpointed recomputation draws what the forward drew
    (before: "not deterministic", which it is)."""
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4).double()

        def forward(self, x: Tensor) -> Tensor:
            g = torch.Generator().manual_seed(3)
            return self.lin(x) * (torch.rand(x.shape, generator=g, dtype=x.dtype) > 0.5)
    torch.manual_seed(0)
    experts = [Masked() for _ in range(3)]
    xs = [torch.randn(2, 4, dtype=torch.float64, requires_grad=True) for _ in experts]
    want = torch.autograd.grad(sum(e(x).sum() for e, x in zip(experts, xs)), xs)
    outs = parallel_apply(experts, xs, mode=mode, checkpoint=True)
    got = torch.autograd.grad(sum(o.sum() for o in outs), xs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
