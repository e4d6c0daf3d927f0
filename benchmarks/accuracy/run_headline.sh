#!/usr/bin/env bash
# Headline accuracy runs (resumable: rerun the script to continue where it stopped). CPU, fp32, greedy.
# diffkv runs first on each task so that the eviction baselines get the budget 1 / DiffKV's measured compression.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
RUN="nice -n 10 $PY -m diffkv.eval run --no-progress --out benchmarks/accuracy"  # a later --out wins
# The profiled/, gen512/ and long-profiled/ runs used the qwen profile calibrated with per-token keys and a K8V2 low
# tier (kept as OLD); profiled-smooth/ and long-smooth/ the one shipped from 2026-12-01 to 12-03 (smooth_keys, K4V2;
# kept as SMOOTH; since 2026-12-03 the shipped profile is its recalibration with compact_meta). Runs recorded with the
# old path "profiles/qwen2.5-0.5b.json" refuse to resume under the new path: pass --overwrite to redo them.
OLD=benchmarks/calibration/qwen2.5-0.5b-K8V2-per-token.json
SMOOTH=benchmarks/calibration/qwen2.5-0.5b-full-smooth.json
$RUN --model qwen2.5-0.5b --task gsm8k --methods diffkv,full,bf16,K8V4,K4V4,kivi2,h2o,snapkv --limit 40 --batch-size 5 \
  --max-new-tokens 256
$RUN --model qwen2.5-0.5b --task gsm8k --methods full,K4V4,kivi2,h2o,snapkv --limit 100 --batch-size 5 \
  --max-new-tokens 256
$RUN --model qwen2.5-0.5b --task gsm8k --methods diffkv --profile $OLD \
  --out benchmarks/accuracy/profiled --limit 100 --batch-size 5 --max-new-tokens 256
$RUN --model qwen2.5-0.5b --task gsm8k --methods full --limit 100 --batch-size 5 --max-new-tokens 512 \
  --out benchmarks/accuracy/gen512
$RUN --model qwen2.5-0.5b --task gsm8k --methods diffkv --profile $OLD --limit 100 \
  --batch-size 5 --max-new-tokens 512 --out benchmarks/accuracy/gen512
$RUN --model smollm2-135m --task ppl --methods diffkv,full,K4V4,kivi2,h2o,snapkv,streamingllm --batch-size 4 \
  --ppl-context 1024 --ppl-continuation 128 --ppl-essays 4
$RUN --model qwen2.5-0.5b --task ppl --methods diffkv,full,K4V4,kivi2,h2o,snapkv,streamingllm --batch-size 4 \
  --ppl-context 1024 --ppl-continuation 128 --ppl-essays 4
$RUN --model qwen2.5-0.5b --task ppl --methods diffkv --profile $OLD \
  --out benchmarks/accuracy/profiled --batch-size 4 --ppl-context 1024 --ppl-continuation 128 --ppl-essays 4
$RUN --model qwen2.5-0.5b --task needle --methods diffkv,full,h2o,snapkv --batch-size 3 \
  --needle-lengths 1024,2048 --needle-depths 0,0.5,1
$RUN --model qwen2.5-0.5b --task needle --methods diffkv --profile $OLD --batch-size 3 \
  --needle-lengths 1024,2048 --needle-depths 0,0.5,1 --out benchmarks/accuracy/profiled
$RUN --model qwen2.5-0.5b --task needle --methods diffkv,full,h2o,snapkv --batch-size 3 --needle-lengths 4096 \
  --needle-depths 0,0.5,1 --out benchmarks/accuracy/long
$RUN --model qwen2.5-0.5b --task needle --methods diffkv --profile $OLD --batch-size 3 \
  --needle-lengths 4096 --needle-depths 0,0.5,1 --out benchmarks/accuracy/long-profiled
for m in smollm2-135m qwen2.5-0.5b; do
  $RUN --model $m --task ppl --methods diffkv-smooth --batch-size 4 --ppl-context 1024 --ppl-continuation 128 \
    --ppl-essays 4
done
$RUN --model gemma3-270m --task ppl --methods diffkv,full,h2o,snapkv,kivi2,K4V4,diffkv-smooth,K4V4-smooth --batch-size 4 \
  --ppl-context 1024 --ppl-continuation 128 --ppl-essays 4
$RUN --model qwen2.5-0.5b --task ppl --methods diffkv --profile $SMOOTH \
  --out benchmarks/accuracy/profiled-smooth --batch-size 4 --ppl-context 1024 --ppl-continuation 128 --ppl-essays 4
$RUN --model smollm2-135m --task ppl --methods diffkv --profile profiles/smollm2-135m.json \
  --out benchmarks/accuracy/profiled --batch-size 4 --ppl-context 1024 --ppl-continuation 128 --ppl-essays 4
$RUN --model qwen2.5-0.5b --task needle --methods diffkv --profile $SMOOTH --batch-size 3 \
  --needle-lengths 4096 --needle-depths 0,0.5,1 --out benchmarks/accuracy/long-smooth
$RUN --model qwen2.5-0.5b --task gsm8k --methods diffkv --profile $SMOOTH \
  --out benchmarks/accuracy/profiled-smooth --limit 100 --batch-size 5 --max-new-tokens 256
# qwen2.5-1.5b (head_dim 128; ~3x slower than qwen2.5-0.5b): ppl as for the others; needle at 1k x 3 depths with the
# shipped (quick) profile, the eviction baselines at that profile's measured compression (profiled-smooth/).
Q15=benchmarks/calibration/qwen2.5-1.5b-quick.json
$RUN --model qwen2.5-1.5b --task ppl --methods diffkv,full,h2o,snapkv,diffkv-smooth,kivi2 \
  --batch-size 4 --ppl-context 1024 --ppl-continuation 128 --ppl-essays 4
$RUN --model qwen2.5-1.5b --task ppl --methods diffkv --profile $Q15 --out benchmarks/accuracy/profiled-smooth \
  --batch-size 4 --ppl-context 1024 --ppl-continuation 128 --ppl-essays 4
$RUN --model qwen2.5-1.5b --task needle --methods diffkv,full,h2o,snapkv --profile $Q15 --batch-size 1 \
  --needle-lengths 1024 --needle-depths 0,0.5,1 --out benchmarks/accuracy/profiled-smooth
# the compression-quality frontier: operating points of the eviction methods and of the profiles (README, "frontier")
PPL="--batch-size 4 --ppl-context 1024 --ppl-continuation 128 --ppl-essays 4"
$RUN --model qwen2.5-0.5b --task ppl --methods diffkv@x4,diffkv@x16,diffkv@x64 --profile $SMOOTH \
  --out benchmarks/accuracy/profiled-smooth $PPL
$RUN --model qwen2.5-0.5b --task ppl --methods h2o@0.2,snapkv@0.2,h2o@0.15 $PPL
$RUN --model smollm2-135m --task ppl --methods diffkv@x4 --profile profiles/smollm2-135m.json \
  --out benchmarks/accuracy/profiled $PPL
$RUN --model smollm2-135m --task ppl --methods h2o@0.15,snapkv@0.15 $PPL
$RUN --model qwen2.5-0.5b --task gsm8k --methods diffkv-compact-meta --profile $SMOOTH \
  --out benchmarks/accuracy/gen512 --limit 100 --batch-size 5 --max-new-tokens 512
$PY -m diffkv.eval report --out benchmarks/accuracy > benchmarks/accuracy/results.md
for d in profiled gen512 long long-profiled profiled-smooth long-smooth; do  # single-method folders: tables only (their plots go to a temp dir)
  printf '\n## %s/\n' "$d"
  $PY -m diffkv.eval report --out "benchmarks/accuracy/$d" --plot "${TMPDIR:-/tmp}/diffkv_$d.png" | sed '/^plot:/d'
done >> benchmarks/accuracy/results.md
