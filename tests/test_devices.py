"""The runtime's contract on every device: each test runs on the CPU and, where
there is one, on ``cuda:0`` (the ``device`` fixture), and compares the runtime
with a plain sequential loop on the same device, bit for bit (float64) where
the runtime promises equality (see "Semantics: the loop is the specification"
in README.md): ``parallel_apply`` in every mode, ``map_with_parallel_backward``,
checkpointed calls with dropout, ``run_experts``, non-reentrant
``torch.utils.checkpoint`` frames, autocast to bfloat16 and the per-call random
streams (the same seed gives the same bits at every pool size and in every
mode). ``MixtureOfExperts`` is compared with a dense reference (other sums,
so up to rounding) and with itself across modes and checkpointing (bit for bit).

All data is drawn on the CPU from explicit generators and then moved, so both
devices see the same inputs and weights; results are moved to the CPU before
they are compared. A random op inside a call draws from the call's own stream,
forked in call order (README, "global RNG state"): the reference for calls
that draw is the loop with those streams (:func:`_stream_loop`).
"""
import copy
from typing import Any, Callable, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import Function
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from helpers import MLP, params_of
from moe_autograd import MixtureOfExperts, map_with_parallel_backward, parallel_apply
from moe_autograd.moe import run_experts
from moe_autograd.rng import CallRng

DT = torch.float64
MODES = ["inline", "lanes", "parallel"]
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="needs CUDA"))])
def device(request: pytest.FixtureRequest) -> str:
    """``"cpu"``, or ``"cuda:0"`` where a GPU is present."""
    return "cpu" if request.param == "cpu" else "cuda:0"


# -- data, drawn on the CPU and moved -----------------------------------------------------

def _randn(*shape: int, seed: int, device: str, dtype: torch.dtype = DT,
           requires_grad: bool = True) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, dtype=DT, generator=g).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def _leaf(t: Tensor) -> Tensor:
    return t.detach().clone().requires_grad_(t.requires_grad)


def _mlps(n: int, device: str, dtype: torch.dtype = DT) -> List[nn.Module]:
    return [MLP(d_in=4, hidden=8, d_out=4, seed=e).to(device=device, dtype=dtype)
            for e in range(n)]



def _loss(outputs: Sequence[Tensor], seed: int = 0) -> Tensor:
    """A loss that is not linear in the outputs, with fixed random weights."""
    g = torch.Generator().manual_seed(seed)
    total: Optional[Tensor] = None
    for out in outputs:
        w = torch.randn(out.shape, dtype=DT, generator=g).to(device=out.device, dtype=out.dtype)
        term = (out * w + 0.1 * out.square()).sum().to(DT)
        total = term if total is None else total + term
    assert total is not None
    return total


def _grads(tensors: Sequence[Tensor]) -> List[Optional[Tensor]]:
    return [None if t.grad is None else t.grad.detach().cpu() for t in tensors]


def _cpu(tensors: Sequence[Tensor]) -> List[Tensor]:
    return [t.detach().cpu() for t in tensors]


def _assert_equal(got: Sequence[Optional[Tensor]], want: Sequence[Optional[Tensor]],
                  what: str = "") -> None:
    """Bit for bit, ``None``s included (both lists already on the CPU)."""
    assert len(got) == len(want), what
    for k, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), f"{what} [{k}]: {a is None} vs {b is None}"
        if a is not None and b is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what} [{k}]"
            assert torch.equal(a, b), \
                f"{what} [{k}]: max diff {(a.double() - b.double()).abs().max().item()}"


def _stream_loop(modules: Sequence[Callable[..., Any]], inputs: Sequence[Any]) -> List[Any]:
    """The loop that the runtime's random streams promise: each call in a
    stream of its own, forked in call order (README, "global RNG state")."""
    rngs = CallRng.fork_many(len(modules))
    outs = []
    for m, x, rng in zip(modules, inputs, rngs):
        with rng.activate():
            outs.append(m(*(x if isinstance(x, tuple) else (x,))))
    return outs


# -- parallel_apply -----------------------------------------------------------------------

class TwoOutputs(nn.Module):
    """Takes ``(x, scale)``, returns ``(mlp(x) * scale, mlp(x).sum(-1))``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.mlp = MLP(d_in=4, hidden=8, d_out=4, seed=seed)

    def forward(self, x: Tensor, scale: Tensor) -> Tuple[Tensor, Tensor]:
        h = self.mlp(x)
        return h * scale, h.sum(-1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_parallel_apply_equals_the_loop(device: str, mode: str) -> None:
    """Values, input and parameter gradients, ``None``s: a shared input, a
    shared module, a tuple input with two outputs, an input that needs no
    gradient and a call whose output the loss does not use."""
    mlps = _mlps(4, device)
    two = TwoOutputs(seed=9).to(device=device, dtype=DT)
    owners: List[nn.Module] = [*mlps, two]
    ref_owners = copy.deepcopy(owners)
    x = _randn(5, 4, seed=1, device=device)
    s = _randn(4, seed=2, device=device)
    z = _randn(3, 4, seed=3, device=device, requires_grad=False)
    u = _randn(2, 4, seed=4, device=device)
    leaves = [x, s, z, u]
    ref_leaves = [_leaf(t) for t in leaves]

    def calls(owned: List[nn.Module], t: List[Tensor]) -> Tuple[List[Any], List[Any]]:
        m0, m1, m2, m3, tw = owned
        x_, s_, z_, u_ = t
        return ([m0, m1, m2, m0, tw, m3],
                [x_, 2 * x_, x_.sin(), z_, (x_, s_), u_])

    modules, inputs = calls(owners, leaves)
    got = parallel_apply(modules, inputs, mode=mode)
    ref_modules, ref_inputs = calls(ref_owners, ref_leaves)
    want = [m(*(i if isinstance(i, tuple) else (i,))) for m, i in zip(ref_modules, ref_inputs)]

    def flat(outs: List[Any]) -> List[Tensor]:
        return [o for out in outs for o in (out if isinstance(out, tuple) else (out,))]
    got_flat, want_flat = flat(got), flat(want)
    assert [o.device for o in got_flat] == [o.device for o in want_flat]
    assert [o.requires_grad for o in got_flat] == [o.requires_grad for o in want_flat]
    _assert_equal(_cpu(got_flat), _cpu(want_flat), "outputs")
    _loss(got_flat[:-1]).backward()  # the last call's output is unused
    _loss(want_flat[:-1]).backward()
    got_grads = _grads(leaves + params_of(owners))
    want_grads = _grads(ref_leaves + params_of(ref_owners))
    _assert_equal(got_grads, want_grads, "gradients")
    assert got_grads[2] is None and got_grads[3] is None  # z needs none, u's call is unused
    assert all(p.grad is None for p in mlps[3].parameters())


# -- map_with_parallel_backward -----------------------------------------------------------

class Affine(Function):
    """``(x * w + b, (x * x).sum(-1))``; ``b`` gets no gradient (``None``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w + b, (x * x).sum(-1)

    @staticmethod
    def backward(ctx: Any, g: Tensor, h: Tensor) -> Any:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return g * w + 2 * x * h.unsqueeze(-1), (g * x).sum(0), None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_map_with_parallel_backward_equals_apply(device: str, mode: str) -> None:
    xs = [_randn(3, 4, seed=10 + i, device=device) for i in range(4)]
    w = _randn(4, seed=20, device=device)  # shared by every call
    b = _randn(4, seed=21, device=device)
    ref = [_leaf(t) for t in xs + [w, b]]
    xr, (wr, br) = ref[:4], ref[4:]
    got = map_with_parallel_backward(Affine, *[(x, w, b) for x in xs], mode=mode)
    want = [Affine.apply(x, wr, br) for x in xr]
    got_flat = [o for out in got for o in out]
    want_flat = [o for out in want for o in out]
    _assert_equal(_cpu(got_flat), _cpu(want_flat), "outputs")
    _loss(got_flat).backward()
    _loss(want_flat).backward()
    got_grads, want_grads = _grads(xs + [w, b]), _grads(ref)
    _assert_equal(got_grads, want_grads, "gradients")
    assert got_grads[-1] is None


# -- checkpointed calls with dropout ------------------------------------------------------

class DropMLP(nn.Module):
    """``drop(fc2(drop(tanh(fc1(x)))))``: the last dropout's mask shows in the
    output (a Linear's outputs are never exactly zero)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.mlp = MLP(d_in=4, hidden=8, d_out=4, seed=seed)
        self.drop_hidden = nn.Dropout(0.5)
        self.drop_out = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop_hidden(torch.tanh(self.mlp.fc1(x)))
        return self.drop_out(self.mlp.fc2(h))


def _dropout_run(device: str, runner: Callable[[List[nn.Module], List[Tensor]], List[Tensor]]
                 ) -> List[Optional[Tensor]]:
    """Outputs, then input and parameter gradients, of four DropMLPs called by
    ``runner`` after ``torch.manual_seed(7)``."""
    experts: List[nn.Module] = [DropMLP(seed=e).to(device) for e in range(4)]
    xs = [_randn(6, 4, seed=30 + e, device=device) for e in range(4)]
    torch.manual_seed(7)
    outs = runner(experts, xs)
    _loss(outs).backward()
    return _cpu(outs) + _grads(xs + params_of(experts))  # type: ignore[operator]


@pytest.mark.timeout(120)
def test_checkpointed_dropout_replays_exactly(device: str) -> None:
    """checkpoint=True (all, or some calls) equals checkpoint=False bit for
    bit in every mode, and both equal the loop with the calls' streams."""
    want = _dropout_run(device, _stream_loop)
    for mode in MODES:
        for flags in (False, True, [True, False, True, False]):
            got = _dropout_run(device, lambda e, x: parallel_apply(e, x, checkpoint=flags,
                                                                   mode=mode))
            _assert_equal(got, want, f"mode={mode} checkpoint={flags}")
    masks = [torch.ne(o, 0) for o in want[:4] if o is not None]
    assert len(masks) == 4
    for m in masks:  # the dropout really drops ...
        assert 0.05 < m.double().mean().item() < 0.95
    for i in range(4):  # ... and each call draws from its own stream
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), (i, j)


# -- MixtureOfExperts ---------------------------------------------------------------------

def _moe_dense_reference(moe: MixtureOfExperts, x: Tensor) -> Tuple[Tensor, Tensor]:
    """``y, aux`` with every expert on every token (other sums: up to rounding)."""
    flat = x.reshape(-1, x.shape[-1])
    logits = moe.gate(flat)
    top, idx = logits.topk(moe.k, dim=-1)
    weights = top.softmax(-1)
    dense = torch.stack([e(flat) for e in moe.experts], dim=1)  # [T, E, d]
    y = (dense.gather(1, idx[..., None].expand(-1, -1, dense.shape[-1]))
         * weights[..., None]).sum(1)
    num_experts = len(moe.experts)
    probs = torch.softmax(logits, dim=-1).mean(dim=0)
    counts = torch.bincount(idx.reshape(-1), minlength=num_experts)
    aux = num_experts * (counts.to(probs.dtype) / idx.numel() * probs).sum()
    return y.reshape(*x.shape[:-1], y.shape[-1]), aux


def _moe_run(moe: MixtureOfExperts, x: Tensor) -> List[Optional[Tensor]]:
    y, aux = moe(x)
    (_loss([y]) + aux).backward()
    return _cpu([y, aux]) + _grads([x] + list(moe.parameters()))


@pytest.mark.timeout(120)
def test_moe_layer_equals_a_dense_reference_and_itself_in_every_mode(device: str) -> None:
    torch.manual_seed(0)
    base = MixtureOfExperts(_mlps(4, "cpu"), 4, k=2).to(DT)
    with torch.no_grad():  # every expert gets tokens
        for p in base.gate.parameters():
            p.mul_(4)
    x = _randn(3, 7, 4, seed=40, device=device)

    ref = copy.deepcopy(base).to(device)
    xr = _leaf(x)
    y_ref, aux_ref = _moe_dense_reference(ref, xr)
    (_loss([y_ref]) + aux_ref).backward()
    dense = _cpu([y_ref, aux_ref]) + _grads([xr] + list(ref.parameters()))

    runs = {}
    for mode in MODES:
        for ckpt in (False, True):
            moe = copy.deepcopy(base).to(device)
            moe.mode, moe.checkpoint = mode, ckpt
            runs[mode, ckpt] = _moe_run(moe, _leaf(x))
    first = runs["parallel", False]
    assert all(g is not None for g in first)  # every expert was routed to
    for a, b in zip(first, dense):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for key, got in runs.items():
        if device.startswith("cuda"):
            # x's gradient gathers the tokens' terms with CUDA's index_add_,
            # whose atomic adds land in no fixed order: the loop's own x
            # gradient differs in the last bit from one run to the next
            # (seen on an H200: 1 ulp between two modes). The rest is exact.
            torch.testing.assert_close(got[2], first[2], rtol=1e-14, atol=1e-15)
            got, first_ = got[:2] + got[3:], first[:2] + first[3:]
            _assert_equal(got, first_, f"mode={key[0]} checkpoint={key[1]}")
        else:
            _assert_equal(got, first, f"mode={key[0]} checkpoint={key[1]}")


# -- run_experts --------------------------------------------------------------------------

def _hf_loop(experts: Sequence[nn.Module], x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
    """transformers' eager expert loop, written out (as in tests/moe/test_run_experts.py)."""
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        slots, tokens = torch.where((index == e).t())
        if len(tokens):
            out = expert(x[tokens]) * weights[tokens, slots, None]
            y = y.index_add(0, tokens, out.to(y.dtype))
    return y


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("mode", MODES)
def test_run_experts_equals_the_transformers_loop(device: str, mode: str, checkpoint: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_AUTOGRAD_MODE", mode)
    num_experts, k, tokens = 5, 2, 16
    experts = [nn.Sequential(MLP(d_in=4, hidden=8, d_out=4, seed=e), nn.SiLU()).to(device)
               for e in range(num_experts)]
    ref = copy.deepcopy(experts)
    g = torch.Generator().manual_seed(50)
    logits = torch.randn(tokens, num_experts, generator=g, dtype=DT)
    logits[:, 3] = -1e9  # expert 3 gets no token: not called, no gradients
    top, index = logits.softmax(-1).topk(k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).to(device).requires_grad_()
    index = index.to(device)
    x = _randn(tokens, 4, seed=51, device=device)
    xr, wr = _leaf(x), _leaf(weights)

    y = run_experts(experts, x, index, weights, checkpoint=checkpoint)
    y_ref = _hf_loop(ref, xr, index, wr)
    assert y.device == y_ref.device and y.dtype == y_ref.dtype
    _assert_equal(_cpu([y]), _cpu([y_ref]), "y")
    _loss([y]).backward()
    _loss([y_ref]).backward()
    got = _grads([x, weights] + params_of(experts))
    _assert_equal(got, _grads([xr, wr] + params_of(ref)), "gradients")
    assert all(p.grad is None for p in experts[3].parameters())


# -- non-reentrant torch.utils.checkpoint frames ------------------------------------------

def _three_inputs(t: Tensor) -> List[Tensor]:
    return [t, 2 * t, t.sin()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inner_checkpoint", [False, [True, False, True]],
                         ids=["plain", "inner-checkpoint"])
@pytest.mark.parametrize("mode", MODES)
def test_non_reentrant_checkpoint_frame_equals_the_loop_in_the_frame(
        device: str, mode: str, inner_checkpoint: Any) -> None:
    experts = _mlps(3, device)
    ref = copy.deepcopy(experts)
    x = _randn(5, 4, seed=60, device=device)
    xr = _leaf(x)

    def ours(t: Tensor) -> Tensor:
        return _loss(parallel_apply(experts, _three_inputs(t), checkpoint=inner_checkpoint,
                                    mode=mode))

    def loop(t: Tensor) -> Tensor:
        return _loss([e(i) for e, i in zip(ref, _three_inputs(t))])
    got_loss = torch_checkpoint(ours, x, use_reentrant=False)
    want_loss = torch_checkpoint(loop, xr, use_reentrant=False)
    _assert_equal(_cpu([got_loss]), _cpu([want_loss]), "loss")
    got_loss.backward()
    want_loss.backward()
    _assert_equal(_grads([x] + params_of(experts)), _grads([xr] + params_of(ref)), "gradients")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_non_reentrant_checkpoint_frame_replays_dropout(device: str, mode: str) -> None:
    """The frame's recomputation of a batch that draws gives the bits of the
    same batch without the frame (the streams are forked again from the
    restored CPU generator)."""
    def framed(e: List[nn.Module], xs: List[Tensor]) -> List[Tensor]:
        def body(*t: Tensor) -> Tuple[Tensor, ...]:
            return tuple(parallel_apply(e, list(t), mode=mode))
        return list(torch_checkpoint(body, *xs, use_reentrant=False))
    want = _dropout_run(device, lambda e, x: parallel_apply(e, x, mode=mode))
    _assert_equal(_dropout_run(device, framed), want, "framed")
    _assert_equal(want, _dropout_run(device, _stream_loop), "stream loop")


# -- autocast -----------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("mode", MODES)
def test_autocast_bfloat16_equals_the_loop_under_autocast(device: str, mode: str,
                                                          cache: bool) -> None:
    """With the weight cache (the default) the calls run as the loop; without
    it they fan out: the same bits either way."""
    device_type = torch.device(device).type
    experts = _mlps(3, device, dtype=torch.float32)
    ref = copy.deepcopy(experts)
    x = _randn(5, 4, seed=70, device=device, dtype=torch.float32)
    xr = _leaf(x)
    with torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=cache):
        got = parallel_apply(experts, _three_inputs(x), mode=mode)
    with torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=cache):
        want = [e(i) for e, i in zip(ref, _three_inputs(xr))]
    assert [o.dtype for o in got] == [torch.bfloat16] * 3
    assert [o.dtype for o in want] == [torch.bfloat16] * 3
    _assert_equal(_cpu(got), _cpu(want), "outputs")
    _loss(got).backward()
    _loss(want).backward()
    _assert_equal(_grads([x] + params_of(experts)), _grads([xr] + params_of(ref)), "gradients")


# -- per-call random streams --------------------------------------------------------------

class Noisy(nn.Module):
    """Draws on its input's device in three ways: dropout, ``randn_like`` and
    ``rand(..., device=...)``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.mlp = MLP(d_in=4, hidden=8, d_out=4, seed=seed)
        self.drop = nn.Dropout(0.4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop(torch.tanh(self.mlp.fc1(x)))
        h = h + 0.1 * torch.randn_like(h)
        return self.mlp.fc2(h) * torch.rand(h.shape[0], 1, dtype=h.dtype, device=h.device)


def _rng_batch(device: str, runner: Callable[[List[nn.Module], List[Tensor]], List[Tensor]]
               ) -> List[Optional[Tensor]]:
    """Outputs and gradients of five Noisy calls (the last one repeats the
    second: same module, same input tensor) after ``torch.manual_seed(11)``,
    then the default CPU generator's state."""
    noisy = [Noisy(seed=e).to(device=device, dtype=DT) for e in range(4)]
    experts: List[nn.Module] = [*noisy, noisy[1]]
    xs = [_randn(3 + e, 4, seed=80 + e, device=device) for e in range(4)]
    torch.manual_seed(11)
    cuda_state = torch.cuda.get_rng_state(0) if device.startswith("cuda") else None
    outs = runner(experts, xs + [xs[1]])
    _loss(outs).backward()
    if cuda_state is not None:  # the calls drew from private generators only
        assert torch.equal(torch.cuda.get_rng_state(0), cuda_state)
    return _cpu(outs) + _grads(xs + params_of(noisy)) + [torch.get_rng_state()]  # type: ignore[operator]


@pytest.mark.timeout(120)
def test_same_seed_same_bits_at_every_pool_size_and_mode(device: str,
                                                        fresh_pool: Callable[[int], Any]) -> None:
    want = _rng_batch(device, _stream_loop)
    for workers in (1, 2, 5):
        fresh_pool(workers)
        for mode in MODES:
            for flags in (False, [False, True, False, True, True]):
                got = _rng_batch(device, lambda e, x: parallel_apply(e, x, checkpoint=flags,
                                                                     mode=mode))
                _assert_equal(got, want, f"workers={workers} mode={mode} checkpoint={flags}")
    second, fifth = want[1], want[4]
    assert second is not None and fifth is not None
    assert not torch.equal(second, fifth)  # same module and input, streams of their own


@pytest.mark.timeout(120)
def test_same_bits_with_one_worker_in_a_fresh_process(device: str, tmp_path: Any,
                                                      run_python: Callable[..., str]) -> None:
    """MOE_AUTOGRAD_WORKERS=1 in a new interpreter gives this process's bits
    (default pool size) for the same seed."""
    path = tmp_path / "bits.pt"
    out = run_python(f"""
        import sys
        sys.path.insert(0, "tests")
        import torch
        from moe_autograd import executor, parallel_apply
        from test_devices import _rng_batch
        bits = _rng_batch({device!r}, lambda e, x: parallel_apply(e, x, mode="parallel"))
        torch.save(bits, {str(path)!r})
        print("workers", executor.get_pool().max_workers)
    """, env={"MOE_AUTOGRAD_WORKERS": "1"})
    assert "workers 1" in out
    theirs = torch.load(path)
    ours = _rng_batch(device, lambda e, x: parallel_apply(e, x, mode="parallel"))
    _assert_equal(theirs, ours, "fresh process, one worker")
