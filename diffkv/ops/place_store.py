"""Decode placement + store of one layer's new tokens: the fused Triton kernel (``diffkv.kernels.place_store``, one
launch for all items) on CUDA, else the torch reference (``diffkv.ops.reference.place_store_ref``:
``policy.place_decode`` and ``PagedKV`` reads and writes;
the first half of the torch decode backend, ``diffkv.ops.decode_step``).

:func:`place_store_planned` is the same launch for a decode plan (``diffkv.ops.decode_plan``): it also applies the
key and query transforms, checks finiteness on the device and leaves the new counts in the plan's workspace."""

from __future__ import annotations

import numpy as np
import torch

from diffkv.core.page_io import resolve_dtypes
from diffkv.memory import HIGH_COL, LOW_COL
from diffkv.ops.kernel_choice import use_triton
from diffkv.ops.paged_attention import _offsets, _tier_args
from diffkv.ops.reference import place_store_ref

_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (torch evaluates ``alpha / base`` as ``reciprocal(base) * fp32(alpha)``)."""
    return float(np.float32(x))


def place_store(kv, items: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                alpha_high: float, alpha_low: float, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments, effects and result as :func:`place_store_ref` (bit-identical pool bytes and counts).

    backend: "auto" runs the kernel when the pool is on CUDA and the reference otherwise; "triton" forces the kernel
    (on CPU only under ``TRITON_INTERPRET=1``); "torch" the reference. The kernel needs a power-of-two head_dim and
    numbers of groups; keys/values must be finite (tokens that are not, or overflow the tier's dtypes, are not
    written: the caller checks finiteness first).
    """
    data = kv.pool.data
    if not use_triton(backend, data.is_cuda):
        return place_store_ref(kv, items, keys, values, position, alpha_high, alpha_low)
    items = items.to(data.device, torch.int64).contiguous()
    k, d = keys.shape
    if k:
        scratch = torch.empty(k, 3, d, dtype=torch.float32, device=data.device)
        _launch(kv, items, keys, values, position.to(data.device, torch.int64).contiguous(), alpha_high, alpha_low,
                scratch)
    n = kv.tables.tokens_flat[items].long()
    return n[:, 0], n[:, 1]


def place_store_planned(kv, plan, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        alpha_high: float, alpha_low: float) -> torch.Tensor:
    """One launch of the kernel for ``layer`` of a decode plan (``diffkv.ops.decode_plan.DecodePlan``, checked by
    the caller): places and stores the new tokens as :func:`place_store`, from the keys as the model gives them (the
    key transform, ``PagedKV.stored_keys``, is applied in the kernel); writes the new (n_high, n_low) clamped to the
    plan's widths into ``plan.workspace.counts`` and ORs the layer's error bits into its flag (checked by
    ``plan.finish``). query: [B, H_q, D]; keys, values: [K, D]. Returns the queries to attend with: ``query``
    itself, or (``smooth_keys``) the workspace's copy scaled by the key scales (``PagedKV.stored_queries``).
    """
    ws = plan.workspace
    k, d = keys.shape
    b, hq, _ = query.shape
    center, scale = kv.key_center, kv.key_scale
    queries = query if scale is None else ws.take("queries", (b, hq, d), query.dtype)
    extra = {}
    if center is not None:
        if keys.dtype not in _KIND or (scale is not None and query.dtype not in _KIND):
            raise ValueError(f"the key transform runs in the kernel for fp16/bf16/fp32 keys and queries, got "
                             f"{keys.dtype} / {query.dtype}")
        extra = dict(center_ptr=center, kscale_ptr=scale, KEY_TRANSFORM=1 if scale is None else 2,
                     K_KIND=_KIND[keys.dtype])
    if scale is not None:
        g = hq // plan.num_kv_heads
        extra.update(q_ptr=query, qo_ptr=queries, num_kv_heads=plan.num_kv_heads, stride_qb=query.stride(0),
                     stride_qh=query.stride(1), stride_ob=queries.stride(0), stride_oh=queries.stride(1),
                     SCALE_Q=True, Q_KIND=_KIND[query.dtype], G=g, GP=1 << (g - 1).bit_length())
        if query.stride(2) != 1:
            raise ValueError("place_store_planned needs queries with unit channel stride")
    _launch(kv, plan.items[layer], keys, values, plan.positions, alpha_high, alpha_low,
            ws.take("place_scratch", (k, 3, d), torch.float32), cnt_ptr=ws.take("counts", (2, k), torch.int32),
            err_ptr=plan.flag(layer), num_k=k, cap_hi=plan.m_hi, cap_lo=plan.m_lo, PLANNED=True, **extra)
    return queries


def _launch(kv, items: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
            alpha_high: float, alpha_low: float, scratch: torch.Tensor, **planned) -> None:
    """``place_store_kernel`` over the K = ``len(items)`` items (int64, contiguous, on the pool's device); position:
    int64 [K]; scratch: fp32 [K, 3, D]; planned: the kernel's planned-decode arguments."""
    from diffkv.kernels.place_store import place_store_kernel

    data, cfg, tables = kv.pool.data, kv.config, kv.tables
    hi, lo = kv.layouts[HIGH_COL], kv.layouts[LOW_COL]
    k, d = keys.shape
    if d & (d - 1) or hi.head_dim != d or lo.head_dim != d or values.shape != keys.shape or items.numel() != k:
        raise ValueError(f"keys/values [K, D] must match items [{items.numel()}] and a power-of-two head_dim "
                         f"{hi.head_dim}, got {tuple(keys.shape)} / {tuple(values.shape)}")
    md, rd = resolve_dtypes(hi, kv.meta_dtype, kv.raw_dtype)
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    values = values if values.stride(1) == 1 else values.contiguous()
    assert data.is_contiguous() and tables.rows.is_contiguous() and tables.counts.is_contiguous()
    hargs, largs = _tier_args(hi, "HI"), _tier_args(lo, "LO")
    lo_off = {**_offsets(lo, "L"), "ls_off": lo.score_offset, "lp_off": lo.pos_offset}
    extra = {"enable_fp_fusion": False} if data.is_cuda else {}  # code * scale rounds before + zero (as torch)
    place_store_kernel[(k,)](
        pool_ptr=data, rows_ptr=tables.rows, counts_ptr=tables.counts, items_ptr=items, pos_ptr=position,
        k_ptr=keys, v_ptr=values, scratch_ptr=scratch, stride_k=keys.stride(0), stride_v=values.stride(0),
        num_items=tables.num_items, width=tables.width, page_bytes=hi.page_bytes, recent_window=cfg.recent_window,
        lag=cfg.score_lag, alpha_low=_f32(alpha_low), alpha_quant=_f32(alpha_high if cfg.two_tier else alpha_low),
        **_offsets(hi, "H"), hs_off=hi.score_offset, hp_off=hi.pos_offset, **lo_off,
        D=d, TWO_TIER=bool(cfg.two_tier), **hargs, **largs, META_KIND=_KIND[md], RAW_KIND=_KIND[rd],
        K_FIELDS=hi.key_meta_fields, FIELD_BYTES=hi.score_bytes, PEAK=cfg.peak, num_warps=4, **planned, **extra)
