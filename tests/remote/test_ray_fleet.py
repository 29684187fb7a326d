"""The elastic fleet on Ray's membership (RayFleet + FleetExpert): discovery by
name (of the servers that prove the job's secret only), replicas with forward
retry, backward to the replica holding the state, drain on leave, a killed
server masked, a replacement serving; calls avoiding a slow replica (issue 32)."""
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

import remote_experts as rx
from wiring import RAY_START_S
from moe_autograd.moe import MixtureOfExperts
from moe_autograd.remote import JobSecret
from moe_autograd.remote.ray_server import RayExpertServer, start_servers

pytestmark = pytest.mark.timeout(90 + 2 * RAY_START_S)  # actors started in the test


def test_ray_fleet_replicas_kill_join_and_drain(ray_world: Dict[str, Any],
                                                tmp_path: Path) -> None:
    from moe_autograd.remote.ray_fleet import RayFleet

    servers = start_servers([("fl-1", "remote_experts:fleet_experts"),
                             ("fl-2", "remote_experts:fleet_experts")],
                            backward="stateful", ready_timeout=RAY_START_S)
    extra: List[Any] = []
    fleet: Optional[RayFleet] = None
    try:
        # another job's server in the same namespace, hosting the same name
        other = JobSecret.generate().save(tmp_path / "other.secret")
        extra.append(RayExpertServer("fl-x", "remote_experts:fleet_experts", secret_file=other,
                                     ready_timeout=RAY_START_S))
        fleet = RayFleet(poll=0.1, transport=ray_world["transport"])
        fleet.wait_for(["f_lin"], timeout=20.0, replicas=2)
        assert fleet.replicas("f_lin") == ["fl-1", "fl-2"]  # discovery by name, oldest first
        # fl-x cannot open the fleet's sealed info(): refused, never chosen
        deadline = time.monotonic() + 10.0
        while not any(e.worker == "fl-x" for e in fleet.events) and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = [e for e in fleet.events if e.worker == "fl-x"]
        assert [e.kind for e in refused] == ["refused"], fleet.events
        assert "fl-x" not in fleet.servers()
        extra.pop().kill()
        expert = fleet.expert("f_lin", forward_timeout=5.0, backward_timeout=5.0)
        local = rx.fleet_experts()["f_lin"]
        x = torch.randn(3, rx.WIDTH, requires_grad=True)
        lx = x.detach().clone().requires_grad_()
        out = expert(x)
        assert expert.last_worker == "fl-1"
        local(lx).sum().backward()
        out.sum().backward()
        assert torch.equal(out, local(lx).detach()) and torch.equal(x.grad, lx.grad)

        # kill -9 of the replica in use: the next forward retries on the other one
        os.kill(servers[0].pid, signal.SIGKILL)
        started = time.monotonic()
        out = expert(torch.randn(2, rx.WIDTH))
        assert expert.last_worker == "fl-2" and time.monotonic() - started < 5.0
        # a MixtureOfExperts over the fleet runs on (the dead replica is skipped)
        moe = MixtureOfExperts([expert, fleet.expert("f_lin", forward_timeout=5.0)], rx.WIDTH,
                               k=2, forward_timeout=5.0, backward_timeout=5.0)
        y, aux = moe(torch.randn(4, rx.WIDTH, requires_grad=True))
        (y.sum() + aux).backward()
        assert all(s["failures"] == 0 and s["timeouts"] == 0 for s in moe.stats()), moe.stats()

        # a replacement joins and is chosen once the dead one is forgotten
        extra.append(RayExpertServer("fl-3", "remote_experts:fleet_experts",
                                     backward="stateful", ready_timeout=RAY_START_S))
        fleet.wait_for(["f_lin"], timeout=20.0, replicas=2)
        deadline = time.monotonic() + 20.0
        while "fl-1" in fleet.servers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert fleet.replicas("f_lin") == ["fl-2", "fl-3"]

        # drain on leave: a held state is still served; no new call goes there
        x = torch.randn(2, rx.WIDTH, requires_grad=True)
        out = expert(x)  # the state is held where it ran (fl-3 is explored first)
        held = expert.last_worker
        assert held in ("fl-2", "fl-3")
        stays = "fl-3" if held == "fl-2" else "fl-2"
        result: Dict[str, Any] = {}
        leaver = {"fl-2": servers[1], "fl-3": extra[-1]}[held]
        leaving = threading.Thread(target=lambda: result.update(leaver.leave(
            drain_timeout=30.0, linger=0.5)))
        leaving.start()
        deadline = time.monotonic() + 10.0
        while held in fleet.replicas("f_lin") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fleet.replicas("f_lin") == [stays]  # unpublished while draining
        assert expert(torch.randn(2, rx.WIDTH)).shape == (2, rx.WIDTH)
        assert expert.last_worker == stays
        out.sum().backward()  # the backward goes to the leaving one, which still holds the state
        assert x.grad is not None
        leaving.join(40.0)
        assert result == {"in_flight": 0, "live": 0}, result
    finally:
        if fleet is not None:
            fleet.shutdown()
        for server in servers + extra:
            server.kill()


def test_ray_fleet_calls_avoid_a_slow_replica(ray_world: Dict[str, Any]) -> None:
    """Issue 32 on Ray: three replicas of ``bal`` (the shared servers srv-a
    and srv-b, and bl-slow, which sleeps 50 ms in forward and in backward,
    server-side): each is explored once, then the slow one gets no call but
    a re-probe (one per 10 s), and every output and gradient equals the local
    expert's."""
    from moe_autograd.remote.ray_fleet import RayFleet

    servers = start_servers([("bl-slow", "remote_experts:balanced_experts_slow")],
                            ready_timeout=RAY_START_S)
    fleet: Optional[RayFleet] = None
    try:
        fleet = RayFleet(poll=0.1, transport=ray_world["transport"])
        fleet.wait_for([rx.BALANCED], timeout=20.0, replicas=3)
        replicas = fleet.replicas(rx.BALANCED)
        assert sorted(replicas) == ["bl-slow", "srv-a", "srv-b"], replicas
        expert = fleet.expert(rx.BALANCED, forward_timeout=10.0, backward_timeout=10.0)
        report = rx.balanced_calls(expert, 30)
        served, stats = report["served"], fleet.replica_stats()[rx.BALANCED]
        assert report["mismatches"] == 0, report
        assert served[:3] == replicas, served  # explored first, in the fleet's order
        assert served[3:].count("bl-slow") <= 1, served  # a count, not a time
        assert stats["bl-slow"]["forward_ms"] > max(stats["srv-a"]["forward_ms"],
                                                    stats["srv-b"]["forward_ms"]), stats
        assert sum(s["calls"] for s in stats.values()) == 30, stats
        assert all(s["in_flight"] == 0 and s["failures"] == 0 for s in stats.values()), stats
    finally:
        if fleet is not None:
            fleet.shutdown()
        for server in servers:
            server.kill()
