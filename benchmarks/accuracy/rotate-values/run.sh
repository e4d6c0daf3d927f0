#!/usr/bin/env bash
# rotate_values (values stored under a randomized Hadamard rotation) through the real cache, against the same cache
# without it (benchmarks/accuracy/full-compact-profile/): qwen2.5-0.5b, the shipped profile, compact_meta, 1472-B pages.
# Usage: bash run.sh gsm8k first100|q500|q200|q700 [method suffix] | ppl x1|x32. Resumable. Run each with OMP_NUM_THREADS=1.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
PROFILE=benchmarks/calibration/qwen2.5-0.5b-full-compact.json  # = profiles/qwen2.5-0.5b.json since 2026-12-03
OUT=benchmarks/accuracy/rotate-values
case "${1:-}" in
  gsm8k)
    slice=${2:?usage: $0 gsm8k first100|q500|q200|q700 [suffix]}
    start=${slice#q}; [[ $slice == first100 ]] && start=0
    $PY -m diffkv.eval run --model qwen2.5-0.5b --task gsm8k --profile $PROFILE --max-new-tokens 512 --limit 100 \
      --start "$start" --max-batch 100 --no-progress --out "$OUT/$slice" \
      --methods "diffkv-compact-meta${3:-}+page_bytes=1472+rotate_values=true" ;;
  ppl)  # the perplexity points of "Perplexity at 8x", essays 0-3: ppl x1 | ppl x32
    scale=${2:?usage: $0 ppl x1|x32}; at="@$scale"; [[ $scale == x1 ]] && at=""
    $PY -m diffkv.eval run --model qwen2.5-0.5b --task ppl --profile $PROFILE --batch-size 4 --ppl-context 1024 \
      --ppl-continuation 128 --ppl-essays 4 --no-progress --out $OUT/ppl \
      --methods "diffkv-compact-meta$at+page_bytes=1472+rotate_values=true" ;;
  *) echo "usage: $0 gsm8k first100|q500|q200|q700 [method suffix] | ppl x1|x32" >&2; exit 2 ;;
esac
