"""`diffkv demo`: a long PG-essay question answered with the full cache and with DiffKVCache, side by side."""

from __future__ import annotations

import json
import time

import torch

from diffkv.bench.common import progress
from diffkv.core.config import DiffKVConfig


def timed_generate(model, ids: torch.Tensor, cache, max_new_tokens: int, stop_at_eos: bool = True, bar=None):
    """Greedy generation of one sequence. ids: [1, L]. ``bar`` (a tqdm bar, optional) advances once per new token.

    Returns (new token ids [T], prefill seconds, decode tokens/s).
    """
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True)
        t1 = time.perf_counter()
        nxt = out.logits[:, -1:].argmax(-1)
        new = [nxt]
        if bar is not None:
            bar.update()
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None and stop_at_eos else set()
        for _ in range(max_new_tokens - 1):
            if int(nxt) in eos:
                break
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            new.append(nxt)
            if bar is not None:
                bar.update()
        t2 = time.perf_counter()
    steps = max(len(new) - 1, 1)
    return torch.cat(new, 1)[0], t1 - t0, steps / max(t2 - t1, 1e-9)


def run_demo(args) -> int:
    from transformers import DynamicCache

    from diffkv.integrations.transformers import DiffKVCache
    from diffkv.prompts import essay_question_ids
    from diffkv.registry.models import load_model

    model, tok = load_model(args.model)
    profile = getattr(args, "profile", None)
    if profile:
        from diffkv.profile import load_profile

        cfg = load_profile(profile, model).config
    else:
        cfg = DiffKVConfig()
    ids = essay_question_ids(tok, args.context_tokens)
    with progress(args, args.max_new_tokens, "token", "full cache") as bar:
        full_ids, full_prefill, full_tps = timed_generate(model, ids, DynamicCache(config=model.config),
                                                          args.max_new_tokens, bar=bar)
    cache = DiffKVCache(model, cfg)
    with progress(args, args.max_new_tokens, "token", "DiffKV") as bar:
        dkv_ids, dkv_prefill, dkv_tps = timed_generate(model, ids, cache, args.max_new_tokens, bar=bar)
    stats = cache.stats()
    plot = getattr(args, "plot", None)
    if plot:
        from diffkv.viz.tiers import tier_fractions

        fractions = tier_fractions(cache)
    cache.release()
    report = {
        "model": args.model,
        "prompt_tokens": ids.shape[1],
        "config": {"high": cfg.high.name, "low": cfg.low.name, "alpha_high": cfg.alpha_high,
                   "alpha_low": cfg.alpha_low, "recent_window": cfg.recent_window, "profile": profile,
                   "per_layer_alphas": cfg.layer_alphas is not None},
        "full_text": tok.decode(full_ids, skip_special_tokens=True),
        "diffkv_text": tok.decode(dkv_ids, skip_special_tokens=True),
        "compression_physical": round(stats["compression_physical"], 3),
        "compression_theoretical": round(stats["compression_theoretical"], 3),
        "tokens_per_tier": stats["tokens_per_tier"],
        "tier_fractions": {k: round(v, 4) for k, v in stats["tier_fractions"].items()},
        "tier_fractions_per_layer": stats["tier_fractions_per_layer"],
        "page_bytes": stats["page_bytes"],
        "pages": stats["pages"],
        "full_tokens_per_s": round(full_tps, 2),
        "diffkv_tokens_per_s": round(dkv_tps, 2),
        "full_prefill_s": round(full_prefill, 2),
        "diffkv_prefill_s": round(dkv_prefill, 2),
    }
    if plot:
        report["plot"] = str(write_tier_heatmap(fractions, plot, f"{args.model}: {report['prompt_tokens']}-token "
                                                f"prompt + {len(dkv_ids)} decoded, {cfg.high}/{cfg.low}"))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.model}: {report['prompt_tokens']}-token prompt (PG essay + question), "
          f"DiffKV {cfg.high}/{cfg.low}, alpha_high {cfg.alpha_high}, alpha_low {cfg.alpha_low}\n")
    print(f"full cache : {report['full_text']}\n")
    print(f"DiffKV     : {report['diffkv_text']}\n")
    f = report["tier_fractions"]
    print(f"physical compression {report['compression_physical']:.2f}x (theoretical "
          f"{report['compression_theoretical']:.2f}x): high {f['high']:.1%}, low {f['low']:.1%}, "
          f"pruned {f['pruned']:.1%} of {stats['tokens_seen']} tokens x layers x KV heads")
    print("tiers per layer (high/low): " + " ".join(
        f"{k}:{v['high']:.2f}/{v['low']:.2f}" for k, v in report["tier_fractions_per_layer"].items()))
    print(f"decode speed: full {full_tps:.1f} tok/s, DiffKV {dkv_tps:.1f} tok/s "
          f"(prefill {full_prefill:.1f}s vs {dkv_prefill:.1f}s)")
    if plot:
        print(f"tier heatmap (layer x KV head): {report['plot']}")
    return 0


def write_tier_heatmap(fractions, path, title: str):
    """Save ``diffkv.viz.plot_tier_heatmap(fractions)`` as an image at ``path`` (parent folders created)."""
    from pathlib import Path

    from diffkv.viz.cache_plots import plot_tier_heatmap

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_tier_heatmap(fractions, title=title, dpi=100).savefig(path)
    return path
