"""Call-state integrity, parameter safety, bounded requests and timeouts
(issue 10, items 1-7), in the shared world. ``srv-b``'s process plays a
second client of ``srv-a`` (another session of the same job) through the
operations ``remote_experts`` registers there (``release_as_me``,
``backward_as_me``, ``flood``)."""
import math
import re
import time
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import Tensor, nn

import remote_experts as rx
from moe_autograd.moe import MixtureOfExperts
from moe_autograd.remote import RemoteCall, RemoteExpert, RemoteExpertError, call_operation
from moe_autograd.remote.client import _Call
from moe_autograd.remote.transport import RPC_MAX_TIMEOUT_S

pytestmark = pytest.mark.timeout(60)


def run(worker: str, name: str, *args: Any) -> Any:
    """The test operation ``name`` (``remote_experts``) on ``worker``."""
    return call_operation(worker, name, *args, timeout=30.0)


def call_of(out: Tensor) -> _Call:
    """The call record behind a RemoteExpert output (its autograd node's ctx)."""
    return out.grad_fn.call  # type: ignore[union-attr]


def local_copy(expert: RemoteExpert, module: nn.Module) -> nn.Module:
    module.load_state_dict(expert.remote_state_dict())
    return module


# -- item 1: a duplicate call id is an error, never a silent no-store ---------------
def test_duplicate_call_id_is_refused_and_the_first_call_keeps_its_graph(world) -> None:
    expert = RemoteExpert("srv-a", "sf_two")
    local = local_copy(expert, rx.TwoInTwoOut())
    x1, y1 = torch.randn(2, rx.WIDTH, requires_grad=True), torch.randn(2, rx.WIDTH, requires_grad=True)
    x2, y2 = torch.randn(2, rx.WIDTH, requires_grad=True), torch.randn(2, rx.WIDTH, requires_grad=True)
    first, second = expert.function_args(x1, y1), expert.function_args(x2, y2)
    second[0].call_id = first[0].call_id  # a colliding (or replayed) id
    a, b = RemoteCall.apply(*first)
    with pytest.raises(RemoteExpertError, match="forward of expert 'sf_two'.* is already held"):
        RemoteCall.apply(*second)
    (a.sum() + b.sum()).backward()  # the first call's own graph
    lx, ly = x1.detach().clone().requires_grad_(), y1.detach().clone().requires_grad_()
    la, lb = local(lx, ly)
    (la.sum() + lb.sum()).backward()
    torch.testing.assert_close((x1.grad, y1.grad), (lx.grad, ly.grad))


# -- item 3: ids are unguessable and owned by their client's session -----------------
def test_call_ids_are_random_and_other_sessions_cannot_use_them(world) -> None:
    expert = RemoteExpert("srv-a", "sf_lin")
    ids = [_Call(expert, 0).call_id for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    local = local_copy(expert, nn.Linear(rx.WIDTH, rx.WIDTH))
    x = torch.randn(2, rx.WIDTH, requires_grad=True)
    out = expert(x)
    call = call_of(out)
    refused = expert.remote_stats()["refused"]
    status, freed = run("srv-b", "release_as_me", "srv-a", [call.call_id])
    assert (status, freed) == ("ok", 0)
    status, text = run("srv-b", "backward_as_me", "srv-a", "sf_lin", call.call_id,
                       [torch.ones(2, rx.WIDTH)])
    assert status == "error" and "belongs to" in text, text
    assert expert.remote_stats()["refused"] == refused + 2
    out.sum().backward()  # the owner's backward still finds its state
    lx = x.detach().clone().requires_grad_()
    local(lx).sum().backward()
    torch.testing.assert_close(x.grad, lx.grad)


# -- item 2: a rejected backward leaves the state usable -----------------------------
def test_rejected_backwards_leave_the_state_for_the_real_one(world) -> None:
    expert = RemoteExpert("srv-a", "sf_lin")
    local = local_copy(expert, nn.Linear(rx.WIDTH, rx.WIDTH))
    expert.zero_grad()
    x = torch.randn(2, rx.WIDTH, requires_grad=True)
    out = expert(x)
    call = call_of(out)
    g = torch.randn(2, rx.WIDTH)
    other = RemoteExpert("srv-a", "sf_two")  # same server process, another expert
    bad: List[Tuple[RemoteExpert, Any, str]] = [
        (other, [g], "belongs to expert 'sf_lin', not 'sf_two'"),
        (expert, [torch.randn(3, rx.WIDTH)], "has shape [3, 8], but output 0 has shape [2, 8]"),
        (expert, [g.double()], "dtype torch.float64"),
        (expert, [g, g], "expected 1 output gradients"),
        (expert, ["g"], "not a tensor")]
    messages = []
    for sender, grads, match in bad:  # what a buggy client could send for this call
        with pytest.raises(RemoteExpertError) as info:
            sender._backward(call, None, grads)
        messages.append((str(info.value), match))
    out.backward(g)  # the real backward: the state is still there
    lx = x.detach().clone().requires_grad_()
    local(lx).backward(g)
    torch.testing.assert_close(x.grad, lx.grad)
    remote = expert.remote_grads()
    for name, param in local.named_parameters():
        torch.testing.assert_close(remote[name], param.grad)  # no rejected request touched them
    for text, match in messages:
        assert match in text, (match, text)


# -- item 4: one client's volume cannot evict another's states ------------------------
def test_a_flooding_client_evicts_only_its_own_states(world) -> None:
    expert = RemoteExpert("srv-a", "quota_lin")  # max_states=8 for the whole server
    before = expert.remote_stats()
    x = torch.randn(2, rx.WIDTH, requires_grad=True)
    out = expert(x)  # this client's pending state
    held = run("srv-b", "flood", "srv-a", "quota_lin", 50)  # 50 pending calls from srv-b
    out.sum().backward()  # still there
    assert x.grad is not None
    assert held["live"] == 8 and held["clients"] == 2, held
    assert held["evicted"] - before["evicted"] == 50 - 7, held


# -- item 5: no silent parameter damage ---------------------------------------------
def test_failed_load_state_dict_changes_nothing(world) -> None:
    expert = RemoteExpert("srv-b", "lin")
    before = expert.remote_state_dict()
    nan_weight = torch.full_like(before["weight"], math.nan)
    cases: List[Tuple[Any, str]] = [
        ({"weight": nan_weight, "bias": torch.zeros(3)}, "'bias' has shape [3]"),
        ({"weight": nan_weight}, "missing keys ['bias']"),
        ({"weight": nan_weight, "bias": before["bias"], "extra": before["bias"]},
         "unexpected keys ['extra']"),
        ({"weight": nan_weight, "bias": [0.0] * rx.WIDTH}, "not a tensor")]
    for state, match in cases:
        with pytest.raises(RemoteExpertError) as info:
            expert.load_remote_state_dict(state)
        torch.testing.assert_close(expert.remote_state_dict(), before)
        assert match in str(info.value) and "nothing was changed" in str(info.value)
        assert "'lin'" in str(info.value)
    new = {k: v + 1 for k, v in before.items()}
    expert.load_remote_state_dict(new)
    torch.testing.assert_close(expert.remote_state_dict(), new)
    expert.load_remote_state_dict(before)


def test_auto_step_skips_a_non_finite_step_and_reports_it(world) -> None:
    expert = RemoteExpert("srv-a", "skip_lin")  # auto_step SGD, non_finite_grads="skip"
    before, stats = expert.remote_state_dict(), expert.remote_stats()
    x = torch.randn(2, rx.WIDTH, requires_grad=True)
    out = expert(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out.backward(torch.full_like(out, math.nan))
    torch.testing.assert_close(expert.remote_state_dict(), before)  # untouched, finite
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [
        "remote expert 'skip_lin' on worker 'srv-a': optimizer step of expert 'skip_lin' "
        "skipped: non-finite gradients in weight, bias; its parameters are unchanged"]
    assert expert.skipped_steps == 1
    assert expert.remote_stats()["skipped_steps"] == stats["skipped_steps"] + 1
    assert all(g is None for g in expert.remote_grads().values())  # the NaNs did not linger
    expert(x).sum().backward()  # a finite backward steps again
    after = expert.remote_state_dict()
    assert not torch.equal(after["weight"], before["weight"])
    assert all(bool(torch.isfinite(v).all()) for v in after.values())


def test_raise_policy_refuses_a_non_finite_step(world) -> None:
    expert = RemoteExpert("srv-b", "raise_lin")  # stateful, auto_step, non_finite_grads="raise"
    before = expert.remote_state_dict()
    out = expert(torch.randn(2, rx.WIDTH))
    with pytest.raises(RemoteExpertError) as info:
        out.backward(torch.full_like(out, math.inf))
    torch.testing.assert_close(expert.remote_state_dict(), before)
    assert re.search("non-finite gradients.*non_finite_grads='raise'", str(info.value)), info.value
    expert(torch.randn(2, rx.WIDTH)).sum().backward()
    assert not torch.equal(expert.remote_state_dict()["weight"], before["weight"])


# -- item 6: bounded requests and state bytes -------------------------------------------
@pytest.mark.parametrize("grad", [False, True])
def test_expanded_input_is_measured_at_full_size_and_refused(world, grad: bool) -> None:
    expert = RemoteExpert("srv-a", "small_lin")  # max_request_bytes=1 MiB
    x = torch.zeros(1, rx.WIDTH).expand(2 ** 22, rx.WIDTH)  # 32 bytes sent, 128 MiB materialised
    stored = expert.remote_stats()["stored"]
    start = time.monotonic()
    with pytest.raises(RemoteExpertError, match=r"'small_lin'.*max_request_bytes=1048576") as info:
        expert(x.requires_grad_(grad) if grad else x)
    assert "134217728 bytes" in str(info.value) and "'srv-a'" in str(info.value)
    assert time.monotonic() - start < 2.0  # refused before running, not after materialising
    assert expert.remote_stats()["stored"] == stored
    assert expert(torch.randn(4, rx.WIDTH)).shape == (4, rx.WIDTH)


def test_state_bytes_are_capped(world) -> None:
    expert = RemoteExpert("srv-b", "small_lin")  # max_state_bytes=4 MiB
    outs: List[Tensor] = []
    for _ in range(12):  # 256 KiB input + 256 KiB output each
        outs.append(expert(torch.randn(8192, rx.WIDTH, requires_grad=True)))
        stats = expert.remote_stats()
        assert stats["bytes"] <= 4 << 20, stats
    assert stats["live"] == 8 and stats["bytes"] == 8 * (512 << 10), stats
    outs[-1].sum().backward()
    with pytest.raises(RemoteExpertError, match="evicted: the server's states hold at most "
                                                "max_state_bytes=4194304"):
        outs[0].sum().backward()


# -- item 7: timeouts --------------------------------------------------------------------
@pytest.mark.parametrize("bad, error", [(math.nan, ValueError), (0, ValueError), (-1.0, ValueError),
                                        ("5", TypeError), (True, TypeError)])
def test_bad_timeouts_are_refused_at_construction(bad: Any, error: type) -> None:
    for arg in ("forward_timeout", "backward_timeout"):
        with pytest.raises(error, match=f"{arg} of RemoteExpert 'e' must be None, math.inf"):
            RemoteExpert("w", "e", **{arg: bad})
    expert = RemoteExpert("w", "e")
    with pytest.raises(error, match="forward_timeout"):
        expert.forward_timeout = bad
    for arg in ("forward_timeout", "backward_timeout", "timeout_after_k_min"):
        with pytest.raises(error, match=f"{arg} must be None, math.inf"):
            MixtureOfExperts([nn.Linear(2, 2)], 2, k=1, **{arg: bad})


def test_infinite_and_huge_timeouts(world) -> None:
    expert = RemoteExpert("srv-a", "lin", forward_timeout=math.inf, backward_timeout=1e10)
    x = torch.randn(2, rx.WIDTH, requires_grad=True)
    expert(x).sum().backward()  # neither fails at once nor overflows
    assert x.grad is not None
    assert expert.forward_timeout is None and expert.backward_timeout == RPC_MAX_TIMEOUT_S
    experts = [RemoteExpert(w, "lin") for w in ("srv-a", "srv-b", "srv-a")]
    limits: List[Dict[str, Any]] = [
        {"forward_timeout": math.inf, "backward_timeout": math.inf},
        {"forward_timeout": 1e10, "backward_timeout": 1e10, "timeout_after_k_min": 1e12}]
    for kwargs in limits:
        moe = MixtureOfExperts(experts, rx.WIDTH, k=2, **kwargs)
        y, aux = moe(torch.randn(5, rx.WIDTH))
        (y.sum() + aux).backward()
        assert moe.gate.weight.grad is not None
