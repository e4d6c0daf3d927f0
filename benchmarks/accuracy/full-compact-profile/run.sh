#!/usr/bin/env bash
# Issue #30 item 5: the full --compact-meta calibration of qwen2.5-0.5b (benchmarks/calibration/qwen2.5-0.5b-full-compact.json)
# against the shipped profile, on the same measurements: perplexity (4 essays, 1024 + 128) and GSM8K through the engine
# on both slices (512 new tokens), and on two more (gsm8k-more). Usage: bash run.sh ppl | ppl-more | needle | gsm8k |
# gsm8k-more q200|q700 | gsm8k-1.5b first100|q500. Resumable.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
NEW=benchmarks/calibration/qwen2.5-0.5b-full-compact.json
OUT=benchmarks/accuracy/full-compact-profile
case "${1:-}" in
  ppl)
    $PY -m diffkv.eval run --model qwen2.5-0.5b --task ppl --profile $NEW --batch-size 4 --ppl-context 1024 \
      --ppl-continuation 128 --ppl-essays 4 --no-progress --out $OUT/ppl --methods \
      'full,diffkv-compact-meta+page_bytes=1472,diffkv-compact-meta@x16+page_bytes=1472,diffkv-compact-meta@x32+page_bytes=1472' ;;
  ppl-more)  # the knee (x24, x48) on essays 0-3, and the x32 point on a second disjoint set (essays 4-7)
    $PY -m diffkv.eval run --model qwen2.5-0.5b --task ppl --profile $NEW --batch-size 4 --ppl-context 1024 \
      --ppl-continuation 128 --ppl-essays 4 --no-progress --out $OUT/ppl --methods \
      'diffkv-compact-meta@x24+page_bytes=1472,diffkv-compact-meta@x48+page_bytes=1472'
    $PY -m diffkv.eval run --model qwen2.5-0.5b --task ppl --profile $NEW --batch-size 4 --ppl-context 1024 \
      --ppl-continuation 128 --ppl-essays 8 --start 4 --limit 4 --no-progress --out $OUT/ppl-essays4-7 --methods \
      'full,diffkv-compact-meta@x32+page_bytes=1472' ;;
  needle)  # 4k tokens, depths 0 / 0.5 / 1, through the engine (a check on three samples)
    $PY -m diffkv.eval run --model qwen2.5-0.5b --task needle --profile $NEW --batch-size 3 --needle-lengths 4096 \
      --needle-depths 0,0.5,1 --no-progress --out $OUT/needle-4k \
      --methods 'diffkv-compact-meta@x16+page_bytes=1472,diffkv-compact-meta@x32+page_bytes=1472' ;;
  gsm8k)
    for slice in "first100 0" "q500 500"; do
      set -- $slice
      $PY -m diffkv.eval run --model qwen2.5-0.5b --task gsm8k --profile $NEW --max-new-tokens 512 --limit 100 \
        --start "$2" --max-batch 100 --no-progress --out "$OUT/$1" --methods "diffkv-compact-meta+page_bytes=1472"
    done ;;
  gsm8k-more)  # two more disjoint slices (questions 200-299, 700-799), full and DiffKV: the gap at ~3.2x on 400
    slice=${2:?usage: $0 gsm8k-more q200|q700}
    $PY -m diffkv.eval run --model qwen2.5-0.5b --task gsm8k --profile $NEW --max-new-tokens 512 --limit 100 \
      --start "${slice#q}" --max-batch 100 --no-progress --out "$OUT/$slice" --methods "full,diffkv-compact-meta+page_bytes=1472" ;;
  gsm8k-1.5b)  # qwen2.5-1.5b, its shipped full profile at its own thresholds (~45 min per method and core)
    slice=${2:?usage: $0 gsm8k-1.5b first100|q500}
    start=${slice#q}; [[ $slice == first100 ]] && start=0
    $PY -m diffkv.eval run --model qwen2.5-1.5b --task gsm8k --profile profiles/qwen2.5-1.5b.json --max-new-tokens 512 \
      --limit 100 --start "$start" --max-batch 100 --no-progress --out "$OUT/gsm8k-1.5b/$slice" \
      --methods "full,diffkv-compact-meta+page_bytes=2944" ;;
  *) echo "usage: $0 ppl|ppl-more|needle|gsm8k|gsm8k-more q200|q700|gsm8k-1.5b first100|q500" >&2; exit 2 ;;
esac
