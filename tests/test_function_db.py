"""PyTorch's own corpus of custom Functions (``autograd_function_db``) through
the runtime, against sequential ``Function.apply`` / sequential calls (float64).

Every entry runs

* through :func:`map_with_parallel_backward`, its samples as the calls of ONE
  map (each entry has one sample per seed; several seeds make several calls),
* through :func:`parallel_apply`, the entry wrapped as a shared ``nn.Module``
  and as a bare callable,

and is compared with the same calls made one after the other: outputs (values,
dtype, ``requires_grad``, ``grad_fn is None``), input gradients (``None``
included) under ``torch.autograd.grad`` and ``.backward()`` for losses that
use every output, only some calls, or only some outputs, and full Jacobians
(``torch.autograd.functional.jacobian``) plus ``gradcheck``. Scenarios cover
separate inputs, inputs shared across calls, mixed ``requires_grad`` and no
gradients at all. Wherever the sequential calls raise, the runtime must raise
the same kind of error.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

pytest.importorskip("expecttest")  # torch.testing._internal imports it

from torch.testing._internal import autograd_function_db as db  # noqa: E402
from torch.testing._internal.autograd_function_db import autograd_function_db  # noqa: E402

from moe_autograd import map_with_parallel_backward, parallel_apply  # noqa: E402

DT = torch.float64
ENTRIES: Dict[str, Any] = {op.name: op for op in autograd_function_db}
NAMES = sorted(ENTRIES)
FunctionType = Type[torch.autograd.Function]
Args = Tuple[Any, ...]

# The entries whose ``op`` is a lambda around a Function: the Function, and
# what the lambda does to the arguments before ``apply``.
_LAMBDA_ENTRIES: Dict[str, Tuple[FunctionType, Callable[[Args], Args]]] = {
    "NumpyExpMarkDirtyAutogradFunction": (db.NumpyExp_, lambda a: (a[0].clone(), *a[1:])),
    "NumpyCubeNotComposableAutogradFunction": (db.NumpyCubeNotComposable, lambda a: a),
}



def function_of(name: str) -> Tuple[FunctionType, Callable[[Args], Args]]:
    """The ``autograd.Function`` behind an entry and the argument preparation
    its ``op`` applies before ``Function.apply``."""
    if name in _LAMBDA_ENTRIES:
        return _LAMBDA_ENTRIES[name]
    op = ENTRIES[name].op
    func = getattr(op, "__self__", None)
    assert isinstance(func, type) and issubclass(func, torch.autograd.Function), (
        f"{name}: unknown op {op!r}; add it to _LAMBDA_ENTRIES")
    return func, lambda a: a


def test_every_entry_is_known() -> None:
    assert len(NAMES) >= 14
    for name in NAMES:
        function_of(name)


# -- building the calls ---------------------------------------------------------------------

def sample_args(name: str, seed: int) -> Args:
    op = ENTRIES[name]
    torch.manual_seed(seed)
    sample = next(iter(op.sample_inputs_func(op, "cpu", DT, True)))
    assert not sample.kwargs, f"{name}: kwargs are not part of the corpus any more"
    return (sample.input, *sample.args)


def _is_float(t: Any) -> bool:
    return isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())


# Which floating tensors of each call require grad, per scenario; ``shared``
# scenarios reuse tensor objects across calls.
SCENARIOS = ["all", "mixed", "none", "shared", "partly_shared"]
NUM_CALLS = 4


def _masks(scenario: str, n_float: int) -> List[List[bool]]:
    if scenario == "none":
        return [[False] * n_float for _ in range(NUM_CALLS)]
    if scenario == "mixed":
        first_only = [k == 0 for k in range(n_float)]
        last_only = [k == n_float - 1 for k in range(n_float)] if n_float > 1 else [True]
        return [[True] * n_float, first_only, [False] * n_float, last_only]
    return [[True] * n_float for _ in range(NUM_CALLS)]


class Calls:
    """The arguments of NUM_CALLS calls of one entry, twice: one copy for the
    runtime and one for the sequential reference (same values, own leaves;
    a tensor shared between calls is shared in both copies)."""

    def __init__(self, name: str, scenario: str, seed: int = 0, num_calls: int = NUM_CALLS) -> None:
        raw = [sample_args(name, seed + 100 * i) for i in range(num_calls)]
        if scenario == "shared":
            raw = [raw[0]] * num_calls
        elif scenario == "partly_shared":
            raw = [raw[i % 2] for i in range(num_calls)]
        n_float = sum(_is_float(a) for a in raw[0])
        masks = _masks(scenario, n_float)[:num_calls]
        self.par: List[Args] = []
        self.seq: List[Args] = []
        memo: Dict[int, Tuple[Tensor, Tensor]] = {}
        for i, args in enumerate(raw):
            par_args, seq_args = [], []
            k = 0
            for a in args:
                if isinstance(a, Tensor):
                    if id(a) not in memo:
                        rg = _is_float(a) and masks[i][k]
                        memo[id(a)] = (a.detach().clone().requires_grad_(rg),
                                       a.detach().clone().requires_grad_(rg))
                    p, s = memo[id(a)]
                    par_args.append(p)
                    seq_args.append(s)
                    k += _is_float(a)
                else:
                    par_args.append(a)
                    seq_args.append(a)
            self.par.append(tuple(par_args))
            self.seq.append(tuple(seq_args))
        self.par_leaves = _distinct_leaves(self.par)
        self.seq_leaves = _distinct_leaves(self.seq)
        assert len(self.par_leaves) == len(self.seq_leaves)


def _distinct_leaves(calls: Sequence[Args]) -> List[Tensor]:
    seen: Dict[int, Tensor] = {}
    for args in calls:
        for a in args:
            if isinstance(a, Tensor) and a.requires_grad and id(a) not in seen:
                seen[id(a)] = a
    return list(seen.values())


# -- the three ways through the runtime -----------------------------------------------------

class Wrapped(nn.Module):
    """An entry's ``op`` as a module (shared by every call)."""

    def __init__(self, op: Callable[..., Any]) -> None:
        super().__init__()
        self.op = op

    def forward(self, *args: Any) -> Any:
        return self.op(*args)


PATHS = ["map", "module", "callable"]
Outputs = List[List[Any]]  # per call, its output leaves (tensors and others)


def run_parallel(path: str, name: str, calls: Sequence[Args]) -> Outputs:
    if path == "map":
        func, prepare = function_of(name)
        results = map_with_parallel_backward(func, *[prepare(a) for a in calls])
        return [list(r) for r in results]
    op = ENTRIES[name].op
    expert: Callable[..., Any] = Wrapped(op) if path == "module" else op
    results = parallel_apply([expert] * len(calls), list(calls))
    return [tree_flatten(r)[0] for r in results]


def run_sequential(path: str, name: str, calls: Sequence[Args]) -> Outputs:
    if path == "map":
        func, prepare = function_of(name)
        outs = []
        for args in calls:
            result = func.apply(*prepare(args))
            outs.append(list(result) if isinstance(result, tuple) else [result])
        return outs
    op = ENTRIES[name].op
    return [tree_flatten(op(*args))[0] for args in calls]


Outcome = Tuple[str, Any]  # ("ok", value) or ("error", exception)


def outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        return "ok", fn()
    except Exception as error:  # noqa: BLE001 - compared with the sequential outcome
        return "error", error


def same_outcome(got: Outcome, want: Outcome, what: str) -> bool:
    """Asserts both succeeded or both raised the same kind of error; True if
    both succeeded."""
    if want[0] == "error":
        assert got[0] == "error", (
            f"{what}: sequential raised {type(want[1]).__name__}: {want[1]}, "
            f"the runtime did not")
        assert isinstance(got[1], type(want[1])), (
            f"{what}: sequential raised {type(want[1]).__name__}: {want[1]}; "
            f"the runtime raised {type(got[1]).__name__}: {got[1]}")
        return False
    if got[0] == "error":
        raise AssertionError(f"{what}: the runtime raised where sequential calls do not") from got[1]
    return True


# -- comparisons ----------------------------------------------------------------------------

def assert_values_equal(got: Any, want: Any, what: str) -> None:
    if isinstance(want, Tensor):
        assert isinstance(got, Tensor), f"{what}: {type(got).__name__} instead of a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{what}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}")
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0,
                                   msg=lambda m: f"{what}: {m}")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and np.array_equal(got, want), what
    else:
        assert got == want, what


def assert_outputs_match(got: Outputs, want: Outputs) -> None:
    assert len(got) == len(want)
    for i, (g_call, w_call) in enumerate(zip(got, want)):
        assert len(g_call) == len(w_call), f"call {i}: {len(g_call)} vs {len(w_call)} outputs"
        for k, (g, w) in enumerate(zip(g_call, w_call)):
            what = f"call {i} output {k}"
            assert_values_equal(g, w, what)
            if isinstance(w, Tensor):
                assert g.requires_grad == w.requires_grad, (
                    f"{what}: requires_grad {g.requires_grad}, sequential {w.requires_grad}")
                assert (g.grad_fn is None) == (w.grad_fn is None), (
                    f"{what}: grad_fn {g.grad_fn}, sequential {w.grad_fn}")


def assert_grads_match(got: Sequence[Optional[Tensor]], want: Sequence[Optional[Tensor]],
                       what: str) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        if w is None or g is None:
            assert g is None and w is None, (
                f"{what}, leaf {k}: {'None' if g is None else 'a gradient'} where sequential "
                f"gives {'None' if w is None else 'a gradient'}")
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}, leaf {k}"
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14,
                                   msg=lambda m: f"{what}, leaf {k}: {m}")


def loss_of(outputs: Outputs, kind: str) -> Optional[Tensor]:
    """A weighted sum of the chosen differentiable outputs (weights fixed by
    position, so both sides use the same); None when nothing is chosen."""
    total: Optional[Tensor] = None
    for i, call in enumerate(outputs):
        if kind == "some_calls" and i % 2 == 1:
            continue
        for k, out in enumerate(call):
            if not (_is_float(out) and out.requires_grad):
                continue
            if kind == "first_outputs" and k != 0:
                continue
            if kind == "one_output" and (i, k) != (NUM_CALLS - 1, len(call) - 1):
                continue
            g = torch.Generator().manual_seed(1000 * i + k)
            w = torch.randn(out.shape, dtype=out.dtype, generator=g)
            term = (out * w).sum()
            total = term if total is None else total + term
    return total


def grads_by_engine(loss: Tensor, leaves: Sequence[Tensor]) -> List[Optional[Tensor]]:
    return list(torch.autograd.grad(loss, leaves, allow_unused=True, retain_graph=True))


# -- the tests ------------------------------------------------------------------------------

# Every path and scenario through the parallel node's own workers; the lanes
# mode (calls in order on a few workers) on a subset.
COMBOS = ([(path, scenario, "parallel") for path in PATHS for scenario in SCENARIOS]
          + [(path, scenario, "lanes") for path in ("map", "module")
             for scenario in ("all", "partly_shared")])
# Losses in this order: those that leave some leaves without gradient first,
# since ``.grad`` accumulates over them.
LOSS_ORDER = ["some_calls", "one_output", "first_outputs", "every_output"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,scenario,mode", COMBOS)
@pytest.mark.parametrize("name", NAMES)
def test_entry_matches_sequential(name: str, path: str, scenario: str, mode: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs and input gradients (None included) under torch.autograd.grad
    and .backward() for every loss kind, as sequential calls give them."""
    monkeypatch.setenv("MOE_AUTOGRAD_MODE", mode)
    calls = Calls(name, scenario)
    got = outcome(lambda: run_parallel(path, name, calls.par))
    want = outcome(lambda: run_sequential(path, name, calls.seq))
    if not same_outcome(got, want, f"{name} forward"):
        return
    assert_outputs_match(got[1], want[1])
    for loss_kind in LOSS_ORDER:
        got_loss, want_loss = loss_of(got[1], loss_kind), loss_of(want[1], loss_kind)
        assert (got_loss is None) == (want_loss is None)
        if want_loss is None or not calls.seq_leaves:
            continue
        what = f"{name}, loss {loss_kind}"
        got_g = outcome(lambda: grads_by_engine(got_loss, calls.par_leaves))
        want_g = outcome(lambda: grads_by_engine(want_loss, calls.seq_leaves))
        if same_outcome(got_g, want_g, f"{what}: torch.autograd.grad"):
            assert_grads_match(got_g[1], want_g[1], f"{what}: torch.autograd.grad")
        # .grad accumulated over the losses so far, by plain backward()
        got_b = outcome(lambda: got_loss.backward(retain_graph=True))
        want_b = outcome(lambda: want_loss.backward(retain_graph=True))
        if same_outcome(got_b, want_b, f"{what}: backward()"):
            assert_grads_match([t.grad for t in calls.par_leaves],
                               [t.grad for t in calls.seq_leaves], f"{what}: .grad")


def _jacobian_function(path: str, name: str, calls: Calls, use_par: bool
                       ) -> Callable[..., Tuple[Tensor, ...]]:
    """``f(*leaves)``: the calls with ``leaves`` in place of their leaves,
    returning every differentiable floating output of every call."""
    template = calls.par if use_par else calls.seq
    leaves = calls.par_leaves if use_par else calls.seq_leaves
    position = {id(t): n for n, t in enumerate(leaves)}
    run = run_parallel if use_par else run_sequential

    def f(*new_leaves: Tensor) -> Tuple[Tensor, ...]:
        args = [tuple(new_leaves[position[id(a)]] if isinstance(a, Tensor) and id(a) in position
                      else a for a in call) for call in template]
        outs = run(path, name, args)
        return tuple(o for call in outs for o in call if _is_float(o) and o.requires_grad)
    return f


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,scenario", [("map", "all"), ("map", "shared"), ("map", "mixed"),
                                           ("module", "all"), ("module", "shared")])
@pytest.mark.parametrize("name", NAMES)
def test_entry_jacobian_matches_sequential(name: str, path: str, scenario: str) -> None:
    """Full float64 Jacobians (every output of every call w.r.t. every leaf:
    the blocks between different calls must be exactly zero, as sequentially),
    and gradcheck passes through the runtime exactly when it passes
    sequentially."""
    calls = Calls(name, scenario, num_calls=3)
    f_par = _jacobian_function(path, name, calls, use_par=True)
    f_seq = _jacobian_function(path, name, calls, use_par=False)
    par_in = tuple(t.detach().clone() for t in calls.par_leaves)
    seq_in = tuple(t.detach().clone() for t in calls.seq_leaves)
    got = outcome(lambda: torch.autograd.functional.jacobian(f_par, par_in))
    want = outcome(lambda: torch.autograd.functional.jacobian(f_seq, seq_in))
    if not same_outcome(got, want, f"{name}: jacobian"):
        return
    j_got, j_want = got[1], want[1]
    # jacobian nests (outputs) x (inputs)
    flat_got, _ = tree_flatten(j_got)
    flat_want, _ = tree_flatten(j_want)
    assert len(flat_got) == len(flat_want)
    for n, (a, b) in enumerate(zip(flat_got, flat_want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14,
                                   msg=lambda m: f"{name}: Jacobian block {n}: {m}")

    gc_in_par = tuple(t.detach().clone().requires_grad_() for t in calls.par_leaves)
    gc_in_seq = tuple(t.detach().clone().requires_grad_() for t in calls.seq_leaves)
    seq_ok = outcome(lambda: torch.autograd.gradcheck(f_seq, gc_in_seq, raise_exception=False,
                                                                 fast_mode=True))
    par_ok = outcome(lambda: torch.autograd.gradcheck(f_par, gc_in_par, raise_exception=False,
                                                                 fast_mode=True))
    if same_outcome(par_ok, seq_ok, f"{name}: gradcheck"):
        assert par_ok[1] == seq_ok[1], (
            f"{name}: gradcheck {'passes' if par_ok[1] else 'fails'} through the runtime, "
            f"{'passes' if seq_ok[1] else 'fails'} sequentially")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", NAMES)
def test_outputs_without_grad_are_plain_tensors(name: str) -> None:
    """A map whose inputs need no gradient returns what sequential calls
    return: no grad_fn, requires_grad False, usable with ``.numpy()``."""
    calls = Calls(name, "mixed")
    func, prepare = function_of(name)
    results = map_with_parallel_backward(func, *[prepare(a) for a in calls.par])
    no_grad_call = results[2]  # the call of the "mixed" scenario with no grad at all
    want = func.apply(*prepare(calls.seq[2]))
    want = want if isinstance(want, tuple) else (want,)
    for k, (g, w) in enumerate(zip(no_grad_call, want)):
        if isinstance(w, Tensor):
            assert g.requires_grad == w.requires_grad is False, f"output {k}"
            assert g.grad_fn is None, f"output {k}: {g.grad_fn}"
            np.testing.assert_array_equal(g.numpy(), w.numpy())
