"""The red team: what an outsider (a process without the job's secret) and a
member of the job try against expert servers and trainers, on both engines.

Each attempt must be refused with a clear error (and counted, and logged
where it was refused), must run no code (a payload that would create a file
creates none), and must leave the server's and the trainer's state intact:
after every attempt, a training step's outputs and gradients still equal the
local ones bit for bit. The outsider reaches the servers through the engine
itself (an RPC to the servers' one entry point, a call of the actor's one
method), as a process that knows only the worker's name would."""
import logging
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
from torch import nn

import remote_experts as rx
from moe_autograd.remote import (ExpertServer, Fleet, JobSecret, RemoteAuthError, RemoteCall,
                                 RemoteExpertError,
                                 RemoteExpert, security_stats)
from moe_autograd.remote import auth, endpoint, rpc_engine, wire
from moe_autograd.remote.auth import Session
from moe_autograd.remote.frame import REFUSAL, REPLY, Frame, parse
from moe_autograd.remote.registry import NameTaken, Registry, ServerRecord
from wiring import SECRET, Backend, Done, InProcess, ray_token_env

pytestmark = pytest.mark.timeout(90)


class Evil:
    """Unpickling this creates the file ``path``: the proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def evil(tmp_path: Path, name: str) -> bytes:
    return pickle.dumps(Evil(str(tmp_path / name)), protocol=5)


def raw(backend: Backend, worker: str, head: bytes, buffers: Optional[List[Any]] = None) -> Frame:
    """What the engine's entry point of ``worker`` answers to ``(head,
    buffers)``, sent as an outsider would (no secret involved)."""
    buffers = buffers or []
    if backend.name == "rpc":
        from torch.distributed import rpc

        reply_head, reply_buffers = rpc.rpc_sync(worker, rpc_engine._receive,
                                                 args=(head, buffers), timeout=20.0)
        return Frame(reply_head, reply_buffers)
    import ray

    from moe_autograd.remote.ray_engine import _split

    handle = backend.transport.handle(worker)  # type: ignore[attr-defined]
    blob = b"".join(bytes(b) for b in buffers)
    reply_head, reply_blob = ray.get(handle.handle.remote(head, blob), timeout=20.0)
    return Frame(reply_head, _split(reply_head, reply_blob))


def refused_by(frame: Frame) -> str:
    header = parse(frame)
    assert header.kind == REFUSAL, header
    return auth.REASONS[header.code]


def server_refusals(backend: Backend, worker: str = "srv-a") -> Dict[str, int]:
    return dict(backend.expert(worker, "lin").remote_stats()["auth_refused"])


def sealed_request(session: Session, worker: str, message: Dict[str, Any]) -> Frame:
    body, buffers = wire.encode(message)
    return session.seal(worker, body, [bytes(b.numpy()) for b in buffers])[0]


def assert_step_equals_local(backend: Backend) -> None:
    """The state is intact: a stateless and a stateful step equal local ones."""
    for name in ("lin", "sf_lin"):
        expert = backend.expert("srv-a", name)
        local = nn.Linear(rx.WIDTH, rx.WIDTH)
        local.load_state_dict(expert.remote_state_dict())
        expert.zero_grad()
        x = torch.randn(3, rx.WIDTH, requires_grad=True)
        lx = x.detach().clone().requires_grad_()
        y, ly = expert(x), local(lx)
        assert torch.equal(y, ly.detach()), name
        y.square().sum().backward()
        ly.square().sum().backward()
        assert torch.equal(x.grad, lx.grad), name
        remote = expert.remote_grads()
        assert torch.equal(remote["weight"], local.weight.grad), name


# -- an outsider ----------------------------------------------------------------------------
def test_raw_pickle_payloads_run_nothing(backend: Backend, tmp_path: Path) -> None:
    before = server_refusals(backend)
    outsider = Session(JobSecret.generate())
    attempts = {
        "a pickle as the frame": (evil(tmp_path, "head"), []),
        "a pickle as a buffer": (evil(tmp_path, "head2")[:8], [evil(tmp_path, "buffer")]),
        "a pickle sealed with another secret": (
            sealed_request(outsider, "srv-a", {"op": "info"}).head[:-4]
            + evil(tmp_path, "sealed")[:4], []),
    }
    for what, (head, buffers) in attempts.items():
        assert refused_by(raw(backend, "srv-a", head, buffers)) in ("malformed", "unknown job"), what
    # a frame that is whole but sealed by an outsider: refused before its body is read
    frame = sealed_request(outsider, "srv-a", {"op": "call", "name": "sleep", "args": [0.0]})
    assert refused_by(raw(backend, "srv-a", frame.head, list(frame.buffers))) == "unknown job"
    # a member's frame whose body is a pickle: no decoder runs code; an error reply
    member = auth.session_for(SECRET)
    head = member.seal("srv-a", evil(tmp_path, "member"), [])[0].head
    reply = raw(backend, "srv-a", head)
    assert parse(reply).kind == REPLY
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # no file: no code ran
    after = server_refusals(backend)
    assert sum(after.values()) >= sum(before.values()) + 4, (before, after)
    assert_step_equals_local(backend)


def test_forged_stale_and_replayed_requests_are_refused(backend: Backend,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    member = Session(SECRET)  # a session of the job, its frames captured on the way
    captured = sealed_request(member, "srv-a", {"op": "info"})
    first = raw(backend, "srv-a", captured.head, list(captured.buffers))
    assert parse(first).kind == REPLY
    assert refused_by(raw(backend, "srv-a", captured.head, list(captured.buffers))) == "replay"
    frame = sealed_request(member, "srv-a", {"op": "info"})
    header = parse(frame)
    forged = bytearray(frame.head)
    forged[header.mac_start + 5] ^= 0x40
    assert refused_by(raw(backend, "srv-a", bytes(forged))) == "bad MAC"
    forged = bytearray(frame.head)
    forged[header.body_start] ^= 1  # a changed body under the old MAC
    assert refused_by(raw(backend, "srv-a", bytes(forged))) == "bad MAC"
    assert refused_by(raw(backend, "srv-b", frame.head)) == "bad MAC"  # sealed for srv-a
    now = time.time()
    monkeypatch.setattr(auth.time, "time", lambda: now - 3600.0)  # sealed an hour ago
    stale = sealed_request(member, "srv-a", {"op": "info"})
    monkeypatch.undo()
    assert refused_by(raw(backend, "srv-a", stale.head)) == "stale"
    assert_step_equals_local(backend)


def test_an_outsider_cannot_change_an_experts_weights(backend: Backend,
                                                      caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="moe_autograd.remote.auth")
    monkeypatch.setattr(auth, "_logged", {})  # earlier tests' lines do not hold this one back
    member = backend.expert("srv-a", "opt_lin" if backend.name == "rpc" else "lin")
    weights = member.remote_state_dict()
    transport = backend.transport
    if backend.name == "ray":  # an outsider's own client skips our identity check (ours
        import ray             # refuses to call an actor not identified for its job at all)

        from moe_autograd.remote import RayTransport

        transport = RayTransport(namespace=backend.transport.namespace, timeout=30.0)
        transport.use_handle("srv-a", ray.get_actor("srv-a", namespace=transport.namespace),
                             started=True)
        with pytest.raises(RemoteExpertError, match="was not called: its identity record is "
                                                    "not signed with this job's secret"):
            backend.expert("srv-a", member.name, secret=JobSecret.generate())(
                torch.randn(2, rx.WIDTH))
    outsider = backend.expert("srv-a", member.name, secret=JobSecret.generate(),
                              transport=transport)
    zeros = {k: torch.zeros_like(v) for k, v in weights.items()}
    attempts = [lambda: outsider.load_remote_state_dict(zeros), outsider.zero_grad,
                outsider.step, outsider.remote_state_dict,
                lambda: outsider(torch.randn(2, rx.WIDTH, requires_grad=True))]
    for attempt in attempts:
        with pytest.raises(RemoteAuthError, match="refused the request .unknown job"):
            attempt()
    after = member.remote_state_dict()
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    # the trainer sees it: the server reports its refusals in its next reply
    assert security_stats()["peer_refusals"].get("srv-a", 0) >= len(attempts)
    assert any("srv-a" in r.getMessage() and "refused" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert_step_equals_local(backend)


def test_a_member_cannot_use_another_sessions_state(backend: Backend) -> None:
    expert = backend.expert("srv-a", "sf_lin")
    x = torch.randn(2, rx.WIDTH, requires_grad=True)
    args = expert.function_args(x)
    out = RemoteCall.apply(*args)[0]
    call_id = args[0].call_id
    intruder = Session(SECRET)  # another session of the job (same secret, other process)
    grad = torch.ones_like(out)
    for message, match in [
            ({"op": "backward", "expert": "sf_lin", "call": call_id, "seed": 0, "flags": [True],
              "args": None, "grads": [grad]}, "belongs to"),
            ({"op": "collect", "batch": "b" * 32}, "unknown batch")]:
        frame = sealed_request(intruder, "srv-a", message)
        reply = raw(backend, "srv-a", frame.head, list(frame.buffers))
        body, buffers = intruder.open_reply("srv-a", parse(frame).seq, reply)
        status, text = wire.decode(body, buffers)["reply"]
        assert status == "error" and match in text, text
    frame = sealed_request(intruder, "srv-a", {"op": "release", "calls": [call_id]})
    body, buffers = intruder.open_reply("srv-a", parse(frame).seq,
                                        raw(backend, "srv-a", frame.head))
    assert wire.decode(body, buffers)["reply"] == ["ok", 0]  # nothing of another's freed
    out.backward(grad)  # the owner's backward still finds its state
    assert x.grad is not None
    assert_step_equals_local(backend)


def test_requests_that_expand_are_refused_before_they_run(backend: Backend) -> None:
    """One small stride-0 tensor shared by four calls of one request: each
    call materialises it in full, so each counts it (max_request_bytes of
    small_lin: 1 MiB; 400 kB each, so two fit and two are refused)."""
    shared = torch.zeros(1, rx.WIDTH).expand(12_500, rx.WIDTH)  # 32 bytes on the wire
    jobs = [{"op": "forward", "expert": "small_lin", "call": f"{k:032x}", "seed": k, "grad": False,
             "flags": [False], "args": [shared], "answer_by": None} for k in range(4)]
    status, (answers, more) = backend.ask("srv-b", {"op": "batch", "batch": "e" * 32,
                                                    "jobs": jobs})
    while status == "ok" and more:  # the refused ones are answered at once, the rest later
        status, (late, more) = backend.ask("srv-b", {"op": "collect", "batch": "e" * 32})
        answers = [a if a is not None else b for a, b in zip(answers, late)]
    assert status == "ok"
    assert [a[0] for a in answers] == ["ok", "ok", "error", "error"], answers
    assert all("max_request_bytes" in a[1] and "for each" in a[1] for a in answers[2:])
    assert_step_equals_local(backend)


# -- a hostile server ------------------------------------------------------------------------
class Hostile:
    """A transport whose 'server' answers what ``answer(frame)`` makes."""

    name = "hostile"

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Any:
        return Done(self.answer(frame))

    def local_name(self) -> str:
        return "trainer"


def test_a_hostile_server_runs_no_code_in_the_trainer(tmp_path: Path) -> None:
    server = ExpertServer({"hostile_lin": nn.Linear(rx.WIDTH, rx.WIDTH)})
    try:
        honest = InProcess()
        old: List[Frame] = []

        def replayed(frame: Frame) -> Frame:
            reply = endpoint.serve(frame, "srv-h")
            old.append(reply)
            return old[0]  # the first reply, again and again
        other = JobSecret.generate()

        def other_secret(frame: Frame) -> Frame:
            caller, _, _, _ = endpoint.gate().open(frame, "srv-h")
            body, buffers = wire.encode({"reply": ["ok", 1], "refused": 0})
            return auth.Gate.seal_reply(other, caller, "srv-h", body, buffers)

        def pickled_body(frame: Frame) -> Frame:
            caller, _, _, secret = endpoint.gate().open(frame, "srv-h")
            return auth.Gate.seal_reply(secret, caller, "srv-h", evil(tmp_path, "body"), [])
        answers = {"a pickle as the reply": lambda frame: Frame(evil(tmp_path, "reply"), []),
                   "a reply sealed with another secret": other_secret,
                   "a member's reply whose body is a pickle": pickled_body}
        x = torch.randn(2, rx.WIDTH)
        assert RemoteExpert("srv-h", "hostile_lin", transport=Hostile(replayed))(x).shape == x.shape
        with pytest.raises(RemoteAuthError, match="answers no request"):
            RemoteExpert("srv-h", "hostile_lin", transport=Hostile(replayed))(x)
        for what, answer in answers.items():
            with pytest.raises(RemoteAuthError) as info:
                RemoteExpert("srv-h", "hostile_lin", transport=Hostile(answer))(x)
            assert "srv-h" in str(info.value), what
        assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # no code ran here
        assert security_stats()["rejected_replies"].get("srv-h", 0) >= 3
        assert RemoteExpert("srv-h", "hostile_lin", transport=honest)(x).shape == x.shape
    finally:
        server.close()


# -- the fleet's registry: publications, names, admission -----------------------------------
@pytest.fixture
def store() -> Any:
    import datetime

    import torch.distributed as dist

    from moe_autograd.remote.loopback import free_port
    return dist.TCPStore("127.0.0.1", free_port(), None, True, datetime.timedelta(seconds=10),
                         wait_for_workers=False)


def test_an_outsider_cannot_publish_or_take_a_name(store: Any) -> None:
    job, outsider = Registry(store, SECRET), Registry(store, JobSecret.generate(), run="0" * 32)
    job.found()
    before = sum(security_stats()["refused"].values())
    outsider.publish(ServerRecord("impostor", 9, {"e": "stateless"}))
    assert job.roster() == {} and job.record("impostor") is None
    job.publish(ServerRecord("srv_x", 3, {"e": "stateless"}))
    assert job.roster() == {"srv_x": 3}
    with pytest.raises(NameTaken, match="srv_x"):  # a member cannot take a live name either
        job.publish(ServerRecord("srv_x", 4, {"e": "stateless"}), live=lambda n, r: True)
    outsider.request_stop()
    outsider.evict("srv_x", 3)
    assert not job.stop_requested() and not job.evicted("srv_x", 3)
    assert sum(security_stats()["refused"].values()) > before


def test_an_earlier_runs_records_replayed_into_a_new_run_are_refused(store: Any) -> None:
    """Every signed fleet record names its run (issue 45): a copy of an
    earlier run's roster, record, eviction mark, stop and beats (same
    secret), written into a new run's store, is refused and counted; the new
    run's servers stay listed, unevicted and running."""
    from moe_autograd.remote.registry import PREFIX

    old = Registry(store, SECRET)
    old.found()
    old.beat("srv_a", 3)
    old.publish(ServerRecord("srv_a", 3, {"e": "stateless"}))
    for _ in range(5):
        old.beat("srv_b", 4)
    old.evict("srv_b", 4)
    old.request_stop()
    captured = {key: store.get(PREFIX + key) for key in
                ("roster", "server/srv_a", "evicted/srv_b", "stop", "beat/srv_b-4")}
    fresh = _fresh_store()
    new = Registry(fresh, SECRET)
    new.found()
    new.beat("srv_b", 4)
    new.publish(ServerRecord("srv_b", 4, {"e": "stateless"}))
    before = sum(security_stats()["refused"].values())
    for key, value in captured.items():
        if key != "roster":
            fresh.set(PREFIX + key, value)
    assert new.record("srv_a") is None and not new.stop_requested()
    assert not new.evicted("srv_b", 4) and new.beats({"srv_b": 4}) == {}
    assert new.roster() == {"srv_b": 4}
    fresh.set(PREFIX + "roster", captured["roster"])  # the old run's roster, whole
    assert new.roster() == {}
    assert sum(security_stats()["refused"].values()) >= before + 5
    # a replayed older beat never counts as a move: only a higher signed number does
    beat = new.beat("srv_b", 4)
    high = new.beats({"srv_b": 4})["srv_b"]
    assert high == beat and new.beats({"srv_b": 4})["srv_b"] == high


def test_signed_marks_expire(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_autograd.remote import registry as registry_module

    job = Registry(store, SECRET)
    job.found()
    monkeypatch.setattr(registry_module, "MARK_TTL_S", -2 * registry_module.CLOCK_SLACK_S)
    expired = security_stats()["refused"].get("expired", 0)
    job.request_stop()
    job.evict("srv_x", 3)
    assert not job.stop_requested() and not job.evicted("srv_x", 3)
    assert security_stats()["refused"].get("expired", 0) == expired + 2


def _fresh_store() -> Any:
    import datetime

    import torch.distributed as dist

    from moe_autograd.remote.loopback import free_port
    return dist.TCPStore("127.0.0.1", free_port(), None, True, datetime.timedelta(seconds=10),
                         wait_for_workers=False)


def test_a_fleet_admits_only_servers_that_prove_the_secret(store: Any) -> None:
    """A signed record is not enough: the worker named in it must answer the
    fleet's sealed challenge with a sealed reply for the published rank."""
    from moe_autograd.remote.server import host_info, set_host_info

    job = Registry(store, SECRET)
    job.found()
    server = ExpertServer({"adm_e": nn.Linear(2, 2)})
    saved = host_info()
    set_host_info(rank=3)

    class Answering:
        """srv_good is served here; srv_liar is an impostor without the key."""

        name = "answering"

        def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Any:
            if worker == "srv_good":
                return InProcess().call(worker, frame, timeout)
            return Done(auth.refusal_frame("unknown job"))

        def local_name(self) -> str:
            return "trainer"
    fleet = Fleet(store, "trainer", 0, founder=False, transport=Answering(), reap=False,
                  secret=SECRET)
    try:
        for name, rank in (("srv_good", 3), ("srv_liar", 5)):  # signed, by members
            job.beat(name, rank)  # a server beats before it publishes
            job.publish(ServerRecord(name, rank, {"adm_e": "stateless"}))
        deadline = time.monotonic() + 10
        while not fleet.replicas("adm_e") and time.monotonic() < deadline:
            for name, rank in (("srv_good", 3), ("srv_liar", 5)):
                job.beat(name, rank)
            fleet.refresh()
            time.sleep(0.05)
        fleet.refresh()
        assert fleet.replicas("adm_e") == ["srv_good"]
        kinds = {(e.kind, e.worker) for e in fleet.events}
        assert ("joined", "srv_good") in kinds and ("refused", "srv_liar") in kinds, kinds
        assert ("joined", "srv_liar") not in kinds
    finally:
        fleet.shutdown(timeout=1.0, stop_servers=False)
        set_host_info(**saved)
        server.close()


# -- Ray's own layer: a stranger without the cluster's token ---------------------------------
def test_a_stranger_without_the_clusters_token_is_refused_at_connect(ray_world: Dict[str, Any],
                                                                     tmp_path: Path) -> None:
    import ray

    address = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MOE_AUTOGRAD"))}
    env.update(HOME=str(tmp_path), RAY_AUTH_MODE="disabled",
               RAY_gcs_server_port_wait_time_s="2",  # Ray's connect retries: 2, not 20
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # as the cluster: loopback addresses
    code = ("import ray, sys\n"
            "try:\n"
            f"    ray.init(address={address!r}, log_to_driver=False, configure_logging=False)\n"
            "except Exception as error:\n"
            "    print('REFUSED', type(error).__name__); sys.exit(0)\n"
            "print('CONNECTED')\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert "REFUSED" in done.stdout, (done.stdout, done.stderr[-500:])
    assert ray_token_env()["RAY_AUTH_MODE"] == "token"


# -- Ray: never call what we have not identified (issue 45) ---------------------------------
class _Touches:
    """A reply whose unpickling touches a file (a harmless stand-in for code)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.path),))


def test_an_impostor_that_takes_a_servers_name_is_never_called(ray_world: Dict[str, Any],
                                                               tmp_path: Path) -> None:
    """Ray unpickles an actor's reply before any check of ours, so a trainer
    must not call an actor it has not identified. A server's actor publishes
    its name bound to its actor ID, signed with the job's secret; an actor
    that takes the name of a killed server (a token holder can, in 0.17 s)
    has another actor ID: a static RemoteExpert's call after the reconnect is
    refused before anything is sent (counted, logged), no code of the
    impostor's runs here, and a RayFleet never asks it either. The step
    after the attempt, on a live server, is still exact."""
    import ray

    from moe_autograd.remote import RayFleet, RayTransport
    from moe_autograd.remote.ray_server import RayExpertServer

    namespace = ray_world["transport"].namespace
    marker = tmp_path / "impostor-code-ran"

    @ray.remote(num_cpus=0)
    class Impostor:
        def handle(self, head: Any, blob: Any) -> Any:
            return _Touches(str(marker))

    victim = RayExpertServer("srv-victim", "remote_experts:setup_servers", namespace=namespace,
                             ready_timeout=240.0)
    transport = RayTransport(namespace=namespace, timeout=30.0)
    expert = RemoteExpert("srv-victim", "lin", transport=transport, forward_timeout=30.0)
    x = torch.randn(2, rx.WIDTH)
    expert(x)  # identified, called
    victim.kill()
    deadline = time.monotonic() + 60.0
    impostor = None
    while impostor is None and time.monotonic() < deadline:  # the name is free once Ray says so
        try:
            impostor = Impostor.options(name="srv-victim", namespace=namespace).remote()
        except ValueError:
            time.sleep(0.2)
    assert impostor is not None
    refused = security_stats()["refused"].get("unidentified", 0)
    try:
        for _ in range(50):  # the first tries may still meet the dead actor's handle
            try:
                expert(x)
            except RemoteExpertError as error:
                if "was not called" in str(error):
                    assert "the name's signed identity is actor" in str(error), error
                    break
                assert "dead or unreachable" in str(error), error
            time.sleep(0.2)
        else:
            raise AssertionError("the impostor was called, or never refused")
        # a name that never had an expert server: no identity record at all
        stranger = Impostor.options(name="srv-stranger", namespace=namespace).remote()
        with pytest.raises(RemoteExpertError, match="published no identity record"):
            RemoteExpert("srv-stranger", "lin", transport=transport, forward_timeout=30.0)(x)
        fleet = RayFleet(namespace=namespace, poll=0.05)
        try:
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline and not {"srv-victim", "srv-stranger"} <= {
                    e.worker for e in fleet.events if e.kind == "refused"}:
                fleet.refresh()
                time.sleep(0.1)
            kinds = {(e.kind, e.worker) for e in fleet.events}
            assert ("refused", "srv-victim") in kinds and ("refused", "srv-stranger") in kinds
            assert ("joined", "srv-victim") not in kinds
        finally:
            fleet.shutdown(timeout=5.0)
        assert not marker.exists()  # nothing of theirs was ever deserialised here
        assert security_stats()["refused"]["unidentified"] >= refused + 2
        after = RemoteExpert(ray_world["servers"][0].name, "lin",  # the step after: exact
                             transport=ray_world["transport"])
        state = after.remote_state_dict()
        assert torch.equal(after(x), nn.functional.linear(x, state["weight"], state["bias"]))
    finally:
        for actor in (impostor, locals().get("stranger")):
            if actor is not None:
                ray.kill(actor)
