"""Launcher of the "streams" decode kernel (``diffkv.kernels.paged_decode_streams``), the default Triton split
kernel of :func:`diffkv.ops.paged_attention.paged_decode_attention` where both tiers' formats allow it."""

from __future__ import annotations

import os

import torch

KERNELS = ("auto", "streams", "split")
# Warps per program by the queries' dtype and head_dim: the fewest SASS warp-instructions per page with no register
# spill, compiled for sm_90a (benchmarks/gpu/sass_budget.py; Triton puts a 16-row score tile's warps on its rows, so
# more warps repeat the same work; fp32 queries carry twice the query operands and spill sooner). Untimed:
# benchmarks/gpu/bench_decode.py sweeps the warps on a GPU.
STREAMS_WARPS = {"16-bit": {64: 1, 128: 1, 256: 4}, "float32": {64: 1, 128: 2, 256: 8}}
_Q_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def use_streams(kernel: str, high, low) -> bool:
    """True to run the streams kernel for tier layouts ``high`` and ``low``: "auto" where both are supported;
    "streams" raises ValueError if one is not, naming it; "split" never."""
    from diffkv.kernels.paged_decode_streams import streams_supported

    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    bad = [lay.name for lay in (high, low) if not streams_supported(lay)]
    if kernel == "streams" and bad:
        raise ValueError(f"the streams kernel reads 2-, 4- and 8-bit tiers with one metadata group per vector and "
                         f"head_dim * bits / 8 >= 16; tier(s) {bad} are not: use kernel='split' or 'auto'")
    return kernel != "split" and not bad


def streams_warps(head_dim: int, dtype: torch.dtype) -> int:
    """Warps per program for queries of ``dtype`` as the kernel receives them (:data:`STREAMS_WARPS`, else 4)."""
    return STREAMS_WARPS["float32" if dtype == torch.float32 else "16-bit"].get(head_dim, 4)


def launch_streams(query: torch.Tensor, data: torch.Tensor, tables, common: dict, high, low, logits: torch.Tensor,
                   part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor, qk_scale: float,
                   meta_kind: int, store_logits: bool, num_warps: int | None = None) -> None:
    """One launch of the streams split kernel over grid (K, NUM_SPLITS): half the splits per tier.

    query: [B, H_q, D] fp16 / bf16 / fp32 (other dtypes go as fp32); data: uint8 pool [P, page_bytes]; common: the
    keyword arguments shared with the reduce kernel (``paged_decode_attention`` builds them, ``NUM_SPLITS`` even);
    logits [K * G * m_total], part_m / part_l [K, S, G], part_acc [K, S, G, D] fp32 outputs, the layout of
    ``paged_decode_split_kernel``'s. num_warps: default :func:`streams_warps`.
    On CUDA the codes are unpacked by inline PTX (``ASM``; the interpreter runs the same function in Triton ops);
    ``DIFFKV_STREAMS_PTX=0`` in the environment turns it off there (an A/B switch for GPU runs, read per launch).
    """
    from diffkv.kernels.paged_decode_streams import paged_decode_streams_kernel

    if query.dtype not in _Q_KIND:
        query = query.float()
    splits = common["NUM_SPLITS"]
    shared = {key: common[key] for key in ("items_ptr", "nh_ptr", "nl_ptr", "rows_ptr", "pool_ptr", "num_kv_heads",
                                           "width", "page_bytes", "m_hi", "m_total", "G", "GP", "D")}
    shared["num_warps"] = num_warps or streams_warps(common["D"], query.dtype)
    tiers = dict(hk_off=high.key_offset, hkm_off=high.key_meta_offset, hv_off=high.value_offset,
                 hvm_off=high.value_meta_offset, lk_off=low.key_offset, lkm_off=low.key_meta_offset,
                 lv_off=low.value_offset, lvm_off=low.value_meta_offset,
                 N_HI=high.tokens_per_page, N_LO=low.tokens_per_page)
    paged_decode_streams_kernel[(part_m.shape[0], splits)](
        q_ptr=query, lg_ptr=logits, m_ptr=part_m, l_ptr=part_l, acc_ptr=part_acc, stride_qb=query.stride(0),
        stride_qh=query.stride(1), qk_scale=qk_scale, **shared, **tiers,
        S_HI=splits // 2, S_LO=splits // 2,
        BN_HI=_block(high.tokens_per_page), KB_HI=high.key_bits, VB_HI=high.value_bits,
        BN_LO=_block(low.tokens_per_page), KB_LO=low.key_bits, VB_LO=low.value_bits,
        META_KIND=meta_kind, Q_KIND=_Q_KIND[query.dtype], K_FIELDS=high.key_meta_fields, STORE_LOGITS=store_logits,
        ASM=query.is_cuda and os.environ.get("DIFFKV_STREAMS_PTX", "1") != "0")


def _block(n: int) -> int:
    """Tile rows for a page of ``n`` tokens: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, 1 << (n - 1).bit_length())
