"""Replicas of a training expert stay one expert on Ray (issue 44,
moe_autograd/remote/mirrored.py; the RPC twin is test_mirrored.py's
mirror_fleet run): three :class:`RayExpertServer` actors serve ``dur``
(peer_recovery's expert, Adam with a step after every backward), each built
from its own seed, and a :class:`RayFleet`'s :class:`FleetExpert` trains it
under ``balance="latency"`` for 100 steps.

* ``mir-a`` (seed 0, the reference's) trains alone for the first steps;
  ``mir-b`` and ``mir-c`` (seeds 7 and 8) start with ``recover=True`` and
  take its state before they serve (the peer path).
* At a random instant of one pass (armed at the pass's start, fired only
  while the pass is in flight) one of the three actors is killed with
  SIGKILL (``max_restarts=0``: it stays dead).
* A fresh actor ``mir-d`` (seed 9, no ``recover``) starts while the training
  goes on; the client finds it at another version and brings it into sync
  (the resync path), and it trains mirrored from then on.

At the end every live replica's whole state (weights, Adam's state, steps) is
bit-equal to a local run of the 100 steps: no step lost, none applied twice;
the forwards were spread over more than one replica. The full 100 steps are
kept: they take 5 to 8 s on 2 loaded cores (a pass is a forward and a
backward sent to every in-sync replica, 12 to 20 ms); the actor starts
dominate, so the test starts them in three waves only (mir-a; mir-b with
mir-c; mir-d) on the shared local Ray (``ray_world``).
"""
import os
import random
import signal
import statistics
import threading
import time
from typing import Any, Dict, List, Optional

import pytest

import peer_recovery as pr
from mirror_fleet import _optimizer_equal, reference
from wiring import RAY_START_S
from moe_autograd.remote import RemoteExpert
from moe_autograd.remote.ray_server import RayExpertServer

pytestmark = pytest.mark.timeout(120 + 3 * RAY_START_S)  # three waves of actor starts

STEPS, ALONE, KILL_AT, JOIN_AT, JOINED_BY = 100, 5, 30, 35, 60
SEEDS = {"mir-a": 0, "mir-b": 7, "mir-c": 8, "mir-d": 9}


def _start(name: str, recover: bool = False, wait: bool = True) -> RayExpertServer:
    """peer_recovery's training expert ``dur`` on a new actor, built from its
    own seed (``PEER_SEED`` in the actor's environment only)."""
    return RayExpertServer(name, "peer_recovery:experts", optimizer=pr.adam, max_restarts=0,
                           recover=recover, wait=wait, ready_timeout=RAY_START_S,
                           runtime_env={"env_vars": {"PEER_SEED": str(SEEDS[name])}})


def _wait_replicas(fleet: Any, names: List[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not set(names) <= set(fleet.replicas("dur")):
        assert time.monotonic() < deadline, f"{names} not all serving: {fleet.servers()}"
        time.sleep(0.05)


class _Killer:
    """Kills ``pid`` with SIGKILL at a random instant of a pass: armed when a
    pass starts, it fires after a random delay only if that pass is still in
    flight (else it is armed again at the next pass, with a new delay)."""

    def __init__(self, pid: int, rng: random.Random) -> None:
        self.pid, self.rng = pid, rng
        self.lock = threading.Lock()
        self.armed = 0  # the pass armed now (0: none)
        self.passes = 0
        self.fired_at: Optional[float] = None
        self.delay = 0.0

    def arm(self, longest: float) -> None:
        with self.lock:
            self.passes += 1
            self.armed = self.passes
            self.delay = self.rng.uniform(0.0, longest)
            threading.Timer(self.delay, self._fire, (self.passes,)).start()

    def _fire(self, armed: int) -> None:
        with self.lock:  # (a timer of an earlier pass does nothing)
            if self.armed == armed and self.fired_at is None:
                os.kill(self.pid, signal.SIGKILL)
                self.fired_at = time.monotonic()

    def disarm(self) -> None:
        with self.lock:
            self.armed = 0


def test_three_ray_replicas_stay_one_expert_through_a_kill_and_a_fresh_join(
        ray_world: Dict[str, Any]) -> None:
    from moe_autograd.remote.ray_fleet import RayFleet

    transport = ray_world["transport"]
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed}")
    servers: Dict[str, RayExpertServer] = {}
    fleet: Optional[RayFleet] = None
    began = time.monotonic()
    try:
        servers["mir-a"] = _start("mir-a")
        fleet = RayFleet(poll=0.1, transport=transport)
        fleet.wait_for(["dur"], timeout=20.0)
        assert fleet.replicas("dur") == ["mir-a"], fleet.servers()  # nobody else serves dur
        expert = fleet.expert("dur", forward_timeout=30.0, backward_timeout=30.0,
                              balance="latency")
        served: List[Optional[str]] = []
        passes: List[float] = []

        def step(i: int, killer: Optional[_Killer] = None) -> None:
            """One pass (a forward and its backward); ``killer`` is armed
            for the pass's span only."""
            start = time.monotonic()
            if killer is not None:
                killer.arm(1.5 * statistics.median(passes[ALONE:]))
            try:
                expert(pr.batch(i)).square().mean().backward()
            finally:
                if killer is not None:
                    killer.disarm()
            passes.append(time.monotonic() - start)
            served.append(expert.last_worker)

        for i in range(ALONE):
            step(i)
        started = time.monotonic()
        for name in ("mir-b", "mir-c"):  # both at once: each takes mir-a's state
            servers[name] = _start(name, recover=True, wait=False)
        for name in ("mir-b", "mir-c"):
            servers[name].wait_ready()
        print(f"mir-a, then mir-b and mir-c started: {started - began:.1f} s + "
              f"{time.monotonic() - started:.1f} s")
        for name in ("mir-b", "mir-c"):  # their own seeds' weights are gone: mir-a's state
            state = RemoteExpert(name, "dur", transport=transport,
                                 forward_timeout=20.0).remote_snapshot()
            assert state.steps == ALONE and pr._same(state.module, pr.reference(ALONE)), name
        _wait_replicas(fleet, ["mir-a", "mir-b", "mir-c"], 20.0)

        victim = rng.choice(["mir-a", "mir-b", "mir-c"])
        killer = _Killer(servers[victim].pid, rng)
        killed_in: Optional[int] = None
        joining = trained = time.monotonic()
        for i in range(ALONE, STEPS):
            if i == JOIN_AT:  # starts while the training goes on
                servers["mir-d"] = _start("mir-d", wait=False)
                joining = time.monotonic()
            if i == JOINED_BY:  # trains mirrored from here on, whenever it joined
                _wait_replicas(fleet, ["mir-d"], RAY_START_S)
                print(f"mir-d serves {time.monotonic() - joining:.1f} s after its start")
            step(i, killer if i >= KILL_AT and killed_in is None else None)
            if killed_in is None and killer.fired_at is not None:
                killed_in = i
                print(f"{victim} killed {killer.delay * 1e3:.1f} ms into pass {i} "
                      f"(of {passes[-1] * 1e3:.1f} ms)")
        spent = time.monotonic() - trained
        servers["mir-d"].wait_ready()
        assert killed_in is not None, "the victim was never killed mid-pass"
        print(f"{STEPS - ALONE} steps in {spent:.1f} s (passes: median "
              f"{statistics.median(passes) * 1e3:.1f} ms, longest {max(passes) * 1e3:.1f} ms)")

        want = reference(STEPS)
        live = [w for w in ("mir-a", "mir-b", "mir-c", "mir-d") if w != victim]
        for worker in live:  # no step lost, none twice: bit-equal to the local run
            state = RemoteExpert(worker, "dur", transport=transport,
                                 forward_timeout=20.0).remote_snapshot()
            assert state.steps == STEPS and state.skipped_steps == 0, (worker, state.steps)
            assert pr._same(state.module, want["module"]), worker
            assert state.optimizer is not None and _optimizer_equal(
                state.optimizer["state"], want["optimizer"]), worker
        snapshot = expert.remote_snapshot()  # the fleet's view: a replica at its truth
        assert snapshot.steps == STEPS and pr._same(snapshot.module, want["module"])
        # calls were spread over the replicas; mir-d was brought into sync by the client
        counts = {w: served.count(w) for w in set(served) if w is not None}
        stats = expert.replica_stats()
        print(f"forwards served: {counts}; resyncs {expert.view.resyncs}; balancer: {stats}")
        assert len(counts) >= 2, counts
        assert len([w for w, s in stats.items() if s["calls"]]) >= 2, stats
        assert expert.view.resyncs >= 1  # mir-d, found at its own version, took a replica's
        # then applied the mirrored backwards, and took forwards too: the answer that
        # found it out of sync is no failure for the balancer
        assert counts.get("mir-d", 0) >= 1, counts
        late = servers["mir-d"].served()
        assert late["backward"] >= STEPS - JOINED_BY - 1, late  # (one refused: "failed")
        assert victim not in fleet.servers(), fleet.servers()  # it stayed dead
        with pytest.raises(Exception):  # (max_restarts=0)
            servers[victim].refresh(timeout=5.0)
    finally:
        if fleet is not None:
            fleet.shutdown()
        for server in servers.values():
            server.kill()
