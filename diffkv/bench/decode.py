"""`diffkv bench decode`: greedy decode speed of DiffKVCache vs DynamicCache on one long prompt, side by side.

    diffkv bench decode --model smollm2-135m --prompt-tokens 2048 --new-tokens 128 --json

The full cache runs before and after DiffKV; the ratio uses their mean (the machines are shared and noisy).
"""

from __future__ import annotations

import json
import platform
import time

import torch


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--alpha-high", type=float, default=1.0)
    p.add_argument("--alpha-low", type=float, default=0.02)
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from transformers import DynamicCache

    from diffkv.config import DiffKVConfig
    from diffkv.demo import timed_generate
    from diffkv.integrations.transformers import DiffKVCache
    from diffkv.models import load_model
    from diffkv.prompts import essay_tokens

    model, tok = load_model(args.model)
    ids = torch.tensor([essay_tokens(tok, args.prompt_tokens)])
    cfg = DiffKVConfig(alpha_high=args.alpha_high, alpha_low=args.alpha_low)
    full_tps = []
    _, _, tps = timed_generate(model, ids, DynamicCache(config=model.config), args.new_tokens, stop_at_eos=False)
    full_tps.append(tps)
    cache = DiffKVCache(model, cfg)
    new, _, dkv_tps = timed_generate(model, ids, cache, args.new_tokens, stop_at_eos=False)
    stats = cache.stats()
    cache.release()
    _, _, tps = timed_generate(model, ids, DynamicCache(config=model.config), args.new_tokens, stop_at_eos=False)
    full_tps.append(tps)
    full = sum(full_tps) / len(full_tps)
    report = {
        "model": args.model, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "config": {"high": cfg.high.name, "low": cfg.low.name, "alpha_high": cfg.alpha_high,
                   "alpha_low": cfg.alpha_low},
        "full_tokens_per_s": [round(x, 3) for x in full_tps],
        "diffkv_tokens_per_s": round(dkv_tps, 3),
        "speed_ratio": round(dkv_tps / full, 3),
        "compression_physical": round(stats["compression_physical"], 3),
        "compression_theoretical": round(stats["compression_theoretical"], 3),
        "tier_fractions": {k: round(v, 4) for k, v in stats["tier_fractions"].items()},
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"full {full:.2f} tok/s, DiffKV {dkv_tps:.2f} tok/s: speed_ratio {report['speed_ratio']:.2f}, "
              f"physical compression {report['compression_physical']:.2f}x")
    return 0
