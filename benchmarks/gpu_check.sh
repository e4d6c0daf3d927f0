#!/usr/bin/env bash
# Kept for the commands recorded in benchmarks/gpu/results/ (2026-12-04): the GPU session is now
# benchmarks/gpu/session.sh (at most 8 min; its header lists the steps). Same variables: $OUT (default now
# benchmarks/gpu/results/<date>-<commit>/), SKIP_DECODE=1 drops the decode step; STEPS=... picks steps.
cd "$(dirname "$0")/.." || exit 1
[ -n "${SKIP_DECODE:-}" ] && export STEPS="${STEPS:-env tests engine}"
exec bash benchmarks/gpu/session.sh "$@"
