"""Benchmark: remote experts on Ray, against plain Ray actor calls.

Setting (one local Ray instance, ``ray.init(num_cpus=2)``, started and shut
down here): 4 server actors hosting 16 experts in all (4 each), each expert a
64-wide ``Linear`` + ``tanh`` that sleeps ``L`` in forward and again in
backward (:class:`~moe_autograd.bench.remote.SleepyExpert`, as the RPC rows).
16 calls (one per expert, 32 rows each) are timed forward + backward:

* ``ours``: :class:`~moe_autograd.remote.RemoteExpert` calls through
  :func:`moe_autograd.parallel_apply` over :class:`~moe_autograd.remote.RayTransport`
  (:class:`~moe_autograd.remote.RayExpertServer` actors, stateful backward):
  one request per server and pass;
* ``plain``: what a Ray user writes without us: 4 actors hosting the same
  experts (``max_concurrency=16``, like ours), one ``.remote()`` per expert
  call in forward (the actor keeps the graph) and again in backward,
  ``ray.get`` to join each pass.

Goals (issue 20): ours <= 0.5 x plain at L = 5 ms; at L = 50 ms (the
latency-bound case), ours against the 2L limit. The comparison with ours on
torch RPC at L = 50 ms is the ``remote/L50-vs-limit`` row of the ``remote``
group (same experts, same limit): compare the two ``ours`` columns.
``python -m moe_autograd.bench.ray_remote [--quick]`` prints the rows alone;
without ``ray`` installed the group is one "skipped" row.

Ray of our own: :func:`local_ray` starts the local instances of the benches
and demos (token authentication on, every file of Ray's in a private
directory removed at exit), and :func:`run_on_local_ray` runs a group's
measurement under a job secret of its own (:func:`own_job_secret`).
"""
import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import threading
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .measure import Plan, compare, measure
from .remote import SleepyExpert, format_rows

__all__ = ["run", "main", "local_ray", "LocalRay", "own_job_secret", "run_on_local_ray"]

L_S = 0.005
SLOW_L_S = 0.05
WIDTH, BATCH = 64, 32
SERVERS = tuple(f"ray-bench-{k}" for k in range(4))
NAMES = tuple(f"e{k}" for k in range(4))


def _experts() -> Dict[str, nn.Module]:
    torch.manual_seed(0)
    return dict({n: SleepyExpert(WIDTH, L_S) for n in NAMES},
                **{f"slow_{n}": SleepyExpert(WIDTH, SLOW_L_S) for n in NAMES})


def setup() -> Dict[str, nn.Module]:
    """The experts factory of the bench's RayExpertServers."""
    torch.set_num_threads(1)
    return _experts()


class PlainExperts:
    """The plain Ray baseline's actor: forward keeps the graph under a key,
    backward takes it and returns the input gradient."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.experts = _experts()
        self.graphs: Dict[int, Tuple[Tensor, Tensor]] = {}
        self.lock = threading.Lock()

    def ready(self) -> bool:
        return True

    def forward(self, name: str, key: int, x: Tensor) -> Tensor:
        leaf = x.detach().requires_grad_()
        out = self.experts[name](leaf)
        with self.lock:
            self.graphs[key] = (leaf, out)
        return out.detach()

    def backward(self, key: int, grad: Tensor) -> Optional[Tensor]:
        with self.lock:
            leaf, out = self.graphs.pop(key)
        out.backward(grad)
        return leaf.grad


def _measure(quick: bool, secret_file: Optional[str]) -> List[Dict[str, Any]]:
    import ray

    from .. import parallel_apply
    from ..remote import RemoteExpert
    from ..remote.ray_engine import RayTransport
    from ..remote.ray_server import start_servers

    plan = Plan.pick(quick, Plan(warmup=3, reps=30), Plan(warmup=1, reps=5))
    slow_plan = Plan.pick(quick, Plan(warmup=1, reps=8), Plan(warmup=1, reps=3))
    servers = start_servers([(s, "moe_autograd.bench.ray_remote:setup") for s in SERVERS],
                            backward="stateful", ready_timeout=120.0,
                            secret_file=secret_file)
    plain_class: Any = ray.remote(PlainExperts)
    plain: List[Any] = [plain_class.options(num_cpus=0, max_concurrency=16).remote() for _ in SERVERS]
    try:
        ray.get([p.ready.remote() for p in plain], timeout=120.0)
        transport = RayTransport()
        pairs = [(k, n) for k in range(len(SERVERS)) for n in NAMES]
        xs = [torch.randn(BATCH, WIDTH, requires_grad=True) for _ in pairs]
        keys = iter(range(1 << 62))

        def ours(prefix: str) -> Callable[[], None]:
            experts = [RemoteExpert(SERVERS[k], prefix + n, transport=transport,
                                    forward_timeout=30, backward_timeout=30) for k, n in pairs]

            def step() -> None:
                outs = parallel_apply(experts, xs)
                sum(o.sum() for o in outs).backward()
            return step

        def plain_calls(prefix: str) -> Callable[[], None]:
            def step() -> None:
                ids = [next(keys) for _ in pairs]
                outs = ray.get([plain[k].forward.remote(prefix + n, key, x.detach())
                                for (k, n), key, x in zip(pairs, ids, xs)])
                grads = [torch.ones_like(o) for o in outs]
                ray.get([plain[k].backward.remote(key, g)
                         for (k, _), key, g in zip(pairs, ids, grads)])
            return step

        fast = measure({"plain": plain_calls(""), "ours": ours("")}, plan.reps, plan.warmup)
        fast["2L"] = [2e3 * L_S] * plan.reps
        slow = measure({"plain": plain_calls("slow_"), "ours": ours("slow_")},
                       slow_plan.reps, slow_plan.warmup)
        slow["2L"] = [2e3 * SLOW_L_S] * slow_plan.reps
    finally:
        for actor in plain:
            ray.kill(actor)
        for server in servers:
            server.kill()
    world = (f"{len(SERVERS) * len(NAMES)} calls fwd+bwd, {len(SERVERS)} Ray actors x "
             f"{len(NAMES)} experts, stateful")
    base = "baseline = plain Ray actor calls (one .remote() per call and pass, ray.get)"
    rows = [
        compare("ray/vs-plain-actors", fast, "plain", "ours", 0.5,
                f"{world}, L = {L_S * 1e3:g} ms; {base}"),
        compare("ray/vs-limit", fast, "2L", "ours", None,
                "same; baseline = physical limit 2L"),
        compare("ray/L50-vs-plain-actors", slow, "plain", "ours", None,
                f"L = {SLOW_L_S * 1e3:g} ms; {base}"),
        compare("ray/L50-vs-limit", slow, "2L", "ours", 1.2,
                "L = 50 ms; baseline = physical limit 2L (compare ours with "
                "remote/L50-vs-limit, the same on torch RPC)"),
    ]
    return [{"name": r.name, "baseline_ms": r.baseline, "ours_ms": r.ours, "ratio": r.ratio,
             "goal": r.goal, "note": r.note} for r in rows]


LOOPBACK = "127.0.0.1"
# Ray's switch between a one-machine instance on loopback (its default on macOS
# and Windows) and a cluster on the machine's network address (Linux's):
# "0" makes every node's address, and so every socket it listens on, 127.0.0.1
# (ray.init rewrites a loopback _node_ip_address to the network one otherwise).
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_RAY_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR", "PYTHONPATH",
            LOOPBACK_ONLY_ENV)


class LocalRay:
    """What :func:`local_ray` started: ``dir`` (the private directory: Ray's
    token, its temporary files under ``dir/ray``, the job's secret file),
    ``cluster`` (the :class:`ray.cluster_utils.Cluster`, or ``None`` for a
    plain ``ray.init``) and ``secret_file`` (the secret given to
    :func:`local_ray`, saved for the expert server actors, or ``None``)."""

    def __init__(self, path: str, cluster: Any, secret_file: Optional[str]) -> None:
        self.dir, self.cluster, self.secret_file = path, cluster, secret_file

    def node_args(self, **args: Any) -> Dict[str, Any]:
        """``Cluster.add_node`` arguments: ``args`` on loopback."""
        return dict({"node_ip_address": LOOPBACK}, **args)


def _reload_ray_settings() -> None:
    """Ray reads its authentication mode and token, and whether it runs on
    loopback, once per process: read them again from the environment."""
    from ray._private import ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(
        LOOPBACK_ONLY_ENV, not ray_constants.IS_WINDOWS_OR_OSX)


@contextlib.contextmanager
def local_ray(*, cluster: bool = False, head_node_args: Optional[Mapping[str, Any]] = None,
              secret: Optional[Any] = None, python_path: Sequence[str] = (),
              **init_options: Any) -> Iterator[LocalRay]:
    """A new local Ray of this process's own, connected for the block, then
    shut down, whatever happens.

    Token authentication is on (``RAY_AUTH_MODE=token``, a fresh token in a
    file of mode 600); the token, Ray's temporary files (``_temp_dir``, and
    ``RAY_TMPDIR`` for the files Ray puts in its default one) and the job's
    secret file live in a private directory (``tempfile.mkdtemp``, mode 700,
    short: unix socket paths are limited), removed at the end: nothing in
    ``/tmp/ray`` or ``~/.ray`` is read or written. Nodes have the address
    ``127.0.0.1`` and listen there only (:data:`LOOPBACK_ONLY_ENV`). Ray's
    processes inherit the environment set here (and ``PYTHONPATH`` naming
    this package); it is restored at the end.

    ``cluster=False``: ``ray.init(address="local", **init_options)`` (never a
    cluster found through ``RAY_ADDRESS`` or ``ray_current_cluster``).
    ``cluster=True``: a :class:`ray.cluster_utils.Cluster` whose head node
    takes ``head_node_args`` (add nodes with ``here.cluster.add_node(
    **here.node_args(...))``), and this process connects to it as a driver
    (``ray.init(address=..., **init_options)``). ``secret``: a
    :class:`~moe_autograd.remote.JobSecret` saved as ``secret_file`` for the
    expert server actors (``RayExpertServer(..., secret_file=...)``).
    ``python_path``: more directories for the workers' ``PYTHONPATH`` (where
    an experts factory lives).
    """
    import ray

    if ray.is_initialized():
        raise RuntimeError("local_ray starts a Ray of its own: this process is connected "
                           "to one already")
    private = tempfile.mkdtemp(prefix="moe-ray-", dir="/tmp")  # mode 700
    saved = {name: os.environ.get(name) for name in _RAY_ENV}
    started: Any = None
    connected = False
    try:
        token = os.path.join(private, "auth_token")
        with os.fdopen(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        secret_file = None if secret is None else secret.save(os.path.join(private, "job.secret"))
        temp_dir = os.path.join(private, "ray")  # Ray's default under RAY_TMPDIR, too
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token, RAY_TMPDIR=private,
                          PYTHONPATH=os.pathsep.join(p for p in (*python_path, here,
                                                                 saved["PYTHONPATH"]) if p),
                          **{LOOPBACK_ONLY_ENV: "0"})
        _reload_ray_settings()
        options: Dict[str, Any] = dict(log_to_driver=False, configure_logging=False)
        options.update(init_options)
        if cluster:
            # A test utility of Ray's public package: real nodes (raylets) on one
            # machine, added and removed at will.
            from ray.cluster_utils import Cluster

            head = dict(include_dashboard=False, include_log_monitor=False,
                        node_ip_address=LOOPBACK, temp_dir=temp_dir)
            head.update(head_node_args or {})
            started = Cluster(initialize_head=True, head_node_args=head)
            ray.init(address=started.address, _node_ip_address=LOOPBACK, **options)
        else:
            options.setdefault("include_dashboard", False)
            ray.init(address="local", _temp_dir=temp_dir, _node_ip_address=LOOPBACK, **options)
        connected = True
        yield LocalRay(private, started, secret_file)
    finally:
        try:
            if connected or ray.is_initialized():
                ray.shutdown()
        finally:
            try:
                if started is not None:
                    started.shutdown()  # every node: raylets, GCS, their workers
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                _reload_ray_settings()
                shutil.rmtree(private, ignore_errors=True)


@contextlib.contextmanager
def own_job_secret() -> Iterator[Any]:
    """A new :class:`~moe_autograd.remote.JobSecret`, this process's default
    for the block (the one before is restored after it)."""
    from ..remote import JobSecret, set_job_secret

    secret = JobSecret.generate()
    previous = set_job_secret(secret)  # None: the environment's, as before
    try:
        yield secret
    finally:
        set_job_secret(previous)


def run_on_local_ray(name: str, rows: Callable[[Optional[str]], List[Dict[str, Any]]]
                     ) -> List[Dict[str, Any]]:
    """``rows(secret_file)`` with Ray connected: on a local instance started
    here (:func:`local_ray`, shut down after) under a job secret of its own
    (:func:`own_job_secret`; ``secret_file`` holds it, for the server
    actors), unless this process is connected to a Ray already (then under
    the process's job secret, ``secret_file=None``); one skipped row named
    ``name`` without ray."""
    try:
        import ray
    except ImportError:
        return [{"name": name, "baseline_ms": None, "ours_ms": None, "ratio": None,
                 "goal": None, "note": "skipped: ray is not installed (pip install "
                 "-e '.[ray]')"}]
    if ray.is_initialized():
        return rows(None)
    with own_job_secret() as secret, local_ray(num_cpus=2, secret=secret) as here:
        return rows(here.secret_file)


def run(quick: bool = False) -> List[Dict[str, Any]]:
    """Measures on a local Ray instance (see :func:`run_on_local_ray`)."""
    return run_on_local_ray("ray", lambda secret_file: _measure(quick, secret_file))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    print(format_rows(run(quick="--quick" in args)))
    return 0


if __name__ == "__main__":  # run the package's module, so that the actors import it by name
    from moe_autograd.bench.ray_remote import main as _main

    sys.exit(_main())
