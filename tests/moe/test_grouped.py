"""grouped_experts and MixtureOfExperts(grouped_mm=True): stacked SwiGLU experts
in two torch._grouped_mm calls. NOT bit-equal to the loop: outputs and every
gradient are compared with a plain float64 loop within tolerance, on the CPU
(float32, bfloat16, float16) and, when CUDA is available, on it (bfloat16;
skipped cleanly otherwise). Also: empty experts, empty slots, no routed rows,
256 experts, and every refusal naming what was wrong."""
import copy
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import moe_autograd
from moe_autograd.bench.moe_scale import SwiGLU
from moe_autograd.moe import MixtralExpert, MixtureOfExperts, grouped_experts
from moe_autograd.moe import grouped
from moe_autograd.moe.grouped import check_experts, stack_experts

pytestmark = pytest.mark.timeout(60)

needs_grouped_mm = pytest.mark.skipif(not callable(getattr(torch, "_grouped_mm", None)),
                                      reason="this torch has no torch._grouped_mm")
_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (device, dtype) cases: the CPU in every dtype its grouped_mm takes, CUDA in
# bfloat16 (the grouped kernel's dtype; compute capability 9.x/10.x, e.g. H100/H200).
CASES = [
    pytest.param("cpu", torch.float32, id="cpu-float32"),
    pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16"),
    pytest.param("cpu", torch.float16, id="cpu-float16"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16", marks=_CUDA),
]

# Tolerances on max|actual - reference| / max|reference| (a normalised error:
# robust to the scale of each tensor, while any wrong expert, weight or row is
# an O(1) error). float32 differs from the float64 loop by summation order
# only; 16-bit floats also round every intermediate (gate/up projections,
# activation, answers), as the loop in that dtype would. Measured on the CPU:
# float32 ~1e-6, bfloat16 up to ~1e-2; a GPU's bfloat16 GEMMs (float32
# accumulation, another summation order) land in the same range.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _usable(device: str, dtype: torch.dtype) -> None:
    """Skips a CUDA case on a GPU the grouped kernel does not run on."""
    if device == "cuda" and torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch._grouped_mm's grouped kernel needs compute capability 9.x/10.x")


def _error(actual: Optional[Tensor], reference: Optional[Tensor]) -> float:
    """The normalised max error of ``actual`` against ``reference`` (float64)."""
    assert actual is not None and reference is not None
    assert actual.shape == reference.shape, (actual.shape, reference.shape)
    a, r = actual.detach().double().cpu(), reference.detach().double().cpu()
    assert bool(torch.isfinite(a).all()), "non-finite values"
    scale = r.abs().max().item()
    return (a - r).abs().max().item() / (scale if scale > 0 else 1.0)


def _close(actual: Optional[Tensor], reference: Optional[Tensor], dtype: torch.dtype,
           what: str) -> None:
    err = _error(actual, reference)
    assert err <= TOLERANCE[dtype], f"{what}: normalised error {err:.3g} > {TOLERANCE[dtype]}"


def _loop(x: Tensor, index: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
          act: Callable[[Tensor], Tensor] = F.silu) -> Tensor:
    """The plain loop: one expert after the other on its tokens, in float64."""
    num_experts = w_gate_up.shape[0]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(num_experts):
        tokens, slots = torch.where(index == e)
        if len(tokens):
            gate, up = (x[tokens] @ w_gate_up[e]).chunk(2, dim=-1)
            out = (act(gate) * up) @ w_down[e]
            y = y.index_add(0, tokens, out * weights[tokens, slots, None])
    return y


def _problem(tokens: int, d: int, hidden: int, num_experts: int, k: int, *, seed: int = 0,
             used: Optional[int] = None, empty_slots: int = 0
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``x, index, weights, w_gate_up, w_down`` on the CPU in float32; only
    experts ``< used`` get tokens, ``empty_slots`` slots hold the sentinel E."""
    gen = torch.Generator().manual_seed(seed)
    used = num_experts if used is None else used
    x = torch.randn(tokens, d, generator=gen)
    index = torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(tokens)])
    if empty_slots:
        flat = index.view(-1)
        flat[torch.randperm(flat.numel(), generator=gen)[:empty_slots]] = num_experts
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
    w_gate_up = torch.randn(num_experts, d, 2 * hidden, generator=gen) / d ** 0.5
    w_down = torch.randn(num_experts, hidden, d, generator=gen) / hidden ** 0.5
    return x, index, weights, w_gate_up, w_down


def _check_against_loop(device: str, dtype: torch.dtype, tokens: int, d: int, hidden: int,
                        num_experts: int, k: int, *, used: Optional[int] = None,
                        empty_slots: int = 0, column_major: bool = False) -> Dict[str, Tensor]:
    """Runs grouped_experts and the float64 loop on the same (rounded) values;
    compares the output and the gradients of x, both weights and the routing
    weights. Returns grouped_experts' gradients, on the CPU."""
    base = _problem(tokens, d, hidden, num_experts, k, used=used, empty_slots=empty_slots)
    x, index, weights, w_gate_up, w_down = base
    # The values both sides see: rounded to dtype once.
    x, w_gate_up, w_down = (t.to(dtype) for t in (x, w_gate_up, w_down))
    grad_out = torch.randn(tokens, d, generator=torch.Generator().manual_seed(1)).to(dtype)

    leaves = [t.to(device).detach().clone().requires_grad_()
              for t in (x, weights, w_gate_up, w_down)]
    gx, gw, gwgu, gwd = leaves
    if column_major:  # transformers' [E, 2*hidden, d] layout, transposed
        wgu_in = gwgu.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        wd_in = gwd.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        assert wgu_in.stride(1) == 1 and wd_in.stride(1) == 1
        leaves = [gx, gw, wgu_in, wd_in]
        gwgu, gwd = wgu_in, wd_in
    y = grouped_experts(gx, index.to(device), gw, gwgu, gwd)
    assert y.dtype == dtype and y.device.type == device and y.shape == (tokens, d)
    grads = torch.autograd.grad(y, leaves, grad_out.to(device), allow_unused=True)

    ref_leaves = [t.detach().double().requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    rx, rw, rwgu, rwd = ref_leaves
    ref = _loop(rx, index, rw, rwgu, rwd)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.double(), allow_unused=True)

    _close(y, ref, dtype, "output")
    names = ["x", "top_k_weights", "w_gate_up", "w_down"]
    out: Dict[str, Tensor] = {}
    for name, grad, ref_grad in zip(names, grads, ref_grads):
        if ref_grad is None:  # nothing routed
            assert grad is None or not bool(grad.any()), name
            continue
        _close(grad, ref_grad, dtype, f"gradient of {name}")
        assert grad is not None
        out[name] = grad.detach().cpu()
    return out


# -- grouped_experts -----------------------------------------------------------

@needs_grouped_mm
@pytest.mark.parametrize("device, dtype", CASES)
def test_grouped_experts_equals_the_loop_within_tolerance(device: str, dtype: torch.dtype) -> None:
    _usable(device, dtype)
    _check_against_loop(device, dtype, tokens=64, d=32, hidden=48, num_experts=8, k=2)


@needs_grouped_mm
@pytest.mark.parametrize("device, dtype", CASES)
def test_experts_without_tokens_and_empty_slots(device: str, dtype: torch.dtype) -> None:
    _usable(device, dtype)
    # Experts 5, 6 and 7 get no token (empty groups, including the last);
    # 9 slots hold the sentinel E = 8.
    grads = _check_against_loop(device, dtype, tokens=40, d=16, hidden=24, num_experts=8, k=2,
                                used=5, empty_slots=9)
    assert not bool(grads["w_gate_up"][5:].any()) and not bool(grads["w_down"][5:].any())
    assert bool(grads["w_gate_up"][:5].any())
    _, index, *_ = _problem(40, 16, 24, 8, 2, used=5, empty_slots=9)
    empty = index == 8
    assert int(empty.sum()) == 9
    assert not bool(grads["top_k_weights"][empty].any())  # an empty slot's weight: zero


@needs_grouped_mm
@pytest.mark.parametrize("device, dtype", CASES)
def test_column_major_weights(device: str, dtype: torch.dtype) -> None:
    """Weights given as transposed views of transformers' [E, out, in] layout."""
    _usable(device, dtype)
    _check_against_loop(device, dtype, tokens=24, d=16, hidden=32, num_experts=4, k=2,
                        column_major=True)


@needs_grouped_mm
@pytest.mark.parametrize("device, dtype", CASES)
def test_256_experts(device: str, dtype: torch.dtype) -> None:
    _usable(device, dtype)
    # 256 experts, 300 tokens, k = 2: many groups of 1-5 rows, some empty.
    _check_against_loop(device, dtype, tokens=300, d=16, hidden=16, num_experts=256, k=2)


@needs_grouped_mm
@pytest.mark.parametrize("device, dtype", CASES)
def test_nothing_routed_gives_zeros_in_the_graph(device: str, dtype: torch.dtype) -> None:
    _usable(device, dtype)
    num_experts, d, hidden = 4, 16, 16
    for tokens in (0, 5):
        x = torch.randn(tokens, d, dtype=dtype, device=device, requires_grad=True)
        index = torch.full((tokens, 2), num_experts, device=device)  # every slot empty
        weights = torch.rand(tokens, 2, device=device, requires_grad=True)
        w_gate_up = torch.randn(num_experts, d, 2 * hidden, dtype=dtype, device=device,
                                requires_grad=True)
        w_down = torch.randn(num_experts, hidden, d, dtype=dtype, device=device,
                             requires_grad=True)
        y = grouped_experts(x, index, weights, w_gate_up, w_down)
        assert y.shape == (tokens, d) and y.dtype == dtype and not bool(y.any())
        assert y.requires_grad
        y.sum().backward()
        assert weights.grad is not None and not bool(weights.grad.any())
        assert w_gate_up.grad is None and w_down.grad is None  # as uncalled experts


@needs_grouped_mm
def test_other_activation_and_float64_routing_weights() -> None:
    x, index, weights, w_gate_up, w_down = _problem(20, 8, 8, 3, 2)
    y = grouped_experts(x, index, weights.double(), w_gate_up, w_down, act=torch.tanh)
    assert y.dtype == torch.float32
    ref = _loop(x.double(), index, weights.double(), w_gate_up.double(), w_down.double(),
                act=torch.tanh)
    _close(y, ref, torch.float32, "output")


@needs_grouped_mm
def test_top_level_name_is_the_function() -> None:
    assert moe_autograd.grouped_experts is grouped_experts
    assert "grouped_experts" in moe_autograd.__all__


# -- refusals of grouped_experts -------------------------------------------------

def _args(dtype: torch.dtype = torch.float32, d: int = 16, hidden: int = 16,
          num_experts: int = 4) -> List[Tensor]:
    x, index, weights, w_gate_up, w_down = _problem(6, d, hidden, num_experts, 2)
    return [x.to(dtype), index, weights, w_gate_up.to(dtype), w_down.to(dtype)]


@needs_grouped_mm
@pytest.mark.parametrize("change, error, match", [
    (lambda a: [t.double() if t.is_floating_point() and i != 2 else t for i, t in enumerate(a)],
     ValueError, "dtype torch.float64 is not supported on the CPU"),
    (lambda a: [a[0], a[1], a[2], a[3].half(), a[4]], ValueError, "must share one dtype"),
    (lambda a: [a[0], a[1].float(), a[2], a[3], a[4]], ValueError, "must be an integer tensor"),
    (lambda a: [a[0], a[1], a[2][:, :1], a[3], a[4]], ValueError, r"must both be \[tokens, k\]"),
    (lambda a: [a[0][:, :8], a[1], a[2], a[3], a[4]], ValueError, "hidden_states has d = 8"),
    (lambda a: [a[0], a[1], a[2], a[3][:, :, :31], a[4]], ValueError, "2\\*hidden"),
    (lambda a: [a[0], a[1], a[2], a[3][0], a[4]], ValueError, "must be 3-D"),
    (lambda a: [a[0], a[1], a[2], a[3], a[4][:3]], ValueError, r"w_down must be \[4, 16, 16\]"),
    # a weight that is neither row- nor column-major in its last two dimensions
    (lambda a: [a[0], a[1], a[2], a[3].repeat(1, 1, 2)[:, :, ::2], a[4]], ValueError,
     "row- or column-major"),
    (lambda a: [a[0], a[1] + 7, a[2], a[3], a[4]], ValueError, "holds expert"),
    (lambda a: [a[0], a[1] - 9, a[2], a[3], a[4]], ValueError, "holds expert -"),
])
def test_grouped_experts_refuses_bad_arguments(change: Callable[[List[Tensor]], List[Tensor]],
                                               error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        grouped_experts(*change(_args()))


@needs_grouped_mm
def test_grouped_experts_refuses_unaligned_sizes() -> None:
    # 16-byte rows: multiples of 4 float32 or 8 bfloat16 elements.
    with pytest.raises(ValueError, match=r"d = 10 and hidden = 16 must be multiples of 4"):
        grouped_experts(*_args(d=10))
    with pytest.raises(ValueError, match=r"d = 16 and hidden = 12 must be multiples of 8 in "
                                         r"torch.bfloat16"):
        grouped_experts(*_args(torch.bfloat16, hidden=12))
    grouped_experts(*_args(torch.float32, hidden=12))  # 48 bytes: aligned in float32


@needs_grouped_mm
def test_grouped_experts_refuses_devices() -> None:
    args = _args()
    with pytest.raises(ValueError, match="must be on one device"):
        grouped_experts(args[0].to("meta"), *args[1:])
    with pytest.raises(NotImplementedError, match="device meta is not supported"):
        grouped_experts(*[t.to("meta") for t in args])


def test_grouped_experts_refuses_a_torch_without_grouped_mm(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    with pytest.raises(NotImplementedError, match="has no torch._grouped_mm"):
        grouped_experts(*_args())
    with pytest.raises(NotImplementedError, match="has no torch._grouped_mm"):
        MixtureOfExperts(_swiglus(4, 16, 16), 16, grouped_mm=True)


@needs_grouped_mm
def test_cuda_platform_checks_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA refusals' logic, with the device's capability faked."""
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="dtype torch.float32 is not supported on CUDA"):
        grouped._check_platform(cuda, torch.float32, 8)
    for capability, ok in [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True),
                           ((12, 0), False)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None, c=capability: c)
        monkeypatch.setattr(torch.version, "hip", None)
        if ok:
            grouped._check_platform(cuda, torch.bfloat16, 256)
            with pytest.raises(NotImplementedError, match="at most 1023 groups"):
                grouped._check_platform(cuda, torch.bfloat16, 1024)
        else:
            with pytest.raises(NotImplementedError,
                               match=f"compute capability {capability[0]}.{capability[1]}"):
                grouped._check_platform(cuda, torch.bfloat16, 8)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(NotImplementedError, match="ROCm"):
        grouped._check_platform(cuda, torch.bfloat16, 8)


@_CUDA
@needs_grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_refuses_dtypes_without_the_grouped_kernel(dtype: torch.dtype) -> None:
    args = [t.cuda() for t in _args(dtype)]
    with pytest.raises(ValueError, match=f"dtype {dtype} is not supported on CUDA"):
        grouped_experts(*args)


@_CUDA
@needs_grouped_mm
def test_cuda_refuses_too_many_groups() -> None:
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("needs compute capability 9.x/10.x")
    args = [t.cuda() for t in _args(torch.bfloat16, d=8, hidden=8, num_experts=1024)]
    with pytest.raises(NotImplementedError, match="at most 1023 groups"):
        grouped_experts(*args)


# -- the layer -------------------------------------------------------------------

def _swiglus(n: int, d: int, hidden: int, seed: int = 0) -> List[nn.Module]:
    torch.manual_seed(seed)
    return [SwiGLU(d, hidden) for _ in range(n)]


def _mixtrals(n: int, d: int, hidden: int, seed: int = 0,
              act: Callable[[Tensor], Tensor] = F.silu) -> List[nn.Module]:
    gen = torch.Generator().manual_seed(seed)
    return [MixtralExpert(torch.randn(2 * hidden, d, generator=gen) / d ** 0.5,
                          torch.randn(d, hidden, generator=gen) / hidden ** 0.5, act)
            for _ in range(n)]


def _expert_call(expert: nn.Module, x: Tensor) -> Tensor:
    """One expert in float64, as its own forward computes (a plain call)."""
    return cast(Tensor, expert(x))


def _layer_reference(layer: MixtureOfExperts, x: Tensor, chosen: Tensor) -> Tensor:
    """The plain loop in float64 (a float64 copy of ``layer``: gate, experts),
    over the experts ``chosen`` ([tokens, k], the grouped layer's routing, so
    that near-ties of the logits cannot route the two sides differently),
    weighted by the softmax of the chosen logits (``norm_topk_prob``)."""
    flat = x.reshape(-1, x.shape[-1])
    logits = layer.gate(flat).double()
    top = logits.gather(-1, chosen)
    weights = torch.softmax(top, dim=-1)
    if not layer.norm_topk_prob:
        weights = weights * torch.exp(top.logsumexp(-1, keepdim=True)
                                      - logits.logsumexp(-1, keepdim=True))
    y = torch.zeros(flat.shape, dtype=torch.float64)
    for e, expert in enumerate(layer.experts):
        tokens, slots = torch.where(chosen == e)
        if len(tokens):
            y = y.index_add(0, tokens, _expert_call(expert, flat[tokens])
                            * weights[tokens, slots, None])
    return y.reshape(x.shape)


LAYER_EXPERTS = {"swiglu": _swiglus, "mixtral": _mixtrals}


@needs_grouped_mm
@pytest.mark.parametrize("kind", sorted(LAYER_EXPERTS))
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("device, dtype", CASES)
def test_layer_equals_the_loop_within_tolerance(kind: str, norm_topk_prob: bool, device: str,
                                                dtype: torch.dtype) -> None:
    """Output and gradients of x, the gate and every expert's parameters; an
    expert without tokens gets no gradient, as in the loop."""
    _usable(device, dtype)
    d, hidden, num_experts = 16, 32, 8
    experts = LAYER_EXPERTS[kind](num_experts, d, hidden)
    torch.manual_seed(3)
    layer = MixtureOfExperts(experts, d, k=2, grouped_mm=True, return_router_logits=True,
                             norm_topk_prob=norm_topk_prob)
    gate = cast(nn.Linear, layer.gate)
    with torch.no_grad():  # expert 7 never chosen: a gate row far below the others
        gate.weight[7].zero_()
        assert gate.bias is not None
        gate.bias[7] = -1e4
    # Routing in float32 whatever dtype the experts run in (the README's recipe).
    layer = layer.to(device=device, dtype=dtype)
    layer.gate.float()
    reference = copy.deepcopy(layer).to(device="cpu", dtype=torch.float64)
    reference.gate.double()

    gen = torch.Generator().manual_seed(5)
    x_cpu = torch.randn(3, 21, d, generator=gen).to(dtype)
    grad_out = torch.randn(3, 21, d, generator=gen).to(dtype)
    x = x_cpu.to(device).clone().requires_grad_()
    y, aux, logits = layer(x)
    assert y.shape == x.shape and y.dtype == dtype
    (y * grad_out.to(device)).sum().backward()
    chosen = logits.detach().cpu().topk(2, dim=-1).indices
    assert not bool((chosen == 7).any())

    x_ref = x_cpu.double().requires_grad_()
    y_ref = _layer_reference(reference, x_ref, chosen)
    (y_ref * grad_out.double()).sum().backward()

    _close(y, y_ref, dtype, "output")
    _close(x.grad, x_ref.grad, dtype, "gradient of x")
    _close(cast(nn.Linear, layer.gate).weight.grad, cast(nn.Linear, reference.gate).weight.grad,
           dtype, "gradient of the gate")
    for (name, p), (_, p_ref) in zip(layer.experts.named_parameters(),
                                     reference.experts.named_parameters()):
        if p_ref.grad is None:
            assert p.grad is None, f"{name}: the loop gives no gradient"
        else:
            _close(p.grad, p_ref.grad, dtype, f"gradient of experts.{name}")
    assert all(p.grad is None for p in layer.experts[7].parameters())
    calls = [s["calls"] for s in layer.stats()]
    assert calls[7] == 0 and all(c == 1 for c in calls[:7])


@needs_grouped_mm
def test_layer_default_path_is_untouched_and_close() -> None:
    """The same experts with grouped_mm False (the loop, bit for bit) and True."""
    torch.manual_seed(0)
    plain = MixtureOfExperts(_swiglus(6, 16, 16), 16, k=2)
    grouped = copy.deepcopy(plain)
    grouped.grouped_mm = True
    x = torch.randn(30, 16)
    y_plain, aux_plain = plain(x)
    y_grouped, aux_grouped = grouped(x)
    assert torch.equal(aux_plain, aux_grouped)
    _close(y_grouped, y_plain.double(), torch.float32, "output")
    y_plain.square().sum().backward()
    y_grouped.square().sum().backward()
    for (name, a), (_, b) in zip(grouped.named_parameters(), plain.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if b.grad is not None:
            _close(a.grad, b.grad.double(), torch.float32, name)


@needs_grouped_mm
def test_layer_with_a_shared_expert_and_a_lone_output() -> None:
    torch.manual_seed(0)
    shared = SwiGLU(16, 8)
    layer = MixtureOfExperts(_mixtrals(4, 16, 8), 16, k=1, grouped_mm=True,
                             return_aux_loss=False, shared_expert=shared,
                             shared_expert_gate=nn.Linear(16, 1, bias=False))
    plain = copy.deepcopy(layer)
    plain.grouped_mm = False
    x = torch.randn(2, 5, 16)
    y, y_plain = layer(x), plain(x)
    assert isinstance(y, Tensor) and y.shape == x.shape
    _close(y, y_plain.double(), torch.float32, "output")


@needs_grouped_mm
def test_layer_from_mixtral_block() -> None:
    pytest.importorskip("transformers")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    torch.manual_seed(0)
    config: Dict[str, Any] = dict(hidden_size=16, intermediate_size=32, num_local_experts=4,
                                  num_experts_per_tok=2, experts_implementation="eager")
    block = MixtralSparseMoeBlock(MixtralConfig(**config))
    for p in block.parameters():
        nn.init.normal_(p, std=0.3)
    layer = MixtureOfExperts.from_mixtral(block, grouped_mm=True)
    x = torch.randn(2, 7, 16, requires_grad=True)
    y_block = block(x)
    y_block = y_block[0] if isinstance(y_block, tuple) else y_block
    y = layer(x)
    assert isinstance(y, Tensor)
    _close(y, y_block.double(), torch.float32, "output")
    g_layer, = torch.autograd.grad(y.square().sum(), x)
    g_block, = torch.autograd.grad(y_block.square().sum(), x)
    _close(g_layer, g_block.double(), torch.float32, "gradient of x")


# -- refusals of the layer ----------------------------------------------------------

@needs_grouped_mm
@pytest.mark.parametrize("option, value", [
    ("checkpoint", True), ("forward_timeout", 1.0), ("timeout_after_k_min", 1.0),
    ("backward_timeout", 1.0), ("detect_anomalies", True), ("allow_zero_outputs", True),
    ("mode", "inline"),
])
def test_layer_refuses_options(option: str, value: Any) -> None:
    options: Dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=f"grouped_mm=True\\) does not take {option}="):
        MixtureOfExperts(_swiglus(4, 16, 16), 16, grouped_mm=True, **options)
    MixtureOfExperts(_swiglus(4, 16, 16), 16, **options)  # fine without grouped_mm


class _SubSwiGLU(SwiGLU):
    def forward(self, x: Tensor) -> Tensor:
        return 2 * super().forward(x)


def _with_bias() -> nn.Module:
    expert = SwiGLU(16, 16)
    expert.w2 = nn.Linear(16, 16)
    return expert


def _hooked() -> nn.Module:
    expert = SwiGLU(16, 16)
    expert.register_forward_hook(lambda module, args, out: out * 2)
    return expert


def _remote() -> nn.Module:
    from moe_autograd.remote import RemoteExpert
    return RemoteExpert("worker", "expert", transport=cast(Any, object()))


@needs_grouped_mm
@pytest.mark.parametrize("make, match", [
    (lambda: nn.Linear(16, 16), r"expert 3 \(Linear\) is not a same-shape SwiGLU"),
    (lambda: _SubSwiGLU(16, 16), r"expert 3 \(_SubSwiGLU\) is not a same-shape SwiGLU"),
    (_with_bias, "nn.Linear without bias"),
    (_hooked, "has forward hooks"),
    (_remote, r"expert 3 \(RemoteExpert\) is a remote expert"),
    (lambda: SwiGLU(16, 8), "must share one shape"),
    (lambda: SwiGLU(16, 16).double(), "torch.float64"),
    (lambda: _mixtrals(1, 16, 16)[0], "must share one shape|activation"),
])
def test_layer_refuses_experts(make: Callable[[], nn.Module], match: str) -> None:
    experts = _swiglus(3, 16, 16) + [make()]
    with pytest.raises(ValueError, match=match):
        MixtureOfExperts(experts, 16, grouped_mm=True)


@needs_grouped_mm
def test_layer_refuses_mixed_activations_and_feature_counts() -> None:
    experts = _mixtrals(2, 16, 16) + _mixtrals(1, 16, 16, act=torch.tanh)
    with pytest.raises(ValueError, match=r"expert 2 \(MixtralExpert\) has activation"):
        MixtureOfExperts(experts, 16, grouped_mm=True)
    with pytest.raises(ValueError, match="in_features=8"):
        MixtureOfExperts(_swiglus(2, 16, 16), 8, k=1, grouped_mm=True)
    with pytest.raises(ValueError, match="out_features=8"):
        MixtureOfExperts(_swiglus(2, 16, 16), 16, k=1, grouped_mm=True, out_features=8)


@needs_grouped_mm
def test_layer_checks_its_experts_each_forward() -> None:
    """An expert swapped in after construction is refused at the next forward."""
    layer = MixtureOfExperts(_swiglus(3, 16, 16), 16, k=3, grouped_mm=True)
    layer.experts[1] = nn.Linear(16, 16)
    with pytest.raises(ValueError, match=r"expert 1 \(Linear\)"):
        layer(torch.randn(4, 16))


@needs_grouped_mm
def test_layer_refuses_unaligned_experts_at_forward() -> None:
    layer = MixtureOfExperts(_swiglus(3, 16, 12), 16, k=2, grouped_mm=True).bfloat16()
    with pytest.raises(ValueError, match="must be multiples of 8 in torch.bfloat16"):
        layer(torch.randn(4, 16, dtype=torch.bfloat16))


def test_stack_experts_shapes_and_layout() -> None:
    experts = _swiglus(3, 16, 8)
    assert check_experts(experts) == 16
    stacked = stack_experts(experts, [2, 0])
    assert stacked.w_gate_up.shape == (2, 16, 16) and stacked.w_down.shape == (2, 8, 16)
    assert stacked.act is F.silu
    first = cast(SwiGLU, experts[2])
    assert torch.equal(stacked.w_gate_up[0], torch.cat([first.w1.weight, first.w3.weight]).t())
    assert torch.equal(stacked.w_down[1], cast(SwiGLU, experts[0]).w2.weight.t())
    stacked.w_gate_up.sum().backward()
    assert cast(SwiGLU, experts[1]).w1.weight.grad is None
    grad = cast(SwiGLU, experts[0]).w1.weight.grad
    assert grad is not None and bool((grad == 1).all())

