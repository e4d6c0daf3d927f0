"""Issue #62 item 4: the same greedy answer alone and in batches of 4 and 8 inside vLLM? 16 essay prompts (the first
``--chars`` characters of pg-essays texts and a request for a summary), 60 greedy tokens each, sent one at a time,
then 4 at once, then 8 at once, through one engine per mode, each in its own child process:

* ``vllm-cpu``: vLLM's own CPU attention (fp32 K/V);
* ``diffkv``: the DiffKV plug-in and connector (``DIFFKV_VLLM_PROFILE``: the model's shipped profile);
* ``diffkv-invariant``: the same with ``DIFFKV_VLLM_BATCH_INVARIANT=1`` (vLLM's linear layers in 16-row products,
  ``diffkv.integrations.vllm.invariance``).

Per mode: how many prompts get another answer in a batch than alone, and where the first differs.

    ~/.venvs/diffkv-vllm/bin/python benchmarks/serve/batch_invariance/vllm_batches.py \\
        --out benchmarks/serve/batch_invariance/vllm_batches.json
(the vLLM venv's python; README "Inside vLLM").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONNECTOR = {"kv_connector": "DiffKVConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "diffkv.integrations.vllm.connector"}
MODES = ("vllm-cpu", "diffkv", "diffkv-invariant")


def prompts(tok, n: int, chars: int) -> list[list[int]]:
    from diffkv.registry.data import load_dataset

    essays = load_dataset("pg-essays")
    return [tok(essays[i]["text"][:chars] + "\n\nSummarize the essay above in one paragraph:\n").input_ids
            for i in range(n)]


def job(mode: str, args) -> dict:
    """One engine (in a child process): every prompt alone, then in groups of each batch size."""
    from vllm import LLM, SamplingParams

    from diffkv.registry.models import model_dir

    llm = LLM(model=str(model_dir(args.model)), kv_transfer_config=None if mode == "vllm-cpu" else CONNECTOR,
              dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=max(args.batches), seed=0,
              kv_cache_memory_bytes=args.kv_bytes)
    ids = prompts(llm.get_tokenizer(), args.prompts, args.chars)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)

    def run(group: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in group], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    t0 = time.perf_counter()
    result = {"alone": [run([p])[0] for p in ids], "prompt_tokens": [len(p) for p in ids]}
    result["alone_s"] = round(time.perf_counter() - t0, 1)
    for b in args.batches:
        t0 = time.perf_counter()
        result[f"batch{b}"] = [t for i in range(0, len(ids), b) for t in run(ids[i:i + b])]
        result[f"batch{b}_s"] = round(time.perf_counter() - t0, 1)
    return result


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--chars", type=int, default=1600, help="characters of each essay (~400 tokens)")
    ap.add_argument("--new-tokens", type=int, default=60)
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--kv-bytes", type=int, default=256 << 20)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--out", required=True)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        Path(args.out).write_text(json.dumps(job(args.job, args)))
        return
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               OMP_NUM_THREADS=args.threads, VLLM_CPU_OMP_THREADS_BIND="nobind")
    out = {"command": "python benchmarks/serve/batch_invariance/vllm_batches.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("out", "job")), "runs": {}}
    for mode in args.modes:
        run_env = env if mode == "vllm-cpu" else dict(env, DIFFKV_VLLM_BACKEND="1", DIFFKV_VLLM_PROFILE=args.model,
                                                       DIFFKV_VLLM_ADMIT="8")
        if mode == "diffkv-invariant":
            run_env["DIFFKV_VLLM_BATCH_INVARIANT"] = "1"
        part = Path(args.out).with_suffix(f".{mode}.json")
        argv = [*sys.argv[1:], "--job", mode]
        argv[argv.index("--out") + 1] = str(part)
        proc = subprocess.run([sys.executable, __file__, *argv], env=run_env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{mode} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        run = json.loads(part.read_text())
        part.unlink()
        for b in args.batches:
            firsts = [first_difference(a, x) for a, x in zip(run["alone"], run[f"batch{b}"], strict=True)]
            run[f"batch{b}_differ"] = sum(f is not None for f in firsts)
            run[f"batch{b}_first_difference"] = firsts
            print(f"{mode}: {run[f'batch{b}_differ']} / {len(firsts)} differ alone vs {b} at once "
                  f"(first tokens {sorted(f for f in firsts if f is not None)})", flush=True)
        out["runs"][mode] = run
        out["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
