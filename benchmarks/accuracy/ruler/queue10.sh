#!/usr/bin/env bash
# Issue #46: every RULER-10 run still to do, in order, as two lanes of one core each (start both, one per core;
# each step resumes where an earlier session stopped, finished steps take seconds to skip). Start both in the same
# checkout: the ask-after presses are shared by the two lanes through their output files.
#   nohup bash benchmarks/accuracy/ruler/queue10.sh diffkv > diffkv.log 2>&1 &
#   nohup bash benchmarks/accuracy/ruler/queue10.sh peers  > peers.log  2>&1 &
# diffkv: score_spans at thresholds x2 on all 12 families (item 4's fix nearer the shipped bytes; x4 is done),
# ask-after DiffKV (repeat scores, x64), then the ask-after presses from the last sample, then qwen2.5-1.5b DiffKV.
# peers: kvpress in-prompt at DiffKV's in-prompt bytes (6.72x: the ratio of its first 24 samples; the 120 measured
# 6.70x, 0.3% more bytes than the presses get), then ask-after at DiffKV's measured ask-after bytes (its metrics.json,
# or while it runs the bytes-weighted ratio of its first >= 24 samples), then the qwen2.5-1.5b full cache.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=benchmarks/accuracy/ruler
X64="$R/ask-after-10/qwen2.5-0.5b/ruler/diffkv-compact-meta@x64+page_bytes=1472+importance=peak+prompt_scores=repeat"
case ${1:?lane: diffkv or peers} in
  diffkv)
    bash $R/run10.sh spans 2
    bash $R/run10.sh ask-after
    # then a second core on the ask-after presses, last sample first (same files as the peers lane)
    REVERSE=1 bash $R/peers10.sh ask-after "$(python3 $R/ratio10.py "$X64")" kvzip expected_attention
    bash $R/run15.sh diffkv ;;
  peers)
    bash $R/peers10.sh in-prompt 6.72 snapkv expected_attention kvzip
    # SnapKV ran at 5.61x, the ratio of the DiffKV run's first 97 samples (1.6% fewer bytes than its final 5.52x)
    bash $R/peers10.sh ask-after 5.61 snapkv
    bash $R/peers10.sh ask-after "$(python3 $R/ratio10.py "$X64")" kvzip expected_attention
    bash $R/run15.sh full ;;
  *) echo "unknown lane $1 (diffkv or peers)" >&2; exit 2 ;;
esac
