"""The shared loopback RPC world of the remote tests.

This pytest process joins ONE world as the client ``client`` (rank 0), with
two spawned server processes (``srv-a``, ``srv-b``) serving
:func:`remote_experts.setup_servers`. A process cannot join a second RPC world
after ``rpc.shutdown()`` (torch's rendezvous hangs), so tests that need a world
of their own run their client in a child process (test_remote_failures.py).

The world is shut down right after the last test that uses it (not at the end
of the whole session), and its processes are joined, terminated or killed;
the tests that use it are collected back to back (first in this directory),
whichever files they are in.

Options: ``--plans N`` runs N random fault plans (test_fault_plans.py) on
top of the fixed ones; ``--plans-seed S`` replays the random plans of seed S
(the run prints the seed it used). Pass them with this directory on the
command line (``pytest tests/remote --plans 5``): a conftest below the
rootdir adds options only when pytest loads it at start-up.
"""
import os
import sys
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # remote_experts, also for spawned children

from moe_autograd.remote.loopback import backend_options, free_port, start_servers, stop_processes  # noqa: E402

SERVERS: Tuple[str, ...] = ("srv-a", "srv-b")
_world: Dict[str, Any] = {}


def _shutdown() -> None:
    if _world.get("closed", True):
        return
    _world["closed"] = True
    from torch.distributed import rpc

    try:
        rpc.shutdown(graceful=True, timeout=15.0)
    except Exception:  # noqa: BLE001 - a server died: still stop locally
        pass
    stop_processes(_world["processes"], timeout=10.0)


def _warm_up_client() -> None:
    # The first autograd.backward with explicit grads imports sympy (~1 s);
    # pay it here, not inside a timed test.
    from moe_autograd import parallel_apply

    modules = [torch.nn.Linear(2, 2) for _ in range(2)]
    outs = parallel_apply(modules, [torch.randn(1, 2, requires_grad=True) for _ in modules])
    sum(o.sum() for o in outs).backward()


@pytest.fixture(scope="session")
def world() -> Iterator[Tuple[str, ...]]:
    if "processes" in _world:
        pytest.fail("the shared RPC world was already shut down; keep its tests together")
    from torch.distributed import rpc

    port = free_port()
    _world["processes"] = start_servers(port, 1 + len(SERVERS), SERVERS,
                                        "remote_experts:setup_servers")
    _world["closed"] = False
    try:
        rpc.init_rpc("client", rank=0, world_size=1 + len(SERVERS),
                     rpc_backend_options=backend_options(port, rpc_timeout=30.0))
    except BaseException:
        _world["closed"] = True
        stop_processes(_world["processes"], timeout=0.0)
        raise
    _warm_up_client()
    yield SERVERS
    _shutdown()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fault plans (tests/remote/test_fault_plans.py)")
    group.addoption("--plans", type=int, default=0, metavar="N",
                    help="also run N random fault plans (default 0: the fixed plans only)")
    group.addoption("--plans-seed", type=int, default=None, metavar="S",
                    help="the seed of the random fault plans (default: a fresh one, printed)")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Runs this directory's tests that use the shared world back to back
    (first, in their collected order), so that the world, shut down after
    the last of them, serves them all whichever files they are in."""
    here = os.path.dirname(os.path.abspath(__file__))
    slots = [k for k, item in enumerate(items) if str(item.path).startswith(here + os.sep)]
    mine = [items[k] for k in slots]
    mine.sort(key=lambda item: "world" not in getattr(item, "fixturenames", ()))  # stable
    for k, item in zip(slots, mine):
        items[k] = item


def pytest_runtest_teardown(item: pytest.Item, nextitem: Any) -> None:
    uses = "world" in getattr(item, "fixturenames", ())
    if uses and (nextitem is None or "world" not in getattr(nextitem, "fixturenames", ())):
        _shutdown()
