#!/usr/bin/env bash
# GSM8K frontier points through the engine runner (qwen2.5-0.5b, the profile shipped until 2026-12-03, 512 new
# tokens), on the first 100 questions (--out benchmarks/accuracy/engine-eval/first100) and on questions 500-599
# (.../q500). Resumable.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
# The profile shipped when these ran (2026-12-01 to 12-03). Their config.json files name it by its old path,
# profiles/qwen2.5-0.5b.json, so a rerun into the same folders is refused: pass --overwrite or another --out.
PROFILE=benchmarks/calibration/qwen2.5-0.5b-full-smooth.json
run() {  # out start methods
  $PY -m diffkv.eval run --model qwen2.5-0.5b --task gsm8k --profile $PROFILE --max-new-tokens 512 \
    --limit 100 --start "$2" --max-batch 100 --no-progress --out "benchmarks/accuracy/engine-eval/$1" --methods "$3"
}
# the full cache on the first 100 is engine_vs_fixed.py's engine run (26/100, outputs identical to generate()'s)
full=benchmarks/accuracy/engine-eval/first100/qwen2.5-0.5b/gsm8k/full
[[ -d $full ]] || { mkdir -p "$(dirname $full)"; cp -r benchmarks/accuracy/engine-eval/engine/qwen2.5-0.5b/gsm8k/full $full; }
run first100 0 "diffkv-compact-meta+page_bytes=1472"
run first100 0 "diffkv-compact-meta+page_bytes=1472+recent_window=32"
run q500 500 "full"
run q500 500 "diffkv-compact-meta+page_bytes=1472"
# a K4V4 high tier (smooth keys make 4-bit keys as good as 8-bit per-token ones: key_quant_study.md)
run first100 0 "diffkv-compact-meta+page_bytes=1472+high=K4V4"
run q500 500 "diffkv-compact-meta+page_bytes=1472+high=K4V4"
# decode-time pruning at ~3.6x: the paper's mean vs peak importance (#30 item 4), both with score_after_window
run first100 0 "diffkv-compact-meta@x1+page_bytes=1472+score_after_window=true,diffkv-compact-meta@x1.5+page_bytes=1472+score_after_window=true+importance=peak"
# 3-bit values in the low tier (#30 item 2), the recent window halved; with the profile's heavy hitters, and with
# none (every token past the window low, nothing pruned: window_tier_study.py's 3.48x point, KL 0.0069)
for slice in "first100 0" "q500 500"; do
  set -- $slice
  run "$1" "$2" "diffkv-compact-meta+page_bytes=1472+low=K4V3+recent_window=32"
  run "$1" "$2" "diffkv-compact-meta+page_bytes=1472+low=K4V3+recent_window=32+layer_alphas=null+alpha_high=1000000+alpha_low=0"
done
