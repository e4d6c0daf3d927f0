#!/usr/bin/env bash
# Issue #46 item 4: the weakest families (the uuid needles, niah_single_3 and niah_multikey_3) with scores pooled
# over words (DiffKVConfig.score_spans) at equal bytes. 10 samples per family (the samples of run10.sh), qwen2.5-0.5b,
# in-prompt, the shipped profile, 1472-B pages; unpooled, pooled at the profile's thresholds, and pooled with the
# thresholds scaled up (x1.3, x1.6; then x4, x8: the first two moved the bytes little) to bracket the unpooled
# bytes. Resumable, one core.
#   bash benchmarks/accuracy/ruler/spans10.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
M=diffkv-compact-meta
for method in "$M+page_bytes=1472+score_spans=true" "$M+page_bytes=1472" "$M@x1.3+page_bytes=1472+score_spans=true" \
              "$M@x1.6+page_bytes=1472+score_spans=true" "$M@x4+page_bytes=1472+score_spans=true" \
              "$M@x8+page_bytes=1472+score_spans=true"; do
  env OMP_NUM_THREADS=1 nice -n 10 $PY -m diffkv.eval run --no-progress --model qwen2.5-0.5b --task ruler \
    --ruler-lengths 4096 --ruler-samples 10 --ruler-families niah_single_3,niah_multikey_3 \
    --profile profiles/qwen2.5-0.5b.json --methods "$method" --out benchmarks/accuracy/ruler/spans-10
done
