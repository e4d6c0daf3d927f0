"""Compression accounting for a DiffKV cache (docs/algorithm.md §5, physical ratio with every byte counted).

* physical compression = fp16 bytes of the tokens seen by every layer ÷ ``bytes_kept``: the pages (page waste,
  scales, zeros, scores and positions included) plus, with ``center_keys``, one fp32 key center per head and
  sequence, with ``smooth_keys`` a center and a scale (``bytes_in_pages`` counts them; ``key_center_bytes`` the
  centers and scales alone), plus the tokens the sliding-window layers keep, at fp16 (``window_layer_bytes``).
  ``compression_physical_compressed`` is the same ratio over the compressed layers alone (all layers but Gemma-3's
  sliding ones);
* theoretical compression = 32 bits ÷ average stored K+V bits per seen token (metadata ignored, pruned = 0 bits);
* held compression = fp16 bytes of the tokens seen ÷ ``bytes_held``, every byte of every tensor the cache owns
  (``cache.nbytes()``: the pool with its free pages and ring, the page tables, key centers and scales, per-layer
  bookkeeping, uncompressed sliding-window layers). This is the memory the process holds for the cache.
"""

from __future__ import annotations

import torch


def tier_stats(config, cells: int, high: int, low: int, fp16_bytes: int, bytes_kept: int) -> dict:
    """The fields every host reports the same way (a transformers cache, an engine request): of ``cells`` (token,
    layer, KV head) cells, ``high`` and ``low`` kept in each tier (the rest pruned); the physical compression
    ``fp16_bytes`` ÷ ``bytes_kept`` and the theoretical one, 32 bits ÷ the mean K+V bits per cell (None where a
    divisor is 0: nothing kept)."""
    hi, lo = config.high, config.low
    bits = high * (hi.key.bits + hi.value.bits) + low * (lo.key.bits + lo.value.bits)
    return {"tokens_per_tier": {"high": high, "low": low, "pruned": cells - high - low},
            "fp16_bytes": fp16_bytes, "compression_physical": fp16_bytes / bytes_kept if bytes_kept else None,
            "compression_theoretical": cells * 32 / bits if bits else None}


def window_layer_bytes(cache, tokens_seen: int) -> tuple[int, int]:
    """``(fp16 bytes of the tokens seen, fp16 bytes kept)`` over the sliding-window layers of ``cache`` (those
    with ``is_sliding``; they keep only their window). ``tokens_seen``: valid tokens summed over the batch."""
    seen = kept = 0
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if getattr(layer, "is_sliding", False) and isinstance(keys, torch.Tensor) and keys.dim() == 4:
            b, h, n, d = keys.shape
            seen += tokens_seen * h * 4 * d
            kept += b * h * n * 4 * d
    return seen, kept


def with_window_layers(stats: dict, cache, tokens_seen: int) -> dict:
    """``stats`` of the compressed layers (``fp16_bytes``, ``bytes_in_pages``, ``compression_physical``) with the
    sliding-window layers added: ``compression_physical`` over every layer, ``bytes_kept`` the bytes it divides
    by, ``compression_physical_compressed`` the compressed layers' own ratio."""
    seen, kept = window_layer_bytes(cache, tokens_seen)
    fp16, pages = stats["fp16_bytes"] + seen, stats["bytes_in_pages"] + kept
    held = stats.get("bytes_held")
    extra = {"compression_held": fp16 / held if held else float("inf")} if held is not None else {}
    return {**stats, **extra, "fp16_bytes": fp16, "window_layer_bytes": kept, "bytes_kept": pages,
            "compression_physical": fp16 / pages if pages else float("inf"),
            "compression_physical_compressed": stats["compression_physical"]}


def cache_stats(cache) -> dict:
    """Stats of a :class:`~diffkv.integrations.transformers.DiffKVCache` (or anything with the same fields)."""
    layers = [i for i, layer in enumerate(cache.layers) if getattr(layer, "filled", False)]
    uncompressed = [i for i, layer in enumerate(cache.layers) if not hasattr(layer, "filled")]
    if cache.kv is None or not layers or not cache.slots:
        return {"layers_compressed": 0, "tokens_seen": 0, "uncompressed_layers": uncompressed,
                "bytes_held": cache.nbytes()}
    kv, cfg, d = cache.kv, cache.config, cache.head_dim
    slots = torch.tensor(cache.slots, device=kv.tables.device)
    li = torch.tensor(layers, device=kv.tables.device)
    tok = kv.tables.num_tokens[slots][:, li].long()  # [B, L', H, 2]
    pages = kv.tables.num_pages[slots][:, li].long()
    seen = cache.seen_tokens()  # [B] valid tokens per sequence
    h = tok.shape[2]
    total = int(seen.sum()) * len(layers) * h  # (token, layer, head) cells
    n_high, n_low = int(tok[..., 0].sum()), int(tok[..., 1].sum())
    center_bytes = tok.shape[0] * len(layers) * h * d * 4 * cfg.key_vectors
    page_bytes = int(pages.sum()) * kv.plan.page_bytes + center_bytes
    held = cache.nbytes()
    per_layer = (tok.sum(dim=(0, 2)).float() / max(int(seen.sum()) * h, 1)).tolist()  # [L', 2]
    return with_window_layers({
        "layers_compressed": len(layers),
        "uncompressed_layers": uncompressed,
        "tokens_seen": int(seen.sum()),
        **tier_stats(cfg, total, n_high, n_low, total * 2 * d * 2, page_bytes),
        "tier_fractions": {"high": n_high / total, "low": n_low / total, "pruned": 1 - (n_high + n_low) / total},
        "tier_fractions_per_layer": {str(layer): {"high": round(f[0], 4), "low": round(f[1], 4)}
                                     for layer, f in zip(layers, per_layer, strict=True)},
        "tokens_per_head": tok.sum(-1).tolist(),  # [B][L'][H] retained tokens
        "pages": int(pages.sum()),
        "page_bytes": kv.plan.page_bytes,
        "bytes_in_pages": page_bytes,
        "key_center_bytes": center_bytes,
        "bytes_held": held,
        "pool_pages_free": kv.pool.free_pages(),
        "pool_pages_total": kv.pool.num_pages,
    }, cache, int(seen.sum()))
