#!/usr/bin/env bash
# The GPU tests that failed or hung on the H200 on 2026-12-04 (results/README.md), one pytest process per test with
# its own timeout, each writing its traceback before the next starts (a hang in a launch cannot hide the others).
#   OUT=$OUT bash benchmarks/gpu/failing.sh      # ~4 min at most; then the rest of gpu_check.sh as usual
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
status=0
for t in "tests/test_kernel_place_store.py::test_gpu_many_steps[K8V4-64]" \
         "tests/test_kernel_prefill_scores.py::test_gpu_long_prompt[256-7]" \
         "tests/test_store.py::test_kernel_bit_exact_on_cuda[128]" \
         "tests/test_store.py::test_kernel_bit_exact_on_cuda[256]" \
         "tests/test_store.py::test_kernel_bit_exact_compact_and_symmetric_keys_on_cuda"; do
  name=$(echo "$t" | tr -c 'A-Za-z0-9_\n' '_' | cut -c1-80)
  timeout 60 python -m pytest -x -q -p no:cacheprovider --tb=long "$t" > "$OUT/$name.txt" 2>&1
  rc=$?
  echo "$rc $t" | tee -a "$OUT/failing_summary.txt"
  [ $rc -eq 0 ] || status=1
done
exit $status
