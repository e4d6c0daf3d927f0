#!/usr/bin/env bash
# Issue #60: the lead from cwe on seed 1 (ruler.md, "cwe on seed 1"): a K4V4 low tier at thresholds x4 instead of the
# in-prompt setting's K4V2 at x2, over all 12 families x 10, in-prompt, at about the same bytes. Seed 1 next to
# ruler/seed1/in-prompt (its full run is the reference), seed 0 next to ruler/in-prompt-10. One core, resumable
# (--max-batch 4: a stop loses at most 4 prompts in flight):
#   bash benchmarks/accuracy/ruler/k4v4.sh 1      then   table10.py --folder seed1/in-prompt --ratios
#   bash benchmarks/accuracy/ruler/k4v4.sh 0      then   table10.py --folder in-prompt-10 --ratios
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
seed=${1:-}
case $seed in 0) OUT=benchmarks/accuracy/ruler/in-prompt-10 ;; 1) OUT=benchmarks/accuracy/ruler/seed1/in-prompt ;;
  *) echo "usage: $0 0|1" >&2; exit 2 ;; esac
env OMP_NUM_THREADS=1 nice -n 10 $PY -m diffkv.eval run --no-progress --model qwen2.5-0.5b --task ruler \
  --ruler-lengths 4096 --seed "$seed" --profile profiles/qwen2.5-0.5b.json --ruler-samples 10 --max-batch 4 \
  --methods 'diffkv-compact-meta@x4+page_bytes=1472+score_spans=true+low="K4V4"' --out $OUT
