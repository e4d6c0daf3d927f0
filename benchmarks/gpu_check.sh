#!/usr/bin/env bash
# One GPU session check (at most 10 min, by its timeouts): gpu-marked tests, then the decode attention benchmark.
#   bash benchmarks/gpu_check.sh            # results under $OUT (default: benchmarks/results/gpu)
# Writes: $OUT/pytest_gpu.txt, $OUT/pytest_memory_kernel.txt, $OUT/memory_cuda.json, $OUT/decode_attention.json,
#         $OUT/decode_attention.md, $OUT/env.txt
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" \
  2>/dev/null && PY=.venv/bin/python
unset TRITON_INTERPRET
status=0

{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$OUT/env.txt"

echo "== gpu-marked tests"
if "$PY" -c "import pytest" 2>/dev/null; then
  # -v: one line per test as it ends, so a run cut by `timeout` still names what passed; --timeout: a hung test
  # fails with its stack instead of eating the budget (pytest-timeout is in the GPU image)
  per_test=""; "$PY" -c "import pytest_timeout" 2>/dev/null && per_test="--timeout=${GPU_TEST_TIMEOUT:-90}"
  timeout 300 "$PY" -m pytest -v -m gpu -p no:cacheprovider $per_test --tb=short --durations=15 tests/ 2>&1 \
    | tee "$OUT/pytest_gpu.txt" | grep -E "PASSED|FAILED|ERROR|Timeout|passed|failed" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "== ring kernels on CUDA vs the torch ops (bit-identical bookkeeping)"
  timeout 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_memory_kernel.py 2>&1 \
    | tee "$OUT/pytest_memory_kernel.txt" | tail -5
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "pytest is not installed: gpu tests not run" | tee "$OUT/pytest_gpu.txt"; status=1
fi

echo "== memory manager benchmark (Triton ring kernels vs the per-head Python free list; target >= 20x)"
timeout 60 "$PY" -m diffkv.bench.memory --device cuda --ring-backend triton --iters 10 --json > "$OUT/memory_cuda.json" \
  || status=1
tail -c 400 "$OUT/memory_cuda.json"

[ -n "${SKIP_DECODE:-}" ] && exit $status   # SKIP_DECODE=1: a rerun that needs only the tests and the memory bench
echo "== decode attention benchmark"
timeout 180 "$PY" benchmarks/gpu/bench_decode.py --out "$OUT" --num-warps 4 8 "$@" || status=1
exit $status
