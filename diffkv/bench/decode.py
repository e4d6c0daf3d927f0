"""`diffkv bench decode`: greedy decode speed of DiffKVCache vs DynamicCache on one long prompt, side by side.

    diffkv bench decode --model smollm2-135m --prompt-tokens 2048 --new-tokens 128 --json

Both caches are prefilled with the same prompt, then decoded **interleaved, one token each in turn** (the order
of the pair alternates every step), so both see the same machine load at the same time (the machines are shared and
noisy); ``speed_ratio`` = DiffKV tokens/s ÷ DynamicCache tokens/s over the same number of greedy steps.
"""

from __future__ import annotations

import json
import platform
import time

import torch

from diffkv.bench.common import add_config_arguments, bench_config


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=128)
    add_config_arguments(p)
    p.add_argument("--json", action="store_true")


class _Greedy:
    """Greedy decoding of one sequence through ``cache``, one timed step at a time."""

    def __init__(self, model, ids: torch.Tensor, cache):
        self.model, self.cache, self.seconds, self.tokens = model, cache, 0.0, []
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True)
        self.prefill_s = time.perf_counter() - t0
        self.next = out.logits[:, -1:].argmax(-1)

    def step(self) -> None:
        t0 = time.perf_counter()
        out = self.model(self.next, past_key_values=self.cache, use_cache=True)
        self.next = out.logits[:, -1:].argmax(-1)
        self.seconds += time.perf_counter() - t0
        self.tokens.append(int(self.next))


def run(args) -> int:
    from transformers import DynamicCache

    from diffkv.integrations.transformers import DiffKVCache
    from diffkv.models import load_model
    from diffkv.prompts import essay_tokens

    model, tok = load_model(args.model)
    ids = torch.tensor([essay_tokens(tok, args.prompt_tokens)])
    cfg = bench_config(args, model)
    cache = DiffKVCache(model, cfg)
    with torch.no_grad():
        full = _Greedy(model, ids, DynamicCache(config=model.config))
        dkv = _Greedy(model, ids, cache)
        for i in range(args.new_tokens - 1):
            for run_ in ((full, dkv) if i % 2 == 0 else (dkv, full)):
                run_.step()
    steps = max(args.new_tokens - 1, 1)
    full_tps, dkv_tps = steps / max(full.seconds, 1e-9), steps / max(dkv.seconds, 1e-9)
    stats = cache.stats()
    cache.release()
    same = next((i for i, (a, b) in enumerate(zip(full.tokens, dkv.tokens, strict=True)) if a != b), len(dkv.tokens))
    report = {
        "model": args.model, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "config": {"high": cfg.high.name, "low": cfg.low.name, "alpha_high": cfg.alpha_high,
                   "alpha_low": cfg.alpha_low, "profile": args.profile},
        "method": "interleaved: one greedy decode step of each cache in turn, pair order alternating",
        "full_tokens_per_s": round(full_tps, 3),
        "diffkv_tokens_per_s": round(dkv_tps, 3),
        "speed_ratio": round(dkv_tps / full_tps, 3),
        "prefill_s": {"full": round(full.prefill_s, 3), "diffkv": round(dkv.prefill_s, 3)},
        "tokens_equal_to_full": same,
        "compression_physical": round(stats["compression_physical"], 3),
        "compression_theoretical": round(stats["compression_theoretical"], 3),
        "tier_fractions": {k: round(v, 4) for k, v in stats["tier_fractions"].items()},
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"full {full_tps:.2f} tok/s, DiffKV {dkv_tps:.2f} tok/s: speed_ratio {report['speed_ratio']:.2f}, "
              f"physical compression {report['compression_physical']:.2f}x")
    return 0
