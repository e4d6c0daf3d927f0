"""The suite cannot pass with its compiled CPU cases gone: a failing C compiler stops ``pytest`` with an error."""

import os
import subprocess
import sys
from pathlib import Path


def test_a_failing_compiler_fails_the_run(tmp_path):
    env = {**os.environ, "CC": "false", "DIFFKV_HOME": str(tmp_path / "home")}  # no cached library to fall back on
    env.pop("DIFFKV_TORCH_ONLY", None)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_config.py"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "the compiled CPU paths ['diffkv.memory.ring_cpu', 'diffkv.ops.decode_cpu'] did not build" in proc.stdout
    assert " passed" not in proc.stdout  # stopped before any test ran
