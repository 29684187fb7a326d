#!/bin/bash
# The GPU checks of issue 21, as one run on a lent device machine (see
# /work/.library/device): the CUDA tests, a profiler trace of overlapping
# calls, PyTorch's CUDA sanitizer on the stream paths, the bench's GPU rows,
# then the whole suite file by file. Logs go to $OUT (at most 8 files come
# back: cuda_tests.txt, repeat.txt, bench.txt, profile.txt, sanitizer.txt, suite.txt, trace/ (3)). Usage there: bash tools/gpu_check.sh [SECTIONS...]  (default: all)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if [ ! -d /tmp/site/transformers ] && ls .whl/*.whl >/dev/null 2>&1; then
  # transformers as CI has it (the image's is older); once per machine: sections run
  # side by side must not install at the same time
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=$PWD:/tmp/site
sections=${*:-"env tests repeat overlap bench sanitizer suite"}
log() { echo "== $(date +%T) $*"; }

for s in $sections; do case $s in
env)
  log env
  { nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('transformers', transformers.__version__)"; } > "$OUT/cuda_tests.txt" 2>&1
  cat "$OUT/cuda_tests.txt" ;;
tests)
  log tests
  timeout 150 python3 -m pytest tests/test_cuda.py tests/test_call_streams.py tests/test_devices.py \
    tests/moe/test_grouped.py -rA --durations=15 -p no:cacheprovider --timeout 120 >> "$OUT/cuda_tests.txt" 2>&1
  echo "rc=$?" >> "$OUT/cuda_tests.txt"
  # cuBLAS promises bitwise reproducibility with several streams active only
  # with a fixed workspace: the exact-equality tests again under it, to tell
  # a cuBLAS effect from a runtime bug.
  echo "== again with CUBLAS_WORKSPACE_CONFIG=:4096:8" >> "$OUT/cuda_tests.txt"
  CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 90 python3 -m pytest tests/test_devices.py \
    tests/test_call_streams.py -q -p no:cacheprovider --timeout 60 >> "$OUT/cuda_tests.txt" 2>&1
  echo "rc=$?" >> "$OUT/cuda_tests.txt"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda_tests.txt" | tail -15 ;;
repeat)
  log repeat  # the exact-equality tests again and again: a race shows in some runs only
  for i in $(seq ${REPEAT:-5}); do
    timeout 60 python3 -m pytest tests/test_devices.py tests/test_cuda.py -q -p no:cacheprovider \
      --timeout 50 -rfE >> "$OUT/repeat.txt" 2>&1
    echo "run $i rc=$?" >> "$OUT/repeat.txt"
  done
  grep -E "^(FAILED|ERROR)|^run" "$OUT/repeat.txt" ;;
overlap)
  log overlap
  # streams on (MOE_AUTOGRAD_CUDA_STREAMS=8): small experts, then medium ones
  MOE_AUTOGRAD_CUDA_STREAMS=8 timeout 90 python3 tools/gpu_overlap.py --out "$OUT/trace" \
    >> "$OUT/bench.txt" 2>&1
  echo "overlap rc=$?" >> "$OUT/bench.txt"
  MOE_AUTOGRAD_CUDA_STREAMS=8 timeout 60 python3 tools/gpu_overlap.py --out /tmp/overlap-medium \
    --experts 8 --tokens 2048 --hidden 4096 --repeats 10 >> "$OUT/bench.txt" 2>&1
  echo "overlap (medium) rc=$?" >> "$OUT/bench.txt"; tail -5 "$OUT/bench.txt" ;;
bench)
  log bench
  timeout 200 python3 -m moe_autograd bench --device cuda --markdown --profile-dir "$OUT/prof" \
    >> "$OUT/bench.txt" 2>&1
  echo "bench rc=$?" >> "$OUT/bench.txt"
  cat "$OUT"/prof/*.txt > "$OUT/profile.txt" 2>/dev/null; rm -rf "$OUT/prof"
  tail -30 "$OUT/bench.txt" ;;
sanitizer)
  log sanitizer  # TORCH_CUDA_SANITIZER: unsynchronised accesses across streams
  TORCH_CUDA_SANITIZER=1 timeout 60 python3 -m pytest tests/test_call_streams.py tests/test_cuda.py \
    --maxfail=3 -q -p no:cacheprovider --timeout 50 > "$OUT/sanitizer.txt" 2>&1
  echo "rc=$?" >> "$OUT/sanitizer.txt"; tail -5 "$OUT/sanitizer.txt" ;;
suite)
  log suite  # file by file: torch 2.11's checkpoint leaks its hooks after a raising frame
  mkdir -p /tmp/suite
  # SUITE_FILES: a file listing the test files to run (default: all); SUITE_S: seconds
  { if [ -n "$SUITE_FILES" ]; then cat "$SUITE_FILES"; else find tests -name 'test_*.py' | sort; fi; } \
    | timeout $((${SUITE_S:-170} + 10)) xargs -P 14 -I{} sh -c \
    'f={}; timeout '"${SUITE_S:-170}"' python3 -m pytest "$f" -q -p no:cacheprovider --timeout 100 -rfE > "/tmp/suite/$(echo $f | tr / _).log" 2>&1; echo "rc=$? $f"' \
    > /tmp/suite/rc.txt
  { sort -k2 /tmp/suite/rc.txt; for f in /tmp/suite/*.log; do echo "### $f"; grep -E "passed|failed|error|^(FAILED|ERROR)" "$f" | tail -40; done; } > "$OUT/suite.txt"
  grep -c "rc=0" /tmp/suite/rc.txt; grep -v "rc=0" /tmp/suite/rc.txt ;;
esac; done
log done
