"""The processes of the multi-process bench groups: how they are started and
how the parent waits for the one that measures.

Why: every group that runs a world of processes (``remote``, ``elastic``,
``replicas``, ``trainers``, the bandwidth rows) starts them the same way and
waits for its measuring process the same way; one place keeps both.

* :func:`forkserver_context`: ``forkserver`` where the platform has it, the
  world's modules preloaded once (each spawned process would import torch
  and the package: seconds of CPU each, most of a quick run on a machine
  with few cores). The forkserver computes nothing (no intra-op pool is
  started, so forking it is as safe as DataLoader's fork workers) and forks
  every process of the world; its children leave through ``os._exit``,
  without the interpreter's teardown. It lives on, idle, until this process
  exits; a second call's preload list is ignored once it runs.
* :func:`result_of`: the measuring process's ``(status, value)`` from its
  queue, or an error as soon as it died without one, or after ``timeout``.
"""
import multiprocessing
import queue as queue_module
import time
from typing import Any, Sequence, Tuple

__all__ = ["forkserver_context", "result_of"]


def forkserver_context(preload: Sequence[str]) -> Any:
    """The start method of a bench world's processes (see the module docstring)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))  # ignored if a forkserver already runs
    return ctx


def result_of(results: Any, process: Any, timeout: float, who: str = "client"
              ) -> Tuple[str, Any]:
    """``(status, value)`` as ``process`` put it on ``results``; ``("error",
    why)`` if it exited without one, or nothing came within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=1.0)  # type: ignore[no-any-return]
        except queue_module.Empty:
            if not process.is_alive() and results.empty():
                return "error", f"the {who} process exited with code {process.exitcode}"
            if time.monotonic() > deadline:
                return "error", f"no result within {timeout:g} s"
