"""Remote experts agree with local autograd; bad requests fail clearly."""
from typing import Dict, Optional

import pytest
import torch
from torch import Tensor, nn

import remote_experts as rx
from moe_autograd import map_with_parallel_backward, parallel_apply
from moe_autograd.remote import RemoteCall, RemoteExpert, RemoteExpertError
from wiring import ask
from moe_autograd.rng import CallRng

pytestmark = pytest.mark.timeout(60)
STRATEGIES = ["", "sf_"]  # expert-name prefixes: stateless, stateful servers


def local_copy(expert: RemoteExpert, module: nn.Module) -> nn.Module:
    module.load_state_dict(expert.remote_state_dict())
    return module


def assert_grads_equal(remote: Dict[str, Optional[Tensor]], local: nn.Module) -> None:
    for name, param in local.named_parameters():
        assert remote[name] is not None, name
        torch.testing.assert_close(remote[name], param.grad, msg=name)


@pytest.mark.parametrize("prefix", STRATEGIES)
def test_outputs_and_grads_match_local(world, prefix: str) -> None:
    expert = RemoteExpert("srv-a", prefix + "two")
    local = local_copy(expert, rx.TwoInTwoOut())
    expert.zero_grad()
    x, y = torch.randn(3, rx.WIDTH, requires_grad=True), torch.randn(3, rx.WIDTH, requires_grad=True)
    lx, ly = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    a, b = expert(x, y)
    la, lb = local(lx, ly)
    torch.testing.assert_close((a, b), (la, lb))
    c = torch.randn_like(a)
    ((a * c).sum() + b.square().sum()).backward()
    ((la * c).sum() + lb.square().sum()).backward()
    torch.testing.assert_close((x.grad, y.grad), (lx.grad, ly.grad))
    assert_grads_equal(expert.remote_grads(), local)


@pytest.mark.parametrize("prefix", STRATEGIES)
def test_parameter_grads_without_input_grads_and_accumulation(world, prefix: str) -> None:
    expert = RemoteExpert("srv-b", prefix + "lin")
    local = local_copy(expert, nn.Linear(rx.WIDTH, rx.WIDTH))
    expert.zero_grad()
    for _ in range(2):  # accumulates like local autograd
        x = torch.randn(4, rx.WIDTH)
        expert(x).tanh().sum().backward()
        local(x).tanh().sum().backward()
    assert_grads_equal(expert.remote_grads(), local)


@pytest.mark.parametrize("prefix", STRATEGIES)
def test_dropout_replayed_exactly(world, prefix: str) -> None:
    expert = RemoteExpert("srv-a", prefix + "mlp_drop")
    local = local_copy(expert, rx.mlp_drop())
    expert.zero_grad()
    x = torch.randn(16, rx.WIDTH, requires_grad=True)
    lx = x.detach().clone().requires_grad_()
    torch.manual_seed(7)
    out = expert(x)
    torch.manual_seed(7)
    with CallRng.fork().activate():  # the seed the client drew, as the server used it
        ref = local(lx)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, lx.grad)
    assert_grads_equal(expert.remote_grads(), local)


@pytest.mark.parametrize("prefix", STRATEGIES)
@pytest.mark.parametrize("checkpoint", [False, True])
def test_parallel_apply_dropout_consistent(world, prefix: str, checkpoint: bool) -> None:
    # y = dropout(x) * w, so with unit output gradients x.grad == y / x iff the
    # backward used the forward's mask (also across a checkpointed recompute).
    experts = [RemoteExpert(w, prefix + "drop_scale") for w in ("srv-a", "srv-b", "srv-a")]
    xs = [torch.rand(32, rx.WIDTH).add(0.5).requires_grad_() for _ in experts]
    outs = parallel_apply(experts, xs, checkpoint=checkpoint)
    sum(o.sum() for o in outs).backward()
    for x, out in zip(xs, outs):
        assert 0 < int((out == 0).sum()) < out.numel()
        torch.testing.assert_close(x.grad, out.detach() / x.detach())


@pytest.mark.parametrize("prefix", STRATEGIES)
def test_map_with_parallel_backward(world, prefix: str) -> None:
    experts = [RemoteExpert(w, prefix + "lin") for w in ("srv-a", "srv-b")]
    locals_ = [local_copy(e, nn.Linear(rx.WIDTH, rx.WIDTH)) for e in experts]
    xs = [torch.randn(2, rx.WIDTH, requires_grad=True) for _ in experts]
    lxs = [x.detach().clone().requires_grad_() for x in xs]
    results = map_with_parallel_backward(RemoteCall, *[e.function_args(x) for e, x in zip(experts, xs)])
    sum(r[0].sum() for r in results).backward()
    sum(m(x).sum() for m, x in zip(locals_, lxs)).backward()
    for r, m, x, lx in zip(results, locals_, xs, lxs):
        torch.testing.assert_close(r[0], m(lx))
        torch.testing.assert_close(x.grad, lx.grad)


def test_no_grad_forward_keeps_no_state(world) -> None:
    expert = RemoteExpert("srv-a", "sf_lin")
    local = local_copy(expert, nn.Linear(rx.WIDTH, rx.WIDTH))
    before = expert.remote_stats()["stored"]
    x = torch.randn(2, rx.WIDTH, requires_grad=True)
    with torch.no_grad():
        out = expert(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, local(x).detach())
    assert expert.remote_stats()["stored"] == before


def test_step_and_zero_grad_train_the_server_module(world) -> None:
    expert = RemoteExpert("srv-b", "opt_lin")
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
    torch.testing.assert_close(expert.remote_state_dict(), local.state_dict())
    with pytest.raises(RemoteExpertError, match="has no optimizer"):
        RemoteExpert("srv-b", "lin").step()


def test_auto_step_after_each_backward(world) -> None:
    expert = RemoteExpert("srv-a", "auto_lin")
    local = local_copy(expert, nn.Linear(rx.WIDTH, rx.WIDTH))
    x = torch.randn(4, rx.WIDTH)
    expert(x).sum().backward()
    local(x).sum().backward()
    with torch.no_grad():
        for p in local.parameters():
            assert p.grad is not None
            p.sub_(0.1 * p.grad)
    torch.testing.assert_close(expert.remote_state_dict(), local.state_dict())
    assert all(g is None for g in expert.remote_grads().values())


@pytest.mark.parametrize("bad, match", [
    ("hello", "must be Tensor"),
    (torch.randn(3, 5), "cannot be multiplied"),
    (torch.randn(3, rx.WIDTH, dtype=torch.float64), "dtype"),
])
def test_bad_inputs_fail_clearly_and_server_survives(world, bad, match) -> None:
    expert = RemoteExpert("srv-a", "lin")
    with pytest.raises(RemoteExpertError, match=match) as info:
        expert(bad)
    assert "'lin'" in str(info.value) and "'srv-a'" in str(info.value)
    assert expert(torch.randn(2, rx.WIDTH)).shape == (2, rx.WIDTH)


def test_unknown_expert_failing_expert_and_unknown_worker(world) -> None:
    x = torch.randn(2, rx.WIDTH)
    with pytest.raises(RemoteExpertError, match="unknown expert 'nope'") as info:
        RemoteExpert("srv-b", "nope")(x)
    assert "'srv-b'" in str(info.value) and "lin" in str(info.value)  # lists what is served
    with pytest.raises(RemoteExpertError, match="boom from the expert"):
        RemoteExpert("srv-b", "failing")(x)
    with pytest.raises(RemoteExpertError, match="'no-such-worker'"):
        RemoteExpert("no-such-worker", "lin")(x)
    with pytest.raises(TypeError, match="argument list\\[1\\] is a builtins.function, which "
                                        "cannot travel"):
        RemoteExpert("srv-b", "lin")(x, lambda: 0)  # not a wire value
    assert RemoteExpert("srv-b", "lin")(x).shape == x.shape


def test_garbage_requests_get_error_replies(world) -> None:
    t = torch.randn(2, rx.WIDTH)

    def forward(**change):
        return dict({"op": "forward", "expert": "lin", "call": "id", "seed": 0, "grad": True,
                     "flags": [True], "args": [t]}, **change)

    def backward(**change):
        return dict({"op": "backward", "expert": "lin", "call": "id", "seed": 0, "flags": [True],
                     "args": [t], "grads": [t]}, **change)
    garbage = [
        (forward(expert=123), "expert name must be a str"),
        (forward(seed="seed?"), "field 'seed' must be int"),
        (forward(seed=True), "field 'seed' must be int"),
        (forward(flags=[True, True]), "flags"),
        (forward(args="notalist"), "field 'args' must be list"),
        (forward(expert="sf_lin", call="x" * 1000), "call id must be"),
        (forward(call=None), "call id must be"),
        (backward(expert="sf_lin", call="never-stored", args=None), "no state for call"),
        (backward(grads=[t, t]), "expected 1 output gradients"),
        (backward(grads=["grad"]), "not a tensor"),
        (backward(grads=[t[:1]]), "has shape [1, 8]"),
        (backward(args="x"), "'args' must be a list or None"),
        ({"op": "control", "expert": "lin", "what": "explode"}, "unknown control operation"),
        ({"op": "release", "calls": "not-a-list"}, "calls must be a list"),
        ({"op": "release", "calls": [3]}, "call id must be"),
        ({"op": "no-such-op"}, "unknown operation 'no-such-op'"),
        ({"op": 7}, "unknown operation 7"),
        ({"op": "call", "name": "no-such-operation", "args": []}, "no operation"),
    ]
    for message, match in garbage:
        status, text = ask("srv-a", message)
        assert status == "error" and match in text, (message, text)
    assert RemoteExpert("srv-a", "lin")(t).shape == t.shape
