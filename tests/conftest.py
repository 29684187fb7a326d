"""Fixtures shared by the runtime tests (executor, autograd, parallel, stress)."""
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional

import pytest

import torch_versions

torch_versions.install()  # torch <= 2.12: a failed checkpoint frame's hooks (see there)

from moe_autograd import executor  # noqa: E402
import helpers  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_PREFIX = "moe_autograd-worker-"


@pytest.fixture
def fresh_pool(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], executor.WorkerPool]:
    """``fresh_pool(n)`` installs a new ``WorkerPool(n)`` as the process-wide
    pool for the duration of the test, and shuts it down afterwards."""
    pools: List[executor.WorkerPool] = []

    def make(n: int) -> executor.WorkerPool:
        pool = executor.WorkerPool(n)
        monkeypatch.setattr(executor, "_pool", pool)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.shutdown()


def _run_python(code: str, env: Optional[Dict[str, str]] = None, timeout: float = 90) -> str:
    """Runs ``code`` in a fresh interpreter (the pool is process-wide) and
    returns its stdout; fails the test on a non-zero exit."""
    full_env = dict(os.environ)
    full_env.pop("MOE_AUTOGRAD_WORKERS", None)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout



@pytest.fixture
def thread_guard():
    """Asserts after the test that it left no thread behind but pool workers,
    and that the process-wide pool stayed within its bound."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        extra = [t for t in threading.enumerate()
                 if t not in before and t.is_alive() and not t.name.startswith(WORKER_PREFIX)]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not extra, f"threads leaked: {extra}"
    pool = executor._pool
    if pool is not None:
        workers = [t for t in threading.enumerate() if t.name.startswith(WORKER_PREFIX)]
        assert len(pool.threads) <= pool.max_workers
        assert set(pool.threads) >= {t for t in workers if t not in before}


@pytest.fixture
def run_python() -> Callable[..., str]:
    """``run_python(code, env=None, timeout=90)``: see :func:`_run_python`."""
    return _run_python


@pytest.fixture
def wait_dead() -> Callable[..., List[bool]]:
    """``wait_dead(refs, timeout=5.0)``: see :func:`helpers.wait_dead`."""
    return helpers.wait_dead


# Files that test the parallel node itself: auto mode would run a site's
# calls inline from its second batch on (a plain loop), so they force the
# fan-out; tests/test_policy.py shows every mode gives the same bits.
PARALLEL_NODE_FILES = {"test_autograd", "test_parallel", "test_parallel_checkpoint",
                       "test_stress", "test_parallel_skip", "test_function_db",
                       "test_param_inputs", "test_checkpoint_frames", "test_compile",
                       "test_moe_gaps"}


@pytest.fixture(autouse=True)
def no_cli_handler_left() -> Iterator[None]:
    """A test that runs the command line in-process (``__main__.main``,
    ``serve``) installs its stderr handler on the ``moe_autograd`` logger
    (moe_autograd.logs.configure_cli): taken off after the test, with the
    logger's level, so that no later test sees it."""
    import logging
    logger = logging.getLogger("moe_autograd")
    level = logger.level
    yield
    for handler in list(logger.handlers):
        if getattr(handler, "_moe_autograd_cli", False):
            logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(autouse=True)
def fresh_policy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Every test starts with no learned execution modes (see
    moe_autograd.policy): a site's first batch fans out, as in a new process."""
    from moe_autograd import policy
    policy._reset()
    if request.module.__name__.rsplit(".", 1)[-1] in PARALLEL_NODE_FILES:
        monkeypatch.setenv("MOE_AUTOGRAD_MODE", "parallel")
    yield


@pytest.fixture
def several_lanes(monkeypatch: pytest.MonkeyPatch) -> int:
    """``lanes`` mode with more than one lane, whatever the machine: lanes are
    sized ``cores() // torch.get_num_threads()`` (see moe_autograd.policy), a
    single lane on a 2-core machine, where a lanes run is a plain loop and
    tests no concurrency at all. This makes the runtime see four lanes'
    worth of cores (issue 34); the value is that lane count."""
    import torch
    from moe_autograd import policy
    monkeypatch.setattr(policy, "cores", lambda: 4 * max(1, torch.get_num_threads()))
    assert policy._lanes_for(4) == 4
    return 4
