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

Every world serves ONE job, :data:`wiring.SECRET` (this process's default
secret; servers get it from their start pipe or, on Ray, a private file).

The Ray backend (the conformance suite, test_conformance.py, runs against
both): ONE local Ray instance (``ray.init(num_cpus=2)``, token authentication
on, its token and temporary files in a private directory) with two server
actors of the same names serving the same experts, started by the first test
that needs it (fixture ``ray_world``, skipped when ``ray`` is not importable)
and shut down (actors, then ``ray.shutdown()``: no process left) right after
the last one. Tests of the RPC world run first, then those of Ray, so the two
engines are never up together.

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

sys.path.insert(0, os.path.dirname(__file__))  # remote_experts, also for spawned children

from moe_autograd.remote import set_job_secret, start_rpc  # noqa: E402
from moe_autograd.remote.loopback import backend_options, free_port, start_servers, stop_processes  # noqa: E402
from wiring import SECRET, Backend, init_local_ray, shutdown_local_ray  # noqa: E402

set_job_secret(SECRET)  # this process is a member of the test job; its servers get SECRET

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


def _warm_up_client(transport: Any = None) -> None:
    # The first autograd.backward with explicit grads imports sympy (~1 s),
    # and a process's first remote pass pays its own first-use costs; pay
    # them here (one remote pass, forced to fan out), not in a timed test.
    import torch.fx.experimental.symbolic_shapes  # noqa: F401 - sympy, once

    from moe_autograd import parallel_apply
    from moe_autograd.remote import RemoteExpert

    modules = [torch.nn.Linear(2, 2) for _ in range(2)]
    outs = parallel_apply(modules, [torch.randn(1, 2, requires_grad=True) for _ in modules],
                          mode="parallel")
    sum(o.sum() for o in outs).backward()
    experts = [RemoteExpert(w, "lin", transport=transport) for w in SERVERS]
    outs = parallel_apply(experts, [torch.randn(1, 8, requires_grad=True) for _ in experts])
    sum(o.sum() for o in outs).backward()


_ray: Dict[str, Any] = {}
RAY_TIMEOUT_S = 30.0  # RayTransport's own timeout in the tests (rpc_timeout's twin)


def _shutdown_ray() -> None:
    if _ray.get("closed", True):
        return
    _ray["closed"] = True
    for server in _ray.get("servers", ()):
        server.kill()
    shutdown_local_ray()


@pytest.fixture(scope="session")
def ray_world() -> Iterator[Dict[str, Any]]:
    """The shared local Ray instance: ``servers``, its server actors ``srv-a``
    and ``srv-b`` (RayExpertServers) serving what the RPC world's servers
    serve, and ``transport``, a RayTransport whose own timeout is
    :data:`RAY_TIMEOUT_S` (as the RPC world's ``rpc_timeout``)."""
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    if "closed" in _ray:
        pytest.fail("the shared Ray instance was already shut down; keep its tests together")
    from moe_autograd.remote.ray_engine import RayTransport
    from moe_autograd.remote.ray_server import start_servers

    here = os.path.dirname(os.path.abspath(__file__))
    _ray["closed"] = False
    try:
        # a new instance of its own, with token authentication; its workers import
        # this directory's modules (remote_experts)
        init_local_ray(python_path=(here,), num_cpus=2, namespace="moe_autograd_tests")
        _ray["servers"] = start_servers([(name, "remote_experts:setup_servers")
                                         for name in SERVERS], ready_timeout=240.0)
    except BaseException:
        _shutdown_ray()
        raise
    _ray["transport"] = RayTransport(timeout=RAY_TIMEOUT_S)
    _warm_up_client(_ray["transport"])
    yield {"servers": tuple(_ray["servers"]), "transport": _ray["transport"]}
    _shutdown_ray()


@pytest.fixture(scope="session")
def world() -> Iterator[Tuple[str, ...]]:
    if "processes" in _world:
        pytest.fail("the shared RPC world was already shut down; keep its tests together")

    port = free_port()
    _world["processes"] = start_servers(port, 1 + len(SERVERS), SERVERS,
                                        "remote_experts:setup_servers")
    _world["closed"] = False
    try:
        start_rpc("client", 0, 1 + len(SERVERS), backend_options(port, rpc_timeout=30.0))
    except BaseException:
        _world["closed"] = True
        stop_processes(_world["processes"], timeout=0.0)
        raise
    _warm_up_client()
    yield SERVERS
    _shutdown()


@pytest.fixture(params=["rpc", "ray"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The shared servers on either engine (test_conformance.py, test_redteam.py)."""
    if request.param == "rpc":
        from moe_autograd.remote import RpcTransport

        yield Backend("rpc", RpcTransport(), request.getfixturevalue("world"))
    else:
        ray_world = request.getfixturevalue("ray_world")
        yield Backend("ray", ray_world["transport"], ray_world["servers"])


@pytest.fixture(autouse=True)
def _the_jobs_secret_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test leaves this process's default job secret as it found it: a
    test that runs ``serve``'s main in process with a secret file of its own
    made it the default (``set_job_secret``), and every later test's servers
    and clients then belonged to different jobs (issue 43's runs under load)."""
    from moe_autograd.remote import auth

    monkeypatch.setattr(auth, "_default", auth._default)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fault plans (tests/remote/test_fault_plans.py)")
    group.addoption("--plans", type=int, default=0, metavar="N",
                    help="also run N random fault plans (default 0: the fixed plans only)")
    group.addoption("--plans-seed", type=int, default=None, metavar="S",
                    help="the seed of the random fault plans (default: a fresh one, printed)")


#: How long the start of a shared world or Ray instance may take, on top of
#: its first test's own limit.
SHARED_START_S = 300.0


def _backend(item: Any) -> Any:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("backend") if callspec is not None else None


def _uses_world(item: Any) -> bool:
    return "world" in getattr(item, "fixturenames", ()) or _backend(item) == "rpc"


def _uses_ray(item: Any) -> bool:
    return "ray_world" in getattr(item, "fixturenames", ()) or _backend(item) == "ray"


@pytest.hookimpl(trylast=True)  # after -k/-m deselected: "the first test" is one that runs
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Runs this directory's tests that use the shared world back to back
    (first, in their collected order), then those that use the shared Ray
    instance, so that each, shut down after the last of its tests, serves
    them all whichever files they are in."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("MOE_AUTOGRAD_MUTATE"):
        # a mutation run (tools/mutate.py): no shared world or Ray instance,
        # spawned again for every mutant; in-process servers cover their code
        shared = [item for item in items if _uses_world(item) or _uses_ray(item)]
        if shared:
            config.hook.pytest_deselected(items=shared)
            items[:] = [item for item in items if not (_uses_world(item) or _uses_ray(item))]
    slots = [k for k, item in enumerate(items) if str(item.path).startswith(here + os.sep)]
    mine = [items[k] for k in slots]
    mine.sort(key=lambda item: 0 if _uses_world(item) else 1 if _uses_ray(item) else 2)  # stable
    for k, item in zip(slots, mine):
        items[k] = item
    # The first test of each shared instance starts it (a local Ray and its
    # server actors: about 20 s quiet, past 60 s on 2 loaded cores): its time
    # limit covers that start, so that a slow start is not taken for a hang
    # that then fails every later test of the instance (issue 43).
    for uses in (_uses_world, _uses_ray):
        first = next((item for item in mine if uses(item)), None)
        if first is not None:
            marker = first.get_closest_marker("timeout")
            limit = float(marker.args[0]) if marker is not None and marker.args else 120.0
            first.add_marker(pytest.mark.timeout(max(limit, SHARED_START_S) + limit),
                             append=False)  # before its own: the closest marker wins


def pytest_runtest_teardown(item: pytest.Item, nextitem: Any) -> None:
    if _uses_world(item) and (nextitem is None or not _uses_world(nextitem)):
        _shutdown()
    if _uses_ray(item) and (nextitem is None or not _uses_ray(nextitem)):
        _shutdown_ray()
