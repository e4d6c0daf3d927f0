"""The decode step of one layer: one interface, three interchangeable backends, chosen when a cache is built.

* ``"torch"``: the reference (any device): ``place_store_ref`` (placement by ``policy.place_decode``, the one torch
  implementation of the rule of docs/algorithm.md §4.4, and the stores) then ``paged_decode_attention_ref`` with the
  score update;
* ``"cpu"``: the compiled C step (``diffkv.ops.decode_cpu``), everything in one call — the default on CPU;
* ``"triton"``: the fused place-and-store kernel, then the split-K paged attention kernels — the default on CUDA.

All three read the pages and nothing else: no backend keeps a dense or dequantized copy of the cache.
"""

from __future__ import annotations

import torch

from diffkv.core import backends
from diffkv.memory import HIGH_COL, LOW_COL


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The attention backend ``name`` means on ``device`` (``diffkv.core.backends.resolve_backend``), checked now so
    a bad choice fails when the cache is built: "cpu" needs the compiled decode step (``diffkv.ops.decode_cpu``).
    Every backend reads every page format (``DiffKVConfig.compact_meta``, ``symmetric_keys``).
    """
    from diffkv.ops import decode_cpu

    return backends.resolve_backend(name, device, what="attention_backend", compiled=decode_cpu)


def decode_step(kv, items: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                position: torch.Tensor, alpha_high: float, alpha_low: float, scaling: float, *,
                backend: str) -> torch.Tensor:
    """Place, store and attend for one new token per item, then add the attention to the stored scores.

    kv: ``PagedKV``; items: int64 [K] distinct flat head ids with this step's pages reserved, K = B * H_kv;
    query: [B, H_q, D]; key, value: [K, D] the new token; position: int [K] its index (tokens before it).
    backend: a resolved backend ("torch", "cpu" or "triton"). Returns out [B, H_q, D] fp32.
    """
    if backend == "cpu":
        from diffkv.ops.decode_cpu import decode_step_cpu

        return decode_step_cpu(kv, items, query, key, value, position, alpha_high, alpha_low, scaling)
    from diffkv.ops.paged_attention import paged_decode_attention
    from diffkv.ops.place_store import place_store

    if backend not in ("torch", "triton"):
        raise ValueError(f"decode_step takes a resolved backend ('torch', 'cpu', 'triton'), got {backend!r}")
    n_hi, n_lo = place_store(kv, items, key, value, position, alpha_high, alpha_low, backend=backend)
    out, _ = paged_decode_attention(query, kv.pool.data, kv.tables, items, n_hi, n_lo, (kv.layouts[HIGH_COL],
                                    kv.layouts[LOW_COL]), scaling, meta_dtype=kv.meta_dtype, raw_dtype=kv.raw_dtype,
                                    update_scores=True, return_gain=False, backend=backend, position=position,
                                    lag=kv.config.score_lag, peak=kv.config.peak)
    return out

