"""Offline vLLM throughput, DiffKV plug-in (first slice) vs vLLM's default CPU backend, smollm2-135m, fp32.

Run in the vllm venv (benchmarks/vllm/README.md), one engine per process; the parent runs both, alternating:
    nice -n 15 /tmp/vllm-venv/bin/python benchmarks/vllm/bench_plugin.py [rounds]
Prints one JSON line per engine run: backend, start-up seconds, batched and single-request tokens/s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are",
           "In 1969, humans first", "Water boils at", "The quick brown fox",
           "A list of prime numbers: 2, 3, 5,", "Photosynthesis is the process"]


def child(folder: str, backend: str) -> None:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    start_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0))  # warm
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS, params)
    batch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    one = llm.generate(PROMPTS[:1], params)
    single_s = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"backend": backend, "start_s": round(start_s, 1),
                                  "batch8_tok_s": round(n / batch_s, 1),
                                  "single_tok_s": round(len(one[0].outputs[0].token_ids) / single_s, 1),
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from diffkv.registry.models import model_dir

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               VLLM_CPU_KVCACHE_SPACE="1")
    tokens = {}
    for _ in range(rounds):
        for backend in ("default", "diffkv"):
            env.pop("DIFFKV_VLLM_BACKEND", None)
            if backend == "diffkv":
                env["DIFFKV_VLLM_BACKEND"] = "1"
            proc = subprocess.run([sys.executable, __file__, "--child", str(model_dir("smollm2-135m")), backend],
                                  env=env, capture_output=True, text=True, check=True)
            line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT "))
            result = json.loads(line[len("RESULT "):])
            tokens[backend] = result.pop("tokens")
            print(json.dumps(result), flush=True)
    print(json.dumps({"same_tokens": tokens["default"] == tokens["diffkv"]}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
