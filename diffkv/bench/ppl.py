"""`diffkv bench ppl`: perplexity of a PG-essay continuation decoded token by token through the cache.

The context (``--context-tokens``) is prefilled, then each continuation token is fed one at a time (teacher
forcing), so the scores of the continuation come from the compressed cache as it evolves during decode, not only
from the prefill. Full cache and DiffKV run on the same tokens, side by side.

    diffkv bench ppl --model smollm2-135m --context-tokens 1024 --continuation-tokens 256 --json
"""

from __future__ import annotations

import json
import math
import time

import torch

from diffkv.bench.common import add_config_arguments, add_output_arguments, bench_config, progress
from diffkv.hf.generation import continuation_nll


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--continuation-tokens", type=int, default=256)
    p.add_argument("--essays", type=int, default=1, help="independent samples (consecutive essays)")
    add_config_arguments(p)
    add_output_arguments(p)


def run(args) -> int:
    from transformers import DynamicCache

    from diffkv.integrations.transformers import DiffKVCache
    from diffkv.prompts import essay_tokens
    from diffkv.registry.models import load_model

    model, tok = load_model(args.model)
    cfg = bench_config(args, model)
    total = args.context_tokens + args.continuation_tokens
    rows = []
    with progress(args, 2 * args.essays * args.continuation_tokens, "tok", "continuations") as bar:
        for i in range(args.essays):
            ids = torch.tensor([essay_tokens(tok, total, start_essay=i)])
            n = args.continuation_tokens
            full = float(continuation_nll(model, ids, args.context_tokens, DynamicCache(config=model.config), bar)) / n
            cache = DiffKVCache(model, cfg)
            dkv = float(continuation_nll(model, ids, args.context_tokens, cache, bar)) / n
            stats = cache.stats()
            cache.release()
            rows.append({"essay": i, "full_ppl": math.exp(full), "diffkv_ppl": math.exp(dkv),
                         "compression_physical": stats["compression_physical"]})
    full_ppl = math.exp(sum(math.log(r["full_ppl"]) for r in rows) / len(rows))
    dkv_ppl = math.exp(sum(math.log(r["diffkv_ppl"]) for r in rows) / len(rows))
    report = {
        "model": args.model, "context_tokens": args.context_tokens,
        "continuation_tokens": args.continuation_tokens, "essays": args.essays,
        "config": {"high": cfg.high.name, "low": cfg.low.name, "alpha_high": cfg.alpha_high,
                   "alpha_low": cfg.alpha_low, "profile": args.profile},
        "full_ppl": round(full_ppl, 4), "diffkv_ppl": round(dkv_ppl, 4),
        "ppl_increase": round(dkv_ppl / full_ppl - 1, 5),
        "compression_physical": round(sum(r["compression_physical"] for r in rows) / len(rows), 3),
        "per_essay": rows, "date": time.strftime("%Y-%m-%d"),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"perplexity: full {full_ppl:.3f}, DiffKV {dkv_ppl:.3f} ({report['ppl_increase']:+.2%}), "
              f"physical compression {report['compression_physical']:.2f}x")
    return 0
