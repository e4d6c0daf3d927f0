"""The wheel carries what an installed diffkv needs outside the checkout, and builds without deprecation warnings."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_has_the_package_data_and_builds_quietly(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path)], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert "deprecat" not in (build.stdout + build.stderr).lower(), build.stderr[-2000:]
    names = set(zipfile.ZipFile(next(tmp_path.glob("diffkv-*.whl"))).namelist())
    want = {"diffkv/profiles/smollm2-135m.json", "diffkv/profiles/qwen2.5-0.5b.json",
            "diffkv/lm_eval_tasks/diffkv_gsm8k.yaml", "diffkv/lm_eval_tasks/utils.py",
            "diffkv/kernels/decode_cpu.c", "diffkv/kernels/decode_cpu_attend.c", "diffkv/kernels/decode_cpu.h",
            "diffkv/memory/ring_cpu.c"}
    assert want <= names, sorted(want - names)
