"""Issue #45 inside vLLM: the shared-prefix workload of ``run.py`` (32 questions on a ~2.45k-token document) through
vLLM on CPU, side by side in one run, both engines given the same KV memory (``kv_cache_memory_bytes``):

* ``vllm-cpu``: vLLM's CPU attention with its prefix cache (vLLM's defaults): the first request computes the
  document, the others read its fp16 blocks;
* ``diffkv``: the DiffKV plug-in and connector with shared prefixes (``diffkv.integrations.vllm.prefix_map``): one
  prime request stores the document once, compressed, scored by its re-read copy; every question reads it as an
  external hit (vLLM computes only the question) and shares its pages. Same thresholds as ``run.py``'s ``diffkv``.

Per engine, in a child process (vLLM reads the DiffKV switch from the environment at start): time to first token
of the first question alone (a miss: the document is computed; for DiffKV the prime, then the question) and of the
second alone (a hit), then all questions at once (wall time, answers, the most KV bytes in use at any step: vLLM's
blocks in use x block bytes; DiffKV's pool pages in use x page bytes). The model runs in float32 (vLLM's CPU
backend on this AVX2 machine), so vLLM's blocks hold fp32 K/V: half of it is what fp16 blocks would hold.

    python benchmarks/serve/prefix/vllm_run.py --out benchmarks/serve/prefix/vllm_results.json
(run it with the vLLM venv's python; README "Inside vLLM").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONNECTOR = {"kv_connector": "DiffKVConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "diffkv.integrations.vllm.connector"}


def config_json(model_name: str, method: str, profile: str) -> str:
    """The DiffKV config of ``method`` as ``DIFFKV_VLLM_CONFIG`` JSON (window scores: primes score by repeat)."""
    from diffkv.core.config import DiffKVConfig
    from diffkv.eval.methods import get_method
    from diffkv.registry.models import load_model

    model, _ = load_model(model_name)
    cfg = dataclasses.replace(get_method(method).storage(model, profile), prompt_scores="window")
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields["high"], fields["low"] = str(cfg.high), str(cfg.low)
    text = json.dumps(fields)
    if DiffKVConfig(**json.loads(text)) != cfg:
        raise RuntimeError("the DiffKV config does not survive JSON; extend config_json")
    return text


def fp16_bytes_per_token(model_name: str) -> int:
    """Bytes of one token's fp16 K and V over every layer: an fp16 prefix cache's floor."""
    from diffkv.registry.models import model_dir

    c = json.loads((model_dir(model_name) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * 2


def job(kind: str, args) -> dict:
    """One engine's run (in a child process)."""
    from run import answer, workload  # this folder's run.py (on PYTHONPATH)
    from vllm import LLM, SamplingParams

    from diffkv.integrations.vllm.backend import worker_stats
    from diffkv.integrations.vllm.prefix_map import BRIDGE, prime_prompt, reader_params
    from diffkv.registry.models import model_dir

    diffkv = kind == "diffkv"
    llm = LLM(model=str(model_dir(args.model)), kv_transfer_config=CONNECTOR if diffkv else None, dtype="float32",
              enforce_eager=True, max_model_len=args.max_len, max_num_batched_tokens=args.max_len,
              max_num_seqs=args.questions + 2, kv_cache_memory_bytes=args.kv_bytes, seed=0, disable_log_stats=False,
              block_size=args.block_size)
    tok = llm.get_tokenizer()
    prefix, questions = workload(tok, args.questions, args.doc_tokens)
    extra = {"kv_transfer_params": reader_params(len(prefix))} if diffkv else None
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True, extra_args=extra)
    first = SamplingParams(max_tokens=1, temperature=0, extra_args=extra)
    prompts = [prefix + q for q, _ in questions]

    def used_bytes() -> int:
        if diffkv:
            s = llm.collective_rpc(worker_stats)[0]
            return (s["pages"] - s["free_pages"]) * s["page_bytes"]
        usage = [m.value for m in llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc"]
        return round(usage[0] * args.kv_bytes) if usage else -1

    t0 = time.perf_counter()
    if diffkv:
        prime, prime_params = prime_prompt(prefix, tok(BRIDGE, add_special_tokens=False).input_ids)
        llm.generate([{"prompt_token_ids": prime}], SamplingParams(max_tokens=1,
                                                                   extra_args={"kv_transfer_params": prime_params}))
    llm.generate([{"prompt_token_ids": prompts[0]}], first, use_tqdm=False)
    ttft_miss = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompts[1]}], first, use_tqdm=False)
    ttft_hit = time.perf_counter() - t0
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done, peak, t0 = {}, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.split("-")[0])] = list(out.outputs[0].token_ids)
        peak = max(peak, used_bytes())
    wall = time.perf_counter() - t0
    got = [done[i] for i in range(len(prompts))]
    codes = [c for _, c in questions]
    return {"prefix_tokens": len(prefix), "question_tokens": [len(q) for q, _ in questions],
            "ttft_miss_s": round(ttft_miss, 2), "ttft_hit_s": round(ttft_hit, 2),
            "all_wall_s": round(wall, 1), "peak_kv_bytes": peak, "answers": [answer(tok, g) for g in got],
            "correct": sum(answer(tok, g) == c for g, c in zip(got, codes, strict=True)), "tokens": got,
            "held_after": used_bytes()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--profile", default="benchmarks/calibration/qwen2.5-0.5b-full-smooth.json")
    ap.add_argument("--method", default='diffkv@x256+importance="peak"')
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--kv-bytes", type=int, default=160 << 20,
                    help="KV memory given to each engine (vLLM needs one max-len request of fp32 blocks)")
    ap.add_argument("--max-len", type=int, default=5120, help="max_model_len = one step's tokens (the prime's)")
    ap.add_argument("--block-size", type=int, default=32, help="vLLM's block size (tokens), both engines")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--out", required=True)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        result = job(args.job, args)
        Path(args.out).write_text(json.dumps(result))
        return
    here = Path(__file__).resolve().parent
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", OMP_NUM_THREADS=args.threads,
               VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONPATH=os.pathsep.join([str(here), os.environ.get(
                   "PYTHONPATH", "")]))
    runs = {}
    for kind in ("vllm-cpu", "diffkv"):
        run_env = dict(env, DIFFKV_VLLM_BACKEND="1", DIFFKV_VLLM_CONFIG=config_json(
            args.model, args.method, args.profile), DIFFKV_VLLM_ADMIT="64") if kind == "diffkv" else env
        part = Path(args.out).with_suffix(f".{kind}.json")
        argv = [a for a in sys.argv[1:]] + ["--job", kind]
        argv[argv.index("--out") + 1] = str(part)
        proc = subprocess.run([sys.executable, __file__, *argv], env=run_env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{kind} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        runs[kind] = json.loads(part.read_text())
        part.unlink()
    base, ours = runs["vllm-cpu"], runs["diffkv"]
    fp16_ideal = fp16_bytes_per_token(args.model) * (base["prefix_tokens"] + sum(
        q + args.new_tokens for q in base["question_tokens"]))  # the tokens held at the end, prefix once
    out = {"command": "python benchmarks/serve/prefix/vllm_run.py " + " ".join(
        f"--{k.replace('_', '-')} '{v}'" for k, v in vars(args).items() if k not in ("out", "job")),
        "bytes_vs_vllm_prefix_cache": round(base["peak_kv_bytes"] / ours["peak_kv_bytes"], 2),
        "bytes_vs_fp16_prefix_cache_ideal": round(fp16_ideal / ours["peak_kv_bytes"], 2),
        "fp16_ideal_bytes": fp16_ideal,
        "ttft_hit_diffkv_vs_vllm": round(ours["ttft_hit_s"] / base["ttft_hit_s"], 2),
        "wall_diffkv_vs_vllm": round(ours["all_wall_s"] / base["all_wall_s"], 2),
        "answer_matches_vllm": sum(a == b for a, b in zip(ours["answers"], base["answers"], strict=True)),
        **runs, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
