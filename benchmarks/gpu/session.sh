#!/usr/bin/env bash
# The GPU session of issue #59 (item 6): one prepared script, at most 8 min by its own timeouts, each step under its
# own `timeout` (a hang costs that step only). In order of value:
#   env     T_ENV=20 s      nvidia-smi, python/torch/triton versions, commit, copy bandwidth          -> env.txt
#   decode  T_DECODE=120 s  bench_decode.py: streams vs split vs SDPA over dense fp16; llama3-8b (32/8 heads, d=128)
#                           and qwen2.5-0.5b (14/2, d=64) at 8k/32k x batch 1/32, 40 % high tier; device time
#                           (CUDA graph replay) and host time per call; warps 1/2/4/8 at llama3 32k x 32, and
#                           there the codes unpacked without the inline PTX (DIFFKV_STREAMS_PTX=0); streams vs
#                           split agreement per case (O(1) = a wrong kernel: rerun with DIFFKV_STREAMS_PTX=0)
#                                                                    -> decode_attention.json, decode_attention.md
#   tests   T_FAILING=90 s  the gpu-marked tests that failed on 2026-12-04 (benchmarks/gpu/failing.sh's list), then
#           T_TESTS=140 s   every other gpu-marked test; pytest-timeout 180 s per test (thread method) where
#                           importable, GPU_TEST_WORKERS=4 xdist workers where importable (0: none) -> pytest_gpu.txt
#   engine  T_ENGINE=90 s   bench_engine.py: qwen2.5-0.5b fp16, `fp16` paged vs `diffkv`, equal batch and equal KV
#                           budget; random weights unless MODEL_DIR holds them (the GPU machine has no network)
#                                                                    -> engine.json
# 20 + 120 + 90 + 140 + 90 s + 4 s kill grace per step = 480 s. Every step's exit status and seconds -> summary.txt;
# everything printed -> session_log.txt: 7 files, within the 8 that a device run brings back.
#
#   COMMIT=$(git rev-parse --short HEAD) OUT=$OUT bash benchmarks/gpu/session.sh   # on the GPU machine
#   bash benchmarks/gpu/session.sh       # $OUT defaults to benchmarks/gpu/results/<UTC date>-<commit>/
# STEPS="decode" reruns one step (names above; "memory", not in the default, adds the ring kernels' CUDA tests and the
# memory bench, 2 x 60 s, as gpu_check.sh did); DECODE_ARGS / ENGINE_ARGS add arguments; SMOKE=1 runs the decode
# and engine steps on CPU at tiny shapes (a check of this script, tests/test_gpu_scripts.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${COMMIT:-}" ]; then  # given on a machine without .git (the device run's copy of the tree)
  COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && COMMIT="$COMMIT-dirty"
fi
export COMMIT
OUT="${OUT:-benchmarks/gpu/results/$(date -u +%F)-$COMMIT}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && { [ -n "${SMOKE:-}" ] || .venv/bin/python -c \
  "import torch; assert torch.cuda.is_available()" 2>/dev/null; } && PY=.venv/bin/python
export PY
STEPS=" ${STEPS:-env decode tests engine} "
status=0
exec > >(tee -a "$OUT/session_log.txt") 2>&1
if [ -n "${SMOKE:-}" ]; then
  export TRITON_INTERPRET=1
  DECODE_ARGS="--device cpu --shapes smollm2 --contexts 96 --batches 1 --reps 1 --rounds 1 --host-calls 1
    --copy-mib 4 --sweep smollm2/96/1 --warps 1 ${DECODE_ARGS:-}"
  ENGINE_ARGS="--device cpu --dtype float32 --tiny --requests 2 --prompt-len 32 --new-tokens 2 --batch 2
    --big-budget 4MiB --kv-budget 1MiB ${ENGINE_ARGS:-}"
else
  unset TRITON_INTERPRET
fi
echo "GPU session: commit $COMMIT, python $PY, steps:$STEPS, results in $OUT ($(date -u +%FT%TZ))"

# run_step NAME LIMIT_S LOG COMMAND...: COMMAND under `timeout`, its output also appended to $OUT/LOG ("-": none)
run_step() {
  local name=$1 limit=$2 log=$3 t0=$SECONDS rc note=""
  shift 3
  echo "== $name (limit $limit s): $*"
  if [ "$log" = - ]; then
    timeout -k 4 "$limit" "$@"
    rc=$?
  else
    timeout -k 4 "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
    rc=${PIPESTATUS[0]}
  fi
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && note=" (cut by its time limit)"
  echo "step $name: exit $rc$note, $((SECONDS - t0)) s of $limit s" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
}
want() { [[ "$STEPS" == *" $1 "* ]]; }

if want env; then
  # shellcheck disable=SC2016,SC2086  # $COMMIT and $PY expand in the inner shell; DECODE_ARGS is a list
  run_step env "${T_ENV:-20}" env.txt bash -c 'echo "date: $(date -u +%FT%TZ)"; echo "commit: $COMMIT"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory --format=csv 2>&1
    "$PY" benchmarks/gpu/bench_decode.py --env "$@"' env ${DECODE_ARGS:-}
fi

if want decode; then
  # shellcheck disable=SC2086  # DECODE_ARGS is a list of arguments
  run_step decode "${T_DECODE:-120}" - "$PY" benchmarks/gpu/bench_decode.py --out "$OUT" ${DECODE_ARGS:-}
fi

if want tests; then
  opts=(-v -m gpu -p no:cacheprovider --tb=short -rfE)
  "$PY" -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout=180 --timeout-method=thread)
  workers="${GPU_TEST_WORKERS:-4}"
  [ "$workers" -gt 0 ] && "$PY" -c "import xdist" 2>/dev/null && opts+=(-n "$workers")
  mapfile -t failing < <(sed -n 's/^[^#]*"\(tests\/[^"]*\)".*/\1/p' benchmarks/gpu/failing.sh)
  deselect=()
  for t in "${failing[@]}"; do deselect+=(--deselect "$t"); done
  if [ ${#failing[@]} -gt 0 ]; then
    run_step tests-failing-first "${T_FAILING:-90}" pytest_gpu.txt "$PY" -m pytest "${opts[@]}" "${failing[@]}"
  fi
  run_step tests-gpu "${T_TESTS:-140}" pytest_gpu.txt "$PY" -m pytest "${opts[@]}" tests/ "${deselect[@]}"
fi

if want engine; then
  # shellcheck disable=SC2086  # ENGINE_ARGS is a list of arguments
  run_step engine "${T_ENGINE:-90}" - "$PY" benchmarks/gpu/bench_engine.py --out "$OUT" \
    --max-seconds $((${T_ENGINE:-90} - 15)) \
    ${MODEL_DIR:+--model-dir "$MODEL_DIR"} ${ENGINE_ARGS:-}
fi

if want memory; then  # not in the default steps: the ring kernels passed on 2026-12-04 (25.8x at 65k heads)
  run_step memory-kernel-tests 60 pytest_gpu.txt "$PY" -m pytest -q -p no:cacheprovider tests/test_memory_kernel.py
  run_step memory-bench 60 - bash -c '"$PY" -m diffkv.bench.memory --device cuda --ring-backend triton --iters 10 \
    --json > "$0/memory_cuda.json" && tail -c 400 "$0/memory_cuda.json"' "$OUT"
fi

echo "GPU session done in $SECONDS s, exit $status; per step: $OUT/summary.txt"
exec >&- 2>&-  # let tee finish session_log.txt before the files are collected
wait
exit $status
