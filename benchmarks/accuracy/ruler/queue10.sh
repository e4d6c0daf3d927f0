#!/usr/bin/env bash
# Issue #46: every RULER-10 run still to do, in order, as two lanes of one core each (start both, one per core;
# each step resumes where an earlier session stopped, finished steps take seconds to skip).
#   nohup bash benchmarks/accuracy/ruler/queue10.sh diffkv > diffkv.log 2>&1 &
#   nohup bash benchmarks/accuracy/ruler/queue10.sh peers  > peers.log  2>&1 &
# diffkv: score_spans on all 12 families (item 4's fix), ask-after DiffKV (repeat scores), qwen2.5-1.5b (run15.sh).
# peers: kvpress in-prompt at DiffKV's in-prompt bytes (6.72x: the ratio of its first 24 samples; the 120 measured
# 6.70x, 0.3% more bytes than the presses get), then ask-after at DiffKV's measured ask-after bytes.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=benchmarks/accuracy/ruler
case ${1:?lane: diffkv or peers} in
  diffkv)
    bash $R/run10.sh spans
    bash $R/run10.sh ask-after
    bash $R/run15.sh ;;
  peers)
    bash $R/peers10.sh in-prompt 6.72 snapkv expected_attention kvzip
    metrics=$(ls $R/ask-after-10/qwen2.5-0.5b/ruler/diffkv-*/metrics.json 2>/dev/null) ||
      { echo "ask-after DiffKV has no metrics.json yet: its bytes set the presses' ratio; finish the diffkv lane's first step" >&2; exit 1; }
    r=$(python3 -c "import json, sys; print(round(json.load(open(sys.argv[1]))['compression_physical'], 2))" $metrics)
    bash $R/peers10.sh ask-after "$r" snapkv expected_attention kvzip ;;
  *) echo "unknown lane $1 (diffkv or peers)" >&2; exit 2 ;;
esac
