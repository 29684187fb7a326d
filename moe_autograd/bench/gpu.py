"""``gpu``: one MoE training step on a GPU, in bf16, seven ways.

Why: the CPU rows (:mod:`.moe_scale`) cannot tell how the runtime fares
where MoE layers are trained, on a GPU, against what people run there: the
plain expert loop and grouped GEMM (one kernel for all experts' matmuls). The
goal: say where the runtime wins, where grouped GEMM wins, and why.

Variants of every row, on the same input, gate, routing and expert weights
(the stacked ones are copies of the per-expert ``nn.Linear`` weights), each
timed over forward + backward of one step (the router included; the output's
gradient a fixed tensor, so no loss kernel; the gradients of the weights and
of the input are computed):

``loop`` (the baseline)
    :class:`~.moe_scale.LoopBlock`: Mixtral's routing and a Python loop over
    the :class:`~.moe_scale.SwiGLU` experts, ``index_add_`` per expert.
``hf-grouped_mm``
    transformers' ``MixtralExperts`` (stacked ``gate_up_proj`` /
    ``down_proj``) with ``config._experts_implementation = "grouped_mm"``
    (``transformers.integrations.moe.grouped_mm_experts_forward``: sort by
    expert, two grouped GEMMs, a deterministic ``[tokens, k, d]`` sum).
``grouped_mm``
    ``torch._grouped_mm`` called directly (:func:`grouped_swiglu`): tokens
    sorted by expert, int32 cumulative offsets, gate/up then down.
``moe``
    ours: :class:`~moe_autograd.moe.MixtureOfExperts` over the same experts
    and gate, its default (auto) mode.
``run_experts``
    ours: :func:`~moe_autograd.moe.run_experts` over the same experts with
    the loop's routing.
``moe-grouped_mm``
    ours: the same layer with ``grouped_mm=True`` (its opt-in grouped GEMM
    path: the experts' weights stacked each step, then ``grouped_experts``).
``ours-grouped``
    ``moe_autograd.moe.grouped_experts(x, top_k_index, top_k_weights,
    w_gate_up, w_down)`` over the stacked weights of ``grouped_mm`` (``[E, d,
    2 x hidden]`` with the gate half first, ``[E, hidden, d]``), when the
    package has that function.

A variant that cannot be built or fails its first call is a ``skipped`` row.

Rows: Mixtral-like (d 4,096, hidden 14,336, 8 experts, k 2; 4,096 and 16,384
tokens) and many small experts (d 1,024, hidden 512, k 2, 16,384 tokens; 64
and 256 experts). A step is ``18 x d x hidden x tokens x k`` FLOP (three
matmuls, backward twice the forward): 34.6 TFLOP for Mixtral at 16,384
tokens (about 45 ms at 800 TFLOP/s), 8.7 TFLOP at 4,096, 0.31 TFLOP for the
small experts, whose rows should instead be bound by kernel launches and
host syncs (the loop launches dozens of kernels per expert, and syncs to
split its tokens). Per row group and variant: a first forward and step
(checked, untimed), 3 warm-ups, 10 timed samples and one step for memory,
about 100 steps a row group; about a minute for the whole group on an
H100/H200, estimated (``--quick``: 1 warm-up, 3 samples).

Measured as :mod:`.measure` does (variants interleaved, order rotating,
medians, paired ratios variant / loop, collector off while timing), each
sample between two CUDA events, the first after a ``torch.cuda.synchronize()``,
the second after the step and another (the runtime may use streams of its
own); all gradients are set to None before each step (as ``zero_grad`` does),
untimed. The
note gives tokens/s and achieved TFLOP/s of the variant and of the loop, the
peak GPU memory of one step beyond what was allocated before it (weights and
input; the step's activations and new gradients: ``max_memory_allocated``
after ``reset_peak_memory_stats``, same for all), and the largest difference
of the output from the loop's (relative to the loop's largest value). With
``profile``, one more step per variant runs under ``torch.profiler``; the
tables (kernels by self CUDA time) go to ``<profile_dir>/gpu-<row>.txt``, or
to stderr without a directory.

On the CPU (``bench --device cpu --only gpu``) the rows run at tiny sizes, in
bf16, timed with ``perf_counter``, without memory: a smoke run of the code,
not numbers.
"""
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import moe as package
from ..moe import MixtureOfExperts
from .measure import Plan, Row, compare, row
from .moe_scale import LoopBlock, SwiGLU

__all__ = ["Setup", "GPU_SETUPS", "CPU_SETUPS", "bench_gpu", "grouped_swiglu"]

DTYPE = torch.bfloat16
Forward = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Setup:
    """One row group: ``experts`` SwiGLU experts ``d``-``hidden``, top-``k``."""

    name: str
    experts: int
    d: int
    hidden: int
    tokens: int
    k: int = 2

    @property
    def flop(self) -> float:
        """Forward + backward FLOP of the experts' matmuls in one step."""
        return 18.0 * self.d * self.hidden * self.tokens * self.k


GPU_SETUPS = [Setup("mixtral-4k", 8, 4096, 14336, 4096),
              Setup("mixtral-16k", 8, 4096, 14336, 16384),
              Setup("e64", 64, 1024, 512, 16384), Setup("e256", 256, 1024, 512, 16384)]
# bf16 grouped GEMMs need 16-byte aligned strides: d and hidden multiples of 8.
CPU_SETUPS = [Setup("tiny-e4", 4, 64, 32, 64), Setup("tiny-e16", 16, 32, 16, 64)]


def grouped_swiglu(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, w_gate_up: Tensor,
                   w_down: Tensor) -> Tensor:
    """``y[t] = sum_j w[t, j] * down_e(silu(gate_e x) * up_e x)`` for ``e =
    top_k_index[t, j]``, with two ``torch._grouped_mm`` calls over the stacked
    weights ``w_gate_up`` ``[E, d, 2 x hidden]`` (gate half first) and
    ``w_down`` ``[E, hidden, d]``."""
    grouped_mm = getattr(torch, "_grouped_mm")
    tokens, k = top_k_index.shape
    ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    bounds = torch.arange(w_gate_up.shape[0], device=ids.device)
    offs = torch.searchsorted(ids, bounds, right=True).to(torch.int32)  # cumulative ends
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    gate, up = grouped_mm(rows, w_gate_up, offs=offs).chunk(2, dim=-1)
    out = grouped_mm(F.silu(gate) * up, w_down, offs=offs)
    out = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
    # Back to token order (each row once: no atomics), then the k answers summed.
    unsorted = out.new_empty(out.shape).index_copy(0, order, out)
    return unsorted.view(tokens, k, -1).sum(dim=1)


def _route(gate: nn.Module, x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """The loop block's routing: softmax in float32, top-k, renormalised."""
    weights = F.softmax(gate(x), dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(weights, k, dim=-1)
    return top_i, (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)


def _hf_experts(s: Setup, w1: Tensor, w3: Tensor, w2: Tensor) -> nn.Module:
    """transformers' ``MixtralExperts`` on the grouped_mm implementation,
    holding copies of the weights ``[E, hidden, d]`` (w1, w3) and ``[E, d,
    hidden]`` (w2); returns ``experts(x, top_k_index, top_k_weights)``."""
    from transformers import MixtralConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
        raise NotImplementedError("transformers has no 'grouped_mm' experts implementation")
    config = MixtralConfig(hidden_size=s.d, intermediate_size=s.hidden,
                           num_local_experts=s.experts, num_experts_per_tok=s.k,
                           hidden_act="silu")
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        experts = MixtralExperts(config)
    experts.gate_up_proj = nn.Parameter(torch.cat([w1, w3], dim=1))
    experts.down_proj = nn.Parameter(w2.clone())
    return experts


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


class _Model:
    """The weights of one row group, shared by the variants (see the module
    docstring), and the variants themselves."""

    def __init__(self, s: Setup, device: torch.device) -> None:
        torch.manual_seed(0)
        with torch.device(device):
            self.gate = nn.Linear(s.d, s.experts, bias=False).to(DTYPE)
            experts = [SwiGLU(s.d, s.hidden).to(DTYPE) for _ in range(s.experts)]
        self.moe = MixtureOfExperts(experts, s.d, k=s.k, gate=self.gate,
                                    router_dtype=torch.float32, return_aux_loss=False)
        self.loop = LoopBlock(self.gate, self.moe.experts, s.k)
        self.moe_grouped: Optional[nn.Module] = None
        self.moe_grouped_error = ""
        try:  # the layer's opt-in grouped GEMM path, over the same experts and gate
            self.moe_grouped = MixtureOfExperts(experts, s.d, k=s.k, gate=self.gate,
                                                router_dtype=torch.float32,
                                                return_aux_loss=False, grouped_mm=True)
        except Exception as error:  # noqa: BLE001 - a skipped row says why
            self.moe_grouped_error = f"{type(error).__name__}: {error}"
        with torch.no_grad():
            w1, w3, w2 = (torch.stack([getattr(e, name).weight for e in experts])
                          for name in ("w1", "w3", "w2"))
            self.w_gate_up = nn.Parameter(torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous())
            self.w_down = nn.Parameter(w2.transpose(1, 2).contiguous())
        self.params: List[Tensor] = [*self.moe.parameters(), self.w_gate_up, self.w_down]
        self.hf: Optional[nn.Module] = None
        self.hf_error = ""
        try:
            self.hf = _hf_experts(s, w1, w3, w2)
            self.params += list(self.hf.parameters())
        except Exception as error:  # an install without it, another API
            self.hf_error = f"{type(error).__name__}: {error}"
        del w1, w3, w2

    def variants(self, k: int) -> Tuple[Dict[str, Forward], Dict[str, str]]:
        """The variants' forwards, and why the missing ones are missing."""
        gate, w_gate_up, w_down, moe = self.gate, self.w_gate_up, self.w_down, self.moe
        found: Dict[str, Forward] = {"loop": self.loop}
        skipped: Dict[str, str] = {}
        hf = self.hf
        if hf is not None:
            found["hf-grouped_mm"] = lambda x: hf(x, *_route(gate, x, k))
        else:
            skipped["hf-grouped_mm"] = self.hf_error
        if hasattr(torch, "_grouped_mm"):
            found["grouped_mm"] = lambda x: grouped_swiglu(x, *_route(gate, x, k), w_gate_up,
                                                           w_down)
        else:
            skipped["grouped_mm"] = f"torch {torch.__version__} has no torch._grouped_mm"
        found["moe"] = lambda x: _first(moe(x))
        moe_grouped = self.moe_grouped
        if moe_grouped is not None:
            found["moe-grouped_mm"] = lambda x: _first(moe_grouped(x))
        else:
            skipped["moe-grouped_mm"] = self.moe_grouped_error
        experts = list(moe.experts)
        found["run_experts"] = lambda x: package.run_experts(experts, x, *_route(gate, x, k))
        ours: Optional[Callable[..., Tensor]] = getattr(package, "grouped_experts", None)
        if ours is not None:
            found["ours-grouped"] = lambda x: ours(x, *_route(gate, x, k), w_gate_up, w_down)
        else:
            skipped["ours-grouped"] = "moe_autograd.moe has no grouped_experts"
        return found, skipped

    def clear(self, x: Tensor) -> None:
        for p in self.params:
            p.grad = None
        x.grad = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(step: Callable[[], None], device: torch.device) -> float:
    """One step's milliseconds: between two CUDA events on a GPU, the first
    after a synchronize, the second after the step and a device-wide
    synchronize (the runtime may run calls on streams of its own);
    ``perf_counter`` elsewhere. The collector is off meanwhile."""
    gc.collect(1)
    enabled = gc.isenabled()
    gc.disable()
    try:
        if device.type == "cuda":
            _sync(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            _sync(device)
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        begin = time.perf_counter()
        step()
        return (time.perf_counter() - begin) * 1e3
    finally:
        if enabled:
            gc.enable()


def _measure(steps: Dict[str, Callable[[], None]], before: Callable[[], None], plan: Plan,
             device: torch.device) -> Dict[str, List[float]]:
    """:func:`.measure.measure` with a device timer, and ``before`` (untimed)
    ahead of every step."""
    names = list(steps)
    gc.collect()
    for _ in range(plan.warmup):
        for name in names:
            before()
            steps[name]()
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(plan.reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            before()
            samples[name].append(_time_ms(steps[name], device))
    return samples


def _peak_mib(step: Callable[[], None], before: Callable[[], None],
              device: torch.device) -> Optional[float]:
    """Peak GPU memory of one step beyond what was allocated before it."""
    if device.type != "cuda":
        return None
    before()
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _profile_tables(steps: Dict[str, Callable[[], None]], before: Callable[[], None],
                    device: torch.device) -> Iterator[Tuple[str, str]]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    keys = (["self_device_time_total", "self_cuda_time_total"] if device.type == "cuda"
            else ["self_cpu_time_total"])
    for name, step in steps.items():
        before()
        _sync(device)
        with profile(activities=activities) as prof:
            step()
            _sync(device)
        events = prof.key_averages()
        for key in keys:  # the first name this torch knows
            try:
                table = events.table(sort_by=key, row_limit=20, max_name_column_width=100)
                break
            except (AttributeError, KeyError, ValueError):
                table = f"(no {key} in this torch's profiler)"
        yield name, table


def _where(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{device.type} (smoke sizes), torch {torch.__version__}"


def _step(forward: Forward, x: Tensor, dy: Tensor) -> Callable[[], None]:
    def step() -> None:
        forward(x).backward(dy)
    return step


def _bench_setup(s: Setup, model: _Model, plan: Plan, device: torch.device,
                 profile: bool, profile_dir: Optional[str]) -> List[Row]:
    torch.manual_seed(1)
    x = torch.randn(s.tokens, s.d, device=device, dtype=DTYPE, requires_grad=True)
    dy = torch.randn(s.tokens, s.d, device=device, dtype=DTYPE)
    variants, skipped = model.variants(s.k)
    rows: List[Row] = []
    with torch.no_grad():
        reference = model.loop(x).float()
    errors: Dict[str, float] = {}
    for name in list(variants):
        try:  # a first forward and step of each: a variant that fails is a skipped row
            with torch.no_grad():
                y = variants[name](x).float()
            errors[name] = float((y - reference).abs().max() / reference.abs().max())
            del y
            model.clear(x)
            _step(variants[name], x, dy)()
        except Exception as error:
            skipped[name] = f"{type(error).__name__}: {error}"
            del variants[name]
    del reference
    if "loop" not in variants:
        raise RuntimeError(f"the loop baseline failed: {skipped['loop']}")
    steps = {name: _step(f, x, dy) for name, f in variants.items()}
    before = lambda: model.clear(x)  # noqa: E731
    samples = _measure(steps, before, plan, device)
    peaks = {name: _peak_mib(step, before, device) for name, step in steps.items()}
    if profile:
        text = "".join(f"== {s.name} / {name} ==\n{table}\n\n"
                       for name, table in _profile_tables(steps, before, device))
        if profile_dir:
            os.makedirs(profile_dir, exist_ok=True)
            path = os.path.join(profile_dir, f"gpu-{s.name}.txt")
            with open(path, "w", encoding="utf-8") as out:
                out.write(text)
            print(f"[bench] gpu/{s.name}: profiler tables in {path}", file=sys.stderr, flush=True)
        else:
            print(text, file=sys.stderr, flush=True)
    model.clear(x)

    def perf(name: str) -> str:
        ms = statistics.median(samples[name])
        peak = peaks[name]
        memory = f", peak +{peak:.0f} MiB" if peak is not None else ""
        return (f"{s.tokens / ms * 1e3:,.0f} tok/s, {s.flop / ms * 1e-9:.3g} TFLOP/s{memory}")

    sizes = (f"bf16, {s.experts} SwiGLU experts d={s.d} hidden={s.hidden}, k={s.k}, "
             f"{s.tokens} tokens, fwd+bwd; {_where(device)}")
    for name in variants:
        if name != "loop":
            note = (f"{perf(name)}; loop {perf('loop')}; max |y - y_loop| / max |y_loop| "
                    f"{errors[name]:.1e}; {sizes}")
            rows.append(compare(f"gpu/{s.name}/{name}", samples, "loop", name, note=note))
    for name, why in skipped.items():
        rows.append(row(f"gpu/{s.name}/{name}", None, None, None, note=f"skipped: {why}"))
    return rows


def bench_gpu(quick: bool, device: str = "cuda", *, profile: bool = False,
              profile_dir: Optional[str] = None,
              setups: Optional[Sequence[Setup]] = None) -> List[Row]:
    """The group's rows on ``device`` (``"cuda"``: :data:`GPU_SETUPS`; ``"cpu"``:
    :data:`CPU_SETUPS`, a smoke run); a single skipped row without CUDA."""
    if device == "cuda" and not torch.cuda.is_available():
        why = ("torch built without CUDA" if torch.version.cuda is None
               else "no CUDA device visible")
        return [row("gpu", None, None, None,
                    note=f"skipped: CUDA is not available ({why}, torch {torch.__version__})")]
    where = torch.device(device)
    if setups is None:
        setups = GPU_SETUPS if where.type == "cuda" else CPU_SETUPS
    plan = Plan.pick(quick, Plan(warmup=3, reps=10), Plan(warmup=1, reps=3))
    rows: List[Row] = []
    model: Optional[_Model] = None
    shape: Any = None
    for s in setups:
        try:  # one row group out of memory must not lose the others' rows
            if model is None or shape != (s.experts, s.d, s.hidden):
                model = None  # free the previous weights first
                gc.collect()
                if where.type == "cuda":
                    torch.cuda.empty_cache()
                model, shape = _Model(s, where), (s.experts, s.d, s.hidden)
            rows.extend(_bench_setup(s, model, plan, where, profile, profile_dir))
        except Exception as error:
            rows.append(row(f"gpu/{s.name}", None, None, None,
                            note=f"FAILED: {type(error).__name__}: {error}"))
    return rows
