"""`diffkv demo`: fetch the default model (offline registry), show its page plan, generate with it.

NOTE: the compressed cache backend (DiffKVCache) is not built yet; until it is, the demo generates with the
full transformers cache and reports the page plan and per-tier byte arithmetic the backend will use.
"""

from __future__ import annotations

import json
import time

from diffkv.config import DiffKVConfig
from diffkv.layout import plan_for_config


def model_kv_shape(config) -> dict:
    """Layers, KV heads and head_dim of a transformers config (text part for multimodal configs)."""
    cfg = getattr(config, "text_config", None) or config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {
        "layers": cfg.num_hidden_layers,
        "q_heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
    }


def run_demo(args) -> int:
    import torch

    from diffkv.models import load_model

    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    load_s = time.perf_counter() - t0
    shape = model_kv_shape(model.config)
    cfg = DiffKVConfig()
    plan = plan_for_config(cfg, shape["head_dim"])
    fp16_bpt = 4 * shape["head_dim"]
    tiers = {
        t.name: {
            "tokens_per_page": t.tokens_per_page,
            "bytes_per_token": t.bytes_per_token,
            "page_level_compression_vs_fp16": round(fp16_bpt * t.tokens_per_page / plan.page_bytes, 3),
        }
        for t in plan.tiers
    }
    messages = [{"role": "user", "content": args.prompt}]
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
    else:
        ids = tok(args.prompt, return_tensors="pt").input_ids
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    gen_s = time.perf_counter() - t0
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    report = {
        "model": args.model,
        "shape": shape,
        "config": {"high": cfg.high.name, "low": cfg.low.name, "alpha_high": cfg.alpha_high, "alpha_low": cfg.alpha_low},
        "page_bytes": plan.page_bytes,
        "tiers": tiers,
        "prompt_tokens": ids.shape[1],
        "new_tokens": out.shape[1] - ids.shape[1],
        "answer": text,
        "cache": "transformers DynamicCache (DiffKVCache not built yet)",
        "load_s": round(load_s, 2),
        "generate_s": round(gen_s, 2),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model {args.model}: {shape['layers']} layers, {shape['kv_heads']} KV heads, head_dim {shape['head_dim']}")
    print(f"page plan for {cfg.high}/{cfg.low}: {plan.page_bytes}-byte pages")
    for name, t in tiers.items():
        print(f"  {name:<8} {t['tokens_per_page']:>3} tokens/page, {t['bytes_per_token']} B/token, "
              f"{t['page_level_compression_vs_fp16']:.2f}x vs fp16")
    print(f"prompt: {args.prompt}\nanswer: {text}")
    print(f"({report['new_tokens']} tokens in {gen_s:.1f}s; {report['cache']})")
    return 0
