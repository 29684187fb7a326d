"""Pieces of the remote package that need no RPC world: the state store, the
CLI's argument handling and its secrets, and the transport seam (an
in-process transport: frames served by this process's own endpoint)."""
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

import pytest
import torch
from torch import nn

from moe_autograd.remote import (ExpertServer, JobSecret, RemoteAuthError, RemoteExpert,
                                 RemoteExpertError, RemoteTimeoutError, endpoint)
from moe_autograd.remote.auth import ENV_SECRET, ENV_SECRET_FILE
from moe_autograd.remote.cli import build_parser, load_object, main, secret_main
from moe_autograd.remote.frame import Frame
from moe_autograd.remote.state import CallState, StateStore
from moe_autograd.remote.transport import TransportTimeout
from wiring import SECRET, InProcess

ROOT = Path(__file__).resolve().parent.parent.parent
pytestmark = pytest.mark.timeout(30)


def _state(owner: str = "a", nbytes: int = 0, expert: str = "e") -> CallState:
    return CallState(expert, owner, [], [], nbytes)


def test_state_store_cap_ttl_and_reasons() -> None:
    store = StateStore(ttl=0.2, max_states=2)
    for k in range(3):
        store.put(f"c{k}", _state())
    assert len(store) == 2
    with pytest.raises(LookupError, match="evicted"):
        store.take("a", "c0", "e")
    store.take("a", "c1", "e")
    with pytest.raises(LookupError, match="used by an earlier backward"):
        store.take("a", "c1", "e")
    assert store.release("a", ["c9"]) == 0
    with pytest.raises(LookupError, match="released by the client before its forward"):
        store.put("c9", _state())  # the release overtook the forward: nothing is stored
    time.sleep(0.25)
    assert store.sweep() == 1 and len(store) == 0
    with pytest.raises(LookupError, match="expired"):
        store.take("a", "c2", "e")
    with pytest.raises(LookupError, match="unknown call id"):
        store.take("a", "never", "e")
    assert store.stats()["live"] == 0


def test_state_store_ids_are_owned_and_never_reused() -> None:
    store = StateStore(ttl=30.0, max_states=8)
    store.put("x", _state("a"))
    with pytest.raises(LookupError, match="already held"):  # item 1: never a silent no-store
        store.put("x", _state("b"))
    with pytest.raises(LookupError, match="call 'x' belongs to another session"):
        store.take("b", "x", "e")  # (owners are sessions; the error names neither)
    assert store.release("b", ["x"]) == 0  # another session's release is refused
    with pytest.raises(LookupError, match="belongs to expert 'e', not 'f'"):
        store.take("a", "x", "f")

    def bad(state: CallState) -> None:
        raise ValueError("wrong gradient shape")
    with pytest.raises(ValueError, match="wrong gradient shape"):
        store.take("a", "x", "e", bad)
    assert store.stats()["refused"] == 3 and len(store) == 1  # all refusals left it intact
    store.take("a", "x", "e")
    with pytest.raises(LookupError, match="used before"):
        store.put("x", _state("a"))


def test_state_store_quotas_protect_smaller_clients() -> None:
    store = StateStore(ttl=30.0, max_states=10, max_states_per_client=6)
    store.put("a0", _state("a"))
    for k in range(100):  # b floods: only its own states go
        store.put(f"b{k}", _state("b"))
    assert store.stats()["live"] == 7 and store.take("a", "a0", "e").owner == "a"
    for k in range(5):
        store.put(f"a{k + 1}", _state("a"))  # full at the 5th: b (6 states) gives way, not a
    assert store.stats()["clients"] == 2 and len(store._owned["a"]) == 5
    for k in range(5):
        store.put(f"c{k}", _state("c"))  # each eviction hits a client holding more than c
    counts = sorted(len(ids) for ids in store._owned.values())
    assert len(store) == 10 and counts == [3, 3, 4], counts  # fair shares


def test_state_store_byte_cap() -> None:
    store = StateStore(ttl=30.0, max_states=100, max_bytes=1000)
    store.put("a0", _state("a", 300))
    for k in range(10):
        store.put(f"b{k}", _state("b", 300))
        assert store.nbytes <= 1000
    assert store.take("a", "a0", "e").nbytes == 300  # b's volume evicted only b's states
    with pytest.raises(MemoryError, match="expert 'big'.*max_state_bytes=1000"):
        store.put("huge", _state("a", 1001, expert="big"))


class _Ready:
    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: Optional[float]) -> Any:
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class Hooked(InProcess):
    """This process's endpoint as the worker ``here``; with ``hook``, each
    frame's reply is ``hook(frame)`` instead (an exception: the pending raises it)."""

    def __init__(self, hook: Optional[Callable[[Frame], Any]] = None) -> None:
        super().__init__("here")
        self.hook = hook

    def call(self, worker: str, frame: Frame, timeout: Optional[float]) -> Any:
        if self.hook is not None:
            return _Ready(self.hook(frame))
        return super().call(worker, frame, timeout)


@pytest.mark.parametrize("backward", ["stateless", "stateful"])
def test_in_process_transport_seam(backward: str) -> None:
    transport = Hooked()
    module = nn.Linear(3, 3)
    with ExpertServer({f"unit_{backward}": module}, backward=backward, transport=transport) as server:
        assert server.worker == "here"
        expert = RemoteExpert("here", f"unit_{backward}", transport=transport)
        x = torch.randn(2, 3, requires_grad=True)
        expert(x).sum().backward()
        lx = x.detach().clone().requires_grad_()
        module.zero_grad()
        module(lx).sum().backward()
        torch.testing.assert_close(x.grad, lx.grad)
        assert server.stats()["live"] == 0
    # Closed: the expert is gone, and with it (no other server of this process
    # serving the job) the job's key: the gate refuses the request unread.
    served = SECRET.key_id.hex() in endpoint.gate().jobs()
    with pytest.raises(RemoteExpertError, match="unknown expert" if served else "unknown job"
                       ) as info:
        expert(x)
    assert served or isinstance(info.value, RemoteAuthError), info.value


def test_transport_timeout_becomes_remote_timeout_error() -> None:
    labels: List[str] = []

    def too_slow(frame: Frame) -> Any:
        labels.append(frame.label)
        return TransportTimeout("too slow")
    expert = RemoteExpert("w", "e", forward_timeout=0.1, transport=Hooked(too_slow))
    with pytest.raises(RemoteTimeoutError, match="'e' on worker 'w' missed its 0.1 s deadline"):
        expert(torch.randn(1))
    assert labels == ["forward"]


def test_duplicate_expert_names_are_refused() -> None:
    transport = Hooked()
    with ExpertServer({"unit_dup": nn.Linear(1, 1)}, transport=transport):
        with pytest.raises(ValueError, match="already served"):
            ExpertServer({"unit_dup": nn.Linear(1, 1)}, transport=transport)
    with pytest.raises(ValueError, match="backward must be"):
        ExpertServer({}, backward="sometimes")


def test_cli_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv(ENV_SECRET_FILE, raising=False)
    args = build_parser().parse_args(["--experts", "m:f"])
    assert (args.master_port, args.rank, args.world_size) == (1234, 3, None)
    assert (args.max_request_bytes, args.max_state_bytes, args.non_finite_grads) == (
        256 << 20, 1 << 30, "skip")
    assert (args.secret_file, args.insecure) == (None, False)
    args = build_parser().parse_args(["--experts", "m:f", "--max-state-bytes", "none",
                                      "--max-request-bytes", "4096", "--non-finite-grads", "raise",
                                      "--secret-file", "job.secret", "--insecure"])
    assert (args.max_request_bytes, args.max_state_bytes, args.non_finite_grads) == (
        4096, None, "raise")
    assert (args.secret_file, args.insecure) == ("job.secret", True)
    monkeypatch.setenv(ENV_SECRET_FILE, "/etc/moe/job.secret")  # the default --secret-file
    assert build_parser().parse_args(["--experts", "m:f"]).secret_file == "/etc/moe/job.secret"
    assert load_object("moe_autograd.remote.cli:main") is main
    with pytest.raises(ValueError, match="package.module:function"):
        load_object("no_colon")
    with pytest.raises(SystemExit) as info:
        main(["serve"])  # --experts is required
    assert info.value.code == 2
    # A secret file that is missing, or that others may read, is refused
    # (exit 2) before anything is loaded or started.
    loose = tmp_path / "loose.secret"
    loose.write_text(JobSecret.generate().hex())
    loose.chmod(0o644)
    for path in (tmp_path / "missing.secret", loose):
        assert main(["serve", "--experts", "m:f", "--rank", "0", "--secret-file",
                     str(path)]) == 2, path


def test_serve_refusals_say_what_to_do_without_a_usage_dump(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 43: a 25-line usage dump came before each secret error, and a bad
    --experts factory gave a raw traceback."""
    secret = JobSecret.generate().save(str(tmp_path / "job.secret"))
    cases = {
        "no_such_module_here:make": "--experts no_such_module_here:make: cannot load the "
                                    "factory: ModuleNotFoundError",
        "moe_autograd.remote.cli:no_such": "--experts moe_autograd.remote.cli:no_such: cannot "
                                           "load the factory: AttributeError",
        "moe_autograd.remote.cli:build_parser": "--experts moe_autograd.remote.cli:build_parser "
                                                "returned ArgumentParser, not a dict",
        "os:abort_not:": "cannot load the factory",
    }
    for spec, words in cases.items():
        assert main(["serve", "--experts", spec, "--rank", "1", "--world-size", "2",
                     "--secret-file", secret]) == 2, spec
        err = capsys.readouterr().err
        assert err.startswith("python -m moe_autograd serve: error: ") and words in err, err
        assert "usage:" not in err and "Traceback" not in err, err
    assert main(["serve", "--experts", "m:f", "--rank", "0", "--secret-file",
                 str(tmp_path / "missing.secret")]) == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and "missing.secret" in err and len(err.splitlines()) <= 3, err


def test_secret_command_writes_a_private_file_and_never_overwrites(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "job.secret"
    assert secret_main(["--out", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = JobSecret.from_file(path)
    assert secret.key_id.hex() in capsys.readouterr().out
    assert secret != SECRET  # a new one
    written = path.read_text()
    # through the package's entry point, as a user runs it: refused, exit 2
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "moe_autograd", "secret", "--out", str(path)],
                          env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    # (cwd: the root, where `make mutate`'s trampolines find their setup.cfg)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "never overwritten" in done.stderr, done.stderr
    assert path.read_text() == written and JobSecret.from_file(path) == secret


def test_serve_without_a_secret_says_how_to_make_one() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SECRET, ENV_SECRET_FILE)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "moe_autograd", "serve", "--experts",
                           "remote_experts:cli_experts", "--rank", "1", "--world-size", "2"],
                          env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "no job secret" in done.stderr, done.stderr
    assert "python -m moe_autograd secret" in done.stderr, done.stderr
