"""Durable expert state on Ray (issue 44): a RayExpertServer with a state
directory and ``max_restarts`` whose process is killed with kill -9 at a
random point of a pass is restarted by Ray and resumes its training expert
from its newest snapshot (weights, Adam's state and steps: bit-equal to a
local run at that step; with a save every step, at most the pass in flight
is lost). A restarted server without a state directory comes back too,
fresh, with a WARNING naming the expert. A RayFleet sees the new
incarnation join and trains on it. ``serve --engine ray --state-dir DIR
--save-every 1 --max-restarts 1`` does the same, and exits 0 after a clean
leave (SIGTERM). A new server started with ``recover=True`` takes a live
replica's state before it serves. Each resume says where it came from in
the actor's log (Ray's ``worker-*-<pid>.err``).

One test on the shared local Ray (``ray_world``): every actor start is slow
on a loaded machine, so the servers start together and are killed together.
"""
import glob
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

import peer_recovery as pr
import wiring
from wiring import RAY_START_S
from moe_autograd.remote import RemoteExpert
from moe_autograd.remote.ray_server import RayExpertServer, start_servers

pytestmark = pytest.mark.timeout(120 + 3 * RAY_START_S)  # actors started (and restarted) here
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _serve(name: str, state_dir: Path, log: Path) -> "subprocess.Popen[bytes]":
    """``serve --engine ray`` of peer_recovery's training expert, durable and
    restartable, joining the shared Ray (the job's secret: MOE_AUTOGRAD_SECRET,
    which wiring exported)."""
    import ray

    env = dict(os.environ, **wiring.ray_token_env(), PYTHONPATH=os.pathsep.join(
        [str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "moe_autograd", "serve", "--engine", "ray", "--address",
           ray.get_runtime_context().gcs_address, "--name", name,
           "--experts", "peer_recovery:experts", "--optimizer", "peer_recovery:adam",
           "--state-dir", str(state_dir), "--save-every", "1", "--max-restarts", "1",
           "--no-recover", "--drain-timeout", "1"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _attach(name: str, process: "subprocess.Popen[bytes]", log: Path) -> RayExpertServer:
    deadline = time.monotonic() + RAY_START_S
    while " serves " not in log.read_text():
        assert process.poll() is None, f"serve exited with {process.returncode}: " \
            f"{log.read_text()}"
        assert time.monotonic() < deadline, f"not serving: {log.read_text()}"
        time.sleep(0.1)
    return RayExpertServer.attach(name)


def _train(expert: torch.nn.Module, steps: int, first: int) -> None:
    """``steps`` passes of peer_recovery's training (the server steps Adam
    after each backward)."""
    for step in range(first, first + steps):
        expert(pr.batch(step)).square().mean().backward()


def _same(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> bool:
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k])
                                                 for k in expected)


def _try(fn: Any) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the server died under it
        pass


def _actor_log(pid: int) -> str:
    """What the actor process ``pid`` wrote to its stderr (Ray's worker log)."""
    logs = os.path.join(wiring._ray[1].dir, "ray", "session_latest", "logs")
    return "".join(Path(p).read_text(errors="replace")
                   for p in glob.glob(os.path.join(logs, f"worker-*-{pid}.err")))


def _wait_for_log(pid: int, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = _actor_log(pid)
        if text in log or time.monotonic() > deadline:
            return log
        time.sleep(0.1)


def _restarted(server: RayExpertServer, old_pid: int, timeout: float) -> RayExpertServer:
    """Waits until the actor answers from a new process (Ray restarted it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if server.refresh(timeout=5.0).pid != old_pid:
                return server
        except Exception:  # noqa: BLE001 - dead until Ray has restarted it
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def test_ray_restart_resumes_from_the_state_dir_and_a_new_replica_from_a_peer(
        ray_world: Dict[str, Any], tmp_path: Path) -> None:
    from moe_autograd.remote.ray_fleet import RayFleet

    transport = ray_world["transport"]
    state_dir = tmp_path / "state"
    k, more = 3, 2
    servers: List[RayExpertServer] = []
    fleet: Optional[RayFleet] = None
    cli_log = tmp_path / "dur-c.log"
    process = _serve("dur-c", tmp_path / "cli-state", cli_log)
    try:
        started = time.monotonic()
        servers += start_servers([("dur-r", "peer_recovery:experts")], state_dir=str(state_dir),
                                 save_every=1, optimizer=pr.adam, max_restarts=1,
                                 ready_timeout=RAY_START_S)
        servers += start_servers([("dur-f", "remote_experts:fleet_experts")], max_restarts=1,
                                 ready_timeout=RAY_START_S)
        durable, fresh = servers
        cli = _attach("dur-c", process, cli_log)
        print(f"three actors started in {time.monotonic() - started:.1f} s")
        assert not durable.restarted and not fresh.restarted and not cli.restarted
        cli_expert = RemoteExpert("dur-c", "dur", transport=transport, forward_timeout=20.0,
                                  backward_timeout=20.0)
        _train(cli_expert, 2, 0)
        fleet = RayFleet(poll=0.1, transport=transport)
        fleet.wait_for(["dur", "f_lin"], timeout=20.0)
        expert = RemoteExpert("dur-r", "dur", transport=transport, forward_timeout=20.0,
                              backward_timeout=20.0)
        _train(expert, k, 0)
        assert _same(expert.remote_snapshot().module, pr.reference(k))

        # kill -9 of the three actors' processes, dur-r's at a random point of pass
        # k + 1: Ray restarts them (max_restarts=1)
        pids = {"dur-r": durable.pid, "dur-f": fresh.pid, "dur-c": cli.pid}
        delay = random.uniform(0.0, 0.05)
        print(f"kill after {delay * 1e3:.1f} ms of a pass")
        in_flight = threading.Thread(target=lambda: _try(lambda: _train(expert, 1, k)))
        in_flight.start()
        time.sleep(delay)
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        in_flight.join(30.0)
        for server in servers + [cli]:
            _restarted(server, pids[server.name], RAY_START_S)
            assert server.restarted
        print(f"all three restarted in {time.monotonic() - killed:.1f} s")

        # dur-r resumed from its snapshot: the pass in flight was applied (and saved)
        # whole or not at all; weights and Adam's state as a local run's at that step
        state = expert.remote_snapshot()
        k = state.steps
        print(f"resumed at step {k}")
        assert k in (3, 4) and _same(state.module, pr.reference(k)), state.steps
        log = _wait_for_log(durable.pid, "resumed from snapshot")
        path = state_dir / "dur-r" / "dur" / f"step-{k:012d}.snap"
        assert f"expert 'dur' resumed from snapshot {path} (step {k})" in log, log[-3000:]
        assert "Ray restarted expert server 'dur-r'" in log, log[-3000:]
        # dur-f came back fresh, and says so, naming its expert
        log = _wait_for_log(fresh.pid, "starts fresh")
        assert "WARNING expert 'f_lin' starts fresh on 'dur-f', restarted by Ray" in log, \
            log[-3000:]

        # the serve process's actor resumed too; it saves at its clean leave and exits 0
        state = cli_expert.remote_snapshot()
        assert state.steps == 2 and _same(state.module, pr.reference(2)), state.steps
        _train(cli_expert, 1, 2)
        log = _wait_for_log(cli.pid, "resumed from snapshot")
        assert "expert 'dur' resumed from snapshot" in log and "(step 2)" in log, log[-3000:]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, cli_log.read_text()
        from moe_autograd.remote.durable import read_snapshot, snapshot_paths

        newest = snapshot_paths(str(tmp_path / "cli-state"), "dur")[0][1]
        assert newest.endswith(f"step-{3:012d}.snap")
        assert _same(read_snapshot(newest, wiring.SECRET)[1].module, pr.reference(3))

        # the fleet saw the old incarnation go and the new one join; training goes on there
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline and [
                e.kind for e in fleet.events if e.worker == "dur-r"].count("joined") < 2:
            time.sleep(0.05)
        kinds = [e.kind for e in fleet.events if e.worker == "dur-r"]
        assert kinds[0] == "joined" and kinds[-1] == "joined" and len(kinds) >= 3, fleet.events
        _train(fleet.expert("dur", forward_timeout=20.0, backward_timeout=20.0), more, k)
        state = expert.remote_snapshot()
        assert state.steps == k + more and _same(state.module, pr.reference(k + more))

        # a new replica with recover=True takes dur-r's state before it serves
        servers.append(RayExpertServer("dur-p", "peer_recovery:experts", optimizer=pr.adam,
                                       recover=True, ready_timeout=RAY_START_S))
        taken = RemoteExpert("dur-p", "dur", transport=transport,
                             forward_timeout=20.0).remote_snapshot()
        assert taken.steps == k + more and _same(taken.module, pr.reference(k + more))
        log = _wait_for_log(servers[-1].pid, "took the state of peer")
        assert f"expert 'dur' took the state of peer 'dur-r' (step {k + more}," in log, \
            log[-3000:]
    finally:
        if fleet is not None:
            fleet.shutdown()
        for server in servers:
            server.kill()
        if process.poll() is None:
            process.kill()  # (its actor ends with it)
        process.wait(10)
