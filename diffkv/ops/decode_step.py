"""The decode step of one layer: one interface, three interchangeable backends, chosen when a cache is built.

* ``"torch"``: the reference (any device): ``place_store_ref`` (placement by ``policy.place_decode``, the one torch
  implementation of the rule of docs/algorithm.md §4.4, and the stores) then ``paged_decode_attention_ref`` with the
  score update;
* ``"cpu"``: the compiled C step (``diffkv.ops.decode_cpu``), everything in one call — the default on CPU;
* ``"triton"``: the fused place-and-store kernel, then the split-K paged attention kernels — the default on CUDA.

All three read the pages and nothing else: no backend keeps a dense or dequantized copy of the cache.

:func:`decode_step_planned` is the Triton step of one layer under a decode plan (``diffkv.ops.decode_plan``): three
launches (place-store with the key/query transforms fused, attention split, reduce with the score update) and no
host sync.
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



def decode_step_planned(kv, plan, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        alpha_high: float, alpha_low: float, scaling: float) -> torch.Tensor:
    """:func:`decode_step` on the Triton backend for ``layer`` of ``plan`` (a ``DecodePlan`` the caller checked).

    query: [B, H_q, D] as the model gives it; key: [K, D] as the model gives it (the key transform and the query
    scaling run in the place-store kernel); value: [K, D] as stored (rotated, with ``rotate_values``). The step's
    positions, tier widths, split count and buffers are the plan's; a non-finite key or value is flagged on the
    device (``plan.finish`` raises). Returns out [B, H_q, D] fp32 (the plan buffers' output of this layer).
    """
    from diffkv.ops.paged_attention import paged_decode_attention
    from diffkv.ops.place_store import place_store_planned

    items = plan.items[layer]
    queries = place_store_planned(kv, plan, layer, query, key, value, alpha_high, alpha_low)
    counts = plan.workspace.take("counts", (2, items.numel()), torch.int32)  # written by the launch above
    out, _ = paged_decode_attention(queries, kv.pool.data, kv.tables, items, counts[0], counts[1],
                                    (kv.layouts[HIGH_COL], kv.layouts[LOW_COL]), scaling, meta_dtype=kv.meta_dtype,
                                    raw_dtype=kv.raw_dtype, update_scores=True, return_gain=False, backend="triton",
                                    position=plan.positions, lag=kv.config.score_lag, peak=kv.config.peak,
                                    num_splits=plan.num_splits, num_warps=plan.num_warps,
                                    widths=(plan.m_hi, plan.m_lo), workspace=plan.attention_workspace(layer))
    return out
