#!/usr/bin/env bash
# `make latest`: the transformers zoo and the Ray tests on the newest releases
# of the packages that setup.cfg's `test` extra bounds above (cryptography, transformers,
# accelerate, ray, and the test tools), in a venv of its own, so that a new
# release shows up in this report rather than in a red `make test`.
#
#   tools/latest.sh DIR      build or upgrade the venv DIR, run, report
#
# The venv holds torch==2.13.0 (the pin of `make test`), the package's
# install_requires and the newest of everything else; the package itself is
# not installed (pytest runs from the repository root, which is on sys.path).
# The report (tools/zoo_report.py) prints a row per family or experts class
# that the zoo does not know yet: supported, refused by name, not built, or
# failing with its reason; and every known case that fails. Exit status:
# pytest's (non-zero when a case fails).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
dir=${1:?usage: tools/latest.sh DIR}
mkdir -p "$(dirname "$dir")"
test -x "$dir/bin/python" || "$PYTHON" -m venv "$dir"
pip=("$dir/bin/python" -m pip install --quiet --no-input --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" --upgrade numpy tqdm 'msgpack>=1.0' cryptography transformers accelerate ray pytest \
    pytest-timeout expecttest
"$dir/bin/python" - <<'PY'
from importlib.metadata import version
print("latest: " + ", ".join(f"{p} {version(p)}" for p in
                             ("torch", "cryptography", "transformers", "accelerate", "ray",
                              "pytest")))
PY
status=0
MOE_AUTOGRAD_ZOO=all "$dir/bin/python" -m pytest -p no:cacheprovider -q \
    --junitxml="$dir/report.xml" tests/moe/test_zoo_*.py tests/remote/test_ray_*.py || status=$?
"$dir/bin/python" tools/zoo_report.py "$dir/report.xml"
exit $status
