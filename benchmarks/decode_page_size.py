"""Decode speed and bytes of small pages on GSM8K-length sequences, side by side (#30 item 3).

    .venv/bin/python benchmarks/decode_page_size.py --pages 480,672,1216,1472,3360 --questions 3 --tokens 256 \
        --out benchmarks/results/decode/page_size_qwen2.5-0.5b.json

For each of the first ``--questions`` GSM8K questions, the full cache's greedy answer (``--tokens`` tokens) is fed one
token at a time to one DiffKVCache per page size (the shipped profile with ``compact_meta`` and that
``page_bytes``) and to a DynamicCache, in turn within each step (the order rotates), so every cache sees the same
tokens under the same machine load. The codes of a token do not depend on the page size, so the caches keep the same
tokens in the same tiers (up to near-ties of attention sums, which page boundaries can reorder) and differ in their
page bytes and per-page work. Reports per page size: decode tokens/s (and vs the full cache), physical compression
over the questions, and the tail and in-page waste the planner expects (``diffkv layout --expected-tokens``).
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from diffkv.core.layout import plan_for_config, tail_waste
from diffkv.eval.tasks import get_task
from diffkv.hf.shape import kv_shape
from diffkv.integrations.transformers import DiffKVCache
from diffkv.profile import load_profile
from diffkv.registry.models import load_model


def feed(model, cache, ids: torch.Tensor) -> float:
    """One decode step of ``ids`` [1, 1] through ``cache``; seconds."""
    t0 = time.perf_counter()
    model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--profile", default="benchmarks/calibration/qwen2.5-0.5b-full-smooth.json")
    ap.add_argument("--pages", default="480,672,1216,1472,3360")
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    base = dataclasses.replace(load_profile(args.profile, model).config, compact_meta=True)
    pages = [int(p) for p in args.pages.split(",")]
    names = ["full", *pages]
    seconds = dict.fromkeys(names, 0.0)
    fp16 = dict.fromkeys(pages, 0)
    held = dict.fromkeys(pages, 0)
    tiers = {p: {"high": 0, "low": 0, "pruned": 0} for p in pages}
    steps = 0
    samples = get_task("gsm8k").samples(tok)[:args.questions]
    with torch.no_grad():
        for sample in samples:
            prompt = tok.apply_chat_template(sample["messages"], add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
            answer = model.generate(prompt, max_new_tokens=args.tokens, do_sample=False)[0, prompt.shape[1]:]
            caches = {"full": DynamicCache(config=model.config)}
            caches.update({p: DiffKVCache(model, dataclasses.replace(base, page_bytes=p)) for p in pages})
            for cache in caches.values():
                model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            for i, token in enumerate(answer[:-1].tolist()):
                order = names[i % len(names):] + names[:i % len(names)]
                for name in order:
                    seconds[name] += feed(model, caches[name], torch.tensor([[token]]))
                steps += 1
            for p in pages:
                s = caches[p].stats()
                fp16[p] += s["fp16_bytes"]
                held[p] += s["bytes_in_pages"]
                tiers[p] = {k: v + s["tokens_per_tier"][k] for k, v in tiers[p].items()}
                caches[p].release()
    rows = []
    full_tps = steps / seconds["full"]
    mean_tokens = steps / len(samples) + prompt.shape[1]
    for p in pages:
        plan = plan_for_config(dataclasses.replace(base, page_bytes=p), kv_shape(model).head_dim)
        rows.append({"page_bytes": p, "tokens_per_s": round(steps / seconds[p], 3),
                     "vs_full": round(steps / seconds[p] / full_tps, 3),
                     "compression_physical": round(fp16[p] / held[p], 3), "bytes_in_pages": held[p],
                     "tokens_per_tier": tiers[p],
                     "tokens_per_page": [t.tokens_per_page for t in plan.tiers],
                     "in_page_waste": [round(t.waste_fraction, 4) for t in plan.tiers],
                     "tail_waste_at_mean_length": [round(tail_waste(t, int(mean_tokens)), 4) for t in plan.tiers]})
        print(json.dumps(rows[-1]), flush=True)
    record = {"command": "benchmarks/decode_page_size.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "model": args.model, "questions": len(samples), "steps": steps, "full_tokens_per_s": round(full_tps, 3),
              "threads": torch.get_num_threads(), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
