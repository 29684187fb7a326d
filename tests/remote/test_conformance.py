"""One conformance suite, two engines: every test runs on torch RPC and on Ray.

The ``backend`` fixture (conftest) gives the same two servers (``srv-a``, ``srv-b``,
serving :func:`remote_experts.setup_servers`) on either engine: the shared
RPC world (conftest ``world``) or the shared local Ray instance (conftest
``ray_world``: server actors of the same names); the assertions are the same.
Ray tests skip when ``ray`` is not installed.
"""
import multiprocessing
import threading
import time
from typing import Any, Dict, Iterator

import pytest
import torch
from torch import nn

import remote_experts as rx
from moe_autograd import parallel_apply
from moe_autograd.moe import MixtureOfExperts
from moe_autograd.remote import (RemoteCall, RemoteExpert, RemoteExpertError,
                                 RemoteTimeoutError)
from moe_autograd.remote.channel import request
from moe_autograd.remote.loopback import free_port, start_servers, stop_processes
from moe_autograd.remote.transport import AutoTransport, choose_backend, get_transport
from wiring import RAY_START_S, Backend

pytestmark = pytest.mark.timeout(60)


def local_copy(expert: RemoteExpert, module: nn.Module) -> nn.Module:
    module.load_state_dict(expert.remote_state_dict())
    return module


def assert_bit_equal(a: Any, b: Any, what: str = "") -> None:
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), what
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what


# -- the engine is chosen by how the world was started ----------------------------------
def test_backend_chosen_by_the_world(backend: Backend) -> None:
    chosen = choose_backend()
    assert type(chosen) is type(backend.transport), chosen
    auto = get_transport()
    assert isinstance(auto, AutoTransport)
    assert auto.local_name() == backend.transport.local_name()
    # A RemoteExpert built with the automatic choice works on this engine.
    x = torch.randn(2, rx.WIDTH)
    expert = RemoteExpert("srv-a", "lin")
    assert_bit_equal(expert(x), local_copy(expert, nn.Linear(rx.WIDTH, rx.WIDTH))(x).detach())


# -- gradients bit-equal to local calls, stateless and stateful -------------------------
@pytest.mark.parametrize("prefix", ["", "sf_"])
def test_outputs_and_grads_bit_equal_to_local(backend: Backend, prefix: str) -> None:
    expert = backend.expert("srv-a", prefix + "two")
    local = local_copy(expert, rx.TwoInTwoOut())
    expert.zero_grad()
    live = expert.remote_stats()["live"]
    x, y = (torch.randn(3, rx.WIDTH, requires_grad=True) for _ in range(2))
    lx, ly = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    a, b = expert(x, y)
    la, lb = local(lx, ly)
    assert expert.remote_stats()["live"] == live + (1 if prefix else 0)  # state held
    assert_bit_equal(a, la.detach(), "a")
    assert_bit_equal(b, lb.detach(), "b")
    c = torch.randn_like(a)
    ((a * c).sum() + b.square().sum()).backward()
    ((la * c).sum() + lb.square().sum()).backward()
    assert_bit_equal(x.grad, lx.grad, "x.grad")
    assert_bit_equal(y.grad, ly.grad, "y.grad")
    remote = expert.remote_grads()
    for name, param in local.named_parameters():
        assert_bit_equal(remote[name], param.grad, name)
    assert expert.remote_stats()["live"] == live  # freed at backward


@pytest.mark.parametrize("prefix", ["", "sf_"])
def test_dropout_replayed_in_parallel_apply(backend: Backend, prefix: str) -> None:
    # y = dropout(x) * w: x.grad == y / x iff backward used the forward's mask
    experts = [backend.expert(w, prefix + "drop_scale") for w in ("srv-a", "srv-b", "srv-a")]
    xs = [torch.rand(32, rx.WIDTH).add(0.5).requires_grad_() for _ in experts]
    outs = parallel_apply(experts, xs)
    sum(o.sum() for o in outs).backward()
    for x, out in zip(xs, outs):
        assert 0 < int((out == 0).sum()) < out.numel()
        torch.testing.assert_close(x.grad, out.detach() / x.detach())


# -- coalesced batching: one request per server per pass --------------------------------
@pytest.fixture
def lingering(backend: Backend) -> Iterator[None]:
    """Ready answers wait for all their siblings (no split replies)."""
    old = [backend.run(w, "set_linger", 30.0) for w in ("srv-a", "srv-b")]
    try:
        yield
    finally:
        for w, value in zip(("srv-a", "srv-b"), old):
            backend.run(w, "set_linger", value)


@pytest.mark.parametrize("prefix", ["", "sf_"])
def test_one_request_per_server_and_pass(backend: Backend, lingering: None, prefix: str) -> None:
    t = rx.Counting(backend.transport)
    experts = [RemoteExpert(w, prefix + "lin", transport=t)
               for w in ("srv-a", "srv-b", "srv-a", "srv-b", "srv-a")]
    locals_ = [local_copy(e, nn.Linear(rx.WIDTH, rx.WIDTH)) for e in experts]
    for e in experts:
        e.zero_grad()
    t.take()
    xs = [torch.randn(3, rx.WIDTH, requires_grad=True) for _ in experts]
    outs = parallel_apply(experts, xs)
    assert t.take() == {"srv-a": ["batch"], "srv-b": ["batch"]}
    sum(o.square().sum() for o in outs).backward()
    assert t.take() == {"srv-a": ["batch"], "srv-b": ["batch"]}
    lxs = [x.detach().clone().requires_grad_() for x in xs]
    louts = [m(x) for m, x in zip(locals_, lxs)]
    sum(o.square().sum() for o in louts).backward()
    for k, (out, lout, x, lx) in enumerate(zip(outs, louts, xs, lxs)):
        assert_bit_equal(out, lout.detach(), f"out {k}")
        assert_bit_equal(x.grad, lx.grad, f"x.grad {k}")

    moe = MixtureOfExperts([RemoteExpert(w, n, transport=t) for w in ("srv-a", "srv-b")
                            for n in ("lin", "sf_lin")], rx.WIDTH, k=4)
    t.take()
    y, aux = moe(torch.randn(6, rx.WIDTH))
    assert t.take() == {"srv-a": ["batch"], "srv-b": ["batch"]}
    (y.sum() + aux).backward()
    assert t.take() == {"srv-a": ["batch"], "srv-b": ["batch"]}


# -- deadlines ------------------------------------------------------------------------------
def test_deadline_masks_a_slow_call(backend: Backend) -> None:
    experts = [backend.expert("srv-b", "lin"), backend.expert("srv-a", "lin"),
               backend.expert("srv-b", "slow")]  # "slow" sleeps 2 s
    moe = MixtureOfExperts(experts, rx.WIDTH, k=3, k_min=1, forward_timeout=1.0)
    x = torch.randn(8, rx.WIDTH, requires_grad=True)
    started = time.monotonic()
    y, aux = moe(x)
    assert time.monotonic() - started < 1.0 + 0.5
    stats = moe.stats()
    assert [s["timeouts"] for s in stats] == [0, 0, 1], stats
    assert [s["failures"] for s in stats] == [0, 0, 0], stats
    (y.sum() + aux).backward()
    assert x.grad is not None and bool(torch.isfinite(y).all())
    # alone, the call's own deadline
    with pytest.raises(RemoteTimeoutError, match="'slow' on worker 'srv-b' missed its 0.3 s"):
        backend.expert("srv-b", "slow", forward_timeout=0.3)(torch.randn(2, rx.WIDTH))


def test_transport_timeout_bounds_a_call_without_deadline(backend: Backend) -> None:
    seconds = backend.transport.default_timeout()  # type: ignore[attr-defined]
    assert seconds == 30.0  # rpc_timeout of the RPC world, RayTransport(timeout=) of Ray
    pending = request(backend.transport, "srv-b", {"op": "call", "name": "sleep", "args": [2.0]},
                      0.2)
    with pytest.raises(Exception) as info:
        pending.result(None)
    assert "timeout" in type(info.value).__name__.lower() or "TransportTimeout" in repr(info.value)


# -- bad requests: clear errors, the server survives ------------------------------------
@pytest.mark.parametrize("bad, match", [
    ("hello", "must be Tensor"),
    (torch.randn(3, 5), "cannot be multiplied"),
    (torch.randn(3, rx.WIDTH, dtype=torch.float64), "dtype"),
])
def test_bad_input_fails_clearly_and_the_server_survives(backend: Backend, bad: Any,
                                                        match: str) -> None:
    expert = backend.expert("srv-a", "lin")
    with pytest.raises(RemoteExpertError, match=match) as info:
        expert(bad)
    assert "'lin'" in str(info.value) and "'srv-a'" in str(info.value)
    assert expert(torch.randn(2, rx.WIDTH)).shape == (2, rx.WIDTH)


def test_unknown_expert_worker_and_unsendable_arguments(backend: Backend) -> None:
    x = torch.randn(2, rx.WIDTH)
    with pytest.raises(RemoteExpertError, match="unknown expert 'nope'"):
        backend.expert("srv-b", "nope")(x)
    with pytest.raises(RemoteExpertError, match="boom from the expert"):
        backend.expert("srv-b", "failing")(x)
    with pytest.raises(RemoteExpertError, match="'no-such-worker'"):
        backend.expert("no-such-worker", "lin")(x)
    with pytest.raises(TypeError, match="argument list\\[1\\] is a _thread.lock, which cannot "
                                        "travel"):
        backend.expert("srv-b", "lin")(x, threading.Lock())  # not a wire value
    assert backend.expert("srv-b", "lin")(x).shape == x.shape


def test_garbage_requests_get_error_replies(backend: Backend) -> None:
    t = torch.randn(2, rx.WIDTH)
    garbage = [
        ({"op": "forward", "expert": 123, "call": "id", "seed": 0, "grad": True, "flags": [True],
          "args": [t]}, "expert name must be a str"),
        ({"op": "backward", "expert": "sf_lin", "call": "never-stored", "seed": 0,
          "flags": [True], "args": None, "grads": [t]}, "no state for call"),
        ({"op": "backward", "expert": "lin", "call": "id", "seed": 0, "flags": [True],
          "args": [t], "grads": [t[:1]]}, "has shape [1, 8]"),
        ({"op": "control", "expert": "lin", "what": "explode", "payload": None},
         "unknown control operation"),
    ]
    for message, match in garbage:
        status, text = backend.ask("srv-a", message)
        assert status == "error" and match in text, (message, text)
    assert backend.expert("srv-a", "lin")(t).shape == t.shape


# -- call ids are owned; limits; optimizer= ---------------------------------------------
def test_a_state_is_its_owners_only(backend: Backend) -> None:
    expert = backend.expert("srv-a", "sf_lin")
    x = torch.randn(2, rx.WIDTH, requires_grad=True)
    args = expert.function_args(x)
    call = args[0]
    out = RemoteCall.apply(*args)[0]
    grad = torch.ones_like(out)
    # srv-b's process is another session of the same job: it may not touch the state
    status, text = backend.run("srv-b", "backward_as_me", "srv-a", "sf_lin", call.call_id,
                               [grad])
    assert status == "error" and "belongs to" in text, text
    status, freed = backend.run("srv-b", "release_as_me", "srv-a", [call.call_id])
    assert (status, freed) == ("ok", 0)
    out.backward(grad)  # the owner's backward still finds its state
    assert x.grad is not None


def test_server_limits(backend: Backend) -> None:
    expert = backend.expert("srv-b", "small_lin")  # max_request_bytes = 1 MiB
    with pytest.raises(RemoteExpertError, match="max_request_bytes"):
        expert(torch.randn(40_000, rx.WIDTH))  # 1.28 MB
    assert expert(torch.randn(2, rx.WIDTH)).shape == (2, rx.WIDTH)


def test_server_side_optimizer(backend: Backend) -> None:
    expert = backend.expert("srv-b", "opt_lin")
    local = local_copy(expert, nn.Linear(rx.WIDTH, rx.WIDTH))
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for _ in range(2):
        expert.zero_grad()
        opt.zero_grad()
        x = torch.randn(4, rx.WIDTH)
        expert(x).square().sum().backward()
        local(x).square().sum().backward()
        expert.step()
        opt.step()
    remote = expert.remote_state_dict()
    for key, value in local.state_dict().items():
        assert_bit_equal(remote[key], value, key)
    with pytest.raises(RemoteExpertError, match="has no optimizer"):
        backend.expert("srv-b", "lin").step()


# -- a server killed (kill -9) mid-step is masked within its deadline --------------------
def _rpc_kill_world() -> Dict[str, Any]:
    port = free_port()
    servers = start_servers(port, 3, ["srv-l", "srv-k"], "remote_experts:kill_experts")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    client = ctx.Process(target=rx.kill_world_client, args=(port, servers[1].pid, queue),
                         daemon=True)
    client.start()
    try:
        report: Dict[str, Any] = queue.get(timeout=45)
    finally:
        stop_processes([client], timeout=5.0)
        stop_processes(servers, timeout=2.0)  # srv-l waits for the dead one: terminated
    return report


@pytest.mark.timeout(60 + RAY_START_S)  # (Ray) an actor started in the test
def test_killed_server_is_masked_within_its_deadline(backend: Backend) -> None:
    if backend.name == "rpc":  # a static world cannot take a member: a world of its own
        report = _rpc_kill_world()
    else:
        import os
        import signal

        from moe_autograd.remote import RayExpertServer

        doomed = RayExpertServer("srv-k", "remote_experts:kill_experts",
                                 ready_timeout=RAY_START_S)
        try:
            report = rx.killed_server_steps(backend.transport, "srv-a", "srv-k",
                                            lambda: os.kill(doomed.pid, signal.SIGKILL))
        finally:
            doomed.kill()
    assert "error" not in report, report
    elapsed, masked, finite_y, finite_grad = report["killed_mid_step"]
    assert masked[0] == 0 and masked[2] >= 1, report  # the running call on the dead one
    assert elapsed < 3.0 + 3.0 + 1.0, report  # within the deadlines (forward + backward)
    assert finite_y and finite_grad, report
    elapsed, masked, finite_y, finite_grad = report["dead"]
    assert masked[0] == 0 and masked[1] >= 1 and masked[2] >= 1, report
    assert elapsed < 3.0 + 1.0, report
    assert finite_y and finite_grad, report
