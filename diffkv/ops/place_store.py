"""Decode placement + store of one layer's new tokens: the fused Triton kernel (``diffkv.kernels.place_store``, one
launch for all items) on CUDA, else the torch reference built from ``policy.place_decode`` and ``PagedKV`` reads and
writes (the first half of the torch decode backend, ``diffkv.ops.decode_step``)."""

from __future__ import annotations

import numpy as np
import torch

from diffkv.core import policy
from diffkv.core.store import resolve_dtypes
from diffkv.memory import HIGH, LOW
from diffkv.ops.kernel_choice import use_triton
from diffkv.ops.paged_attention import _offsets, _tier_args

_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def place_store_ref(kv, items: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                    alpha_high: float, alpha_low: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's placement (docs/algorithm.md §4.4) and stores for K items of one layer (torch reference).

    kv: the :class:`~diffkv.cache.paged_kv.PagedKV` (its config gives ``recent_window`` and ``two_tier``); items:
    int64 [K] flat head ids whose pages for this step are reserved; keys, values: [K, D] the new token; position:
    int [K] its index (tokens processed before it). Demotes / prunes as ``policy.place_decode`` decides, zeroes the
    score of the token leaving the window (``policy.window_exits``, only with ``score_after_window``), writes the new
    token in high precision (score 0, pos = position) and the new (n_high, n_low) into the tables. Returns them,
    int64 [K].
    """
    cfg, tables = kv.config, kv.tables
    n = tables.tokens_flat[items].long()
    n_hi, n_lo = n[:, 0], n[:, 1]
    w_hi, w_lo = (int(x) + 1 for x in torch.stack([n_hi.max(), n_lo.max()]).tolist())
    position = position.to(torch.int64)
    hs, hp, _ = kv.read_meta(HIGH, items, n_hi, w_hi, position)
    ls, lp, _ = kv.read_meta(LOW, items, n_lo, w_lo, position)
    place = policy.place_decode(hs, hp, n_hi, ls, lp, n_lo, position, alpha_high, alpha_low, cfg.recent_window,
                                two_tier=cfg.two_tier, lag=cfg.score_lag, compact=kv.compact, peak=cfg.peak)
    if cfg.score_lag:  # score_after_window: the token leaving the recent window starts a fresh score
        r, slot = policy.window_exits(hp, n_hi, position, cfg.score_lag).nonzero(as_tuple=True)
        kv.reset_scores(HIGH, items[r], slot)
    demote = (place.case == policy.DEMOTE_OVER_LOW) | (place.case == policy.DEMOTE_APPEND_LOW)
    r = demote.nonzero(as_tuple=True)[0]
    if r.numel():  # re-quantize the victim from its stored high-precision values into the low tier
        kk, vv, ss, pp = kv.read_at(HIGH, items[r], place.high_slot[r])
        kv.write(LOW, items[r], place.low_slot[r], kk, vv, ss, pp)
    append = place.case == policy.APPEND
    target = torch.where(append, n_hi, place.high_slot)
    zeros = torch.zeros(len(items), dtype=torch.float32, device=keys.device)
    kv.write(HIGH, items, target, keys, values, zeros, position)
    n_hi = n_hi + append.long()
    n_lo = n_lo + (place.case == policy.DEMOTE_APPEND_LOW).long()
    tables.tokens_flat[items] = torch.stack([n_hi, n_lo], -1).to(torch.int32)
    return n_hi, n_lo


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (torch evaluates ``alpha / base`` as ``reciprocal(base) * fp32(alpha)``)."""
    return float(np.float32(x))


def place_store(kv, items: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                alpha_high: float, alpha_low: float, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments, effects and result as :func:`place_store_ref` (bit-identical pool bytes and counts).

    backend: "auto" runs the kernel when the pool is on CUDA and the reference otherwise; "triton" forces the kernel
    (on CPU only under ``TRITON_INTERPRET=1``); "torch" the reference. The kernel needs a power-of-two head_dim and
    numbers of groups; keys/values must be finite (tokens that are not, or overflow the tier's dtypes, are not
    written: the caller checks finiteness first, as ``LayerCompressor.decode`` does).
    """
    data = kv.pool.data
    if not use_triton(backend, data.is_cuda):
        return place_store_ref(kv, items, keys, values, position, alpha_high, alpha_low)
    from diffkv.kernels.place_store import place_store_kernel

    cfg, tables = kv.config, kv.tables
    hi, lo = kv.layouts[HIGH], kv.layouts[LOW]
    k, d = keys.shape
    if d & (d - 1) or hi.head_dim != d or lo.head_dim != d or values.shape != keys.shape or items.numel() != k:
        raise ValueError(f"keys/values [K, D] must match items [{items.numel()}] and a power-of-two head_dim "
                         f"{hi.head_dim}, got {tuple(keys.shape)} / {tuple(values.shape)}")
    md, rd = resolve_dtypes(hi, kv.meta_dtype, kv.raw_dtype)
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    values = values if values.stride(1) == 1 else values.contiguous()
    items = items.to(data.device, torch.int64).contiguous()
    assert data.is_contiguous() and tables.rows.is_contiguous() and tables.counts.is_contiguous()
    if k:
        scratch = torch.empty(k, 2, d, dtype=torch.float32, device=data.device)
        hargs, largs = _tier_args(hi, "HI"), _tier_args(lo, "LO")
        lo_off = {**_offsets(lo, "L"), "ls_off": lo.score_offset, "lp_off": lo.pos_offset}
        extra = {"enable_fp_fusion": False} if data.is_cuda else {}  # code * scale rounds before + zero (as torch)
        place_store_kernel[(k,)](
            pool_ptr=data, rows_ptr=tables.rows, counts_ptr=tables.counts, items_ptr=items,
            pos_ptr=position.to(data.device, torch.int64).contiguous(), k_ptr=keys, v_ptr=values,
            scratch_ptr=scratch, stride_k=keys.stride(0), stride_v=values.stride(0), num_items=tables.num_items,
            width=tables.width, page_bytes=hi.page_bytes, recent_window=cfg.recent_window, lag=cfg.score_lag,
            alpha_low=_f32(alpha_low), alpha_quant=_f32(alpha_high if cfg.two_tier else alpha_low),
            **_offsets(hi, "H"), hs_off=hi.score_offset, hp_off=hi.pos_offset, **lo_off,
            D=d, TWO_TIER=bool(cfg.two_tier), **hargs, **largs, META_KIND=_KIND[md], RAW_KIND=_KIND[rd],
            K_FIELDS=hi.key_meta_fields, FIELD_BYTES=hi.score_bytes, PEAK=cfg.peak, num_warps=4, **extra)
    n = tables.tokens_flat[items].long()
    return n[:, 0], n[:, 1]
