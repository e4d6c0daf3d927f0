"""The decode step of one layer: one interface, three interchangeable backends, chosen when a cache is built.

* ``"torch"``: the reference (any device): ``place_store_ref`` (placement by ``policy.place_decode``, the one torch
  implementation of the rule of docs/algorithm.md §4.4, and the stores) then ``paged_decode_attention_ref`` with the
  score update;
* ``"cpu"``: the compiled C step (``diffkv.ops.decode_cpu``), everything in one call — the default on CPU;
* ``"triton"``: the fused place-and-store kernel, then the split-K paged attention kernels — the default on CUDA.

All three read the pages and nothing else: no backend keeps a dense or dequantized copy of the cache.
"""

from __future__ import annotations

import os

import torch

from diffkv.memory import HIGH_COL, LOW_COL

BACKENDS = ("auto", "torch", "cpu", "triton")


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The backend ``name`` means on ``device``, checked now so a bad choice fails when the cache is built.

    "auto": "triton" on CUDA; on CPU "cpu" when the compiled step builds, else "torch". Raises ValueError for an
    unknown name, "cpu" off the CPU or without a working C compiler, or "triton" on CPU without
    ``TRITON_INTERPRET=1`` (tests). Every backend reads every page format (``DiffKVConfig.compact_meta``,
    ``symmetric_keys``).
    """
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        from diffkv.ops import decode_cpu

        return "cpu" if device.type == "cpu" and decode_cpu.available() else "torch"
    if name == "cpu":
        from diffkv.ops import decode_cpu

        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on CPU tensors, the model is on {device}; use 'auto'")
        try:
            decode_cpu.library()
        except decode_cpu.CompileError as err:
            raise ValueError(f"attention_backend='cpu' needs the compiled decode step, which failed to build: {err}; "
                             "use attention_backend='torch'") from err
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 set before triton is "
                         "imported, for tests); use 'auto'")
    return name


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

