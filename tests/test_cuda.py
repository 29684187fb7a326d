"""The runtime with experts on a CUDA device: gradients equal a loop's, the
per-call random streams are per device and replay exactly, checkpoint frames
and the MoE layer work there. Skipped without a GPU (CI has none)."""
import copy
import threading
from typing import Any, List, Optional

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from moe_autograd import MixtureOfExperts, map_with_parallel_backward, parallel_apply

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DT = torch.float64


def _mlp(seed: int, device: str, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout),
                         nn.Linear(16, 8)).to(device=device, dtype=DT)


def _grads(tensors: List[Tensor]) -> List[Optional[Tensor]]:
    return [None if t.grad is None else t.grad.detach().cpu() for t in tensors]


def _close(a: List[Optional[Tensor]], b: List[Optional[Tensor]], exact: bool = False) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            if exact:
                assert torch.equal(x, y)  # type: ignore[arg-type]
            else:
                torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", [["cuda:0"] * 4, ["cuda:0", "cpu", "cuda:0", "cpu"]],
                         ids=["cuda", "mixed"])
def test_gradients_equal_a_loop(devices: List[str]) -> None:
    experts = [_mlp(k, d) for k, d in enumerate(devices)]
    ref = copy.deepcopy(experts)
    xs = [torch.randn(5, 8, dtype=DT, device=d, requires_grad=True) for d in devices]
    xr = [x.detach().clone().requires_grad_() for x in xs]
    outs = parallel_apply(experts, xs, mode="parallel")
    sum(o.square().sum().cpu() for o in outs).backward()
    want = [e(x) for e, x in zip(ref, xr)]
    sum(o.square().sum().cpu() for o in want).backward()
    for o, w in zip(outs, want):
        assert o.device == w.device
        torch.testing.assert_close(o, w, rtol=1e-10, atol=1e-12)
    params = [p for e in experts for p in e.parameters()]
    ref_params = [p for e in ref for p in e.parameters()]
    _close(_grads(xs + params), _grads(xr + ref_params))


def _dropout_mlp(seed: int, device: str) -> nn.Module:
    """An MLP with a dropout in the middle and one last: the second leaves its
    mask in the output (a Linear's outputs are never exactly zero)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 8),
                         nn.Dropout(0.5)).to(device=device, dtype=DT)


def _dropout_run(checkpoint: Any, mode: str) -> List[Optional[Tensor]]:
    torch.manual_seed(0)
    experts = [_dropout_mlp(k, "cuda:0") for k in range(4)]
    torch.manual_seed(1)
    xs = [torch.randn(6, 8, dtype=DT, device="cuda:0", requires_grad=True) for _ in experts]
    outs = parallel_apply(experts, xs, checkpoint=checkpoint, mode=mode)
    sum(o.sum() for o in outs).backward()
    params = [p for e in experts for p in e.parameters()]
    return [o.detach().cpu() for o in outs] + _grads(xs + params)


@pytest.mark.timeout(120)
def test_cuda_dropout_is_reproducible_and_checkpointing_changes_nothing() -> None:
    want = _dropout_run(False, "parallel")
    _close(_dropout_run(False, "parallel"), want, exact=True)
    _close(_dropout_run(True, "parallel"), want, exact=True)
    _close(_dropout_run([True, False, True, False], "inline"), want, exact=True)
    _close(_dropout_run(False, "inline"), want, exact=True)
    # The last dropout's masks, read off the outputs: each call draws from a
    # stream of its own (the four calls' masks differ), and really drops.
    masks = [torch.ne(o, 0) for o in want[:4] if o is not None]
    assert len(masks) == 4
    for m in masks:
        assert 0.1 < m.double().mean().item() < 0.9
    for i in range(4):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), (i, j)


@pytest.mark.timeout(120)
def test_non_reentrant_checkpoint_frame_on_cuda() -> None:
    experts = [_mlp(k, "cuda:0") for k in range(3)]
    ref = copy.deepcopy(experts)
    x = torch.randn(5, 8, dtype=DT, device="cuda:0", requires_grad=True)
    xr = x.detach().clone().requires_grad_()

    def ours(t: Tensor) -> Tensor:
        return sum(o.square().sum() for o in parallel_apply(experts, [t, 2 * t, t.sin()]))

    def loop(t: Tensor) -> Tensor:
        return sum(e(i).square().sum() for e, i in zip(ref, [t, 2 * t, t.sin()]))
    torch_checkpoint(ours, x, use_reentrant=False).backward()
    torch_checkpoint(loop, xr, use_reentrant=False).backward()
    _close(_grads([x] + [p for e in experts for p in e.parameters()]),
           _grads([xr] + [p for e in ref for p in e.parameters()]))


def _nodes_named(roots: List[Tensor], part: str) -> List[Any]:
    """The nodes of the graph behind ``roots`` whose name holds ``part``."""
    seen: set = set()
    found: List[Any] = []
    todo = [t.grad_fn for t in roots if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if part in fn.name():
            found.append(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["lanes", "parallel"])  # inline: no node, the loop itself
@pytest.mark.parametrize("where", ["cuda", "mixed"])
def test_call_gradient_nodes_run_on_their_devices_engine_thread(mode: str, where: str) -> None:
    """Each call's gradient node runs on the engine's thread for the call's
    device, where the loop's nodes of that call run: a CUDA call's on the CUDA
    device thread, beside the caller's ``x.sin()``; a CPU call's on the
    thread that runs the caller's CPU ops. On another thread it added its
    gradients to ``x``'s buffer concurrently with ``SinBackward``, in a racing
    order, and ``x.grad`` differed from the loop's in its last bits (seen in
    ``test_devices.py``, one run in two on an H200)."""
    devices = ["cuda:0", "cuda:0"] if where == "cuda" else ["cuda:0", "cpu"]
    experts = [_mlp(k, d) for k, d in enumerate(devices)]
    xs = {d: torch.randn(5, 8, dtype=DT, device=d, requires_grad=True) for d in set(devices)}
    inputs = [xs[d] if k == 0 else xs[d].sin() for k, d in enumerate(devices)]
    outs = parallel_apply(experts, inputs, mode=mode)
    threads: dict = {}

    def record(label: str) -> Any:
        def hook(*_: Any) -> None:
            threads.setdefault(label, set()).add(threading.get_ident())
        return hook
    nodes = _nodes_named(outs, "_CallGradients")
    assert len(nodes) == 2
    for fn in nodes:
        fn.register_prehook(record(f"call {fn.i}"))  # the node is the Function's ctx
    sins = _nodes_named(inputs, "SinBackward")
    assert len(sins) == 1
    sins[0].register_prehook(record("sin"))
    outs[0].grad_fn.register_prehook(record("node"))  # on the CUDA thread: it has CUDA outputs
    sum(o.square().sum().cpu() for o in outs).backward()
    assert len(threads["call 1"]) == 1, threads
    assert threads["call 0"] == threads["node"], threads
    assert threads["call 1"] == threads["sin"], threads
    if where == "mixed":
        assert threads["call 1"] != threads["node"], threads


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


@pytest.mark.timeout(120)
def test_map_on_cuda_equals_apply() -> None:
    xs = [torch.randn(4, 3, dtype=DT, device="cuda:0", requires_grad=True) for _ in range(4)]
    w = torch.randn(3, dtype=DT, device="cuda:0", requires_grad=True)
    outs = map_with_parallel_backward(_Scale, *[(x, w) for x in xs], mode="parallel")
    sum(o[0].sum() for o in outs).backward()
    got = _grads(xs + [w])
    for t in xs + [w]:
        t.grad = None
    sum(_Scale.apply(x, w).sum() for x in xs).backward()
    _close(got, _grads(xs + [w]))


@pytest.mark.timeout(120)
def test_moe_layer_on_cuda_equals_a_dense_reference() -> None:
    torch.manual_seed(0)
    moe = MixtureOfExperts([_mlp(k, "cuda:0") for k in range(4)], 8, k=2).to("cuda:0", DT)
    x = torch.randn(3, 7, 8, dtype=DT, device="cuda:0", requires_grad=True)
    y, aux = moe(x)
    (y.square().sum() + aux).backward()
    flat = x.detach().reshape(-1, 8).clone().requires_grad_()
    ref = copy.deepcopy(moe)
    for p in ref.parameters():
        p.grad = None
    logits = ref.gate(flat)
    top, idx = logits.topk(2, dim=-1)
    weights = top.softmax(-1)
    dense = torch.stack([e(flat) for e in ref.experts], dim=1)  # [T, E, d]
    want = (dense.gather(1, idx[..., None].expand(-1, -1, 8)) * weights[..., None]).sum(1)
    torch.testing.assert_close(y.reshape(-1, 8), want, rtol=1e-10, atol=1e-12)
