"""The Ray engine's arguments, its refusal of a Ray without token
authentication, and the engine choice, without a Ray instance: bad input gets
an error naming what was wrong."""
import pytest

from moe_autograd.remote import (AutoTransport, MissingSecretError, RayAuthError,
                                 RayExpertServer, RayTransport, set_transport)
from moe_autograd.remote.frame import Frame
from moe_autograd.remote.ray_engine import ray_available
from moe_autograd.remote.transport import TransportSendError, get_transport

pytestmark = pytest.mark.timeout(30)
needs_ray = pytest.mark.skipif(not ray_available(), reason="ray is not installed")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(name="", experts="m:f"), ValueError, "name must be a non-empty str"),
    (dict(name="s", experts=3), TypeError, "experts must be a 'package.module:function'"),
    (dict(name="s", experts="no_colon"), ValueError, "package.module:function"),
    (dict(name="s", experts="m:f", max_concurrency=0), ValueError, "max_concurrency"),
    (dict(name="s", experts="m:f", backwards="stateful"), TypeError, r"unknown options \['backwards'\]"),
    (dict(name="s", experts="m:f", ready_timeout=-1.0), ValueError, "ready_timeout"),
    (dict(name="s", experts="m:f", save_every=5), ValueError, "need a state_dir"),
    (dict(name="s", experts="m:f", state_dir="d", save_every=0), ValueError, "save_every must"),
    (dict(name="s", experts="m:f", state_dir="d", save_interval=-1.0), ValueError,
     "save_interval must"),
    (dict(name="s", experts="m:f", max_restarts=-2), ValueError, "max_restarts must"),
    (dict(name="s", experts="m:f", max_restarts=True), ValueError, "max_restarts must"),
])
def test_ray_expert_server_refuses_bad_arguments(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        RayExpertServer(**kwargs)


def test_a_detached_restartable_server_needs_a_secret_file(monkeypatch) -> None:
    """A restart reads the secret again, after the driver and its private
    copy of the secret are gone: a detached one needs a file of its own."""
    monkeypatch.delenv("MOE_AUTOGRAD_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="give it a secret_file"):
        RayExpertServer("s", "m:f", detached=True, max_restarts=1)


def test_serve_refuses_max_restarts_without_ray(tmp_path, capsys) -> None:
    from moe_autograd.remote import JobSecret
    from moe_autograd.remote.cli import main

    secret = JobSecret.generate().save(str(tmp_path / "job.secret"))
    for extra, words in ((["--rank", "1", "--world-size", "2", "--max-restarts", "1"],
                          "--max-restarts is --engine ray's"),
                         (["--engine", "ray", "--max-restarts", "-2"],
                          "--max-restarts must be -1 (always) or more")):
        assert main(["serve", "--experts", "m:f", "--secret-file", secret, *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and "usage:" not in err, err


def test_ray_transport_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="namespace must be a non-empty str"):
        RayTransport("")
    with pytest.raises(ValueError, match="timeout of RayTransport"):
        RayTransport(timeout=0.0)
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        RayTransport(name="")
    t = RayTransport(timeout=None)
    assert t.default_timeout() is None and "none" in t.timeout_hint()
    with pytest.raises(TransportSendError, match="timeout"):
        t.call("srv", Frame(b""), float("nan"))


@needs_ray
def test_ray_transport_without_ray_init(run_python) -> None:
    out = run_python("""
        from moe_autograd.remote import RayTransport
        from moe_autograd.remote.frame import Frame
        from moe_autograd.remote.transport import TransportError
        t = RayTransport()
        for what in (lambda: t.call("srv", Frame(b""), 1.0), t.local_name):
            try:
                what()
            except TransportError as error:
                print(type(error).__name__, "|", error)
    """)
    lines = out.splitlines()
    assert lines[0].startswith("TransportSendError | Ray is not initialised"), out
    assert lines[1].startswith("TransportError | Ray is not initialised"), out


# -- a Ray without token authentication is refused, unless the user opts out ---------------
@pytest.fixture
def ray_without_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process "runs" a Ray that has no token authentication: Ray counts
    as initialised (nothing is started) and token_auth_enabled() says no."""
    import ray

    from moe_autograd.remote import ray_engine

    monkeypatch.setattr(ray_engine, "token_auth_enabled", lambda: False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)


def _names_the_remedy(text: str) -> None:
    assert "RAY_AUTH_MODE=token" in text and "RAY_AUTH_TOKEN_PATH" in text, text
    assert "allow_unauthenticated=True" in text, text


class _FakeRef:
    """An ObjectRef whose value is there at once."""

    def __init__(self, value) -> None:
        self.value = value

    def future(self):
        from concurrent.futures import Future

        future: Future = Future()
        future.set_result(self.value)
        return future


class _FakeActor:
    """An actor handle whose ``handle`` serves frames in this process
    (``calls``: how many reached it)."""

    def __init__(self, name: str) -> None:
        from moe_autograd.remote.ray_engine import serve_frame

        actor = self
        self.calls = 0

        class _Method:
            @staticmethod
            def remote(head, blob):
                actor.calls += 1
                return _FakeRef(serve_frame(head, blob, name))
        self.handle = _Method


@needs_ray
def test_ray_transport_refuses_a_ray_without_token_auth(ray_without_token: None) -> None:
    from torch import nn

    from moe_autograd.remote import ExpertServer, RemoteExpertError, call_operation
    from wiring import ask

    server = ExpertServer({"ray_unit_auth_lin": nn.Linear(2, 2)})
    try:
        t, actor = RayTransport(), _FakeActor("srv")
        t.use_handle("srv", actor, started=True)
        with pytest.raises(TransportSendError) as info:
            t.call("srv", Frame(b""), 1.0)
        _names_the_remedy(str(info.value))
        with pytest.raises(RemoteExpertError) as info:  # and so is every call through it
            call_operation("srv", "anything", transport=t, timeout=1.0)
        _names_the_remedy(str(info.value))
        assert actor.calls == 0  # refused before anything was sent

        # opted out: the same calls go through (to a fake actor serving in-process)
        insecure, actor = RayTransport(allow_unauthenticated=True), _FakeActor("srv")
        insecure.use_handle("srv", actor, started=True)
        status, info_ = ask("srv", {"op": "info"}, insecure)
        assert status == "ok" and "ray_unit_auth_lin" in info_["experts"], info_
        with pytest.raises(RemoteExpertError, match="no operation 'anything'"):
            call_operation("srv", "anything", transport=insecure, timeout=5.0)
        assert actor.calls == 2
    finally:
        server.close()


@needs_ray
def test_ray_expert_server_refuses_a_ray_without_token_auth(ray_without_token: None,
                                                            tmp_path) -> None:
    from moe_autograd.remote.ray_server import _ExpertActor

    with pytest.raises(RayAuthError) as info:  # the driver's side, before any actor starts
        RayExpertServer("srv", "m:f")
    assert "RayExpertServer 'srv'" in str(info.value)
    _names_the_remedy(str(info.value))
    with pytest.raises(RayAuthError) as info:  # the actor's own side, first thing it does
        _ExpertActor("srv", "ns", "m:f", {}, 0, None, False)
    assert "Ray expert server 'srv'" in str(info.value)
    _names_the_remedy(str(info.value))
    # opted out: past the check (to the secret file, which is missing here: nothing starts)
    missing = str(tmp_path / "no.secret")
    with pytest.raises(MissingSecretError, match="no.secret"):
        RayExpertServer("srv", "m:f", secret_file=missing, allow_unauthenticated=True)
    with pytest.raises(MissingSecretError, match="no.secret"):
        _ExpertActor("srv", "ns", "m:f", {}, 0, missing, True)


def test_set_transport_checks_and_restores() -> None:
    with pytest.raises(TypeError, match="set_transport expects a Transport"):
        set_transport(42)  # type: ignore[arg-type]
    before = get_transport()
    t = RayTransport()
    set_transport(t)
    try:
        assert get_transport() is t
    finally:
        set_transport(None)
    assert isinstance(get_transport(), AutoTransport) and isinstance(before, AutoTransport)


def test_auto_transport_without_any_engine(run_python) -> None:
    out = run_python("""
        from moe_autograd.remote import RemoteExpert, RemoteExpertError
        import torch
        try:
            RemoteExpert("srv", "lin")(torch.randn(2, 2))
        except RemoteExpertError as error:
            print(error)
    """)
    assert "no remote engine is initialised" in out and "ray.init" in out and "init_rpc" in out


def test_a_private_copy_of_the_secret_is_removed_once_its_actors_have_read_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver whose secret is not in a file writes a private copy for each
    actor (which removes its own once it has read it, so a driver killed
    with SIGKILL leaves none behind: issue 45); the driver removes a copy
    too once its actor started or failed, and the directory with the last,
    not at exit only."""
    import os
    import stat

    from moe_autograd.remote import ray_server
    from moe_autograd.remote.auth import ENV_SECRET_FILE, JobSecret, set_job_secret

    monkeypatch.delenv(ENV_SECRET_FILE, raising=False)
    previous = set_job_secret(JobSecret.generate())
    try:
        first, secret, private = ray_server._secret_source(None)
        second, _, again = ray_server._secret_source(None)  # another actor: its own copy
        assert first == private and second == again and first != second
        folder = os.path.dirname(first)
        assert os.path.dirname(second) == folder
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert JobSecret.from_file(first) == secret == JobSecret.from_file(second)
        ray_server._read_private_copy(first)
        assert not os.path.exists(first) and os.path.exists(second)  # not read yet
        ray_server._read_private_copy(second)
        assert not os.path.exists(folder)
        ray_server._read_private_copy(first)  # once more: nothing left to do
        ray_server._read_private_copy(None)
    finally:
        set_job_secret(previous)
        ray_server._remove_private_dirs()


# -- placement asked for that no node can give (issue 43) ---------------------------------

class _FakeRay:
    """``ray.nodes()`` and this process's node id, as Ray reports them."""

    def __init__(self, nodes, here):  # type: ignore[no-untyped-def]
        self._nodes, self._here = nodes, here

    def nodes(self):  # type: ignore[no-untyped-def]
        return self._nodes

    def get_runtime_context(self):  # type: ignore[no-untyped-def]
        here = self._here
        return type("Context", (), {"get_node_id": lambda self: here})()


_HEAD = {"NodeID": "head", "Alive": True,
         "Resources": {"CPU": 2.0, "memory": 1e9, "node:127.0.0.1": 1.0}}
_EXPERTS = {"NodeID": "b", "Alive": True, "Resources": {"CPU": 2.0, "experts": 4.0}}
_DEAD = {"NodeID": "c", "Alive": False, "Resources": {"CPU": 2.0, "experts": 4.0}}


def test_a_resource_no_node_has_is_named_with_how_to_get_it() -> None:
    from moe_autograd.remote.ray_server import _check_placement

    ray = _FakeRay([_HEAD, _DEAD], "head")
    with pytest.raises(ValueError) as info:
        _check_placement(ray, "server-b", 0.0, {"experts": 1}, None)
    assert str(info.value) == (
        "cannot start Ray expert server 'server-b': any live node of the cluster has no 1 of "
        "the resource 'experts' (it has ['CPU', 'memory']); start a node that advertises it "
        "('ray start ... --resources='{\"experts\": N}'', on one machine the head itself: "
        "'ray start --head --resources=...'), or ask for no 'experts'")
    with pytest.raises(ValueError, match="this process's node has no 1 of the resource 'GPU'"):
        _check_placement(ray, "server-b", 1.0, None, "here")


def test_a_resource_only_another_node_has_names_anywhere() -> None:
    from moe_autograd.remote.ray_server import _check_placement

    ray = _FakeRay([_HEAD, _EXPERTS], "head")
    with pytest.raises(ValueError, match=r"this process's node has no 1 of the resource 'experts' "
                       r"\(it has \['CPU', 'memory'\]\); another node has it: let Ray place the "
                       r"actor there \('serve --engine ray --anywhere', "
                       r"RayExpertServer\(\.\.\., on_node=None\)\)"):
        _check_placement(ray, "server-b", 0.0, {"experts": 1}, "here")
    _check_placement(ray, "server-b", 0.0, {"experts": 4}, None)  # placed anywhere: it fits
    _check_placement(ray, "server-b", 0.0, None, "here")          # nothing asked: nothing checked
