"""Triage for the oracle: replays cases, shrinks each failing one to its
smallest still-failing form, and groups the failures by what is left.

    .venv/bin/python tests/oracle/oracle_triage.py --seed 0 --case 17 -v   # one case, both records
    .venv/bin/python tests/oracle/oracle_triage.py --seed 0 --cases 1000   # groups of failures

A failure is a case whose two records differ (``oracle_harness.compare``;
the raise-is-the-contract table applies, the known-divergence table does
not). Shrinking tries, one at a time, to drop a call, a stage, a caller
pattern, or to make a dimension plain (float32, ``checkpoint=False``, a
tensor output...), and keeps a change while the case still fails the same
way (same kind of divergence at the same step).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import oracle_known  # noqa: E402
from moe_autograd import policy  # noqa: E402
from oracle_cases import Case, CallSpec, constructs, generate  # noqa: E402
from oracle_harness import Divergence, compare, run_case  # noqa: E402


KEEP_POLICY = False


def failure(case: Case) -> Optional[Divergence]:
    if not KEEP_POLICY:
        policy._reset()  # as tests/conftest.py does before every test
    loop, runtime = run_case(case)
    _, divergence = compare(loop, runtime, oracle_known.may_raise(case))
    return divergence


def signature(d: Divergence) -> Tuple[str, str]:
    step = d.key.split(".", 1)[-1]
    return d.kind, step


def _drop_call(case: Case, i: int) -> Optional[Case]:
    if case.n == 1 or any(c.share_with == i or c.same_input_as == i for c in case.calls):
        return None
    if case.raise_at is not None and case.raise_at[0] == i:
        return None

    def shift(j: Optional[int]) -> Optional[int]:
        return None if j is None else j - (j > i)
    calls = tuple(dataclasses.replace(c, share_with=shift(c.share_with),
                                      same_input_as=shift(c.same_input_as))
                  for k, c in enumerate(case.calls) if k != i)
    ck = case.checkpoint if isinstance(case.checkpoint, bool) else tuple(
        f for k, f in enumerate(case.checkpoint) if k != i)
    raise_at = None if case.raise_at is None else (shift(case.raise_at[0]), case.raise_at[1])
    return dataclasses.replace(case, calls=calls, checkpoint=ck, raise_at=raise_at,  # type: ignore[arg-type]
                               tied=case.tied and len(calls) > 1)


def _with_call(case: Case, i: int, **changes: object) -> Case:
    calls = list(case.calls)
    calls[i] = dataclasses.replace(calls[i], **changes)  # type: ignore[arg-type]
    # a shared module keeps the same stages and output as its original
    for k, c in enumerate(calls):
        if c.share_with == i:
            calls[k] = dataclasses.replace(c, stages=calls[i].stages, output=calls[i].output,
                                           extra=calls[i].extra)
    return dataclasses.replace(case, calls=tuple(calls))


def simplifications(case: Case) -> Iterator[Case]:
    for i in reversed(range(case.n)):
        dropped = _drop_call(case, i)
        if dropped is not None:
            yield dropped
    plain = dict(grad_mode="grad", frame="none", pre_autocast_use=False, tied=False,
                 retain_grad=False, grad_method="backward", second_backward=False,
                 optimizer="none", iterations=1, raise_at=None, dtype="float32",
                 checkpoint=False, post_ops=(), hooks=(),
                 # issue 46
                 between=(), forwards=1, caller_ctx=None, subclass=False)
    for key, value in plain.items():
        if getattr(case, key) != value:
            yield dataclasses.replace(case, **{key: value})  # type: ignore[arg-type]
    for key in ("post_ops", "hooks"):
        values = getattr(case, key)
        for v in values:
            yield dataclasses.replace(case, **{key: tuple(x for x in values if x != v)})  # type: ignore[arg-type]
    if case.mode != "parallel":
        yield dataclasses.replace(case, mode="parallel")
    if not isinstance(case.checkpoint, bool):
        yield dataclasses.replace(case, checkpoint=any(case.checkpoint))
    for i, c in enumerate(case.calls):
        if c.share_with is not None:
            continue
        for s in c.stages:
            if case.raise_at is not None and s.startswith("raise_"):
                continue
            yield _with_call(case, i, stages=tuple(x for x in c.stages if x != s))
        if c.output != "tensor":
            yield _with_call(case, i, output="tensor")
        if c.extra != "none" and "embedding" not in c.stages:
            yield _with_call(case, i, extra="none")
        if c.x_kind != "leaf_rg" and c.same_input_as is None:
            yield _with_call(case, i, x_kind="leaf_rg")
    for i, c in enumerate(case.calls):
        if c.share_with is not None:
            calls = list(case.calls)
            calls[i] = dataclasses.replace(c, share_with=None)
            yield dataclasses.replace(case, calls=tuple(calls))
        if c.same_input_as is not None:
            calls = list(case.calls)
            calls[i] = dataclasses.replace(c, same_input_as=None)
            yield dataclasses.replace(case, calls=tuple(calls))


def shrink(case: Case, d: Divergence, budget: int = 150) -> Tuple[Case, Divergence]:
    want = signature(d)
    tries = 0
    changed = True
    while changed and tries < budget:
        changed = False
        for candidate in simplifications(case):
            tries += 1
            try:
                got = failure(candidate)
            except Exception:  # noqa: BLE001 - a harness limit, not a finding
                got = None
            if got is not None and signature(got) == want:
                case, d, changed = candidate, got, True
                break
            if tries >= budget:
                break
    return case, d


_BASE = {"mode:parallel", "dtype:float32", "grad_mode:grad", "frame:none",
         "grad_method:backward", "optimizer:none", "checkpoint:none", "x:leaf_rg",
         "extra:none", "output:tensor"}


def essence(case: Case) -> str:
    return " + ".join(sorted(constructs(case) - _BASE)) or "(plain)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--case", type=str, default=None, help="K or K,K,...")
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true", help="print both records")
    parser.add_argument("--keep-policy", action="store_true",
                        help="let auto mode learn across cases (pytest resets it per case)")
    parser.add_argument("--unknown-only", action="store_true",
                        help="skip failures that a KNOWN_DIVERGENCES entry explains")
    args = parser.parse_args()
    global KEEP_POLICY
    KEEP_POLICY = args.keep_policy
    warnings.simplefilter("ignore")  # the loop's own warnings (checkpoint, ...)
    indices = ([int(k) for k in args.case.split(",")] if args.case
               else range(args.start, args.start + args.cases))
    groups: Dict[Tuple[str, Tuple[str, str]], List[Tuple[Case, Case, Divergence]]] = \
        collections.defaultdict(list)
    started = time.perf_counter()
    for k in indices:
        if k % 100 == 0:
            print(f"... case {k} ({time.perf_counter() - started:.0f} s)", flush=True)
        case = generate(args.seed, k)
        if args.verbose:
            if not KEEP_POLICY:
                policy._reset()
            loop, runtime = run_case(case)
            print(case.describe())
            print("--- loop\n" + loop.dump() + "\n--- runtime\n" + runtime.dump())
        d = failure(case)
        if d is None:
            continue
        if args.unknown_only and oracle_known.known_divergence(case, d) is not None:
            continue
        small, sd = (case, d) if args.no_shrink else shrink(case, d)
        groups[(essence(small), signature(sd))].append((case, small, sd))
        if args.case:
            print(f"case {k}: {d}\nshrunk to:\n{small.describe()}\n{sd}")
    total = sum(len(v) for v in groups.values())
    print(f"\n{total} failing of {len(list(indices))} cases "
          f"({time.perf_counter() - started:.0f} s), {len(groups)} groups")
    for (name, sig), items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        case, small, d = items[0]
        ks = ",".join(str(c.index) for c, _, _ in items[:12])
        print(f"\n== {len(items)} x [{name}] {sig[0]} at {sig[1]}  (cases {ks})")
        print("  " + small.describe().replace("\n", "\n  "))
        print("  " + str(d).replace("\n", "\n  ")[:900])


if __name__ == "__main__":
    main()
