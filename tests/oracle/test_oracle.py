"""The differential oracle: each case runs through the runtime
(``parallel_apply``) and through the plain loop, and everything observable
must be equal bit for bit (see ``oracle_harness.py``), or the runtime must
raise a clear error naming the call where ``oracle_known.RAISES_IS_CONTRACT``
allows it.

The default run draws ``--fuzz-cases`` (1000) cases of ``--fuzz-seed`` (0);
``make fuzz`` runs many more with a fresh seed. A failure prints the case and
the command that replays it::

    pytest tests/oracle --fuzz-seed=S --fuzz-case=K
    python tests/oracle/oracle_triage.py --seed S --case K -v   # both records, shrunk

A case that diverges the way a ``oracle_known.KNOWN_DIVERGENCES`` entry says
is xfailed; each entry's sentinel test is ``xfail(strict=True)`` and fails
once neither a case of the sample nor one of the entry's witness cases shows
it any more (delete the entry then).
"""
import warnings
from typing import Dict, List, Optional, Tuple

import pytest

from oracle_cases import Case, cases, generate
from oracle_harness import Divergence, compare, run_case
from oracle_known import KNOWN_DIVERGENCES, Known, known_divergence, may_raise
from oracle_options import fuzz_cases, fuzz_only, fuzz_seed

#: (seed, case index) -> the case's divergence (None: equal), for the sentinels.
_RESULTS: Dict[Tuple[int, int], Optional[Divergence]] = {}


def _sample(config: pytest.Config) -> List[Case]:
    return cases(fuzz_seed(config), fuzz_cases(config), fuzz_only(config))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        seed = fuzz_seed(metafunc.config)
        metafunc.parametrize("case", [pytest.param(c, id=f"s{seed}-k{c.index}", marks=_marks(c))
                                      for c in _sample(metafunc.config)])
    if "known" in metafunc.fixturenames:
        metafunc.parametrize("known", [pytest.param(k, id=k.name, marks=pytest.mark.xfail(
            strict=True, raises=AssertionError,
            reason=f"{k.name}: {k.reason}. If this XPASSes, no case of the sample shows it "
                   "any more: delete the entry in tests/oracle/oracle_known.py"))
            for k in KNOWN_DIVERGENCES])


def _marks(case: Case) -> List[pytest.MarkDecorator]:
    """A case with an inductor-compiled stage compiles C++ kernels on both
    sides: up to a minute each on a loaded 2-core machine (torch 2.15)."""
    if any("compiled_inductor" in c.stages for c in case.calls):
        return [pytest.mark.timeout(300)]
    return [pytest.mark.timeout(60)]


def replay_command(case: Case) -> str:
    return (f"pytest tests/oracle --fuzz-seed={case.seed} --fuzz-case={case.index}   "
            f"# or: python tests/oracle/oracle_triage.py --seed {case.seed} --case {case.index} -v")


def _divergence(case: Case) -> Optional[Divergence]:
    key = (case.seed, case.index)
    if key not in _RESULTS:
        _CASES.append(case)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the loop's own warnings (checkpoint, ...)
            loop, runtime = run_case(case)
        _RESULTS[key] = compare(loop, runtime, may_raise(case))[1]
    return _RESULTS[key]


def test_runtime_equals_loop(case: Case) -> None:  # timeout: _marks
    divergence = _divergence(case)
    if divergence is None:
        return
    known = known_divergence(case, divergence)
    if known is not None:
        pytest.xfail(f"known divergence {known.name}: {known.reason}")
    raise AssertionError(f"runtime diverges from the loop: {divergence}\n{case.describe()}\n"
                         f"replay: {replay_command(case)}")


def summary() -> List[str]:
    """Lines for the terminal summary: what the cases run so far came to."""
    if not _RESULTS:
        return []
    counts: Dict[str, int] = {}
    equal = unknown = 0
    by_index = {(c.seed, c.index): c for c in _CASES}
    for key, divergence in _RESULTS.items():
        case = by_index.get(key) or generate(*key)  # a sentinel's witness case
        if divergence is None:
            equal += 1
            continue
        known = known_divergence(case, divergence) if case is not None else None
        if known is None:
            unknown += 1
        else:
            counts[known.name] = counts.get(known.name, 0) + 1
    seeds = sorted({s for s, _ in _RESULTS})
    lines = [f"oracle: {len(_RESULTS)} cases run (sample and the sentinels' witness cases; "
             f"seeds {','.join(map(str, seeds))}): {equal} equal "
             f"(or a clear error where the contract allows it), {unknown} unexplained "
             f"divergences, {sum(counts.values())} known divergences"]
    lines += [f"    {n:5d}  {name}" for name, n in sorted(counts.items())]
    return lines


_CASES: List[Case] = []


@pytest.mark.timeout(600)
def test_known_divergence_still_present(known: Known, request: pytest.FixtureRequest) -> None:
    """Fails (xfail strict) while a case of the sample, or one of the entry's
    witness cases, still shows ``known``."""
    if fuzz_only(request.config):
        pytest.skip("the sentinels need the whole sample, not --fuzz-case")
    candidates = [generate(seed, index) for seed, index in known.witnesses]
    candidates += [c for c in _sample(request.config) if known.applies(c)]
    showing = [(c.seed, c.index) for c in candidates
               if (d := _divergence(c)) is not None and known.matches(c, d)]
    if not showing and known.sometimes:
        pytest.xfail(f"{known.name} did not show in this run (it shows in some runs only)")
    assert not showing, f"{known.name} still shows in {len(showing)} cases: {showing[:20]}"
