#!/usr/bin/env bash
# The torch-version matrix (`make compat`): one venv per torch version, built
# from scratch when missing, then the version-sensitive tests on each.
#
#   tools/compat.sh venv VERSION DIR   build DIR (a venv with torch==VERSION)
#   tools/compat.sh ready DIR          exit 0 if DIR is complete and up to date
#   tools/compat.sh test DIR TESTS...  run pytest on TESTS with DIR's python
#
# A venv holds torch's PyPI wheel (a CUDA build) installed without its NVIDIA
# libraries (about 2.5 GB more: 3 GB of downloads per version instead of 0.5-0.8),
# stubbed by tools/cuda_stubs.py so that it imports and runs on the CPU, the
# pure-Python requirements of that torch wheel, and what the tests import.
# The package itself is not installed: pytest runs from the repository root,
# which is on sys.path (`python -m pytest`).
#
# pip runs with PIP_CONFIG_FILE=/dev/null: the machine's pip configuration
# caps torch at 2.14.1 (/etc/xdg/pip) and adds local indexes; PyPI is enough.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

now() { echo "$EPOCHREALTIME"; }
took() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

case "${1:-}" in
venv)
    version=$2; dir=$3
    rm -rf "$dir"
    mkdir -p "$(dirname "$dir")"
    export PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
    t0=$(now)
    "$PYTHON" -m venv "$dir"
    pip=("$dir/bin/python" -m pip install --quiet --no-input)
    t=$(now)
    "${pip[@]}" --no-deps "torch==$version"
    echo "compat: torch $version: wheel downloaded and installed in $(took "$t") s"
    # torch's own requirements but the NVIDIA ones (nvidia-*, cuda-*, triton):
    # the versions each release pins (sympy, typing-extensions, ...).
    mapfile -t reqs < <("$dir/bin/python" - <<'EOF'
from importlib.metadata import requires
import re
for r in requires("torch") or []:
    name = re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower().replace("_", "-")
    if "extra ==" in r or name.startswith(("nvidia-", "cuda-")) or name in ("triton", "pytorch-triton"):
        continue
    print(r)
EOF
)
    t=$(now)
    "${pip[@]}" --no-warn-conflicts "${reqs[@]}" -r tools/compat-requirements.txt
    echo "compat: torch $version: requirements and test tools in $(took "$t") s"
    site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PYTHON" tools/cuda_stubs.py "$site"
    "$dir/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$version', torch.__version__; assert not torch.cuda.is_available()"
    # complete: what it was built from (make compat rebuilds when this changes)
    cat "$0" tools/compat-requirements.txt tools/cuda_stubs.py | sha256sum > "$dir/.built"
    echo "compat: torch $version: venv ready in $(took "$t0") s, $(du -sh "$dir" | cut -f1) on disk"
    ;;
ready)  # exit 0 when DIR is a complete venv built by this version of the script
    dir=$2
    test -x "$dir/bin/python" && test -f "$dir/.built" &&
        cmp -s "$dir/.built" <(cat "$0" tools/compat-requirements.txt tools/cuda_stubs.py | sha256sum)
    ;;
test)
    dir=$2; shift 2
    t=$(now)
    status=0
    "$dir/bin/python" -m pytest -p no:cacheprovider "$@" || status=$?
    echo "compat: $("$dir/bin/python" -c 'import torch; print(torch.__version__)'): tests in $(took "$t") s (exit $status)"
    exit $status
    ;;
*)
    sed -n '2,8p' "$0" >&2
    exit 2
    ;;
esac
