"""@skippable layers: plain calls, Sequentials, namespaces and verify_skippables."""
from typing import Any, Generator

import pytest
import torch
from torch import Tensor, nn

from moe_autograd.microbatch import Batch
from moe_autograd.skip import Namespace, Skippable, pop, skippable, stash, verify_skippables
from moe_autograd.skip.tracker import SkipTracker, current_skip_tracker, use_skip_tracker


@skippable(stash=["skip"])
class StashLinear(nn.Module):
    """Stashes its input, returns a linear map of it."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("skip", x)
        return self.linear(x)


@skippable(pop=["skip"])
class PopAdd(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return x + skip


@skippable(pop=["skip"])
class PopMul(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return x * skip


@skippable(stash=["a"])
class StashA(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("a", x)
        return x


@skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        a = yield pop("a")
        return x + a


@pytest.fixture
def tracker() -> Generator[SkipTracker, None, None]:
    tracker = SkipTracker()
    with use_skip_tracker(tracker):
        yield tracker


def test_decorated_class_keeps_identity() -> None:
    layer = StashLinear(3)
    assert isinstance(layer, Skippable)
    assert isinstance(layer.module.linear, nn.Linear)
    assert StashLinear.__name__ == "StashLinear"
    assert StashLinear.__doc__ == "Stashes its input, returns a linear map of it."
    assert StashLinear.stashable_names == frozenset({"skip"})
    assert StashLinear.poppable_names == frozenset()
    assert "@skippable(" in repr(layer)


def test_sequential_grads_equal_plain_computation(tracker: SkipTracker) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(StashLinear(4), nn.ReLU(), nn.Linear(4, 4), PopMul())
    x = torch.randn(3, 4, requires_grad=True)
    model(x).pow(2).sum().backward()
    assert tracker.tensors == {}

    lin1 = model[0].module.linear
    lin2 = model[2]
    x2 = x.detach().clone().requires_grad_()
    expected = (lin2(torch.relu(lin1(x2))) * x2).pow(2).sum()
    grads = torch.autograd.grad(expected, [x2, lin1.weight, lin1.bias, lin2.weight, lin2.bias])

    actual = [x.grad, lin1.weight.grad, lin1.bias.grad, lin2.weight.grad, lin2.bias.grad]
    for a, e in zip(actual, grads):
        torch.testing.assert_close(a, e)


def test_plain_calls_use_current_tracker() -> None:
    torch.manual_seed(0)
    stasher, popper = StashLinear(2), PopAdd()
    x = torch.randn(2, 2)
    y = stasher(x)
    assert current_skip_tracker().tensors[(None, "skip")] is x
    z = popper(y)
    torch.testing.assert_close(z, stasher.module.linear(x) + x)
    assert current_skip_tracker().tensors == {}


def test_tuple_input_and_output(tracker: SkipTracker) -> None:
    @skippable(stash=["second"])
    class StashSecond(nn.Module):
        def forward(self, pair: Any) -> Generator[Any, Any, Any]:
            a, b = pair
            yield stash("second", b)
            return (a * 2, b)

    @skippable(pop=["second"])
    class PopSecond(nn.Module):
        def forward(self, pair: Any) -> Generator[Any, Any, Any]:
            second = yield pop("second")
            return pair[0] + second

    a, b = torch.ones(2), torch.full((2,), 3.0)
    out = nn.Sequential(StashSecond(), PopSecond())((a, b))
    torch.testing.assert_close(out, torch.full((2,), 5.0))
    assert tracker.tensors == {}


def test_nested_pairs_isolated_by_namespace(tracker: SkipTracker) -> None:
    outer, inner = Namespace(), Namespace()
    model = nn.Sequential(
        StashA().isolate(outer),   # stashes x
        nn.Identity(),
        StashA().isolate(inner),   # stashes x (same values, different key)
        PopA().isolate(inner),     # 2x
        nn.Linear(2, 2, bias=False),
        PopA().isolate(outer),     # W(2x) + x
    )
    verify_skippables(model)
    x = torch.randn(3, 2, requires_grad=True)
    out = model(x)
    torch.testing.assert_close(out, model[4](2 * x) + x)
    assert tracker.tensors == {}
    assert model[0].namespaced("a") == (outer, "a")
    assert model[2].namespaced("a") == (inner, "a")


def test_nested_pairs_collide_without_namespace(tracker: SkipTracker) -> None:
    model = nn.Sequential(StashA(), StashA(), PopA(), PopA())
    with pytest.raises(TypeError, match="stashes 'a' again"):
        verify_skippables(model)
    with pytest.raises(RuntimeError, match="has not been stashed"):
        model(torch.zeros(1))


def test_isolate_only_and_unknown_name() -> None:
    ns = Namespace()
    layer = StashA().isolate(ns, only=["a"])
    assert layer.namespaced("a") == (ns, "a")
    with pytest.raises(ValueError, match="no skip named"):
        StashA().isolate(ns, only=["b"])


def test_namespace_equality_and_default() -> None:
    a, b = Namespace(), Namespace()
    assert a == a and a != b
    assert isinstance(None, Namespace)
    assert a != None  # noqa: E711
    assert {a: 1}[a] == 1


def test_runtime_errors(tracker: SkipTracker) -> None:
    @skippable(stash=["x"])
    class ForgetsToStash(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x

    @skippable(stash=["x"])
    class StashesUndeclared(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield stash("y", x)
            return x

    @skippable(pop=["x"])
    class PopsNothingStashed(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            x = yield pop("x")
            return x

    @skippable(pop=["x"])
    class PopsTwice(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield pop("x")
            yield pop("x")
            return x

    @skippable()
    class YieldsJunk(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield 42
            return x

    x = torch.zeros(1)
    with pytest.raises(RuntimeError, match="must stash 'x' but did not"):
        ForgetsToStash()(x)
    with pytest.raises(RuntimeError, match="did not declare"):
        StashesUndeclared()(x)
    with pytest.raises(RuntimeError, match="pops 'x' but it has not been stashed"):
        PopsNothingStashed()(x)
    tracker.save(Batch(x), None, "x", x)
    with pytest.raises(RuntimeError, match="popped 'x' twice"):
        PopsTwice()(x)
    with pytest.raises(TypeError, match="not a command from @skippable"):
        YieldsJunk()(x)


def test_must_pop_declared(tracker: SkipTracker) -> None:
    @skippable(pop=["skip"])
    class NeverPops(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x

    tracker.save(Batch(torch.zeros(1)), None, "skip", torch.ones(1))
    with pytest.raises(RuntimeError, match="must pop 'skip' but did not"):
        NeverPops()(torch.zeros(1))


def test_stash_none_round_trip(tracker: SkipTracker) -> None:
    @skippable(stash=["maybe"])
    class StashNone(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield stash("maybe", None)
            return x

    @skippable(pop=["maybe"])
    class PopNone(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            maybe = yield pop("maybe")
            assert maybe is None
            return x

    nn.Sequential(StashNone(), PopNone())(torch.zeros(1))
    assert tracker.tensors == {}


# verify_skippables -----------------------------------------------------------


def _verify_message(model: nn.Sequential) -> str:
    with pytest.raises(TypeError) as info:
        verify_skippables(model)
    return str(info.value)


def test_verify_ok_ignores_plain_layers() -> None:
    verify_skippables(nn.Sequential(nn.Identity(), StashLinear(), nn.ReLU(), PopAdd()))
    verify_skippables(nn.Sequential(nn.Identity()))


def test_verify_stashed_never_popped() -> None:
    msg = _verify_message(nn.Sequential(nn.Identity(), StashLinear()))
    assert "layer '1' stashes 'skip' but no later layer pops it" in msg


def test_verify_popped_never_stashed() -> None:
    msg = _verify_message(nn.Sequential(PopAdd(), StashLinear()))
    assert "layer '0' pops 'skip' but no earlier layer stashes it" in msg
    # The stash after it is then unmatched as well.
    assert "layer '1' stashes 'skip' but no later layer pops it" in msg


def test_verify_duplicates() -> None:
    msg = _verify_message(nn.Sequential(StashLinear(), StashLinear(), PopAdd()))
    assert "layer '1' stashes 'skip' again (already stashed by layer '0')" in msg
    msg = _verify_message(nn.Sequential(StashLinear(), PopAdd(), PopMul()))
    assert "layer '2' pops 'skip' again (already popped by layer '1')" in msg


def test_verify_both_stash_and_pop_in_one_layer() -> None:
    @skippable(stash=["skip"], pop=["skip"])
    class Both(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            skip = yield pop("skip")
            yield stash("skip", skip)
            return x

    msg = _verify_message(nn.Sequential(StashLinear(), Both(), PopAdd()))
    assert "layer '1' declared 'skip' both as stashable and as poppable" in msg


def test_verify_lists_every_mismatch() -> None:
    model = nn.Sequential()
    model.add_module("head", PopA())
    model.add_module("body", StashLinear())
    model.add_module("tail", StashA())
    msg = _verify_message(model)
    assert msg.startswith("one or more pairs of stash and pop do not match")
    assert "layer 'head' pops 'a' but no earlier layer stashes it" in msg
    assert "layer 'body' stashes 'skip' but no later layer pops it" in msg
    assert "layer 'tail' stashes 'a' but no later layer pops it" in msg
    assert msg.count("\n* ") == 3


def test_verify_respects_namespaces() -> None:
    ns = Namespace()
    with pytest.raises(TypeError, match="layer '1' pops 'skip' but no earlier layer stashes it"):
        verify_skippables(nn.Sequential(StashLinear().isolate(ns), PopAdd()))
    verify_skippables(nn.Sequential(StashLinear().isolate(ns), PopAdd().isolate(ns)))
