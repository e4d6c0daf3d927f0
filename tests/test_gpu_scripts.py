"""The GPU session's scripts run end to end on CPU (Triton interpreter, tiny shapes), so a lent GPU's few minutes
are not lost to a script error: ``benchmarks/gpu/bench_decode.py`` (streams and split kernels vs SDPA),
``benchmarks/gpu/session.sh`` (its plumbing and the engine step, ``SMOKE=1``) and the scripts' bash syntax."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_decode_smoke_on_cpu(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu/bench_decode.py", "--device", "cpu", "--contexts", "96",
                           "--batches", "1", "--shapes", "smollm2", "--reps", "1", "--rounds", "1", "--host-calls",
                           "1", "--copy-mib", "4", "--sweep", "smollm2/96/1", "--warps", "1", "2",
                           "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "decode_attention.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["context"] == 96 and rows[0]["n_high"] + rows[0]["n_low"] == 96
    row = rows[0]
    assert not [key for key in row if key.endswith("_error")], row
    for key in ("streams_ms", "split_ms", "sdpa_fp16_ms", "streams_host_us", "split_host_us", "sdpa_fp16_host_us",
                "streams_GBps", "split_GBps", "streams_pct_of_copy", "streams_x_sdpa", "split_x_sdpa",
                "streams_scores_ms", "streams_w1_ms", "streams_w2_ms"):
        assert row[key] > 0, key
    assert set(row["timing"].values()) == {"wall"}  # CPU: wall time (CUDA: "graph")
    md = (tmp_path / "decode_attention.md").read_text()
    assert "| smollm2 | 96 | 1 |" in md and "warps per program" in md and "—" not in md


def test_session_smoke_on_cpu(tmp_path):
    """session.sh with SMOKE=1: the env step and the engine step (fp16 vs diffkv, a 2-layer random model)."""
    env = {**os.environ, "SMOKE": "1", "STEPS": "env engine", "OUT": str(tmp_path), "COMMIT": "smoke"}
    proc = subprocess.run(["bash", "benchmarks/gpu/session.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "step env: exit 0" in summary and "step engine: exit 0" in summary, summary
    assert "copy bandwidth" in (tmp_path / "env.txt").read_text()
    report = json.loads((tmp_path / "engine.json").read_text())
    assert report["commit"] == "smoke" and report["weights"].startswith("random")
    for run in ("equal_batch", "equal_budget"):
        for kind in ("fp16", "diffkv"):
            r = report[run][kind]
            assert r["completed"] == r["requests"] and r["errors"] == 0 and r["decode_tokens_per_s"] > 0, (run, kind)
    assert (tmp_path / "session_log.txt").is_file() and len(list(tmp_path.iterdir())) <= 8


def test_gpu_scripts_parse():
    for script in ("benchmarks/gpu/session.sh", "benchmarks/gpu_check.sh", "benchmarks/gpu/failing.sh"):
        subprocess.run(["bash", "-n", script], cwd=ROOT, check=True)
