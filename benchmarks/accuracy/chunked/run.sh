#!/usr/bin/env bash
# Issue #44: a prompt prefilled in chunks of 512 (later chunks appended by KVStore.extend, placed by the decode rule)
# vs the same prompt prefilled whole, qwen2.5-0.5b, shipped profile, needle at 4k: 8 depths x 3 repeats = 24 cases,
# both through generate() (DiffKVCache); then the chunks staged and stored as one prompt (deferred). Resumable,
# one core. Arguments: the runs to make (whole, chunk512, chunk512-deferred; default all).
#   bash benchmarks/accuracy/chunked/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/accuracy/chunked
RUN="env OMP_NUM_THREADS=1 nice -n 10 $PY -m diffkv.eval run --no-progress --model qwen2.5-0.5b --task needle \
  --runner generate --batch-size 4 --needle-lengths 4096 --needle-depths 0,0.15,0.3,0.45,0.6,0.75,0.9,1 \
  --needle-repeats 3 --profile profiles/qwen2.5-0.5b.json --methods diffkv-compact-meta+page_bytes=1472"
runs=("$@"); [[ ${#runs[@]} -gt 0 ]] || runs=(whole chunk512 chunk512-deferred)
for run in "${runs[@]}"; do
  case $run in
    whole) $RUN --out $OUT/whole ;;
    chunk512) $RUN --out $OUT/chunk512 --prefill-chunk 512 ;;
    chunk512-deferred) $RUN --out $OUT/chunk512-deferred --prefill-chunk 512 --chunked-prefill deferred ;;
    *) echo "unknown run $run (whole, chunk512, chunk512-deferred)" >&2; exit 2 ;;
  esac
done
