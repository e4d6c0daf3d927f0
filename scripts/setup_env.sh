#!/usr/bin/env bash
# Create .venv and install diffkv with pinned versions (CPU torch). Idempotent: a finished install leaves
# .venv/.diffkv-installed and a rerun with unchanged pins does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DIFFKV_VENV:-.venv}
STAMP="$VENV/.diffkv-installed"
WANT="$(cat requirements/constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# torch first and pinned: an open range would pull a multi-GB CUDA build. [eval] (lm-eval) is needed by the
# lm-eval integration tests.
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet -c requirements/constraints.txt -e ".[dev,gguf,eval,notebooks]"
echo "$WANT" > "$STAMP"
