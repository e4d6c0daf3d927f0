#!/usr/bin/env bash
# Needle at 2k tokens, qwen2.5-0.5b: the question in the compressed prompt (in-prompt/) vs asked after the context
# was prefilled and compressed (ask-after/). Resumable. The eviction baselines of both protocols get the same budget:
# 1 / the in-prompt DiffKV run's measured physical compression (equal memory).
set -euo pipefail
# The profile below is the one shipped when these ran; their config.json files name it by its old path,
# profiles/qwen2.5-0.5b.json, so a rerun into the same folders is refused: pass --overwrite or another --out.
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/accuracy/ask-after
RUN="nice -n 10 $PY -m diffkv.eval run --no-progress --model qwen2.5-0.5b --task needle --batch-size 5 \
  --needle-lengths 2048 --needle-depths 0.1,0.3,0.5,0.7,0.9"
for p in in-prompt ask-after; do
  $RUN --methods diffkv --profile benchmarks/calibration/qwen2.5-0.5b-full-smooth.json --needle-protocol $p --out $OUT/$p
done
BUDGET=$($PY -c "from diffkv.eval.methods import derive_budget; print(derive_budget('$OUT/in-prompt/qwen2.5-0.5b/needle')[0])")
for m in full snapkv h2o; do
  for p in in-prompt ask-after; do
    $RUN --methods $m --budget "$BUDGET" --needle-protocol $p --out $OUT/$p
  done
done
# A second grid (seed 1: other passkeys and essay offsets), DiffKV and the full cache only.
for p in in-prompt ask-after; do
  $RUN --seed 1 --methods diffkv --profile benchmarks/calibration/qwen2.5-0.5b-full-smooth.json --needle-protocol $p --out $OUT/seed1/$p
done
$RUN --seed 1 --methods full --out $OUT/seed1/in-prompt
# A third grid (seed 2), DiffKV and the full cache only (issue #31: the ask-after result over >= 3 seeds).
for p in in-prompt ask-after; do
  $RUN --seed 2 --methods diffkv --profile benchmarks/calibration/qwen2.5-0.5b-full-smooth.json --needle-protocol $p --out $OUT/seed2/$p
done
$RUN --seed 2 --methods full --out $OUT/seed2/in-prompt
# Repeat scores (prompt_scores="repeat", issue #31 item 3): the profile's thresholds x S on peak importance, scored by
# a re-read of the context (query-agnostic); S = 16, 64, 256 on seed 0, 256 on seeds 1 and 2; the window-peak control.
REP="$RUN --runner generate --profile benchmarks/calibration/qwen2.5-0.5b-full-smooth.json --needle-protocol ask-after"
for s in 16 64 256; do
  $REP --methods "diffkv@x$s+importance=\"peak\"+prompt_scores=\"repeat\"" --out $OUT/repeat/seed0
done
for seed in 1 2; do
  $REP --seed $seed --methods 'diffkv@x256+importance="peak"+prompt_scores="repeat"' --out $OUT/repeat/seed$seed
done
$REP --seed 1 --methods 'diffkv@x256+importance="peak"' --out $OUT/repeat/seed1
$REP --seed 1 --methods 'diffkv@x16+importance="peak"' --out $OUT/repeat/seed1   # the window-peak control near equal memory
