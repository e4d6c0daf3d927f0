"""The GPU session's scripts run end to end on CPU (Triton interpreter, tiny shapes), so a lent GPU's few minutes
are not lost to a script error: ``benchmarks/gpu/bench_decode.py`` and ``benchmarks/gpu_check.sh``'s syntax."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_decode_smoke_on_cpu(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu/bench_decode.py", "--device", "cpu", "--contexts", "96",
                           "--batches", "1", "--shapes", "smollm2", "--iters", "1", "--copy-mib", "4",
                           "--num-warps", "4", "8", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "decode_attention.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["context"] == 96 and rows[0]["n_high"] + rows[0]["n_low"] == 96
    for key in ("kernel_ms", "kernel_scores_ms", "torch_ref_ms", "sdpa_fp16_ms", "kernel_pct_of_copy", "kernel_w8_ms"):
        assert rows[0][key] > 0, key
    md = (tmp_path / "decode_attention.md").read_text()
    assert "| smollm2 | 96 | 1 |" in md and "w8 (same kernel" in md


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=ROOT, check=True)
