"""Where diffkv keeps files in the user's home: the cache (pulled models and data, compiled C kernels, calibration
statistics) and the results of runs the user starts."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """Root of the diffkv cache: ``$DIFFKV_HOME`` or ``~/.cache/diffkv``."""
    return Path(os.environ.get("DIFFKV_HOME") or Path.home() / ".cache" / "diffkv").expanduser()


def results_home() -> Path:
    """Default folder for results a user runs: ``$DIFFKV_RESULTS`` or ``$XDG_DATA_HOME/diffkv/results``
    (``~/.local/share/diffkv/results``). The checkout's recorded results are written only with an explicit --out."""
    if os.environ.get("DIFFKV_RESULTS"):
        return Path(os.environ["DIFFKV_RESULTS"]).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data).expanduser() / "diffkv" / "results"
