"""Process targets of the elastic-fleet tests (test_elastic.py); not a test module.

The world: a *trainer* child process founds a dynamic RPC world with
:meth:`Fleet.start` and runs commands that the test sends through a queue
(``cmd_*`` functions below, each returning a picklable report); server
processes join it with :class:`ElasticServer` (or the CLI's ``--join``).
"""
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

from moe_autograd.moe import MixtureOfExperts
from moe_autograd.remote import ElasticServer, ExpertServer, Fleet, NoLiveReplica
from moe_autograd.remote.loopback import backend_options
from remote_experts import BALANCED, SLOW_REPLICA_S, Balanced, balanced_calls

WIDTH = 4
DEAD_AFTER = 0.5


class Slow(nn.Module):
    """A linear expert that sleeps ``seconds`` in forward."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        return self.lin(x)


def _experts(names: List[str]) -> Dict[str, nn.Module]:
    """``slow``: 1 s in forward; ``bal``: the replica-choice tests' expert
    (``bal:slow``: its slow replica, served as ``bal``); others: a Linear."""
    built: Dict[str, nn.Module] = {}
    for n in names:
        if n.startswith(BALANCED):
            built[BALANCED] = Balanced(SLOW_REPLICA_S if n.endswith(":slow") else 0.0)
        else:
            built[n] = Slow(1.0) if n == "slow" else nn.Linear(WIDTH, WIDTH)
    return built


def cli_experts() -> Dict[str, nn.Module]:
    """The factory of the CLI server (``serve --join``)."""
    return _experts(["lin", "slow"])


def server_main(port: int, name: str, experts: List[str], backward: str) -> None:
    """A server process: join, serve until SIGTERM (clean leave) or the
    trainer's stop; exit 0 (3 if evicted)."""
    torch.set_num_threads(1)
    elastic = ElasticServer(ExpertServer(_experts(experts), backward=backward), name,
                            options=backend_options(port, rpc_timeout=20.0), linger=0.3,
                            log=lambda m: print(f"[{name}] {m}", file=sys.stderr, flush=True))
    signal.signal(signal.SIGTERM, lambda *_: elastic.stop("SIGTERM"))
    elastic.join()
    reason = elastic.serve()
    os._exit(3 if reason == "evicted" else 0)


# -- the trainer ------------------------------------------------------------------------
class _Trainer:
    def __init__(self, port: int) -> None:
        self.fleet = Fleet.start("trainer", options=backend_options(port, rpc_timeout=20.0),
                                 dead_after=DEAD_AFTER)
        self.pending: Dict[str, Any] = {}
        self.training: Optional[Dict[str, Any]] = None


def trainer_main(port: int, commands: Any, replies: Any) -> None:
    """Founds the world, then runs ``(command, kwargs)`` from ``commands``
    until ``("exit", {})``; replies ``("ok", report)`` or ``("error", text)``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = _Trainer(port)
    replies.put(("ok", "ready"))
    try:
        while True:
            command, kwargs = commands.get()
            if command == "exit":
                break
            try:
                replies.put(("ok", globals()[f"cmd_{command}"](trainer, **kwargs)))
            except Exception:  # noqa: BLE001 - reported to the test
                replies.put(("error", traceback.format_exc()))
    finally:
        if trainer.training is not None:
            trainer.training["stop"].set()
            trainer.training["thread"].join(10)
        start = time.monotonic()
        trainer.fleet.shutdown(timeout=10.0)
        replies.put(("ok", {"shutdown_s": time.monotonic() - start}))


def cmd_wait_for(trainer: _Trainer, experts: List[str], timeout: float = 60.0) -> Dict[str, Any]:
    trainer.fleet.wait_for(experts, timeout)
    return {"servers": trainer.fleet.servers()}


def cmd_discover(trainer: _Trainer) -> Dict[str, Any]:
    fleet = trainer.fleet
    x = torch.randn(3, WIDTH, requires_grad=True)
    served: Dict[str, Any] = {}
    for name in ("e0", "e1", "e2"):
        expert = fleet.expert(name, forward_timeout=5.0, backward_timeout=5.0)
        expert(x).sum().backward()
        served[name] = expert.last_worker
    start = time.monotonic()
    try:
        fleet.expert("nobody-hosts-this", forward_timeout=5.0)(x)
        missing = ("returned", 0.0)
    except NoLiveReplica as error:
        missing = (str(error), time.monotonic() - start)
    return {"servers": fleet.servers(), "replicas": {e: fleet.replicas(e) for e in
                                                     ("e0", "e1", "e2")},
            "served": served, "grad": bool(x.grad is not None and x.grad.abs().sum() > 0),
            "missing": missing}


def cmd_balance(trainer: _Trainer, calls: int) -> Dict[str, Any]:
    """Calls of :data:`BALANCED` (three replicas, one slow) through the
    fleet's default balance, checked against local ones."""
    fleet = trainer.fleet
    deadline = time.monotonic() + 30.0
    while len(fleet.replicas(BALANCED)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)  # a loaded machine may delay a server's beats past DEAD_AFTER
    expert = fleet.expert(BALANCED, forward_timeout=10.0, backward_timeout=10.0)
    report = balanced_calls(expert, calls)
    report["stats"] = expert.replica_stats()
    report["replicas"] = trainer.fleet.replicas(BALANCED)
    return report


# -- in-flight calls across a clean leave -----------------------------------------------
def cmd_begin_inflight(trainer: _Trainer) -> str:
    fleet = trainer.fleet
    x = torch.randn(2, WIDTH, requires_grad=True)
    slow = fleet.expert("slow", forward_timeout=10.0, balance="order")
    slow.last_worker = "srv_cli"  # tried first: the call to the leaving server
    result: Dict[str, Any] = {}

    def run() -> None:
        try:
            result["slow"] = ("ok", slow(x).shape, slow.last_worker)
        except Exception as error:  # noqa: BLE001
            result["slow"] = ("error", repr(error), None)
    thread = threading.Thread(target=run)
    thread.start()
    lin = fleet.expert("lin", forward_timeout=5.0, backward_timeout=5.0, balance="order")
    lin.last_worker = "srv_cli"  # the stateful forward goes to the leaving server
    y = lin(x)
    trainer.pending.update(thread=thread, result=result, y=y, x=x, lin_worker=lin.last_worker)
    time.sleep(0.3)  # the slow call is on the server now
    return str(lin.last_worker)


def cmd_finish_inflight(trainer: _Trainer) -> Dict[str, Any]:
    p = trainer.pending
    p["thread"].join(15)
    try:
        p["y"].sum().backward()
        backward: Any = ("ok", bool(p["x"].grad is not None))
    except Exception as error:  # noqa: BLE001
        backward = ("error", repr(error))
    # after the leave: "lin" and "slow" resolve to the replica that stayed
    deadline = time.monotonic() + 10
    while "srv_cli" in trainer.fleet.servers() and time.monotonic() < deadline:
        time.sleep(0.05)
    lin = trainer.fleet.expert("lin", forward_timeout=5.0)
    lin(torch.randn(2, WIDTH))
    events = [(e.kind, e.worker) for e in trainer.fleet.events if e.worker == "srv_cli"]
    return {"slow": p["result"].get("slow"), "backward": backward, "lin_worker": p["lin_worker"],
            "after": lin.last_worker, "events": events}


# -- training while servers come and go -------------------------------------------------
def _train(trainer: _Trainer, state: Dict[str, Any]) -> None:
    moe: MixtureOfExperts = state["moe"]
    opt = torch.optim.SGD(moe.parameters(), lr=0.01)
    while not state["stop"].is_set():
        x = torch.randn(16, WIDTH)
        start = time.monotonic()
        try:
            y, aux = moe(x)
            (y.square().mean() + aux).backward()
            opt.step()
            opt.zero_grad()
        except Exception as error:  # noqa: BLE001 - a step must never fail here
            state["errors"].append(repr(error))
        state["steps"].append((start, time.monotonic()))
        time.sleep(0.01)


def cmd_start_training(trainer: _Trainer, names: List[str], forward_timeout: float = 2.0
                       ) -> Dict[str, Any]:
    experts = trainer.fleet.experts(names, forward_timeout=forward_timeout, backward_timeout=5.0)
    moe = MixtureOfExperts(experts, WIDTH, k=len(names), k_min=0, allow_zero_outputs=True,
                           forward_timeout=forward_timeout + 0.5, backward_timeout=6.0)
    state: Dict[str, Any] = {"moe": moe, "stop": threading.Event(), "steps": [],
                             "errors": [], "names": names}
    state["thread"] = threading.Thread(target=_train, args=(trainer, state), daemon=True)
    trainer.training = state
    state["thread"].start()
    while len(state["steps"]) < 3:
        time.sleep(0.01)
    return {"steps": len(state["steps"])}


def _step_at(steps: List[Any], when: float) -> int:
    """Index of the first step that started at or after ``when``."""
    for k, (start, _) in enumerate(steps):
        if start >= when:
            return k
    return len(steps)


def cmd_wait_served(trainer: _Trainer, worker: str, timeout: float = 30.0) -> Dict[str, Any]:
    """Waits until ``worker`` (a server that joins now) served a training call."""
    fleet, state = trainer.fleet, trainer.training
    assert state is not None
    deadline = time.monotonic() + timeout
    while fleet.first_served(worker) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    served = fleet.first_served(worker)
    joined = [e.at for e in fleet.events if e.kind == "joined" and e.worker == worker]
    steps = list(state["steps"])
    return {"served": served is not None,
            "join_step": _step_at(steps, joined[-1]) if joined else None,
            "served_step": None if served is None else _step_at(steps, served) - 1,
            "join_to_served_s": None if served is None or not joined else served - joined[-1],
            "steps": len(steps)}


def cmd_stats(trainer: _Trainer) -> Dict[str, Any]:
    state = trainer.training
    assert state is not None
    moe: MixtureOfExperts = state["moe"]
    stats: List[Dict[str, Any]] = list(moe.stats())
    steps = list(state["steps"])
    return {"steps": len(steps), "errors": list(state["errors"]),
            "failures": {n: s["failures"] + s["timeouts"] for n, s in zip(state["names"], stats)},
            "calls": {n: s["calls"] for n, s in zip(state["names"], stats)},
            "longest_step_s": max(end - start for start, end in steps),
            "events": [(e.kind, e.worker, e.at) for e in trainer.fleet.events],
            "now": time.monotonic(), "threads": threading.active_count()}


def cmd_stop_training(trainer: _Trainer) -> Dict[str, Any]:
    state = trainer.training
    assert state is not None
    state["stop"].set()
    state["thread"].join(10)
    report = cmd_stats(trainer)
    trainer.training = None
    return report


def cmd_call(trainer: _Trainer, name: str, forward_timeout: float = 2.0,
             prefer: Optional[str] = None) -> Dict[str, Any]:
    expert = trainer.fleet.expert(name, forward_timeout=forward_timeout,
                                  balance="latency" if prefer is None else "order")
    expert.last_worker = prefer  # tried first if it is a candidate ("order")
    start = time.monotonic()
    try:
        expert(torch.randn(2, WIDTH))
        outcome = "ok"
    except Exception as error:  # noqa: BLE001
        outcome = f"{type(error).__name__}: {error}"
    return {"outcome": outcome, "seconds": time.monotonic() - start, "worker": expert.last_worker,
            "retries": expert.retries}


def cmd_wait_event(trainer: _Trainer, kind: str, worker: str, timeout: float = 10.0
                   ) -> Optional[float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in trainer.fleet.events:
            if event.kind == kind and event.worker == worker:
                return event.at
        time.sleep(0.02)
    return None


def cmd_members(trainer: _Trainer) -> List[str]:
    from moe_autograd.remote import membership

    return sorted(membership.members(trainer.fleet.registry.raw))


def cmd_replay_earlier_run(trainer: _Trainer, calls: int = 6) -> Dict[str, Any]:
    """(issue 45) An earlier run's signed records, same secret, written into
    this run's store: a stop, and an eviction of every member at its rank.
    The servers must refuse them (other run) and keep serving: the calls
    after are checked against the local reference."""
    from moe_autograd.remote import membership
    from moe_autograd.remote.registry import Registry

    registry = trainer.fleet.registry
    members = membership.members(registry.raw)
    earlier = Registry(registry.raw, trainer.fleet.secret, run="0" * 32)
    earlier.request_stop()
    for name, rank in members.items():
        if name != "trainer":
            earlier.evict(name, rank)
    time.sleep(1.5)  # beats of the servers: each reads the stop and its eviction mark
    servers = trainer.fleet.servers()
    expert = trainer.fleet.expert(BALANCED, forward_timeout=10.0, backward_timeout=10.0)
    report = balanced_calls(expert, calls)
    for name in members:
        registry.raw.delete_key(registry._key("evicted", name))
    registry.raw.delete_key(registry._key("stop"))
    return {"servers_before": sorted(members), "servers": sorted(servers),
            "after": sorted(membership.members(registry.raw)),
            "mismatches": report["mismatches"], "served": report["served"]}
