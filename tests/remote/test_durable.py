"""Durable expert state (moe_autograd/remote/durable.py, issue 44): snapshots
written atomically and sealed with the job's secret, refused by path and
reason when truncated, altered or another job's (the previous one is used),
one live server per expert and directory, and a server that resumes its
experts exactly: weights, optimizer state and steps, so that training goes
on as if nothing had happened, even after kill -9 (at most the save
interval's steps lost). In process (``wiring.InProcess``): the whole wire,
no engine."""
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch import Tensor, nn

from moe_autograd.remote import ExpertServer, JobSecret, RemoteExpert, security_stats
from moe_autograd.remote.durable import (ExpertState, SnapshotError, Snapshots, read_snapshot,
                                         snapshot_paths, write_snapshot)
from wiring import SECRET, InProcess

pytestmark = pytest.mark.timeout(120)
HERE = "here"
HERE_DIR = Path(__file__).resolve().parent
ROOT = HERE_DIR.parents[1]
WIDTH = 8


def make_expert(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, WIDTH))


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def batch(step: int) -> Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1000 + step))


def train(expert: nn.Module, steps: int, first: int = 0) -> None:
    """``steps`` forward + backward passes through ``expert`` (a RemoteExpert
    whose server steps its optimizer after each backward)."""
    for step in range(first, first + steps):
        expert(batch(step)).square().mean().backward()


def reference(steps: int) -> Dict[str, Tensor]:
    """The weights after ``steps`` steps of the same training, locally."""
    module = make_expert()
    optimizer = adam(module.parameters())
    for step in range(steps):
        module(batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_state(got: Dict[str, Tensor], expected: Dict[str, Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def _state(steps: int = 3) -> ExpertState:
    module = make_expert()
    optimizer = adam(module.parameters())
    for step in range(steps):
        module(batch(step)).sum().backward()
        optimizer.step()
    return ExpertState(dict(module.state_dict()), optimizer.state_dict(), steps, 1,
                       {"note": "x", "nan": float("nan"), "pair": (1, 2.5)})


# -- one file -------------------------------------------------------------------------------
def test_a_snapshot_round_trips_bit_for_bit(tmp_path: Path) -> None:
    state = _state()
    path = write_snapshot(str(tmp_path / "step-3.snap"), "ffn0", state, SECRET)
    name, back = read_snapshot(path, SECRET)
    assert name == "ffn0" and (back.steps, back.skipped_steps) == (3, 1)
    assert_same_state(back.module, state.module)
    assert back.optimizer is not None and state.optimizer is not None
    assert back.optimizer["param_groups"] == [dict(g, betas=tuple(g["betas"]))
                                              for g in state.optimizer["param_groups"]]
    for key, entry in state.optimizer["state"].items():
        for field, value in entry.items():
            assert torch.equal(back.optimizer["state"][key][field], value), (key, field)
    assert back.extra["pair"] == (1, 2.5) and back.extra["nan"] != back.extra["nan"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # renamed into place
    assert open(path, "rb").read().count(b"pickle") == 0


def test_what_cannot_be_kept_is_named(tmp_path: Path) -> None:
    state = ExpertState({"w": torch.zeros(2)}, extra={"bad": object()})
    with pytest.raises(TypeError, match=r"extra\['bad'\]: a object cannot be kept"):
        write_snapshot(str(tmp_path / "s.snap"), "e", state, SECRET)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage,reason,kind", [
    ("truncate", "truncated", "bad MAC"),
    ("flip", "checksum (HMAC-SHA256 with the job's secret) does not verify", "bad MAC"),
    ("header", "not a snapshot", "malformed"),
    ("other job", "sealed for another job", "unknown job"),
])
def test_a_damaged_or_foreign_snapshot_is_refused_by_path_and_reason(
        tmp_path: Path, damage: str, reason: str, kind: str) -> None:
    path = str(tmp_path / "step-3.snap")
    write_snapshot(path, "ffn0", _state(), JobSecret.generate() if damage == "other job"
                   else SECRET)
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[:len(data) - 40]
    elif damage == "flip":
        data[len(data) - 100] ^= 1
    elif damage == "header":
        data[0] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(SnapshotError) as info:
        read_snapshot(path, SECRET)
    assert info.value.path == path and reason in info.value.reason and info.value.kind == kind
    assert str(info.value).startswith(f"snapshot {path}: ")


def test_the_previous_snapshot_is_used_and_the_refusal_counted_and_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_autograd.remote import auth

    monkeypatch.setattr(auth, "_logged", {})  # earlier tests' lines do not hold this one back
    snapshots = Snapshots(str(tmp_path), ["ffn0"], SECRET)
    try:
        older, newer = _state(2), _state(3)
        folder = tmp_path / "ffn0"
        write_snapshot(str(folder / "step-000000000002.snap"), "ffn0", older, SECRET)
        bad = str(folder / "step-000000000003.snap")
        write_snapshot(bad, "ffn0", newer, JobSecret.generate())  # another job's
        before = security_stats()["refused"].get("unknown job", 0)
        with caplog.at_level(logging.WARNING):
            path, state = snapshots.load("ffn0")  # type: ignore[misc]
        assert path.endswith("step-000000000002.snap") and state.steps == 2
        assert_same_state(state.module, older.module)
        assert security_stats()["refused"]["unknown job"] == before + 1
        assert any(bad in r.getMessage() and "sealed for another job" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        snapshots.close()


def test_a_truncated_newest_snapshot_falls_back_to_the_one_before(tmp_path: Path) -> None:
    snapshots = Snapshots(str(tmp_path), ["ffn0"], SECRET)
    try:
        folder = tmp_path / "ffn0"
        write_snapshot(str(folder / "step-000000000002.snap"), "ffn0", _state(2), SECRET)
        newest = folder / "step-000000000003.snap"
        write_snapshot(str(newest), "ffn0", _state(3), SECRET)
        newest.write_bytes(newest.read_bytes()[:-100])  # a crash mid-copy, say
        before = security_stats()["refused"].get("bad MAC", 0)
        path, state = snapshots.load("ffn0")  # type: ignore[misc]
        assert path.endswith("step-000000000002.snap") and state.steps == 2
        assert security_stats()["refused"]["bad MAC"] == before + 1
    finally:
        snapshots.close()


def test_two_live_servers_never_share_an_experts_snapshots(tmp_path: Path) -> None:
    first = Snapshots(str(tmp_path), ["ffn0", "ffn1"], SECRET)
    try:
        with pytest.raises(RuntimeError, match=rf"expert 'ffn1': another live server \(pid "
                           rf"{os.getpid()}\) writes its snapshots in {tmp_path}"):
            Snapshots(str(tmp_path), ["ffn2", "ffn1"], SECRET)
        Snapshots(str(tmp_path), ["ffn2"], SECRET).close()  # ffn2 was unlocked again
    finally:
        first.close()
    Snapshots(str(tmp_path), ["ffn1"], SECRET).close()  # free once the first closed


# -- a server -------------------------------------------------------------------------------
def _serve(tmp_path: Path, **options: Any) -> ExpertServer:
    return ExpertServer({"dur": make_expert(seed=99)}, optimizer=adam, state_dir=str(tmp_path),
                        transport=InProcess(HERE), **options)


def test_a_server_resumes_its_expert_exactly(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Trained 5 steps, closed (a clean leave saves), a new server from fresh
    weights resumes: same weights, same optimizer state, same step count, and
    3 more steps land where 8 uninterrupted ones do."""
    expert = RemoteExpert(HERE, "dur", transport=InProcess(HERE))
    server = _serve(tmp_path, save_every=2)
    with torch.no_grad():  # the factory's weights are another seed's: the test's own start
        for p, q in zip(server._hosted[0].module.parameters(), make_expert().parameters()):
            p.copy_(q)
    train(expert, 5)
    server.close()
    assert [s for s, _ in snapshot_paths(str(tmp_path), "dur")] == [5, 4, 2]
    with caplog.at_level(logging.INFO, logger="moe_autograd.remote.server"):
        server = _serve(tmp_path, save_every=2)
    try:
        assert any(f"expert 'dur' resumed from snapshot {tmp_path}/dur/step-000000000005.snap "
                   f"(step 5)" in r.getMessage() for r in caplog.records)
        assert_same_state(expert.remote_state_dict(), reference(5))
        assert expert.remote_stats()["expert_steps"] == 5
        train(expert, 3, first=5)
        assert_same_state(expert.remote_state_dict(), reference(8))
    finally:
        server.close()


def test_a_server_with_no_snapshot_says_it_starts_fresh(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="moe_autograd.remote.server"):
        server = _serve(tmp_path, save_every=1)
    server.close()
    assert any(f"expert 'dur' starts from its factory's state: no snapshot in {tmp_path}"
               in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="save_every must be a positive number of steps"):
        _serve(tmp_path, save_every=0)
    with pytest.raises(ValueError, match="save_every and save_interval need a state_dir"):
        ExpertServer({"dur2": make_expert()}, save_every=3, transport=InProcess(HERE))


# -- kill -9 --------------------------------------------------------------------------------
_TRAINER = r"""
import sys, torch
sys.path[:0] = [{here!r}]
from test_durable import adam, make_expert, train, HERE
from moe_autograd.remote import ExpertServer, RemoteExpert
from moe_autograd.remote.durable import ExpertState, write_snapshot
from wiring import SECRET, InProcess
state_dir, steps, save_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = ExpertServer({{"dur": make_expert()}}, optimizer=adam, state_dir=state_dir,
                      save_every=save_every, transport=InProcess(HERE))
expert = RemoteExpert(HERE, "dur", transport=InProcess(HERE))
first = expert.remote_stats()["expert_steps"]
print("resumed", first, flush=True)
for step in range(first, steps):
    train(expert, 1, first=step)
    print("step", step + 1, flush=True)
if len(sys.argv) > 4:  # the final weights, in a snapshot of their own (no pickle)
    write_snapshot(sys.argv[4], "final", ExpertState(expert.remote_state_dict()), SECRET)
print("done", flush=True)
"""


def test_a_server_killed_mid_training_resumes_from_its_last_snapshot(tmp_path: Path) -> None:
    """kill -9 at a random step: a new server resumes from the newest snapshot
    (at most save_every steps lost) with exactly the weights of an
    uninterrupted run at that step, and trains on to the same end."""
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER.format(here=str(HERE_DIR)))
    state_dir, out = tmp_path / "state", tmp_path / "final.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE_DIR),
                                                       os.environ.get("PYTHONPATH", "")]))
    kill_after = 4 + int(time.time() * 1000) % 7  # a step from 4 to 10
    victim = subprocess.Popen([sys.executable, str(script), str(state_dir), "1000", "3"],
                              env=env, cwd=str(ROOT), stdout=subprocess.PIPE, text=True)
    seen = 0
    try:
        assert victim.stdout is not None
        for line in victim.stdout:
            if line.startswith("step "):
                seen = int(line.split()[1])
                if seen >= kill_after:
                    break
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
    assert seen == kill_after, seen
    done = subprocess.run([sys.executable, str(script), str(state_dir), str(kill_after + 4), "3",
                           str(out)], env=env, cwd=str(ROOT), capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = int(done.stdout.split("resumed ")[1].split()[0])
    # (the victim may have gone on a step or two between its line and the kill)
    assert resumed % 3 == 0 and kill_after - 3 < resumed <= kill_after + 3, (resumed, seen)
    # the steps lost are redone from the snapshot: the end equals an uninterrupted run
    assert_same_state(read_snapshot(str(out), SECRET)[1].module, reference(kill_after + 4))


def test_serve_takes_the_state_options_and_refuses_them_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from moe_autograd.remote.cli import _durable_options, build_parser, main

    args = build_parser().parse_args(["--experts", "m:f", "--state-dir", str(tmp_path),
                                      "--save-every", "10", "--save-interval", "30"])
    assert _durable_options(args) == {"state_dir": str(tmp_path), "save_every": 10,
                                      "save_interval": 30.0}
    secret = JobSecret.generate().save(str(tmp_path / "job.secret"))
    for extra, words in ((["--save-every", "5"], "--save-every and --save-interval need "
                                                 "--state-dir"),
                         (["--state-dir", str(tmp_path), "--save-every", "0"],
                          "--save-every must be a positive number of steps, got 0")):
        assert main(["serve", "--experts", "remote_experts:cli_experts", "--rank", "1",
                     "--world-size", "2", "--secret-file", secret, *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and "usage:" not in err, err


def test_a_state_sent_from_another_job_or_expert_is_refused_and_nothing_changes(
        tmp_path: Path) -> None:
    """A peer transfer carries the job's authentication: a state sealed with
    another job's secret is refused (counted), one of another expert too, and
    the expert keeps its state; its own state goes back and forth exactly."""
    from moe_autograd.remote import RemoteExpertError
    from moe_autograd.remote.durable import state_bytes

    server = _serve(tmp_path)
    try:
        expert = RemoteExpert(HERE, "dur", transport=InProcess(HERE))
        train(expert, 2)
        before = expert.remote_state_dict()
        state = expert.remote_snapshot()
        assert state.steps == 2 and all(torch.equal(state.module[k], before[k]) for k in before)
        refused = security_stats()["refused"].get("unknown job", 0)
        with pytest.raises(RemoteExpertError, match="sealed for another job"):
            expert._control("restore", state_bytes("dur", state, JobSecret.generate()))
        assert security_stats()["refused"]["unknown job"] == refused + 1
        with pytest.raises(RemoteExpertError, match="it holds the state of expert 'other'; "
                                                    "nothing was changed"):
            expert._control("restore", state_bytes("other", state, SECRET))
        train(expert, 1, first=2)
        assert expert.restore_remote(state) == 2  # back to step 2, exactly
        assert_same_state(expert.remote_state_dict(), before)
        assert expert.remote_stats()["expert_steps"] == 2
    finally:
        server.close()
