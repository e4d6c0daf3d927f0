"""Every tracked path can be checked out anywhere (issue #47): only ``[A-Za-z0-9._@+=-/]`` in names (no quotes,
spaces or colons, which Windows or shells trip on); run folders of quoted method specs drop the quotes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from diffkv.eval.runner import RunConfig

ROOT = Path(__file__).resolve().parents[1]


def test_no_tracked_path_has_characters_outside_the_safe_set():
    try:
        out = subprocess.run(["git", "-c", "core.quotepath=off", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    bad = [p for p in out.split("\0") if p and not re.fullmatch(r"[A-Za-z0-9._@+=/-]+", p)]
    assert not bad, bad[:10]


def test_run_folders_of_quoted_methods_have_no_quotes(tmp_path):
    cfg = RunConfig(model="qwen2.5-0.5b", task="needle", method='diffkv@x256+importance="peak"', out=str(tmp_path))
    assert cfg.run_dir() == tmp_path / "qwen2.5-0.5b" / "needle" / "diffkv@x256+importance=peak"
