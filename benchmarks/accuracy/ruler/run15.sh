#!/usr/bin/env bash
# Issue #46 item 2: RULER-style 4k, 12 families x 5 samples (60 prompts), qwen2.5-1.5b, in-prompt only: the full
# cache, then DiffKV with the shipped profile (profiles/qwen2.5-1.5b.json: compact_meta, its own page size). One
# core, resumable (rerun it: every run continues from its samples.jsonl). A 4k prefill of the 1.5b model is about
# 3x the 0.5b's, so each method is ~2 h of one quiet core. --max-batch 4: the engine prefills one 4k prompt per step
# while the admitted ones decode, so an answer of L tokens is written L prefills after its own; with 60 slots a stop
# loses the ~L prompts in flight (L up to 128), with 4 at most 4 (the two were not timed side by side; with 4, ~2 min
# a sample on each of two busy cores).
# spans: the uuid families (niah_single_3, niah_multikey_3: the shipped profile's losses) with scores pooled over words
# (score_spans) at the profile's thresholds x2, the setting that fixed them on qwen2.5-0.5b (ruler.md); into
# ruler/spans-5-1.5b/ (10 prompts).
# k4v4: issue #60 item 3, the setting that held on both qwen2.5-0.5b slices (thresholds x4, score_spans, a K4V4 low
# tier) with the 1.5b's shipped profile. A second argument picks the slice: 0 (default) into in-prompt-5-1.5b/,
# 1 (--seed 1, other prompts) into seed1/in-prompt-5-1.5b/.
#   bash benchmarks/accuracy/ruler/run15.sh [full|diffkv|all|spans|k4v4] [0|1]   (one method per core)
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
what=${1:-all} seed=${2:-0}
case $seed in 0) OUT=benchmarks/accuracy/ruler/in-prompt-5-1.5b ;; 1) OUT=benchmarks/accuracy/ruler/seed1/in-prompt-5-1.5b ;;
  *) echo "usage: $0 [full|diffkv|all|spans|k4v4] [0|1]" >&2; exit 2 ;; esac
BASE="env OMP_NUM_THREADS=1 nice -n 10 $PY -m diffkv.eval run --no-progress --model qwen2.5-1.5b --task ruler \
  --ruler-lengths 4096 --ruler-samples 5 --max-batch 4 --seed $seed"
RUN="$BASE --out $OUT"
[[ $what == full || $what == all ]] && $RUN --methods full
[[ $what == diffkv || $what == all ]] && $RUN --methods diffkv --profile profiles/qwen2.5-1.5b.json
[[ $what == spans ]] && $BASE --ruler-families niah_single_3,niah_multikey_3 --methods diffkv@x2+score_spans=true \
  --profile profiles/qwen2.5-1.5b.json --out benchmarks/accuracy/ruler/spans-5-1.5b
[[ $what == k4v4 ]] && $RUN --methods 'diffkv@x4+score_spans=true+low="K4V4"' --profile profiles/qwen2.5-1.5b.json
true
