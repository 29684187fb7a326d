"""The report of ``make latest`` (tools/latest.sh): what a newer release of
transformers (and Ray) changes for this project, from pytest's JUnit XML of
the zoo and Ray tests run on the newest releases.

One row per MoE family or experts class that the zoo does not know
(tests/moe/zoo_helpers.py's ``KNOWN_FAMILIES`` / ``KNOWN_EXPERTS``):

* ``supported``: every case of it passed (bit-equal to its eager loop);
* ``refused by name``: moe_autograd raises NotImplementedError naming it;
* ``not built``: the zoo's tiny builder cannot make it (the reason);
* ``failing``: a case failed (the first line of the first failure).

Then every case of a known family or class that failed (a release changed
what the zoo supported: the bound in setup.cfg stays until it is fixed), and
the Ray tests' counts.

    python tools/zoo_report.py REPORT.xml
"""
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "moe"))
from zoo_helpers import KNOWN_EXPERTS, KNOWN_FAMILIES, NEW_PREFIX  # noqa: E402

_SUBJECT = re.compile(r"\[([^\]-]+)")  # the family or class: the id's first part


def _cases(path: str) -> List[Tuple[str, str, str, str]]:
    """(file, test id, outcome, first line of its message) of every case."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag != "skipped" else "skipped"
                message = (node.get("message") or node.text or "").strip().splitlines()
                message = message[0] if message else ""
                break
        cases.append((case.get("classname", ""), case.get("name", ""), outcome, message))
    return cases


def _row(outcomes: List[Tuple[str, str]]) -> str:
    failed = [m for o, m in outcomes if o == "failed"]
    if failed:
        return f"failing: {failed[0][:200]}"
    skipped = [m for o, m in outcomes if o == "skipped" and NEW_PREFIX in m]
    if any("refused by name" in m for m in skipped):
        return "refused by name: " + next(m for m in skipped if "refused by name" in m)[:200]
    if skipped:
        return f"not built: {skipped[0][:200]}"
    if all(o == "skipped" for o, _ in outcomes):
        return "not run"
    return "supported"


def main(path: str) -> int:
    subjects: Dict[str, List[Tuple[str, str]]] = defaultdict(list)
    known_failures: List[str] = []
    ray = defaultdict(int)
    for file, name, outcome, message in _cases(path):
        if "test_ray" in file:
            ray[outcome] += 1
            if outcome == "failed":
                known_failures.append(f"{file}::{name}: {message[:200]}")
            continue
        match = _SUBJECT.search(name)
        if match is None:
            if outcome == "failed":
                known_failures.append(f"{file}::{name}: {message[:200]}")
            continue
        subject = match.group(1)
        if subject in KNOWN_FAMILIES or subject in KNOWN_EXPERTS:
            if outcome == "failed":
                known_failures.append(f"{file}::{name}: {message[:200]}")
        else:
            subjects[subject].append((outcome, message))
    print(f"\nnew in this transformers ({len(subjects)} families and experts classes):")
    for subject in sorted(subjects):
        print(f"  {subject:<40} {_row(subjects[subject])}")
    print(f"\nknown cases failing ({len(known_failures)}):")
    for line in known_failures:
        print(f"  {line}")
    print(f"\nray tests: {dict(ray)}")
    return 1 if known_failures or any(_row(o).startswith("failing") for o in subjects.values()) \
        else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
