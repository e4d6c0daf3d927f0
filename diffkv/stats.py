"""Compression accounting for a DiffKV cache (ALGORITHM.md §8, physical ratio with every byte counted).

* physical compression = fp16 bytes of the tokens seen ÷ bytes the cache holds: its pages (page waste, scales,
  zeros, scores and positions included) plus, with ``center_keys``, one fp32 key center per head and sequence
  (``bytes_in_pages`` counts both; ``key_center_bytes`` the centers alone);
* theoretical compression = 32 bits ÷ average stored K+V bits per seen token (metadata ignored, pruned = 0 bits);
* held compression = fp16 bytes of the tokens seen ÷ ``bytes_held``, every byte of every tensor the cache owns
  (``cache.nbytes()``: the pool with its free pages and ring, the page tables, key centers, per-layer bookkeeping,
  uncompressed sliding-window layers). This is the memory the process holds for the cache.
"""

from __future__ import annotations

import torch


def cache_stats(cache) -> dict:
    """Stats of a :class:`~diffkv.integrations.transformers.DiffKVCache` (or anything with the same fields)."""
    layers = [i for i, layer in enumerate(cache.layers) if getattr(layer, "compressor", None) is not None]
    uncompressed = [i for i, layer in enumerate(cache.layers) if not hasattr(layer, "compressor")]
    if cache.kv is None or not layers or not cache.slots:
        return {"layers_compressed": 0, "tokens_seen": 0, "uncompressed_layers": uncompressed,
                "bytes_held": cache.nbytes()}
    kv, cfg, d = cache.kv, cache.config, cache.head_dim
    slots = torch.tensor(cache.slots, device=kv.tables.device)
    li = torch.tensor(layers, device=kv.tables.device)
    tok = kv.tables.num_tokens[slots][:, li].long()  # [B, L', H, 2]
    pages = kv.tables.num_pages[slots][:, li].long()
    seen = cache.layers[layers[0]].compressor.position.long()  # [B] valid tokens per sequence
    h = tok.shape[2]
    total = int(seen.sum()) * len(layers) * h  # (token, layer, head) cells
    n_high, n_low = int(tok[..., 0].sum()), int(tok[..., 1].sum())
    center_bytes = tok.shape[0] * len(layers) * h * d * 4 if cfg.center_keys else 0
    page_bytes = int(pages.sum()) * kv.plan.page_bytes + center_bytes
    held = cache.nbytes()
    fp16_bytes = total * 2 * d * 2
    hi, lo = cfg.high, cfg.low
    bits = n_high * (hi.key.bits + hi.value.bits) + n_low * (lo.key.bits + lo.value.bits)
    per_layer = (tok.sum(dim=(0, 2)).float() / max(int(seen.sum()) * h, 1)).tolist()  # [L', 2]
    return {
        "layers_compressed": len(layers),
        "uncompressed_layers": uncompressed,
        "tokens_seen": int(seen.sum()),
        "tokens_per_tier": {"high": n_high, "low": n_low, "pruned": total - n_high - n_low},
        "tier_fractions": {"high": n_high / total, "low": n_low / total, "pruned": 1 - (n_high + n_low) / total},
        "tier_fractions_per_layer": {str(layer): {"high": round(f[0], 4), "low": round(f[1], 4)}
                                     for layer, f in zip(layers, per_layer, strict=True)},
        "tokens_per_head": tok.sum(-1).tolist(),  # [B][L'][H] retained tokens
        "pages": int(pages.sum()),
        "page_bytes": kv.plan.page_bytes,
        "bytes_in_pages": page_bytes,
        "key_center_bytes": center_bytes,
        "fp16_bytes": fp16_bytes,
        "compression_physical": fp16_bytes / page_bytes if page_bytes else float("inf"),
        "compression_theoretical": total * 32 / bits if bits else float("inf"),
        "bytes_held": held,
        "compression_held": fp16_bytes / held if held else float("inf"),
        "pool_pages_free": kv.pool.free_pages(),
        "pool_pages_total": kv.pool.num_pages,
    }
