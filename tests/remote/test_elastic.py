"""The elastic fleet (issue 13): servers join and leave a running world, experts
are found by name, training never stops.

Unit tests run in this process (a local TCPStore, a transport that serves
frames with this process's endpoint). The multi-process tests share one world of
their own: a trainer child process founds it with ``Fleet.start`` and runs
the commands of :mod:`elastic_experts`; servers join it (``ElasticServer`` in
forked processes, and the CLI's ``serve --join``). This process never joins
it (it may be in the shared static world of conftest.py).
"""
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from queue import Empty
from typing import Any, Dict, Iterator, List, Optional

import pytest
import torch
from torch import nn

import elastic_experts as ex
from moe_autograd.remote import (ElasticServer, ExpertServer, Fleet, FleetExpert, JobSecret,
                                  NoLiveReplica, RemoteExpertError, flush_releases,
                                  security_stats)
from moe_autograd.remote import membership
from moe_autograd.remote.frame import Frame
from moe_autograd.remote.loopback import free_port, stop_processes
from moe_autograd.remote.registry import (PREFIX, BeatWatch, Registry, ServerRecord,
                                          observe_alive)
from moe_autograd.remote.transport import TransportSendError
from wiring import SECRET, InProcess

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


# -- unit tests ---------------------------------------------------------------------------
@pytest.fixture()
def store() -> Iterator[Any]:
    import torch.distributed as dist

    yield dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=5))


@pytest.mark.timeout(30)
def test_registry_roster_beats_and_liveness(store: Any) -> None:
    registry = Registry(store, SECRET)
    registry.found()
    assert registry.roster() == {} and registry.version() == 0

    def publish(k: int) -> None:
        registry.publish(ServerRecord(f"s{k}", k + 1, {"e": "stateless", f"only{k}": "stateful"}))
    threads = [threading.Thread(target=publish, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert registry.roster() == {f"s{k}": k + 1 for k in range(8)}  # no lost update
    assert registry.version() == 8
    assert registry.records(["s3"])["s3"].experts == {"e": "stateless", "only3": "stateful"}
    registry.unpublish("s3", 99, "left")  # another incarnation: ignored
    assert "s3" in registry.roster()
    registry.unpublish("s3", 4, "draining")
    record = registry.record("s3")
    assert "s3" not in registry.roster() and record is not None and record.state == "draining"

    registry.beat("s1", 2)
    assert registry.beats({"s1": 2, "s2": 3}) == {"s1": 1}  # s2 never beat
    assert registry.beats({"s1": 7}) == {}  # beats are per incarnation
    watch = BeatWatch(dead_after=1.0)
    watch.update({"s1": 1}, now=10.0)
    assert watch.alive("s1", now=10.9) and not watch.alive("s1", now=11.1)
    watch.update({"s1": 1}, now=11.0)  # did not move
    assert not watch.alive("s1", now=11.1) and not watch.alive("never", now=0.0)
    watch.update({"s1": 2}, now=11.2)
    assert watch.alive("s1", now=12.1)

    beating = threading.Event()

    def beat() -> None:
        while not beating.wait(0.02):
            registry.beat("s1", 2)
    thread = threading.Thread(target=beat)
    thread.start()
    registry.beat("s2", 3)  # beat once, then silent
    try:
        alive = observe_alive(registry, {"s1": 2, "s2": 3, "plain": 0}, window=0.2)
    finally:
        beating.set()
        thread.join()
    assert sorted(alive) == ["plain", "s1"]  # "plain" never beat: cannot be judged

    assert not registry.stop_requested() and not registry.evicted("s1", 2)
    registry.request_stop()
    registry.evict("s1", 2)
    assert registry.stop_requested() and registry.evicted("s1", 2) and not registry.evicted("s1", 5)

    # Entries are signed with the job's secret: what is not is not read (and is counted once).
    refused = security_stats()["refused"].get("bad MAC", 0)
    stranger = Registry(store, JobSecret.generate(), run="0" * 32)
    assert stranger.roster() == {} and stranger.record("s1") is None
    assert stranger.records(["s1", "s2"]) == {}
    assert not stranger.stop_requested() and not stranger.evicted("s1", 2)
    stranger.publish(ServerRecord("intruder", 50, {"e": "stateless"}))
    stranger.evict("s2", 3)
    assert "intruder" not in registry.roster() and registry.record("intruder") is None
    assert registry.roster() == {f"s{k}": k + 1 for k in range(8) if k != 3}  # the rest stands
    assert not registry.evicted("s2", 3)
    store.set(PREFIX + "server/s5", store.get(PREFIX + "server/s5").decode().replace(
        '\\"rank\\": 6', '\\"rank\\": 60'))  # a record changed in the store
    assert registry.record("s5") is None and "s5" not in registry.records(["s5", "s6"])
    registry.roster(), registry.record("intruder"), registry.record("s5")  # read again
    assert security_stats()["refused"].get("bad MAC", 0) - refused >= 7
    again = security_stats()["refused"].get("bad MAC", 0)
    registry.roster(), registry.record("intruder"), registry.record("s5")
    assert security_stats()["refused"].get("bad MAC", 0) == again  # each entry counted once


@pytest.mark.timeout(30)
def test_membership_store_helpers(store: Any) -> None:
    import torch.distributed as dist

    ns = dist.PrefixStore(membership.RPC_PREFIX, store)
    assert membership.members(store) == {}
    ns.set("names/_ALL_WORKER_INFOS", "trainer-0,srv_a-3,b_2-12,")
    assert membership.members(store) == {"trainer": 0, "srv_a": 3, "b_2": 12}
    assert [membership.allocate_rank(store) for _ in range(3)] == [1, 2, 3]
    assert membership.store_address("tcp://10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert membership.check_name("srv_a:1") == "srv_a:1"
    with pytest.raises(membership.MembershipError, match="no '-'"):
        membership.check_name("srv-a")  # torch's dynamic join splits 'name-rank' at '-'
    server = ExpertServer({"fleet_unit_named": nn.Linear(1, 1)})
    try:
        with pytest.raises(membership.MembershipError):
            ElasticServer(server, "bad name")
    finally:
        server.close()
    with pytest.raises(membership.MembershipError, match="tcp://"):
        membership.store_address("file:///tmp/x")

    assert membership.token_holder(store) == ("", None)
    with membership._Token(store, "me", "reap", timeout=1.0) as token:
        held, holder = membership.token_holder(store)
        assert held == token.token and holder == "me"
        start = time.monotonic()
        with pytest.raises(membership.MembershipError, match="held by"):
            with membership._Token(store, "other_1", "leave", timeout=0.2):
                pass
        assert time.monotonic() - start < 1.0
    assert membership.token_holder(store) == ("", None)  # released on exit
    assert ns.get(token.token) == b"Done"  # waiters woken the way torch's are

    ns.set(membership.TOKEN_KEY, "Token_for_dead-1_join")  # its holder died mid-join
    assert membership.token_holder(store) == ("Token_for_dead-1_join", "dead-1")
    assert not membership.release_stuck_token(store, "Token_for_someone_else_join")
    assert membership.release_stuck_token(store, "Token_for_dead-1_join")
    assert membership.token_holder(store) == ("", None)


class _LocalTransport(InProcess):
    """Serves frames with this process's endpoint (the servers built here),
    as the worker they are sent to; ``dead`` workers fail at once."""

    name = "local"

    def __init__(self, dead: List[str]) -> None:
        super().__init__("unit-client")
        self.dead = dead
        self.calls: List[str] = []

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Any:
        self.calls.append(worker)
        if worker in self.dead:
            raise TransportSendError(f"RuntimeError: could not find destination name {worker}")
        return super().call(worker, frame, timeout)


class _StubFleet:
    secret = SECRET

    def __init__(self, replicas: List[str], transport: _LocalTransport) -> None:
        self._replicas, self.transport = replicas, transport
        self.suspected: List[str] = []
        self.served: List[str] = []

    def replicas(self, name: str) -> List[str]:
        return [w for w in self._replicas if w not in self.suspected]

    def servers(self) -> Dict[str, Any]:
        return {w: ("unit_lin",) for w in self._replicas}

    def suspect(self, worker: str, why: str = "") -> None:
        self.suspected.append(worker)

    def _served(self, worker: str) -> None:
        self.served.append(worker)

    def refresh_on_miss(self) -> None:
        pass


def _live_after_releases(server: ExpertServer) -> int:
    """The server's held states once the releases of dropped outputs went out
    (test_dropped_outputs_are_released_by_reference_counting: without a GC pass)."""
    flush_releases()
    return int(server.stats()["live"])


@pytest.mark.timeout(30)
def test_fleet_expert_retries_on_a_live_replica() -> None:
    transport = _LocalTransport(dead=["gone"])
    module = nn.Linear(3, 3)
    server = ExpertServer({"fleet_unit_lin": module}, backward="stateful", transport=transport)
    try:
        fleet = _StubFleet(["gone", "good"], transport)
        # "order": last_worker is tried first (the test forces a replica with it)
        expert = FleetExpert(fleet, "fleet_unit_lin", forward_timeout=5.0,  # type: ignore[arg-type]
                             balance="order")
        x = torch.randn(2, 3, requires_grad=True)
        y = expert(x)
        torch.testing.assert_close(y, module(x))
        y.sum().backward()  # to the replica that ran the forward
        assert transport.calls == ["gone", "good", "good"]
        assert fleet.suspected == ["gone"] and fleet.served == ["good"]
        assert expert.last_worker == "good" and expert.retries == 1
        expert(x)  # the replica that served is tried first
        assert transport.calls[-1] == "good"
        assert _live_after_releases(server) == 0  # dropped output: released
        expert.last_worker = "gone"
        fleet.suspected.clear()
        expert(x)  # a failed attempt, then a stateful call whose output is dropped
        assert transport.calls[-2:] == ["gone", "good"]
        assert _live_after_releases(server) == 0

        transport.dead.append("good")
        expert.last_worker = None
        with pytest.raises(RemoteExpertError, match="failed on every live replica") as info:
            expert(x)
        assert not isinstance(info.value, NoLiveReplica)
        with pytest.raises(NoLiveReplica, match="no live server"):
            expert(x)  # both are suspected now
        with pytest.raises(ValueError, match="attempt_timeout"):
            FleetExpert(fleet, "x", attempt_timeout=-1.0)  # type: ignore[arg-type]
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_dropped_outputs_are_released_by_reference_counting() -> None:
    transport = _LocalTransport(dead=["gone"])
    server = ExpertServer({"fleet_unit_rc": nn.Linear(3, 3)}, backward="stateful",
                          transport=transport)
    gc.collect()
    gc.disable()  # a state must be freed by reference counting, not by a GC pass
    try:
        fleet = _StubFleet(["gone", "good"], transport)
        expert = FleetExpert(fleet, "fleet_unit_rc", forward_timeout=5.0,  # type: ignore[arg-type]
                             balance="order")
        x = torch.randn(2, 3, requires_grad=True)
        expert(x)  # the replica that served is tried first
        assert transport.calls == ["gone", "good"]
        flush_releases()
        assert server.stats()["live"] == 0  # dropped output: released
        expert.last_worker = "gone"
        fleet.suspected.clear()
        expert(x)  # a failed attempt, then a stateful call whose output is dropped
        assert transport.calls[-2:] == ["gone", "good"]
        flush_releases()
        assert server.stats()["live"] == 0  # no cycle kept the retried call's state
    finally:
        gc.enable()
        gc.collect()
        flush_releases()  # before the server closes (a release after it is refused)
        server.close()


@pytest.fixture()
def host_rank() -> Iterator[Any]:
    """``host_rank(r)``: the rank this process's ``info`` answers with (as an
    ElasticServer sets it); restored afterwards."""
    from moe_autograd.remote import server as server_module

    before = server_module.host_info()

    def set_rank(rank: int) -> None:
        server_module.set_host_info(rank=rank)
    yield set_rank
    with server_module._registry_lock:
        server_module._host.clear()
        server_module._host.update(before)


def _events(fleet: Fleet, worker: str) -> List[str]:
    return [e.kind for e in list(fleet.events) if e.worker == worker]


@pytest.mark.timeout(30)
def test_fleet_admits_only_servers_that_prove_the_secret_and_rank(store: Any,
                                                                  host_rank: Any) -> None:
    """A published server is resolved only once it answered the sealed
    ``info`` challenge with the rank it published; one that cannot open the
    fleet's requests (it lacks the secret) is refused, never admitted."""
    host_rank(5)
    server = ExpertServer({"adm_unit_e": nn.Linear(2, 2)})  # serves SECRET's job here
    transport = _LocalTransport(dead=[])
    registry = Registry(store, SECRET)
    registry.found()
    other = JobSecret.generate()
    fleets: List[Fleet] = []
    try:
        for name, rank in (("srv_ok", 5), ("srv_wrong_rank", 6)):
            registry.beat(name, rank)
            registry.publish(ServerRecord(name, rank, {"adm_unit_e": "stateless"}))
        fleet = Fleet(store, "unit_trainer", 1, founder=False, reap=False, poll=0.02,
                      transport=transport, secret=SECRET)
        fleets.append(fleet)
        deadline = time.monotonic() + 10.0
        while "joined" not in _events(fleet, "srv_ok") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _events(fleet, "srv_ok") == ["joined"], fleet.events
        assert fleet.replicas("adm_unit_e") == ["srv_ok"]
        time.sleep(0.5)  # asked again meanwhile (every CHALLENGE_EVERY_S): still the wrong rank
        assert _events(fleet, "srv_wrong_rank") == [], fleet.events
        assert transport.calls.count("srv_wrong_rank") >= 2, transport.calls
        assert "srv_wrong_rank" not in fleet.servers()

        # another job's fleet: it reads only what its own secret signed, and the
        # server here cannot open its challenge (a refusal): never admitted
        theirs = Fleet(store, "unit_other", 2, founder=True, reap=False, poll=0.02,
                       transport=transport, secret=other)  # (a run of its own, in this store)
        stranger = Registry(store, other, run=theirs.registry.run)
        stranger.beat("srv_stranger", 5)
        stranger.publish(ServerRecord("srv_stranger", 5, {"adm_unit_e": "stateless"}))
        fleets.append(theirs)
        deadline = time.monotonic() + 10.0
        while "refused" not in _events(theirs, "srv_stranger") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _events(theirs, "srv_stranger") == ["refused"], theirs.events
        refused = [e for e in theirs.events if e.kind == "refused"]
        assert "refused the request" in refused[0].detail, refused
        calls = transport.calls.count("srv_stranger")
        time.sleep(0.3)
        assert transport.calls.count("srv_stranger") == calls  # not asked again
        assert theirs.servers() == {} and theirs.replicas("adm_unit_e") == []
        assert "srv_stranger" not in fleet.servers() and "srv_ok" in fleet.servers()
    finally:
        for f in fleets:
            f.shutdown()
        server.close()


# -- the multi-process world ------------------------------------------------------------
_PRELOAD = ["torch", "torch.distributed.rpc", "moe_autograd.remote", "moe_autograd.moe",
            "elastic_experts"]


def _context() -> Any:
    """Forked from a forkserver that imported torch once (seconds per process
    saved on a small machine); spawn where there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _World:
    def __init__(self) -> None:
        self.port = free_port()
        self.ctx = _context()
        self.commands, self.replies = self.ctx.Queue(), self.ctx.Queue()
        self.trainer = self.ctx.Process(target=ex.trainer_main, name="elastic-trainer",
                                        args=(self.port, self.commands, self.replies))
        self.servers: Dict[str, Any] = {}
        self.popen: List[subprocess.Popen] = []

    def _reply(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, value = self.replies.get(timeout=0.5)
                break
            except Empty:
                if not self.trainer.is_alive():
                    raise RuntimeError(f"the trainer died (exit code {self.trainer.exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no reply from the trainer within {timeout:g} s")
        if status != "ok":
            raise AssertionError(f"the trainer failed:\n{value}")
        return value

    def call(self, command: str, timeout: float = 60.0, **kwargs: Any) -> Any:
        self.commands.put((command, kwargs))
        return self._reply(timeout)

    def start_server(self, name: str, experts: List[str], backward: str = "stateless") -> Any:
        process = self.ctx.Process(target=ex.server_main, name=f"elastic-{name}",
                                   args=(self.port, name, experts, backward), daemon=True)
        process.start()
        self.servers[f"{name}#{len(self.servers)}"] = process
        return process

    def start_cli(self, name: str, log: Path) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "moe_autograd", "serve", "--join", "--name", name,
               "--experts", "elastic_experts:cli_experts", "--backward", "stateful",
               "--master-addr", "127.0.0.1", "--master-port", str(self.port),
               "--transports", "uv", "--drain-timeout", "10", "--rpc-timeout", "20"]
        process = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.popen.append(process)
        return process

    def wait_server(self, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while name not in self.call("wait_for", experts=[])["servers"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not join within {timeout:g} s")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet_world() -> Iterator[_World]:
    w = _World()
    w.trainer.start()
    try:
        assert w._reply(90.0) == "ready"
        w.start_server("srv_a", ["e0", "e1", "lin", "slow", "bal"])
        w.start_server("srv_b", ["e0", "e2", "bal"], backward="stateful")
        w.call("wait_for", experts=["e0", "e1", "e2", "lin", "slow"], timeout=90.0)
        yield w
        w.commands.put(("exit", {}))
        report = w._reply(30.0)
        assert report["shutdown_s"] < 10.0, report
        codes = stop_processes([w.trainer, *w.servers.values()], timeout=20.0)
        for process in w.popen:
            process.wait(10)
        assert w.trainer.exitcode == 0, codes
        alive = [n for n, p in w.servers.items() if p.exitcode is None]
        assert not alive, alive
    finally:
        stop_processes([w.trainer, *w.servers.values()], timeout=0.0)
        for process in w.popen:
            if process.poll() is None:
                process.kill()
                process.wait(5)


@pytest.mark.timeout(120)
def test_discovery_by_name(fleet_world: _World) -> None:
    report = fleet_world.call("discover")
    assert sorted(report["servers"]) == ["srv_a", "srv_b"], report
    assert sorted(report["replicas"]["e0"]) == ["srv_a", "srv_b"]
    assert report["replicas"]["e1"] == ["srv_a"] and report["replicas"]["e2"] == ["srv_b"]
    assert report["served"]["e1"] == "srv_a" and report["served"]["e2"] == "srv_b"
    assert report["grad"]
    message, seconds = report["missing"]
    assert "no live server hosts it" in message and seconds < 0.5, report["missing"]


@pytest.mark.timeout(120)
def test_calls_avoid_a_slow_replica(fleet_world: _World) -> None:
    """Issue 32: three replicas of ``bal`` (srv_a stateless, srv_b stateful,
    srv_slow sleeping 50 ms in forward and in backward, server-side): each is
    explored once, then the slow one gets no call but a re-probe (one per
    10 s), and every output and gradient equals the local expert's."""
    fleet_world.start_server("srv_slow", ["bal:slow"])
    fleet_world.wait_server("srv_slow", timeout=90.0)
    report = fleet_world.call("balance", calls=30)
    # the fleet's order: oldest first (srv_a and srv_b joined together, in either order)
    replicas = report["replicas"]
    assert sorted(replicas[:2]) == ["srv_a", "srv_b"] and replicas[2] == "srv_slow", report
    served, stats = report["served"], report["stats"]
    assert report["mismatches"] == 0, report
    assert served[:3] == replicas, served  # explored first, in order
    assert served[3:].count("srv_slow") <= 1, served  # a count, not a time
    assert stats["srv_slow"]["forward_ms"] > max(stats["srv_a"]["forward_ms"],
                                                 stats["srv_b"]["forward_ms"]), stats
    assert sum(s["calls"] for s in stats.values()) == 30, stats
    assert sum(s["backwards"] for s in stats.values()) == 30, stats
    assert all(s["in_flight"] == 0 and s["failures"] == 0 for s in stats.values()), stats


@pytest.mark.timeout(120)
def test_an_earlier_runs_stop_and_evictions_leave_the_fleet_serving(fleet_world: _World
                                                                    ) -> None:
    """(issue 45, finding 3, end to end) A stop and an eviction of every
    server, signed with the job's secret in an earlier run, written into
    this run's store: no server stops or leaves, and the calls after are
    exact against the local reference."""
    report = fleet_world.call("replay_earlier_run", timeout=90.0)
    assert report["after"] == report["servers_before"], report
    assert {"srv_a", "srv_b"} <= set(report["servers"]), report
    assert report["mismatches"] == 0, report


@pytest.mark.timeout(120)
def test_server_joins_running_world_and_is_used(fleet_world: _World) -> None:
    fleet_world.call("start_training", names=["e0", "e1", "e2", "e3"])
    time.sleep(0.3)
    before = fleet_world.call("stats")
    assert before["failures"]["e3"] > 0 and not before["errors"], before  # masked: no server
    fleet_world.start_server("srv_c", ["e3"])
    served = fleet_world.call("wait_served", worker="srv_c", timeout=90.0)
    after = fleet_world.call("stop_training")
    assert served["served"], served
    assert served["served_step"] - served["join_step"] + 1 <= 2, served  # from the next step
    assert not after["errors"], after["errors"]
    assert after["calls"]["e3"] - after["failures"]["e3"] > 0  # really answered since
    assert after["steps"] > before["steps"]


@pytest.mark.timeout(120)
def test_server_leaves_cleanly_without_failing_inflight_calls(fleet_world: _World,
                                                              tmp_path: Path) -> None:
    log = tmp_path / "srv_cli.log"
    cli = fleet_world.start_cli("srv_cli", log)
    fleet_world.wait_server("srv_cli", timeout=90.0)
    assert fleet_world.call("begin_inflight") == "srv_cli"  # a 1 s call and a held state there
    cli.send_signal(signal.SIGTERM)
    report = fleet_world.call("finish_inflight")
    status = cli.wait(30)
    text = log.read_text()
    assert report["slow"][0] == "ok" and report["slow"][2] == "srv_cli", (report, text)
    assert report["backward"] == ("ok", True), (report, text)  # the held state was used
    assert report["after"] == "srv_a", report  # resolved to the replica that stayed
    assert report["events"] == [("joined", "srv_cli"), ("left", "srv_cli")], report
    assert status == 0, text
    assert "drained" in text and "stopped" in text, text


@pytest.mark.timeout(120)
def test_killed_server_masked_then_replaced(fleet_world: _World) -> None:
    victim = fleet_world.start_server("srv_v", ["e0", "e4"])
    fleet_world.wait_server("srv_v", timeout=90.0)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    killed = fleet_world.call("call", name="e0", prefer="srv_v", forward_timeout=2.0)
    # the dead replica fails at once; the call is retried on srv_a within its deadline
    assert killed["outcome"] == "ok" and killed["worker"] in ("srv_a", "srv_b"), killed
    assert killed["retries"] == 1 and killed["seconds"] < 2.0, killed

    fleet_world.call("start_training", names=["e0", "e4"], forward_timeout=2.0)
    reaped_at = fleet_world.call("wait_event", kind="reaped", worker="srv_v", timeout=15.0)
    assert reaped_at is not None
    assert "srv_v" not in fleet_world.call("members")
    time.sleep(0.3)
    masked = fleet_world.call("stats")
    assert masked["failures"]["e4"] > 0 and not masked["errors"], masked
    lost = [at for kind, name, at in masked["events"] if kind == "lost" and name == "srv_v"]
    assert lost and reaped_at - lost[0] < ex.DEAD_AFTER + 2.0, masked["events"]
    assert masked["longest_step_s"] < 2.0 + 1.0, masked  # nothing waited past a deadline

    fleet_world.start_server("srv_v", ["e4"])  # a replacement under the same name
    served = fleet_world.call("wait_served", worker="srv_v", timeout=90.0)
    after = fleet_world.call("stop_training")
    assert served["served"] and served["served_step"] - served["join_step"] + 1 <= 2, served
    assert not after["errors"], after["errors"]
    assert victim.exitcode == -signal.SIGKILL


@pytest.mark.timeout(120)
def test_frozen_server_is_reaped_and_exits_when_it_wakes(fleet_world: _World) -> None:
    frozen = fleet_world.start_server("srv_z", ["ez"])
    fleet_world.wait_server("srv_z", timeout=90.0)
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        call = fleet_world.call("call", name="ez", forward_timeout=1.0)
        assert call["outcome"].startswith("RemoteTimeoutError"), call  # the deadline holds
        assert 0.9 < call["seconds"] < 1.0 + 0.6, call
        reaped_at = fleet_world.call("wait_event", kind="reaped", worker="srv_z", timeout=15.0)
        assert reaped_at is not None and "srv_z" not in fleet_world.call("members")
        gone = fleet_world.call("call", name="ez", forward_timeout=1.0)
        assert gone["outcome"].startswith("NoLiveReplica") and gone["seconds"] < 0.5, gone
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    frozen.join(15)
    assert frozen.exitcode == 3  # it found its eviction mark and left
