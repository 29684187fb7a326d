"""``python -m moe_autograd serve``: host experts in this process until stopped.

Why a CLI: an expert server is a long-lived process on another machine; its
experts come from a factory ``package.module:function`` that returns a dict
``name -> nn.Module``, its place in the RPC world from flags or the usual
environment variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``).

Lifecycle: :class:`ExpertServer` -> ``init_rpc`` -> serve until SIGINT or
SIGTERM, or (in a static world, i.e. with a world size) until every other
worker has called ``rpc.shutdown()``; then close the server (requests in
flight get ``--drain-timeout`` seconds) and shut RPC down.

Elastic mode (``--join``, see :mod:`.fleet`): no rank or world size; the
server joins the running dynamic world whose store is at ``--master-addr:
--master-port`` (founded by a :class:`~moe_autograd.remote.Fleet`), takes a
fresh rank from the store, publishes its experts by name, and on SIGINT/
SIGTERM or the coordinator's stop leaves cleanly (unpublish, finish calls in
flight and held states within ``--drain-timeout``, then leave the world).

Ray (``--engine ray``, see :mod:`.ray_server`): the process connects to the
running Ray cluster at ``--address HOST:PORT`` (its head's GCS; it must run
with token authentication, ``RAY_AUTH_MODE=token`` and the cluster's token,
unless ``--insecure``), starts the experts as a named actor (``--name``, in
``--namespace``) on this node (``--anywhere``: wherever Ray places it;
``--resources``, ``--num-gpus`` for placement), serves until SIGINT/SIGTERM,
then drains the actor (a :class:`~.ray_fleet.RayFleet` stops choosing it;
calls in flight and held states get ``--drain-timeout`` seconds) and ends
it. The actor belongs to this process: if the process dies (kill -9, its
node lost), Ray ends the actor too, and clients see a dead server. No rank,
world size or store. ``--state-dir``/``--save-every``/``--save-interval``
keep the actor's experts' state as for RPC; ``--max-restarts N`` lets Ray
restart the actor (its process died while this one serves), which resumes
them from there, and (unless ``--no-recover``) from a live replica in
``--namespace``, which is newer.

The job's secret comes from ``--secret-file`` or ``MOE_AUTOGRAD_SECRET_FILE``
(or ``MOE_AUTOGRAD_SECRET``, hex), never from the command line itself;
``python -m moe_autograd secret --out job.secret`` makes one (mode 600).

What it says: its start, stop and errors, and every ``--report-every``
seconds (60 by default) the calls it served since the last report, while it
serves any; as log lines on stderr (``[moe_autograd serve] TIME LEVEL
message``, :func:`moe_autograd.logs.configure_cli`), with the library's own
warnings (refused requests, ...) among them.

Invariant: the process exits with status 0 after a signal or the world's end,
and 2 on bad arguments (argparse, or no usable secret, or a Ray without token
authentication); with ``--join``, 75 if it could not join (start it again),
3 if it was evicted (reaped while stopped), and 76 if it left because its
TensorPipe listener was closed and had already started again
:data:`MAX_REJOINS` times (before that, it starts again by itself); with ``--engine ray``, 1 if
its actor died (logged as an error; an actor that Ray restarts, with
``--max-restarts``, is waited for).
"""
import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Dict, List, Mapping, NoReturn, Optional, Sequence

from ..logs import configure_cli

from .auth import (ENV_ENCRYPT, ENV_SECRET_FILE, JobSecret, MissingSecretError, job_secret,
                   set_job_secret)
from .factory import load_object

__all__ = ["main", "secret_main", "load_object", "build_parser"]

MiB = 1 << 20
MAX_REJOINS = 20  # serve --join starts again at most this many times (its listener closed)
_REJOINS_ENV = "MOE_AUTOGRAD_SERVE_REJOINS"
NON_FINITE_POLICIES = ("skip", "raise")  # as ExpertServer's (not imported: keeps --help light)


def _bytes_or_none(text: str) -> Optional[int]:
    return None if text.lower() == "none" else int(text)


def _names(text: str) -> List[str]:
    return [name for name in text.split(",") if name]


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_autograd serve",
        description="Serve experts to the members of a job, over torch RPC (a static world, "
                    "or --join an elastic fleet's) or Ray (--engine ray). Every request must "
                    "be sealed with the job's secret (--secret-file).")
    p.add_argument("--experts", required=True, metavar="MODULE:FUNCTION",
                   help="factory returning a dict name -> nn.Module")
    p.add_argument("--encrypt", action="store_true",
                   default=os.environ.get(ENV_ENCRYPT, "") == "1",
                   help="the job encrypts its messages (AES-256-GCM; default: authenticated "
                        "only, or $MOE_AUTOGRAD_ENCRYPT=1): every member of the job must say so "
                        "too (JobSecret(..., encrypt=True)); a message in clear is refused")
    p.add_argument("--secret-file", metavar="PATH", default=os.environ.get(ENV_SECRET_FILE),
                   help="the job's secret (mode 600; default: $MOE_AUTOGRAD_SECRET_FILE, else "
                        "$MOE_AUTOGRAD_SECRET in hex); make one with 'python -m moe_autograd "
                        "secret --out job.secret'")
    p.add_argument("--name", help="this worker's RPC name (default: expert-server-<rank>)")
    p.add_argument("--rank", type=int, default=_env_int("RANK"), help="default: $RANK")
    p.add_argument("--world-size", type=int, default=_env_int("WORLD_SIZE"),
                   help="default: $WORLD_SIZE; omit both for a dynamic world")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   help="the world's store (default: $MASTER_ADDR, else 127.0.0.1); RPC listens "
                        "on the interface that faces it (loopback for 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT") or 29500)
    p.add_argument("--backward", choices=("stateless", "stateful"), default="stateless")
    p.add_argument("--optimizer", metavar="MODULE:FUNCTION",
                   help="factory params -> torch.optim.Optimizer, one per expert")
    p.add_argument("--manual-step", action="store_true",
                   help="with --optimizer: step only when clients call RemoteExpert.step()")
    p.add_argument("--state-ttl", type=float, default=60.0)
    p.add_argument("--max-states", type=int, default=1024)
    p.add_argument("--max-states-per-client", type=int, default=None,
                   help="states one client may hold (default: --max-states)")
    p.add_argument("--max-state-bytes", type=_bytes_or_none, default=1024 * MiB,
                   help="bytes all states may hold, or 'none' (default: 1 GiB)")
    p.add_argument("--max-request-bytes", type=_bytes_or_none, default=256 * MiB,
                   help="tensor bytes of one request once materialised, or 'none' "
                        "(default: 256 MiB)")
    p.add_argument("--non-finite-grads", choices=NON_FINITE_POLICIES, default="skip",
                   help="an optimizer step with NaN/inf gradients is skipped (reported) or "
                        "fails the request")
    p.add_argument("--batch-across-calls", nargs="?", const=True, default=False, type=_names,
                   metavar="NAMES",
                   help="batch the pending calls of many trainers (clients, jobs) to the same "
                        "expert into one kernel call: all experts, or those named (comma-"
                        "separated). Only for row-wise experts (row i of the output depends "
                        "on row i of the inputs alone; not BatchNorm in train mode)")
    p.add_argument("--batch-window", type=float, default=0.0, metavar="SECONDS",
                   help="with --batch-across-calls: how long a call waits for others to join "
                        "its batch (default 0: only the calls already pending)")
    p.add_argument("--max-batch-rows", type=int, default=None, metavar="N",
                   help="with --batch-across-calls: rows (first dimension) of one batch at "
                        "most (default: no bound)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="keep each expert's state (weights, optimizer state, steps) in DIR: "
                        "resume from its newest complete snapshot there, save every "
                        "--save-every steps and at a clean stop")
    p.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="with --state-dir: save an expert every N optimizer steps")
    p.add_argument("--save-interval", type=float, default=None, metavar="SECONDS",
                   help="with --state-dir: save an expert at a step once SECONDS have passed "
                        "since its last save")
    p.add_argument("--num-worker-threads", type=int, default=16)
    p.add_argument("--rpc-timeout", type=float, default=60.0,
                   help="this worker's RPC timeout in seconds (clients set their own)")
    p.add_argument("--transports", metavar="LIST",
                   help="TensorPipe transports, e.g. 'uv' (default: TensorPipe's choice; its "
                        "same-host 'shm' transport busy-polls, so prefer 'uv' when server "
                        "processes outnumber cores)")
    p.add_argument("--drain-timeout", type=float, default=10.0)
    p.add_argument("--report-every", type=float, default=60.0, metavar="SECONDS",
                   help="log the calls served every SECONDS while any are (default: 60; "
                        "0: never)")
    p.add_argument("--engine", choices=("rpc", "ray"), default="rpc",
                   help="torch RPC (default) or Ray: the experts become a named Ray actor")
    p.add_argument("--address", metavar="HOST:PORT",
                   help="with --engine ray: the Ray cluster's address (default: $RAY_ADDRESS, "
                        "else 'auto', a cluster started on this machine by 'ray start')")
    p.add_argument("--namespace", default="moe_autograd",
                   help="with --engine ray: the Ray namespace of the server's name")
    p.add_argument("--resources", metavar="JSON",
                   help="with --engine ray: custom resources the actor takes, e.g. "
                        "'{\"experts\": 1}'")
    p.add_argument("--num-gpus", type=float, default=0.0,
                   help="with --engine ray: GPUs the actor takes")
    p.add_argument("--anywhere", action="store_true",
                   help="with --engine ray: let Ray place the actor on any node that fits "
                        "(default: this node)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="with --engine ray: Ray restarts the actor up to N times (-1: always) "
                        "if its process dies while this one serves; a restart resumes its "
                        "experts from --state-dir (default 0: never)")
    p.add_argument("--insecure", action="store_true",
                   help="with --engine ray: serve although the cluster runs without token "
                        "authentication (anyone who reaches its ports can then run code in it)")
    p.add_argument("--join", action="store_true",
                   help="join a running elastic world (a Fleet's) by its store at "
                        "--master-addr:--master-port; no --rank/--world-size")
    p.add_argument("--no-recover", action="store_true",
                   help="with --join or --engine ray: do not take a live replica's state "
                        "before serving (nor at a Ray restart); each "
                        "expert keeps its own (its snapshot's, or fresh), and a trainer brings a "
                        "training expert's replica into sync before it calls it")
    return p


class _UsageError(Exception):
    """A refusal of the command line or its set-up: its message says what
    to do; ``main`` prints it (no usage dump: the message is the help) and
    exits 2."""


def _usage_error(message: str) -> NoReturn:
    raise _UsageError(message)


def _secret(args: argparse.Namespace) -> JobSecret:
    """The job's secret from ``--secret-file`` or the environment; exits 2
    with what to do if there is none."""
    try:
        secret = JobSecret.from_file(args.secret_file) if args.secret_file else job_secret()
    except (MissingSecretError, PermissionError, ValueError) as error:
        _usage_error(str(error))
    if getattr(args, "encrypt", False):
        secret = secret.encrypting(True)
        os.environ[ENV_ENCRYPT] = "1"  # (a Ray actor started from here reads it so too)
    set_job_secret(secret)
    return secret


def _experts(spec: str) -> Mapping[str, Any]:
    """What the ``--experts`` factory builds; a clear refusal naming it when
    it cannot be imported, fails or returns something else."""
    try:
        factory = load_object(spec)
    except (ImportError, AttributeError, ValueError) as error:
        _usage_error(f"--experts {spec}: cannot load the factory: {type(error).__name__}: "
                     f"{error} (it must be 'package.module:function', importable from this "
                     f"directory or PYTHONPATH)")
    try:
        experts = factory()
    except Exception as error:  # noqa: BLE001 - the user's factory: named, not a traceback
        _usage_error(f"--experts {spec}: the factory failed: {type(error).__name__}: {error}")
    if not isinstance(experts, Mapping):
        _usage_error(f"--experts {spec} returned {type(experts).__name__}, not a dict of "
                     f"name -> nn.Module")
    return experts


# By name, not __name__: run as ``python -m moe_autograd.remote.cli`` this
# module is ``__main__``, a logger outside ``moe_autograd`` and its handler.
_logger = logging.getLogger("moe_autograd.remote.cli")


def _log(message: str) -> None:
    _logger.info("%s", message)


def _fail(message: str) -> None:
    _logger.error("%s", message)


def _report_served(read: Callable[[], Dict[str, int]], every: float) -> Callable[[], None]:
    """Starts a thread that logs, every ``every`` seconds, the calls served
    since its last line (``read()``: counts so far), unless there were none;
    returns the function that stops it (and joins it)."""
    stop = threading.Event()

    def run() -> None:
        last: Dict[str, int] = {}
        while not stop.wait(every):
            try:
                now = read()
            except Exception:  # noqa: BLE001 - a busy or closing server: next time
                continue
            if now == last:
                continue
            new = {key: now.get(key, 0) - last.get(key, 0) for key in ("forward", "backward",
                                                                         "failed")}
            _logger.info("served %d forward and %d backward calls in the last %g s (%d "
                         "failed); %d, %d and %d in all", new["forward"], new["backward"],
                         every, new["failed"], now.get("forward", 0), now.get("backward", 0),
                         now.get("failed", 0))
            last = now

    thread = threading.Thread(target=run, daemon=True, name="moe_autograd-serve-report")
    if every > 0:
        thread.start()

    def halt() -> None:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=5.0)
    return halt


def _leave_with_world(done: threading.Event) -> None:
    # In a static world a graceful shutdown returns once every worker has
    # called rpc.shutdown(); this process serves requests meanwhile.
    from torch.distributed import rpc

    try:
        rpc.shutdown(graceful=True)
    except Exception:  # noqa: BLE001 - the main thread stopped RPC first
        pass
    finally:
        done.set()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the server; ``argv`` without the program name ("serve" optional)."""
    args_list: List[str] = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["serve"]:
        args_list = args_list[1:]
    args = build_parser().parse_args(args_list)
    configure_cli("moe_autograd serve")
    try:
        return _serve(args)
    except _UsageError as error:
        print(f"python -m moe_autograd serve: error: {error}\n(python -m moe_autograd serve "
              f"--help lists the options)", file=sys.stderr, flush=True)
        return 2


def _durable_options(args: argparse.Namespace) -> Dict[str, Any]:
    """``state_dir``/``save_every``/``save_interval`` for the server, checked."""
    if args.state_dir is None:
        if args.save_every is not None or args.save_interval is not None:
            _usage_error("--save-every and --save-interval need --state-dir")
        return {}
    if args.save_every is not None and args.save_every < 1:
        _usage_error(f"--save-every must be a positive number of steps, got {args.save_every}")
    if args.save_interval is not None and not args.save_interval > 0:
        _usage_error(f"--save-interval must be positive seconds, got {args.save_interval}")
    return {"state_dir": os.path.abspath(args.state_dir), "save_every": args.save_every,
            "save_interval": args.save_interval}


def _serve(args: argparse.Namespace) -> int:
    if args.engine == "ray":
        if args.join or args.world_size:
            _usage_error("--engine ray takes no --join or --world-size: Ray's own "
                         "membership places the server")
        if args.max_restarts < -1:
            _usage_error(f"--max-restarts must be -1 (always) or more, got {args.max_restarts}")
        return _serve_on_ray(args)
    if args.max_restarts:
        _usage_error("--max-restarts is --engine ray's (an RPC server is restarted by whoever "
                     "started it, and resumes from --state-dir)")
    if args.rank is None and not args.join:
        _usage_error("--rank (or $RANK) is required (or --join)")
    secret = _secret(args)
    from torch.distributed import rpc

    from .server import ExpertServer

    experts = _experts(args.experts)
    optimizer = load_object(args.optimizer) if args.optimizer else None
    name = args.name or f"expert-server-{args.rank}"
    extra = {"_transports": args.transports.split(",")} if args.transports else {}
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        num_worker_threads=args.num_worker_threads, rpc_timeout=args.rpc_timeout, **extra)
    durable = _durable_options(args)
    try:  # before init_rpc: no request finds it missing
        server = ExpertServer(experts, backward=args.backward, optimizer=optimizer,
                              auto_step=not args.manual_step, state_ttl=args.state_ttl,
                              max_states=args.max_states,
                              max_states_per_client=args.max_states_per_client,
                              max_state_bytes=args.max_state_bytes,
                              max_request_bytes=args.max_request_bytes,
                              non_finite_grads=args.non_finite_grads, secret=secret,
                              batch_across_calls=args.batch_across_calls,
                              batch_window=args.batch_window,
                              max_batch_rows=args.max_batch_rows, **durable)
    except (ValueError, RuntimeError, TypeError) as error:  # options, a held state dir
        _usage_error(f"cannot serve: {error}")
    halt_report = _report_served(server.served, args.report_every)
    if args.join:
        from .elastic import EXIT_REJOIN, default_name, serve_joined

        try:
            status = serve_joined(server, args.name or default_name(), options,
                                  drain_timeout=args.drain_timeout, log=_log,
                                  recover=not args.no_recover)
        finally:
            halt_report()
        if status == EXIT_REJOIN:
            _start_again()
        return status
    try:
        return _serve_static(args, server, name, options, sorted(experts))
    finally:
        halt_report()


def _start_again() -> None:
    """``serve --join`` left because its TensorPipe listener was closed
    (:mod:`.elastic`): it starts again as a new process in this one
    (``exec``, same pid and arguments), at most :data:`MAX_REJOINS` times,
    so that a supervisor sees one process. Returns if it may not."""
    done = int(os.environ.get(_REJOINS_ENV, "0") or 0)
    if done >= MAX_REJOINS:
        _log(f"not starting again: it already did {done} times")
        return
    os.environ[_REJOINS_ENV] = str(done + 1)
    _log(f"starting again ({done + 1} of at most {MAX_REJOINS})")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _serve_static(args: argparse.Namespace, server: Any, name: str, options: Any,
                  experts: List[str]) -> int:
    """A static world's server (``--rank``, ``--world-size``), until a
    signal or the world's end."""
    from torch.distributed import rpc

    from .rpc_bind import start_rpc

    start_rpc(name, args.rank, args.world_size, options)
    stop, world_done = threading.Event(), threading.Event()
    if threading.current_thread() is threading.main_thread():  # (a signal during init_rpc kills)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    _log(f"worker {name!r} (rank {args.rank}, world size {args.world_size or 'dynamic'}) "
         f"serves {experts} ({args.backward} backward)")
    if args.world_size:
        threading.Thread(target=_leave_with_world, args=(world_done,), daemon=True,
                         name="moe_autograd-serve-world").start()
    while not (stop.wait(0.2) or world_done.is_set()):
        pass
    _log("the world has shut down" if world_done.is_set() else "signal received, shutting down")
    server.close(timeout=args.drain_timeout)
    if not world_done.is_set():
        try:
            # A graceful shutdown would wait for every peer; leave at once.
            rpc.shutdown(graceful=args.world_size is None)
        except Exception as error:  # noqa: BLE001
            _log(f"rpc shutdown: {error}")
    _log("stopped")
    return 0


def _serve_on_ray(args: argparse.Namespace) -> int:
    import json

    import ray

    from .ray_engine import RayAuthError, require_token_auth
    from .ray_server import RayExpertServer

    _secret(args)
    durable = _durable_options(args)  # refused before connecting

    resources = None
    if args.resources:
        try:
            resources = json.loads(args.resources)
        except ValueError as error:
            _usage_error(f"--resources must be a JSON object, got {args.resources!r} ({error})")
        if not isinstance(resources, dict):
            _usage_error(f"--resources must be a JSON object, got {args.resources!r}")
    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    name = args.name or f"expert-server-{os.getpid()}"
    try:  # before connecting: a process without the token hears this, not Ray's retries
        require_token_auth(args.insecure, "serve --engine ray")
    except RayAuthError as error:
        _fail(str(error))
        return 2
    # The actor's process must import the experts factory as this one does.
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    try:
        ray.init(address=address, namespace=args.namespace, log_to_driver=False,
                 configure_logging=False)
    except Exception as error:  # noqa: BLE001 - no cluster, or its token refused us
        from .ray_engine import TOKEN_HELP

        _fail(f"cannot connect to the Ray cluster at {address!r}: {type(error).__name__}: "
              f"{str(error).strip().splitlines()[0][:300]}")
        if "auth" in f"{type(error).__name__} {error}".lower():
            _fail("the cluster requires its token: set RAY_AUTH_MODE=token and "
                  "RAY_AUTH_TOKEN_PATH=<the cluster's token file> (mode 600) in this "
                  "process's environment")
        else:
            _fail(TOKEN_HELP)
        return 75
    try:
        require_token_auth(args.insecure, "serve --engine ray")
    except RayAuthError as error:
        _fail(str(error))
        ray.shutdown()
        return 2
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    optimizer = load_object(args.optimizer) if args.optimizer else None
    try:
        server = RayExpertServer(
            name, args.experts, namespace=args.namespace,
            max_concurrency=args.num_worker_threads, num_gpus=args.num_gpus,
            resources=resources, on_node=None if args.anywhere else "here",
            runtime_env={"env_vars": {"PYTHONPATH": path}},
            secret_file=args.secret_file, allow_unauthenticated=args.insecure,
            backward=args.backward, optimizer=optimizer, auto_step=not args.manual_step,
            state_ttl=args.state_ttl, max_states=args.max_states,
            max_states_per_client=args.max_states_per_client,
            max_state_bytes=args.max_state_bytes, max_request_bytes=args.max_request_bytes,
            non_finite_grads=args.non_finite_grads, batch_across_calls=args.batch_across_calls,
            batch_window=args.batch_window, max_batch_rows=args.max_batch_rows,
            max_restarts=args.max_restarts, recover=not args.no_recover, **durable)
    except BaseException as error:
        _fail(f"could not start the Ray expert server {name!r}: {error}")
        ray.shutdown()
        return 75
    _log(f"Ray actor {name!r} (namespace {args.namespace!r}, node {server.node_id[:12]}, "
         f"pid {server.pid}) serves {sorted(server.experts)} ({args.backward} backward)")
    halt_report = _report_served(server.served, args.report_every)
    died = _watch_actor(server, stop)
    halt_report()
    if died:
        _fail(f"the Ray actor {name!r} died ({died}): its experts are no longer served; "
              "start the server again (with --state-dir it resumes where it saved)")
        ray.shutdown()
        return 1
    _log("signal received, draining")
    left = server.leave(drain_timeout=args.drain_timeout, linger=min(1.0, args.drain_timeout))
    _log(f"left (undrained: {left})")
    ray.shutdown()
    _log("stopped")
    return 0


def _watch_actor(server: Any, stop: threading.Event, every: float = 2.0) -> str:
    """Waits for ``stop``, asking the actor every ``every`` seconds whether
    it lives (Ray's own ``__ray_ready__`` of the handle this process started);
    returns why it died ("" once ``stop`` is set). An actor that Ray is
    restarting (``--max-restarts``) is waited for."""
    import ray

    while not stop.wait(0.2):
        if stop.wait(every):
            return ""
        try:
            ray.get(server.handle.__ray_ready__.remote(), timeout=every)
        except ray.exceptions.ActorUnavailableError:
            continue  # restarting (or its node unreachable for now)
        except ray.exceptions.RayActorError as error:
            return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        except ray.exceptions.GetTimeoutError:
            continue  # busy: asked again
    return ""


def secret_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m moe_autograd secret``: writes a new job secret to a file."""
    parser = argparse.ArgumentParser(
        prog="python -m moe_autograd secret",
        description="Create a job secret: a file of mode 600 that the trainer and every server "
                    "of the job read (--secret-file, or MOE_AUTOGRAD_SECRET_FILE). Copy it "
                    "to each machine the way you copy SSH keys; never pass it on a command "
                    "line.")
    parser.add_argument("--out", default="job.secret", help="where to write it (a new file; "
                                                             "default: job.secret)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    secret = JobSecret.generate()
    try:
        path = secret.save(args.out)
    except FileExistsError:
        parser.error(f"{args.out} exists: a secret is never overwritten (remove it first)")
    print(f"wrote a new job secret to {path} (mode 600, key id {secret.key_id.hex()}); "
          f"servers and the trainer read it with {ENV_SECRET_FILE}={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
