"""The compiled CPU decode step against the torch reference on a real model: greedy tokens, tier counts and logits.

    .venv/bin/python benchmarks/decode_backends.py --model qwen2.5-0.5b --context 1024 --new-tokens 128

Both caches get the same essay prompt and decode greedily (each step's token from its own logits); prints JSON with
the first step where the tokens differ (``new_tokens`` when none does), both caches' tier counts, and the largest
logit difference over the steps.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from diffkv import DiffKVConfig
from diffkv.integrations.transformers import DiffKVCache
from diffkv.prompts import essay_tokens
from diffkv.registry.models import load_model


def decode(model, ids, backend: str, steps: int):
    cache = DiffKVCache(model, DiffKVConfig(), attention_backend=backend)
    tokens, logits = [], []
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for _ in range(steps):
            last = out.logits[0, -1]
            logits.append(last)
            tokens.append(int(last.argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return tokens, torch.stack(logits), cache.stats()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    model, tok = load_model(args.model)
    ids = torch.tensor([essay_tokens(tok, args.context)])
    t0 = time.perf_counter()
    ref_tokens, ref_logits, ref_stats = decode(model, ids, "torch", args.new_tokens)
    cpu_tokens, cpu_logits, cpu_stats = decode(model, ids, "cpu", args.new_tokens)
    first = next((i for i, (a, b) in enumerate(zip(ref_tokens, cpu_tokens, strict=True)) if a != b), args.new_tokens)
    same = min(first + 1, args.new_tokens)  # logits are comparable up to the first differing token
    print(json.dumps({
        "model": args.model, "context": args.context, "new_tokens": args.new_tokens,
        "tokens_equal": first, "tier_counts": {"torch": ref_stats["tokens_per_tier"],
                                               "cpu": cpu_stats["tokens_per_tier"]},
        "tier_counts_equal": ref_stats["tokens_per_head"] == cpu_stats["tokens_per_head"],
        "max_abs_logit_diff": float((ref_logits[:same] - cpu_logits[:same]).abs().max()),
        "logit_scale": float(ref_logits.abs().max()), "seconds": round(time.perf_counter() - t0, 1),
        "date": time.strftime("%Y-%m-%d %H:%M")}, indent=2))


if __name__ == "__main__":
    main()
