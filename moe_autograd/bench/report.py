"""The table: the machine header, and text or Markdown rendering of rows."""
import datetime
import math
import os
import platform
import subprocess
from typing import List, Optional, Sequence, Tuple

import torch

from ..executor import DEFAULT_WORKERS
from .measure import Row

__all__ = ["HEADERS", "machine_info", "format_text", "format_markdown"]

HEADERS = ["name", "baseline", "ours", "ratio", "goal", "met?", "note"]
_LEGEND = ("ratio = ours / baseline (lower is better); times are medians, "
           "ratios medians of paired repetitions")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _gpu_model() -> str:
    """The GPU the ``gpu`` group runs on (the current CUDA device), or why none."""
    if not torch.cuda.is_available():
        why = "torch built without CUDA" if torch.version.cuda is None else "no device visible"
        return f"none: CUDA is not available ({why})"
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return (f"{torch.cuda.get_device_name(index)} ({props.total_memory / 2**30:.0f} GiB, "
            f"capability {props.major}.{props.minor}), CUDA {torch.version.cuda}, "
            f"{torch.cuda.device_count()} visible")


def machine_info(quick: bool, device: str = "cpu") -> List[Tuple[str, str]]:
    """``(label, value)`` pairs for the table's header; with ``device="cuda"``
    the GPU's too."""
    cores = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = cores
    workers = os.environ.get("MOE_AUTOGRAD_WORKERS") or f"unset (default {DEFAULT_WORKERS})"
    info = [
        ("cpu", _cpu_model()),
        ("cores", f"{cores}" + (f" ({usable} usable)" if usable != cores else "")),
        ("torch", f"{torch.__version__}, intra-op threads {torch.get_num_threads()}"),
        ("python", platform.python_version()),
        *([("gpu", _gpu_model())] if device == "cuda" else []),
        ("MOE_AUTOGRAD_WORKERS", workers),
        ("date", datetime.datetime.now().astimezone().isoformat(timespec="seconds")),
        ("mode", "quick" if quick else "full"),
    ]
    try:
        info.append(("load average", " ".join(f"{v:.2f}" for v in os.getloadavg())))
    except OSError:
        pass
    commit = _commit()
    if commit:
        info.append(("commit", commit))
    return info


def _fmt(value: Optional[float], unit: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if abs(value) >= 100:
        text = f"{value:.1f}"
    elif abs(value) >= 1:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3g}"
    return f"{text} {unit}" if unit else text


def _cells(row: Row) -> List[str]:
    met = "-" if row.met is None else ("yes" if row.met else "NO")
    return [row.name, _fmt(row.baseline, row.unit), _fmt(row.ours, row.unit),
            _fmt(row.ratio), row.goal or "-", met, row.note]


def format_text(info: Sequence[Tuple[str, str]], rows: Sequence[Row],
                notes: Sequence[str]) -> str:
    lines = [f"{label + ':':<22}{value}" for label, value in info]
    lines += [_LEGEND, ""]
    table = [HEADERS] + [_cells(r) for r in rows]
    widths = [max(len(line[k]) for line in table) for k in range(len(HEADERS) - 1)]
    for k, line in enumerate(table):
        cols = [c.ljust(w) if j in (0, 4, 5) else c.rjust(w)  # text left, numbers right
                for j, (c, w) in enumerate(zip(line, widths))]
        lines.append("  ".join(cols + [line[-1]]).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ----")
    if notes:
        lines.append("")
        lines.extend(f"* {n}" for n in notes)
    return "\n".join(lines)


def format_markdown(info: Sequence[Tuple[str, str]], rows: Sequence[Row],
                    notes: Sequence[str]) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|")
    lines = [f"- **{label}**: {esc(value)}" for label, value in info]
    lines += ["", _LEGEND, ""]
    lines.append("| " + " | ".join(HEADERS) + " |")
    lines.append("|" + "|".join([":---", "---:", "---:", "---:", ":---", ":---", ":---"]) + "|")
    for row in rows:
        lines.append("| " + " | ".join(esc(c) for c in _cells(row)) + " |")
    if notes:
        lines.append("")
        lines.extend(f"- {esc(n)}" for n in notes)
    return "\n".join(lines)
