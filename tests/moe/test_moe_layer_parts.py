"""MixtureOfExperts' parts against references written out here, not against
another path of the layer (a comparison of two paths that share a helper
cannot see a bug in it): the shared expert and its gate, the grouped path's
activation and its no-token step, the stacked state-dict layout, and the
exact words of the layer's refusals."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_autograd.moe import MixtralExpert, MixtureOfExperts
from moe_autograd.moe import layer as layer_module

needs_grouped_mm = pytest.mark.skipif(not callable(getattr(torch, "_grouped_mm", None)),
                                      reason="this torch has no torch._grouped_mm")


def _mixtrals(n, d, hidden, act=F.silu, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [MixtralExpert(torch.randn(2 * hidden, d, generator=gen) / d ** 0.5,
                          torch.randn(d, hidden, generator=gen) / hidden ** 0.5, act)
            for _ in range(n)]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("grouped_mm", [False, pytest.param(True, marks=needs_grouped_mm)])
def test_shared_expert_adds_its_answer_gated_by_a_sigmoid(gated, grouped_mm):
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    gate = nn.Linear(8, 1) if gated else None
    experts = _mixtrals(3, 8, 4)
    layer = MixtureOfExperts(experts, 8, k=2, return_aux_loss=False, grouped_mm=grouped_mm,
                             shared_expert=shared, shared_expert_gate=gate)
    routed = MixtureOfExperts(experts, 8, k=2, return_aux_loss=False, grouped_mm=grouped_mm)
    routed.gate = layer.gate
    x = torch.randn(5, 8)
    expected = shared(x) * (torch.sigmoid(gate(x)) if gated else 1)
    torch.testing.assert_close(layer(x), routed(x) + expected)


@needs_grouped_mm
def test_grouped_path_applies_the_experts_activation():
    torch.manual_seed(0)
    experts = _mixtrals(3, 8, 4, act=torch.tanh)
    layer = MixtureOfExperts(experts, 8, k=1, return_aux_loss=False, grouped_mm=True)
    plain = MixtureOfExperts(experts, 8, k=1, return_aux_loss=False)
    plain.gate = layer.gate
    x = torch.randn(6, 8)
    torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)


@needs_grouped_mm
def test_grouped_path_without_tokens_answers_zeros_and_gives_the_gate_a_zero_gradient():
    layer = MixtureOfExperts(_mixtrals(3, 8, 4), 8, k=1, return_aux_loss=False, grouped_mm=True)
    x = torch.randn(0, 8, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 8) and y.requires_grad
    y.sum().backward()
    assert layer.gate.weight.grad is not None and not layer.gate.weight.grad.any()


def test_describe_shows_four_errors_and_counts_the_rest():
    errors = [(e, ValueError(f"bad {e}")) for e in range(6)]
    assert layer_module._describe(errors[:4]) == (
        "expert 0: ValueError: bad 0; expert 1: ValueError: bad 1; expert 2: ValueError: bad 2; "
        "expert 3: ValueError: bad 3")
    assert layer_module._describe(errors[:5]).endswith("expert 3: ValueError: bad 3 (and 1 more)")
    assert layer_module._describe(errors).endswith(" (and 2 more)")
    assert layer_module._describe([]) == ""


class _Holder(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(n))


def test_stacked_expert_weights_load_one_slice_per_expert():
    stacked = torch.arange(12.0).reshape(3, 2, 2)
    state = {"m.experts.weight": stacked,
             "m.experts.0.bias": torch.ones(2),      # already per expert
             "m.experts.7": torch.ones(3),           # an expert's index, not a name
             "m.experts.scale": torch.tensor(2.0),   # 0-dim
             "m.experts.other": torch.ones(4, 2),    # not one row per expert
             "m.experts.flag": 3,                    # not a tensor
             "m.experts.sub.weight": torch.ones(3, 2),  # a submodule's, not stacked
             "m.gate.weight": torch.ones(3, 2)}
    layer_module._load_stacked_experts(_Holder(3), state, "m.", None, True, [], [], [])
    assert sorted(state) == sorted(["m.experts.0.weight", "m.experts.1.weight",
                                    "m.experts.2.weight", "m.experts.0.bias", "m.experts.7",
                                    "m.experts.scale", "m.experts.other", "m.experts.flag",
                                    "m.experts.sub.weight",
                                    "m.gate.weight"])
    for e in range(3):
        assert torch.equal(state[f"m.experts.{e}.weight"], stacked[e])


@pytest.mark.parametrize("option, value, why", [
    ("checkpoint", True, "there are no per-expert calls to recompute"),
    ("forward_timeout", 1.0, "one grouped call cannot miss a deadline per expert"),
    ("timeout_after_k_min", 1.0, "one grouped call cannot miss a deadline per expert"),
    ("backward_timeout", 1.0, "one grouped backward cannot miss a deadline per expert"),
    ("detect_anomalies", True, "non-finite answers cannot be masked per expert"),
    ("allow_zero_outputs", True,
     "no expert can fail alone, so no token is left without answers"),
    ("mode", "inline", "there is one call, not one per expert, to schedule"),
])
def test_grouped_refuses_per_expert_options_in_words(option, value, why):
    with pytest.raises(ValueError) as info:
        MixtureOfExperts(_mixtrals(2, 8, 4), 8, k=1, grouped_mm=True, **{option: value})
    assert str(info.value) == (f"MixtureOfExperts(grouped_mm=True) does not take "
                               f"{option}={value!r}: {why}")


class _NoGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("no gradient today")


class _BrokenBackward(nn.Linear):
    def forward(self, x):
        return _NoGradient.apply(super().forward(x))


def test_backward_quorum_counts_every_surviving_expert_of_a_token():
    torch.manual_seed(0)
    layer = MixtureOfExperts([nn.Linear(4, 4) for _ in range(3)], 4, k=3, backward_k_min=2,
                             return_aux_loss=False)
    layer(torch.randn(5, 4)).sum().backward()  # three survive per token, two are needed
    broken = MixtureOfExperts([nn.Linear(4, 4), nn.Linear(4, 4), _BrokenBackward(4, 4)], 4, k=3,
                              backward_k_min=3, return_aux_loss=False)
    with pytest.raises(layer_module.NotEnoughExperts) as info:
        broken(torch.randn(5, 4)).sum().backward()
    assert str(info.value) == (
        "MixtureOfExperts backward: 5 tokens kept fewer than backward_k_min=3 expert backwards; "
        "expert 2: RuntimeError: no gradient today")
    assert broken.stats()[2]["backward_failures"] == 1


# -- construction, the gate, the experts' answers: the refusals' words ---------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(experts=[]), "MixtureOfExperts needs at least one expert"),
    (dict(k=4), "k must be in [1, 3], got 4"),
    (dict(k=2, k_min=3), "k_min must be in [0, k=2], got 3"),
    (dict(k=2, backward_k_min=3), "backward_k_min must be in [0, k=2], got 3"),
])
def test_construction_refuses_in_words(kwargs, message):
    options = dict(experts=[nn.Linear(4, 4) for _ in range(3)], in_features=4)
    options.update(kwargs)
    with pytest.raises(ValueError) as info:
        MixtureOfExperts(**options)
    assert str(info.value) == message


@pytest.mark.parametrize("name", ["forward_timeout", "timeout_after_k_min", "backward_timeout"])
def test_a_bad_deadline_is_refused_by_its_name(name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        MixtureOfExperts([nn.Linear(4, 4)], 4, k=1, **{name: -1.0})


def test_a_bad_mode_is_refused_at_construction():
    with pytest.raises(ValueError, match="bogus"):
        MixtureOfExperts([nn.Linear(4, 4)], 4, k=1, mode="bogus")


@pytest.mark.parametrize("deadline", ["forward_timeout", "timeout_after_k_min", "backward_timeout"])
def test_any_deadline_runs_the_calls_one_worker_each(deadline):
    layer = MixtureOfExperts([nn.Linear(4, 4) for _ in range(3)], 4, k=2, **{deadline: 30.0})
    decision, lanes = layer._decide(list(layer.experts))
    assert (decision.mode, decision.lanes, decision.reason, lanes) == ("parallel", 3, "deadlines",
                                                                      None)


@pytest.mark.parametrize("mode, lanes", [("inline", 1), ("parallel", None)])
def test_a_forced_mode_without_deadlines(mode, lanes):
    layer = MixtureOfExperts([nn.Linear(4, 4) for _ in range(3)], 4, k=2, mode=mode)
    decision, got = layer._decide(list(layer.experts))
    assert (decision.mode, decision.reason, got) == (mode, "forced", lanes)


class _Quantized(nn.Module):
    """A gate whose weight is not floating point (a quantized router)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.int8))

    def forward(self, x):
        return x @ self.weight.to(x.dtype).t()


class _NoWeight(nn.Module):
    def __init__(self, out) -> None:
        super().__init__()
        self.out = out

    def forward(self, x):
        return self.out(x) if callable(self.out) else self.out


def test_the_gate_runs_in_its_own_floating_dtype_only():
    x = torch.randn(5, 4) * 0.3
    layer = MixtureOfExperts([nn.Linear(4, 4) for _ in range(2)], 4, k=1, return_aux_loss=False,
                             router_dtype=None)
    layer.gate = _Quantized()
    assert torch.equal(layer._router_logits(x), x[:, :2])  # not rounded to int8
    layer.gate = nn.Linear(4, 2).double()
    assert layer._router_logits(x).dtype == torch.float64
    layer.gate = _NoWeight(lambda h: h[:, :2])  # no weight attribute at all
    assert layer._router_logits(x).dtype == torch.float32


@pytest.mark.parametrize("out, got", [(torch.zeros(5, 3), "[5, 3]"), ("logits", "str")])
def test_a_gate_of_the_wrong_shape_is_refused_in_words(out, got):
    layer = MixtureOfExperts([nn.Linear(4, 4) for _ in range(2)], 4, k=1)
    layer.gate = _NoWeight(out)
    with pytest.raises(ValueError) as info:
        layer._router_logits(torch.randn(5, 4))
    assert str(info.value) == f"MixtureOfExperts: the gate must return [5, 2] logits, got {got}"


class _Answers(nn.Module):
    def __init__(self, answer) -> None:
        super().__init__()
        self.answer = answer

    def forward(self, x):
        return self.answer(x)


@pytest.mark.parametrize("answer, shapes", [
    (lambda x: (x, x), "[[3, 4], [3, 4]]"),
    (lambda x: x.sum(), "[[]]"),
    (lambda x: x[:1], "[[1, 4]]"),
])
def test_an_answer_of_the_wrong_shape_is_masked_and_named(answer, shapes):
    experts = [nn.Linear(4, 4), _Answers(answer)]
    layer = MixtureOfExperts(experts, 4, k=2, k_min=1, return_aux_loss=False)
    layer(torch.randn(3, 4))
    assert layer.stats()[1]["last_error"] == (
        "forward call 1 masked: ValueError: MixtureOfExperts: expert 1 must return one tensor "
        f"with 3 rows, got shapes {shapes}")
    assert layer.stats()[0]["last_error"] is None


# -- how the logs and stats() name an expert and why it was masked ---------------------------

class _Long(nn.Module):
    def __init__(self, n) -> None:
        super().__init__()
        self.n = n

    def extra_repr(self) -> str:
        return "x" * self.n


def test_expert_names_show_a_short_extra_repr():
    layer = MixtureOfExperts([nn.Linear(4, 4), _Answers(None), _Long(120), _Long(121)], 4, k=1)
    assert layer._expert_name(0) == "expert 0 (Linear(in_features=4, out_features=4, bias=True))"
    assert layer._expert_name(1) == "expert 1 (_Answers)"
    assert layer._expert_name(2) == f"expert 2 (_Long({'x' * 120}))"
    assert layer._expert_name(3) == "expert 3 (_Long)"


def test_why_a_forward_call_was_masked():
    from moe_autograd.executor import CallCancelled
    layer = MixtureOfExperts([nn.Linear(4, 4)], 4, k=1, forward_timeout=2.5,
                             timeout_after_k_min=0.5)
    limits = "forward_timeout=2.5 s, timeout_after_k_min=0.5 s"
    assert layer._why_masked(None) == f"no answer when the layer stopped waiting ({limits})"
    assert layer._why_masked(CallCancelled("x")) == (
        f"not started when the layer stopped waiting ({limits})")
    assert layer._why_masked(ValueError("bad")) == "ValueError: bad"
    only = MixtureOfExperts([nn.Linear(4, 4)], 4, k=1, timeout_after_k_min=1)
    assert only._why_masked(None) == (
        "no answer when the layer stopped waiting (timeout_after_k_min=1 s)")


def test_the_log_names_the_expert_of_a_failed_backward_and_of_a_masked_call(caplog):
    broken = MixtureOfExperts([nn.Linear(4, 4), _BrokenBackward(4, 4), _Answers(lambda x: (x, x))],
                              4, k=3, k_min=1, backward_k_min=1, return_aux_loss=False)
    with caplog.at_level("WARNING", logger="moe_autograd.moe.stats"):
        broken(torch.randn(5, 4)).sum().backward()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith(
        "MixtureOfExperts: expert 1 (_BrokenBackward(in_features=4, out_features=4, bias=True)): "
        "backward call 1 treated as a constant: RuntimeError: no gradient today")
        for line in lines), lines
    assert any(line.startswith("MixtureOfExperts: expert 2 (_Answers): forward call 1 masked: "
                               "ValueError: ") for line in lines), lines
    assert broken.stats()[1]["last_error"] == (
        "backward call 1 treated as a constant: RuntimeError: no gradient today")


def test_the_default_top_k_is_two():
    assert MixtureOfExperts([nn.Linear(4, 4) for _ in range(4)], 4).k == 2


def test_record_forward_books_latency_in_milliseconds_and_what_each_call_missed():
    from types import SimpleNamespace

    from moe_autograd.executor import CallCancelled
    layer = MixtureOfExperts([nn.Linear(4, 4) for _ in range(4)], 4, k=1, forward_timeout=2.0)
    group = SimpleNamespace(errors=[None, None, CallCancelled("x"), FloatingPointError("nan")],
                            finished_at=[10.25, None, 10.5, 10.75])
    layer._record_forward([0, 1, 2, 3], group, [True, False, False, False], started=10.0)
    stats = layer.stats()
    assert stats[0]["p50_ms"] == 250.0 and stats[0]["last_error"] is None
    assert stats[3]["p50_ms"] == 750.0 and stats[2]["p50_ms"] is None  # cancelled: no latency
    assert [(s["calls"], s["timeouts"], s["failures"], s["non_finite"]) for s in stats] == [
        (1, 0, 0, 0), (1, 1, 0, 0), (1, 1, 0, 0), (1, 0, 1, 1)]  # cancelled: late
    assert stats[1]["last_error"] == (
        "forward call 1 masked: no answer when the layer stopped waiting (forward_timeout=2 s)")


def test_without_deadlines_the_policy_chooses_for_this_site_and_these_experts(monkeypatch):
    from moe_autograd.policy import Decision, site_of
    seen = []

    def choose(site, n, mode, experts=None):
        seen.append((site, n, mode, experts))
        return Decision("lanes", 2, "test")

    monkeypatch.setattr(layer_module, "choose", choose)
    layer = MixtureOfExperts([nn.Linear(4, 4) for _ in range(3)], 4, k=2)
    modules = list(layer.experts)
    decision, lanes = layer._decide(modules)
    assert seen == [(site_of(modules), 3, None, modules)]
    assert decision.reason == "test" and lanes == 2


def test_a_non_finite_answer_is_masked_when_anomalies_are_detected():
    experts = [nn.Linear(4, 4), _Answers(lambda x: x * float("nan"))]
    layer = MixtureOfExperts(experts, 4, k=2, k_min=1, detect_anomalies=True,
                             return_aux_loss=False)
    assert bool(torch.isfinite(layer(torch.randn(3, 4))).all())
    assert layer.stats()[1]["last_error"] == (
        "forward call 1 masked: FloatingPointError: MixtureOfExperts: expert 1 returned "
        "non-finite values")
