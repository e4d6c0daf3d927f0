"""Every Triton kernel compiles for an H200 (sm_90a) with Triton's real NVIDIA backend and ptxas, on a machine
without a GPU.

The interpreter tests check what the kernels compute, but the interpreter runs kernel code as Python and accepts
code the compiler rejects (a plain-float global, ``NEG_BIG``, broke both decode kernels on every GPU until this
check). Here a few interpreter tests record their launches (tests/conftest.py), and
``benchmarks/gpu/compile_sm90.py`` compiles each one for sm_90a, with the options the CUDA launchers use.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")

ROOT = Path(__file__).resolve().parents[1]
ONE_OR_TWO_EACH = [  # small interpreter tests that launch every kernel
    "tests/test_kernel_paged_attention.py::test_llama3_8b_head_shape_fp16",
    "tests/test_kernel_place_store.py::test_one_tier",
    "tests/test_kernel_prefill_scores.py::test_left_padding_gqa7_window_longer_than_prompt",
    "tests/test_kernel_prefill_scores.py::test_head_dim_256_fp32_launcher_tiles",  # 3 stages needed 256 KiB
    "tests/test_memory_kernel.py::test_reserve_kernel_matches_torch[True-one head-triton]",
    "tests/test_memory_kernel.py::test_release_kernel_matches_torch[True-one head-triton]",
    "tests/test_store.py::test_kernel_bit_exact_fp32_meta_and_raw",
    "tests/test_decode_step.py::test_triton_step_matches_reference_for_lean_metadata[peak-compact-after-window]",
    "tests/test_importance.py::test_triton_prefill_peak_matches_the_reference",
    "tests/test_kernel_paged_attention.py::test_presets[tiers2]",  # 3-bit codes (two bit planes)
    "tests/test_kernel_place_store.py::test_three_bit_tiers_keys_below_values",
]
KERNELS = {"paged_decode_split_kernel", "paged_decode_streams_kernel", "paged_decode_reduce_kernel",
           "place_store_kernel", "row_stats_kernel", "column_scores_kernel", "reserve_kernel", "release_kernel",
           "store_kernel"}


def test_every_kernel_compiles_for_h200(tmp_path):
    record = tmp_path / "launches.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1", "DIFFKV_RECORD_LAUNCHES": str(record)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ONE_OR_TWO_EACH],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DIFFKV_RECORD_LAUNCHES")}
    proc = subprocess.run([sys.executable, "benchmarks/gpu/compile_sm90.py", str(record), "--out", str(tmp_path / "r")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert {r["kernel"] for r in rows} == KERNELS
    assert all(r["ok"] and r["registers"] > 0 and r["shared_bytes"] <= 227 * 1024 for r in rows)
    assert "Failed: 0" in (tmp_path / "r.md").read_text()
