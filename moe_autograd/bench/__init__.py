"""Benchmarks of the runtime against its baselines, measured side by side.

Run ``python -m moe_autograd bench [--quick] [--only NAME...] [--markdown]
[--device {cpu,cuda}] [--profile [--profile-dir DIR]]``.
Every row compares a baseline with ours in the *same* process and the *same*
loop; ``ratio`` is ours / baseline, so lower is better everywhere.

Methodology (implemented in :mod:`.measure`)
--------------------------------------------
* **Interleaving.** Within one row, every repetition runs each variant once,
  back to back, and the order rotates from one repetition to the next. Slow
  drift (another job on the machine, thermal or frequency changes, the
  allocator growing) then hits baseline and ours alike instead of whichever
  variant happened to run during the disturbance, and no variant always runs
  right after a particular other one.
* **Medians, paired.** Time columns are medians over repetitions: a few samples
  hit by a preemption or a page fault storm do not move them, where they would
  drag a mean. The ratio is the median of the per-repetition ratios (each pair
  was measured seconds apart), which cancels drift further; it may differ a
  little from the quotient of the two medians. The note gives the ratio's
  interquartile range and the number of repetitions: a wide range means a
  noisy machine, not a slow runtime.
* **Warm-up.** Each row first runs every variant untimed (thread start-up,
  first-touch allocation of gradients, lazy initialisation), then times.
* **GC.** The collector is disabled during each timed sample, as :mod:`timeit`
  does; the young generations are collected before each sample and a full
  collection runs before each row.
* ``--quick`` only cuts repetitions (and, for the heavy rows, the warm-up):
  a smoke run of the whole table, not numbers to publish.

Groups
------
``latency``, ``overhead``, ``compute``
    :mod:`.core`: latency-bound calls against the 2L limit, per-call overhead,
    compute-bound experts.
``checkpoint``, ``recompute-early``, ``rng``
    :mod:`.checkpoint`: memory kept for backward and time of checkpointed
    calls (with and without dropout); early recomputation; the cost of the
    per-call random stream.
``wire``
    :mod:`.wire`: what the remote wire (a schema, no pickle) and its
    authentication (GMAC; AES-256-GCM encrypted) cost per pass, against pickle.
``remote``
    :mod:`.remote`: remote experts against ``torch.distributed.autograd``.
``trainers``
    :mod:`.trainers`: throughput of 1, 2 and 4 trainers calling one expert
    server, with batching across calls and without (``remote/clients-*``).
``ray``
    :mod:`.ray_remote`: remote experts on Ray against plain Ray actor calls
    (skipped without ``ray``).
``moe``
    :mod:`moe_autograd.moe.bench`: a training step with a straggling expert.
``moe-scale``
    :mod:`.moe_scale`: the MoE layer with 8, 64 and 256 experts against a
    Mixtral-style loop block.
``elastic``
    :mod:`.elastic`: the MoE layer over an elastic fleet: step time while
    servers join and leave vs without churn; steps from a join to its first
    served call.
``ray-elastic``
    :mod:`.ray_elastic`: the same two rows with the fleet on Ray (RayFleet
    over named actors; skipped without ``ray``).
``replicas``
    :mod:`.replicas`: the MoE layer over fleet experts with three replicas
    each, one of them 5x slower, against all three fast: replica choice by
    measured latency (``remote/replicas-slow-one``) and by age (the old
    behaviour).
``gpu``
    :mod:`.gpu`: one bf16 MoE training step on a GPU (Mixtral-like and many
    small experts): the expert loop, transformers' and torch's grouped GEMM,
    and ours. Runs with ``--device cuda`` (alone, unless ``--only`` names
    more groups; a skipped row without CUDA), or as a CPU smoke run at tiny
    sizes with ``--device cpu --only gpu``; never in a plain CPU run.
    ``--profile`` adds ``torch.profiler`` tables per variant (to
    ``--profile-dir``, else stderr).

``remote`` and ``moe`` are imported when they run (they need more of torch and
of the package); their ``run(quick)`` returns dicts with keys ``name,
baseline_ms, ours_ms, ratio, goal, note``.
"""
import argparse
import importlib
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .checkpoint import bench_checkpoint, bench_recompute_early, bench_rng
from .core import bench_compute, bench_latency, bench_overhead
from .measure import Plan, Row, row
from .report import HEADERS, format_markdown, format_text, machine_info

__all__ = ["Row", "Plan", "main", "run_benchmarks", "GROUPS", "NOTES", "HEADERS", "format_text",
           "format_markdown", "machine_info"]


def _parents(module: str) -> List[str]:
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _number(value: Any) -> Optional[float]:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _from_dict(d: Mapping[str, Any]) -> Row:
    baseline, ours = _number(d.get("baseline_ms")), _number(d.get("ours_ms"))
    ratio = _number(d.get("ratio"))
    if ratio is None and baseline and ours is not None:
        ratio = ours / baseline
    r = row(str(d.get("name", "?")), baseline, ours, ratio, d.get("goal"), str(d.get("note") or ""),
            str(d.get("unit") or "ms"))
    if isinstance(d.get("met"), bool):
        r.met = d["met"]
    return r


def _external(group: str, module: str) -> Callable[[bool], List[Row]]:
    """A group whose module is imported when it runs; its ``run(quick)``
    returns rows as dicts."""
    def run(quick: bool) -> List[Row]:
        try:
            mod = importlib.import_module(module)
        except ImportError as error:
            why = "not present" if getattr(error, "name", None) in _parents(module) else f"{error}"
            return [row(group, None, None, None, note=f"skipped: {module} {why}")]
        return [_from_dict(d) for d in mod.run(quick)]
    return run


GROUPS: Dict[str, Callable[[bool], List[Row]]] = {
    "latency": bench_latency,
    "overhead": bench_overhead,
    "compute": bench_compute,
    "checkpoint": bench_checkpoint,
    "recompute-early": bench_recompute_early,
    "rng": bench_rng,
    "wire": lambda quick: importlib.import_module(f"{__name__}.wire").bench_wire(quick),
    "remote": _external("remote", f"{__name__}.remote"),
    "trainers": lambda quick: importlib.import_module(f"{__name__}.trainers").bench_trainers(quick),
    "ray": _external("ray", f"{__name__}.ray_remote"),
    "moe": _external("moe", "moe_autograd.moe.bench"),
    "moe-scale": lambda quick: importlib.import_module(f"{__name__}.moe_scale").bench_moe_scale(quick),
    "elastic": _external("elastic", f"{__name__}.elastic"),
    "ray-elastic": _external("ray-elastic", f"{__name__}.ray_elastic"),
    "replicas": _external("replicas", f"{__name__}.replicas"),
    "durable": lambda quick: importlib.import_module(f"{__name__}.durable").bench_durable(quick),
    "gpu": lambda quick: _gpu(quick, "cuda"),
}

DEVICE_GROUPS = ("gpu",)  # run by --device cuda or --only, never by a plain CPU run


def _gpu(quick: bool, device: str, profile: bool = False,
         profile_dir: Optional[str] = None) -> List[Row]:
    module = importlib.import_module(f"{__name__}.gpu")
    rows: List[Row] = module.bench_gpu(quick, device, profile=profile, profile_dir=profile_dir)
    return rows


NOTES: Dict[str, str] = {
    "latency": "Sleeping calls release the GIL, so all 32 overlap in forward and, through the "
               "one parallel node, in backward too; the naive pool overlaps forward only, "
               "since the engine runs its 32 backward nodes one after another.",
    "overhead": "Tiny calls: the engine's own per-call cost is the baseline. As users get it "
                "(auto mode) such calls run inline, the loop itself plus each call's random "
                "stream (fork + activation); forced to fan out, each call also pays the worker "
                "hand-off (GIL round trips), the emulated autograd context and its share of "
                "the one parallel node.",
    "compute": "On 2 cores the Python loop already keeps every core busy inside each ATen "
               "kernel (intra-op threads), so fanning out only adds contention: auto mode "
               "learns the calls are CPU-bound and runs them in cores // intra-op-threads "
               "lanes (here one: inline, the same bits as the fan-out). The loaded variant "
               "spins one core in another process during both arms. The cold variants "
               "time a new site's first batches: torch.nn's own modules on the CPU cannot "
               "wait, so their first batch already runs within the cores (policy.computes); "
               "behind a forward of the user's the first fans out (16 calls crowding 2 cores, "
               "measured) and every later one runs in the mode that batch picked.",
    "checkpoint": "Memory kept for backward, from public means only: the unique storages packed "
                  "by a saved_tensors_hooks pack hook around parallel_apply (the runtime packs the "
                  "calls' saved tensors through the caller's hooks, in call order), plus the storages of the inputs the caller "
                  "passed (every call keeps its inputs until backward as detached views sharing "
                  "their storage, so they are counted from the caller's tensors); parameters "
                  "excluded. A checkpointed call should save nothing, so ours ~ the inputs. "
                  "Time: one extra forward per call, ideally +1/3.",
    "recompute-early": "The trigger is the last layer's output, so recomputation is queued as "
                       "backward starts and may overlap the backward of all 4 layers and the "
                       "concat; the gain is bounded by the recomputation's own time ('at most' "
                       "in the row) and by the backward work it overlaps. On a CPU with few "
                       "cores the gain stays well below that: the recomputation (on workers) and "
                       "the rest of backward (on the engine's thread) are both compute-bound and "
                       "share the same cores, each kernel fanning out over its own intra-op "
                       "threads, so running them together mostly interleaves the work instead "
                       "of hiding it; only each side's idle gaps (Python glue, small kernels, "
                       "hand-offs) are won. Idle cores or an accelerator stream would let it "
                       "approach the bound.",
    "rng": "Every call draws from its own random stream (moe_autograd.rng): forked on the "
           "caller (one 64-bit draw), activated around the call (a dispatch-key switch). Ops "
           "that draw nothing never leave C++; each random op (one per dropout layer) makes "
           "one Python hop that hands it the stream's generator. The direct rows show that "
           "cost per call without the runtime around it.",
    "moe-scale": "CPU-bound experts on 2 cores: the loop block already keeps both cores busy "
                 "inside each expert's kernels, so the best the layer can do is cost nothing "
                 "extra (auto mode runs such calls inline or in lanes, see moe_autograd.policy); "
                 "the 256-expert row is dominated by per-call costs (32 tokens per expert).",
    "wire": "No engine: the CPU both ends of a connection spend encoding, sealing, opening "
            "and decoding the messages (moe_autograd.remote.wire, .auth), against pickling "
            "the old messages. On RPC, TensorPipe moved tensors without pickling them before "
            "and still does (they are buffers beside the frame); on Ray, torch's reducers "
            "pickled them.",
    "remote": "Loopback RPC on this machine: every message costs CPU on both ends, so with few "
              "cores the L = 5 ms rows are CPU-bound; the L = 50 ms rows show the "
              "latency-bound behaviour. Ours sends one request per server and pass "
              "(moe_autograd.remote.batching), torch one RPC per call and pass.",
    "trainers": "Loopback RPC, one server and 4 trainer processes on this machine; ratio = "
                "steps/s of k trainers over one trainer's (higher is better). The expert "
                "emulates one accelerator whose kernels are launch-bound (5 ms each, one at a "
                "time), so without batching the trainers queue for it; with "
                "batch_across_calls (batch_window = one kernel) the trainers' calls run as one "
                "kernel (calls per batch in the note). "
                "Every message still costs CPU on both ends (the note gives CPU per step): "
                "with few cores, the trainers' and the server's CPU bounds the 4-trainer rows.",
    "ray": "A local Ray instance on this machine (4 server actors, 16 experts): ours sends one "
           "request per server and pass through RayTransport (moe_autograd.remote.ray_backend), "
           "the plain baseline one .remote() per call and pass; every Ray message costs CPU "
           "on both ends, so with few cores the L = 5 ms rows are CPU-bound.",
    "elastic": "Servers that join are forked in advance (from a forkserver that imported "
               "torch) and wait for their cue, so the churn rows time the runtime's join and "
               "leave, not an interpreter's start-up; a churn block is back-to-back churn "
               "(the next event could start at once), the densest the fleet allows.",
    "ray-elastic": "A local Ray instance on this machine: servers that join are actors started "
                   "in advance, waiting in their experts factory for a cue, so the rows time "
                   "the fleet's churn (the start completing, RayFleet seeing it, calls moving; "
                   "a drain), not a worker importing torch; the fleet polls every 0.1 s and "
                   "re-reads the cluster at once when a name has no replica.",
    "replicas": "Loopback RPC, an elastic fleet of 3 servers, latency emulated by sleeps "
                "(5 ms per pass, 25 ms on the slow replica). The balancer explores each "
                "replica once, then draws two and takes the lower (EWMA round trip x (1 + the "
                "expert's calls in flight there)); the slow replica is re-probed every 10 s, "
                "so a long run pays one slow step per 10 s and expert (the 'ratio of means' in "
                "the note includes them).",
    "gpu": "ratio = variant / the loop block, one bf16 fwd+bwd step with the router, same "
           "routing and weights (moe_autograd.bench.gpu). Grouped GEMM runs every expert's "
           "matmuls in one kernel per projection without syncing with the host; the loop, "
           "run_experts and the layer launch dozens of kernels per expert and sync to split "
           "the tokens: expected to lose with many small experts (launch-bound), and to tie "
           "with a few big ones (Mixtral), where the same GEMMs dominate; --profile tells. "
           "Peak memory is one step's beyond the weights and input (its activations and "
           "new gradients).",
}


def run_benchmarks(groups: Sequence[str], quick: bool,
                   progress: Optional[Callable[[str], None]] = None, *, device: str = "cpu",
                   profile: bool = False, profile_dir: Optional[str] = None
                   ) -> Tuple[List[Row], List[str]]:
    """Runs the groups in order; returns their rows and the notes that apply.
    ``device``, ``profile`` and ``profile_dir`` go to the ``gpu`` group."""
    rows: List[Row] = []
    notes: List[str] = []
    for group in groups:
        if progress is not None:
            progress(group)
        start = time.perf_counter()
        try:
            produced = (_gpu(quick, device, profile, profile_dir) if group == "gpu"
                        else GROUPS[group](quick))
        except Exception as error:  # one broken group must not lose the others' numbers
            produced = [row(group, None, None, None,
                            note=f"FAILED: {type(error).__name__}: {error}")]
        if progress is not None:
            progress(f"{group} done in {time.perf_counter() - start:.1f} s")
        rows.extend(produced)
        if group in NOTES:
            notes.append(f"{group}: {NOTES[group]}")
    return rows, notes


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_autograd bench",
        description="Baseline vs moe_autograd, measured side by side in one run.")
    parser.add_argument("--quick", action="store_true",
                        help="few repetitions: a smoke run of every group, not numbers to "
                             "publish (320 s on a 2-core machine, 140 s of it the two Ray "
                             "groups; --only picks groups)")
    parser.add_argument("--only", nargs="+", choices=list(GROUPS), metavar="NAME",
                        help=f"run only these groups: {', '.join(GROUPS)}")
    parser.add_argument("--markdown", action="store_true",
                        help="print a Markdown table (for BENCHMARKS.md)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: run the gpu group (alone unless --only names more); cpu "
                             "(default): the CPU groups, and gpu at tiny sizes if --only names it")
    parser.add_argument("--profile", action="store_true",
                        help="gpu group: torch.profiler tables of one step per variant")
    parser.add_argument("--profile-dir", metavar="DIR",
                        help="write the --profile tables here, one gpu-<row>.txt per row group "
                             "(implies --profile; default: stderr)")
    args = parser.parse_args(argv)
    if args.only is not None:
        groups = [g for g in GROUPS if g in args.only]
    elif args.device == "cuda":
        groups = list(DEVICE_GROUPS)
    else:
        groups = [g for g in GROUPS if g not in DEVICE_GROUPS]

    def progress(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    info = machine_info(args.quick, args.device)
    rows, notes = run_benchmarks(groups, args.quick, progress, device=args.device,
                                 profile=args.profile or args.profile_dir is not None,
                                 profile_dir=args.profile_dir)
    formatter = format_markdown if args.markdown else format_text
    print(formatter(info, rows, notes), flush=True)
    failed = [r.name for r in rows if r.note.startswith("FAILED")]
    if failed:  # the table is printed whole; the run still fails (issue 43)
        progress(f"{len(failed)} group(s) failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
