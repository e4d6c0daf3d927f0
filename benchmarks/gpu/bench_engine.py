"""The serving engine on CUDA: the ``fp16`` paged KV cache vs ``diffkv``, decode tokens/s and requests running.

    python benchmarks/gpu/bench_engine.py --out "$OUT"                      # the H200 session (session.sh)
    python benchmarks/gpu/bench_engine.py --device cpu --dtype float32 --tiny --requests 4 --prompt-len 48 \
        --new-tokens 4 --batch 4 --kv-budget 1MiB --out /tmp/e             # CPU smoke of the script itself

Two runs, each serving the same prompts through one engine per cache, stepped in turn (both see the same load):

1. ``equal_batch``: a budget that holds every request (``--big-budget``), at most ``--batch`` running: decode
   tokens/s of each cache at the same batch (target: diffkv >= fp16);
2. ``equal_budget``: both caches in ``--kv-budget`` bytes (everything a cache holds counts): peak and mean requests
   running, preemptions, decode tokens/s (target: more running with diffkv).

decode tokens/s = tokens made by decode steps / the engine's time in decode steps (``Engine.counters.decode_seconds``;
each step ends with the sampled tokens on the host, so it includes the device time).

Model: qwen2.5-0.5b (24 layers, 14 query / 2 KV heads, head_dim 64) in ``--dtype``. Weights from ``--model-dir`` or
the registry's folder (``diffkv models pull qwen2.5-0.5b``, which needs the network); where neither holds weights
(the GPU machine has no network and the 2 GB of weights do not travel with the repo), random weights from the
model's config: the shapes and so the speed per step are the model's, but attention over random weights is not
the trained model's, so diffkv's compression and the requests it fits are not representative (``weights`` says
which). Prompts are random token ids (GSM8K needs the data registry): ``ignore_eos``, greedy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

MODEL = "qwen2.5-0.5b"
QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)


class NoTokenizer:
    """What the engine asks of a tokenizer, for token-id prompts without the model's tokenizer files."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def load(args, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer, what the weights are)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    from diffkv.registry.models import load_model, model_dir

    folder = Path(args.model_dir) if args.model_dir else None if args.tiny else model_dir(MODEL)
    if folder is not None and any(folder.glob("*.safetensors")):
        model, tok = load_model(str(folder), dtype=dtype, device=str(device))
        return model, tok, f"trained ({folder})"
    if folder is not None and (folder / "config.json").is_file():
        config = AutoConfig.from_pretrained(str(folder))
    else:
        config = Qwen2Config(**(TINY if args.tiny else QWEN05))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    why = "tiny config" if args.tiny else f"{MODEL} config; no weights in {folder} (not pulled, or no network)"
    return model.eval(), NoTokenizer(), f"random ({why})"


def serve(model, tok, kinds, budget: int, max_running: int, prompts, args, seconds: float,
          new_tokens: int | None = None) -> dict:
    """Serve ``prompts`` through one engine per cache kind, stepped in turn, for at most ``seconds`` (then the
    summary says ``stopped_by_time_limit``); a summary per kind."""
    from diffkv.engine import Engine, SamplingParams, make_cache

    params = SamplingParams(max_new_tokens=new_tokens or args.new_tokens, ignore_eos=True)
    runs = []
    for kind in kinds:
        cache = make_cache(kind, model, kv_budget_bytes=budget, max_slots=max_running,
                           max_model_len=args.prompt_len + args.new_tokens + 1)
        engine = Engine(model, tok, cache, max_running=max_running)
        runs.append({"kind": kind, "engine": engine, "reqs": [engine.add_request(p, params) for p in prompts],
                     "time": 0.0, "deadline": False, "compression": []})
    start = time.perf_counter()
    while any(r["engine"].has_work() for r in runs):
        if time.perf_counter() - start > seconds:
            for r in runs:
                r["deadline"] = r["engine"].has_work()
            break
        for r in runs:
            if r["engine"].has_work():
                t = time.perf_counter()
                r["engine"].step()
                r["time"] += time.perf_counter() - t
                c = r["engine"].metrics().get("compression_physical")
                if c:
                    r["compression"].append(c)
    out = {}
    for r in runs:
        e, reqs, comp = r["engine"], r["reqs"], r["compression"]
        c = e.counters
        tokens = sum(len(q.output_ids) for q in reqs)
        out[r["kind"]] = {
            "decode_tokens_per_s": round(c.decoded_rows / max(c.decode_seconds, 1e-9), 2),
            "tokens_per_s": round(tokens / max(r["time"], 1e-9), 2), "generated_tokens": tokens,
            "completed": sum(q.finish_reason == "length" for q in reqs), "requests": len(reqs),
            "stopped_by_time_limit": r["deadline"], "peak_running": e.peak_running,
            "mean_decode_batch": round(c.decoded_rows / max(c.decode_steps, 1), 2), "decode_steps": c.decode_steps,
            "decode_s": round(c.decode_seconds, 3), "prefill_s": round(c.prefill_seconds, 3),
            "time_s": round(r["time"], 3), "preemptions": c.preemptions, "pool_pages": e.cache.num_pages,
            "kv_budget_bytes": budget, "attention_backend": getattr(e.cache, "attention_backend", None),
            "mean_compression_physical": round(sum(comp) / len(comp), 3) if comp else None,
            "errors": sum(q.finish_reason == "error" for q in reqs)}
    return out


def main(argv=None) -> int:
    from diffkv.core.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for engine.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--model-dir", default=None, help="a folder with config.json (+ safetensors for real weights)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer random model (CPU smoke)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (random ids)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--batch", type=int, default=32, help="most requests running in the equal_batch run")
    p.add_argument("--big-budget", default="1GiB", help="KV bytes per cache in the equal_batch run")
    p.add_argument("--kv-budget", default="48MiB", help="KV bytes per cache in the equal_budget run")
    p.add_argument("--max-seconds", type=float, default=120.0, help="the script's time: after the model and a "
                   "warm-up (kernel compiles), each run gets an equal share of what is left")
    args = p.parse_args(argv)
    start = time.perf_counter()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, tok, weights = load(args, device, dtype)
    print(f"engine bench: {MODEL if not args.tiny else 'tiny'} in {args.dtype} on {device}, weights: {weights}",
          flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.requests)]
    kinds = ("fp16", "diffkv")
    report = {"model": MODEL if not args.tiny else "tiny", "dtype": args.dtype, "device": str(device),
              "weights": weights, "requests": args.requests, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "date": time.strftime("%Y-%m-%d"),
              "commit": os.environ.get("COMMIT", "unknown")}
    t = time.perf_counter()
    serve(model, tok, kinds, parse_bytes(args.big_budget), 2, prompts[:2], args, args.max_seconds, new_tokens=2)
    print(f"warm-up (2 requests, 2 tokens, both caches; compiles the kernels): {time.perf_counter() - t:.1f} s",
          flush=True)
    runs = (("equal_batch", args.big_budget, args.batch), ("equal_budget", args.kv_budget, args.requests))
    for i, (name, budget, running) in enumerate(runs):
        t = time.perf_counter()
        seconds = (args.max_seconds - (t - start)) / (len(runs) - i)
        report[name] = res = serve(model, tok, kinds, parse_bytes(budget), running, prompts, args, seconds)
        f, d = res["fp16"], res["diffkv"]
        print(f"{name} ({budget} KV per cache, at most {running} running; {time.perf_counter() - t:.1f} s wall "
              f"of {seconds:.0f} s allowed): "
              + "; ".join(f"{k}: decode {r['decode_tokens_per_s']:.1f} tok/s, peak running {r['peak_running']}, "
                          f"mean decode batch {r['mean_decode_batch']}, preemptions {r['preemptions']}, "
                          f"completed {r['completed']}/{r['requests']}, compression "
                          f"{r['mean_compression_physical']}x" for k, r in res.items())
              + f"; diffkv/fp16 decode tok/s {d['decode_tokens_per_s'] / max(f['decode_tokens_per_s'], 1e-9):.2f}x, "
              f"peak running {d['peak_running'] / max(f['peak_running'], 1):.2f}x", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "engine.json"), "w") as fh:  # after each run: a cut step keeps the first
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
