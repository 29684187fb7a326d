"""Do the kernels of different calls overlap on the GPU? A torch.profiler trace says.

Runs one training step of ``--experts`` small MLP experts through
``parallel_apply`` (each mode) and through a plain loop, on CUDA, under
``torch.profiler``; exports each trace (chrome format) and reads its kernels:
how many streams they ran on, and how much of the step's kernel time had two
or more kernels running at once (kernels of different calls overlapping).
Also times each variant with CUDA events (median of ``--repeats``).

    MOE_AUTOGRAD_CUDA_STREAMS=8 python tools/gpu_overlap.py --out DIR [--experts 16 ...]

(``MOE_AUTOGRAD_CUDA_STREAMS=8`` puts the calls on streams of their own; without it
every call runs on the caller's stream and nothing can overlap.)
"""
import argparse
import json
import os
import statistics
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor, nn

from moe_autograd import parallel_apply


def _experts(n: int, d: int, hidden: int) -> List[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)).cuda().to(
        torch.bfloat16) for _ in range(n)]


def _step(run: Callable[[List[Tensor]], List[Tensor]], xs: List[Tensor]) -> None:
    outs = run(xs)
    torch.stack([o.float().square().mean() for o in outs]).sum().backward()


def _kernels(trace: str) -> List[Tuple[float, float, int]]:
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(e["args"].get("stream", -1)))
            for e in events if e.get("cat") == "kernel" and "dur" in e]


def _concurrency(kernels: List[Tuple[float, float, int]]) -> Dict[str, Any]:
    """Busy time, and the part of it with >= 2 kernels running (a sweep)."""
    points = sorted([(s, 1) for s, _, _ in kernels] + [(e, -1) for _, e, _ in kernels])
    running, last, busy, overlapped = 0, 0.0, 0.0, 0.0
    for t, step in points:
        if running >= 1:
            busy += t - last
        if running >= 2:
            overlapped += t - last
        running += step
        last = t
    return {"kernels": len(kernels), "streams": len({s for _, _, s in kernels}),
            "busy_us": round(busy, 1), "overlapped_us": round(overlapped, 1),
            "overlap_fraction": round(overlapped / busy, 3) if busy else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    experts = _experts(args.experts, args.d, args.hidden)
    xs = [torch.randn(args.tokens, args.d, device="cuda", dtype=torch.bfloat16,
                      requires_grad=True) for _ in experts]
    variants: Dict[str, Callable[[List[Tensor]], List[Tensor]]] = {
        "loop": lambda xs: [e(x) for e, x in zip(experts, xs)],
        "inline": lambda xs: parallel_apply(experts, xs, mode="inline"),
        "lanes": lambda xs: parallel_apply(experts, xs, mode="lanes"),
        "parallel": lambda xs: parallel_apply(experts, xs, mode="parallel"),
    }
    report: Dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "experts": args.experts, "tokens": args.tokens, "d": args.d,
                              "hidden": args.hidden, "dtype": "bfloat16"}
    times: Dict[str, List[float]] = {name: [] for name in variants}
    for _ in range(3):
        for name, run in variants.items():
            _step(run, xs)
    torch.cuda.synchronize()
    for r in range(args.repeats):
        names = list(variants)
        names = names[r % len(names):] + names[:r % len(names)]  # rotate the order
        for name in names:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            _step(variants[name], xs)
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    for name, run in variants.items():
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            _step(run, xs)
            torch.cuda.synchronize()
        trace = os.path.join(args.out, f"trace_{name}.json")
        prof.export_chrome_trace(trace)
        entry = _concurrency(_kernels(trace))
        entry["step_ms_median"] = round(statistics.median(times[name]), 3)
        entry["ratio_to_loop"] = round(statistics.median(times[name])
                                       / statistics.median(times["loop"]), 3)
        report[name] = entry
        if name not in ("loop", "parallel"):
            os.remove(trace)  # keep two traces: what comes back is limited
    print(json.dumps(report, indent=1))
    with open(os.path.join(args.out, "overlap.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
