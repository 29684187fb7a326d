"""The Ray backend's arguments and the engine choice, without a Ray instance:
bad input gets an error naming what was wrong."""
import pytest

from moe_autograd.remote import AutoTransport, RayExpertServer, RayTransport, set_transport
from moe_autograd.remote.ray_backend import ray_available
from moe_autograd.remote.transport import TransportError, TransportSendError, get_transport

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(name="", experts="m:f"), ValueError, "name must be a non-empty str"),
    (dict(name="s", experts=3), TypeError, "experts must be a 'package.module:function'"),
    (dict(name="s", experts="no_colon"), ValueError, "package.module:function"),
    (dict(name="s", experts="m:f", max_concurrency=0), ValueError, "max_concurrency"),
    (dict(name="s", experts="m:f", backwards="stateful"), TypeError, r"unknown options \['backwards'\]"),
    (dict(name="s", experts="m:f", ready_timeout=-1.0), ValueError, "ready_timeout"),
])
def test_ray_expert_server_refuses_bad_arguments(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        RayExpertServer(**kwargs)


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
        t.call("srv", print, (), float("nan"))


@pytest.mark.skipif(not ray_available(), reason="ray is not installed")
def test_ray_transport_without_ray_init(run_python) -> None:
    out = run_python("""
        from moe_autograd.remote import RayTransport
        from moe_autograd.remote.transport import TransportError
        t = RayTransport()
        for what in (lambda: t.call("srv", print, (), 1.0), t.local_name):
            try:
                what()
            except TransportError as error:
                print(type(error).__name__, "|", error)
    """)
    lines = out.splitlines()
    assert lines[0].startswith("TransportSendError | Ray is not initialised"), out
    assert lines[1].startswith("TransportError | Ray is not initialised"), out


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
