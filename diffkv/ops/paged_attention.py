"""Paged decode attention over both tiers: the Triton launcher (``diffkv.kernels.paged_attention``) and, elsewhere,
the torch reference (``diffkv.ops.reference.paged_decode_attention_ref``).

Both take the pages as stored (``diffkv.core.layout``) and the per-head tables (``diffkv.memory.HeadTables``) and return
the attention output plus ``gain``, the per-token max over the GQA group of the probabilities, in token order (high
tokens at columns ``[0, M_hi)``, low tokens at ``[M_hi, M_hi + M_lo)``, ``M_tier = ceil(max n_tier / N_tier) *
N_tier``, the widths ``PagedKV.read`` uses), so ``gain[:, :M_hi]`` / ``gain[:, M_hi:]`` feed ``PagedKV.add_scores``.
With ``update_scores=True`` the score update ``score[t] += gain[t]`` (docs/algorithm.md §4.1) is also applied to the
pages (fused into the reduce kernel on the Triton path); compact pages (``DiffKVConfig.compact_meta``) update their
mean scores instead (``diffkv.core.bookkeeping.updated``).
"""

from __future__ import annotations

import torch

from diffkv.core.page_io import resolve_dtypes
from diffkv.ops.decode_plan import multiprocessors, split_count
from diffkv.ops.kernel_choice import use_triton
from diffkv.ops.paged_attention_streams import launch_streams, use_streams
from diffkv.ops.reference import cdiv, paged_decode_attention_ref, tier_widths

_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
LOG2E = 1.4426950408889634


def launch_settings(num_items: int, max_pages: int, device: torch.device, num_splits: int | None = None,
                    num_warps: int | None = None, max_tokens: int = 0, reduce_chunks: int | None = None) -> dict:
    """Split count (flash-decoding): enough programs for ~2 waves over the SMs, at least 4 pages per split; and the
    reduce's programs per item (``REDUCE_CHUNKS``): as many again, at least 1024 of the ``max_tokens`` an item may
    hold per chunk (the score update walks them).

    num_warps: warps per split program, a power of two; default 4 for the split kernel and
    ``paged_attention_streams.streams_warps`` (head_dim, query dtype) for the streams kernel (the reduce always runs 4).
    """
    if num_splits is None:
        num_splits = split_count(num_items, max_pages, device)
    if reduce_chunks is None:
        reduce_chunks = max(1, min(cdiv(2 * multiprocessors(device), max(num_items, 1)), cdiv(max_tokens, 1024)))
    if num_warps is not None and (num_warps < 1 or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    if reduce_chunks < 1:
        raise ValueError(f"reduce_chunks must be >= 1, got {reduce_chunks}")
    return {"NUM_SPLITS": int(num_splits), "num_warps": num_warps or 4, "REDUCE_CHUNKS": int(reduce_chunks)}


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _tier_args(lay, prefix: str) -> dict:
    groups = (lay.key_groups, lay.value_groups)
    for what, bits, ng in (("key", lay.key_bits, groups[0]), ("value", lay.value_bits, groups[1])):
        if bits != 16 and ng & (ng - 1):
            raise ValueError(f"the Triton kernel needs a power-of-two number of {what} groups, tier {lay.name} has "
                             f"{ng}; use backend='torch'")
    return {f"N_{prefix}": lay.tokens_per_page, f"BN_{prefix}": _block(lay.tokens_per_page),
            f"KB_{prefix}": lay.key_bits, f"VB_{prefix}": lay.value_bits,
            f"KG_{prefix}": max(groups[0], 1), f"VG_{prefix}": max(groups[1], 1)}


def _offsets(lay, prefix: str) -> dict:
    p = prefix.lower()
    return {f"{p}k_off": lay.key_offset, f"{p}km_off": lay.key_meta_offset, f"{p}v_off": lay.value_offset,
            f"{p}vm_off": lay.value_meta_offset}


def _step_positions(layout, update_scores: bool, position, device) -> torch.Tensor | None:
    """int64 [K] step positions for the compact score update (as :func:`add_scores_ref` needs them); else None."""
    if not (layout.compact and update_scores):
        return None
    if position is None:
        raise ValueError("compact pages update their mean scores by age: pass position")
    return position.to(device, torch.int64).contiguous()


def paged_decode_attention(query, pool, tables, items, n_high, n_low, layouts, scaling, *, meta_dtype=None,
                           raw_dtype=None, update_scores: bool = False, return_gain: bool = True,
                           num_splits: int | None = None, num_warps: int | None = None, backend: str = "auto",
                           position=None, lag: int = 0, peak: bool = False, kernel: str = "auto",
                           widths: tuple[int, int] | None = None, workspace=None, reduce_chunks: int | None = None):
    """Same arguments and results as :func:`paged_decode_attention_ref`; ``backend`` "auto" runs the Triton kernels
    when the pool is on CUDA and the reference otherwise ("triton" on CPU needs ``TRITON_INTERPRET=1``).

    return_gain : False skips the ``[K, M]`` gain output (then ``gain`` is None; useful with ``update_scores``).
    num_splits, num_warps : split-K partitions per item and warps per program (default: :func:`launch_settings`).
    reduce_chunks : programs per item of the reduce and score update (default: :func:`launch_settings`).
    kernel : "streams" (``diffkv.kernels.paged_decode_streams``: integer codes in fp16/bf16 dots, scales out of
        them; ``num_splits`` per tier), "split" (``diffkv.kernels.paged_attention``: dequantized fp32 tiles), or
        "auto": "streams" where both tiers' formats allow it (:func:`streams_supported`), else "split".
    widths : (M_hi, M_lo) host ints, page multiples at least the tiers' widths (e.g. a decode plan's bounds,
        ``diffkv.ops.decode_plan.tier_bounds``): no host sync; ``gain`` then has M_hi + M_lo columns. Default: the
        exact widths (``tier_widths``, one sync).
    workspace : preallocated outputs, an object whose ``attention_buffers(B, H_q, K, S, G, D, m_total)`` returns
        (logits [K*G*m_total], part_m, part_l [K, S, G], part_acc [K, S, G, D], out [B, H_q, D]), all fp32
        (``diffkv.ops.decode_plan.DecodeWorkspace``); default: allocated per call.
    """
    data = getattr(pool, "data", pool)
    if not use_triton(backend, data.is_cuda):
        out, gain = paged_decode_attention_ref(query, data, tables, items, n_high, n_low, layouts, scaling,
                                               meta_dtype=meta_dtype, raw_dtype=raw_dtype,
                                               update_scores=update_scores, position=position, lag=lag,
                                               peak=peak)
        return out, gain if return_gain else None
    from diffkv.kernels.paged_attention import paged_decode_reduce_kernel, paged_decode_split_kernel

    b, hq, d = query.shape
    k = items.numel()
    hi, lo = layouts[0], layouts[1]
    if k == 0 or k % b or hq % (k // b):
        raise ValueError(f"items [{k}] must be B * H_kv with H_q = {hq} a multiple of H_kv (B = {b})")
    if d & (d - 1) or d < 16 or hi.head_dim != d or lo.head_dim != d:
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16 matching the layouts, got {d}")
    if query.stride(2) != 1:
        query = query.contiguous()
    assert data.is_contiguous() and data.shape[1] == hi.page_bytes == lo.page_bytes and tables.rows.is_contiguous()
    md, rd = resolve_dtypes(hi, meta_dtype, raw_dtype)
    hkv, g = k // b, hq // (k // b)
    m_hi, m_lo = tier_widths(layouts, n_high, n_low) if widths is None else (int(widths[0]), int(widths[1]))
    m_total = m_hi + m_lo
    max_pages = m_hi // hi.tokens_per_page + m_lo // lo.tokens_per_page
    cfg = launch_settings(k, max_pages, data.device, num_splits, num_warps,
                          max_tokens=m_total if return_gain or update_scores else 0, reduce_chunks=reduce_chunks)
    streams = use_streams(kernel, hi, lo)
    s = cfg["NUM_SPLITS"] * (2 if streams else 1)  # streams: NUM_SPLITS programs per tier
    dev = data.device
    f32 = torch.float32
    if workspace is None:
        logits = torch.empty(k * g * max(m_total, 1), dtype=f32, device=dev)
        part_m, part_l = torch.empty(k, s, g, dtype=f32, device=dev), torch.empty(k, s, g, dtype=f32, device=dev)
        part_acc = torch.empty(k, s, g, d, dtype=f32, device=dev)
        out = torch.empty(b, hq, d, dtype=f32, device=dev)
    else:
        logits, part_m, part_l, part_acc, out = workspace.attention_buffers(b, hq, k, s, g, d, max(m_total, 1))
    gain = torch.zeros(k, m_total, dtype=f32, device=dev) if return_gain else logits
    gp = max(16, 1 << (g - 1).bit_length())
    common = dict(items_ptr=items.to(dev, torch.int64).contiguous(), nh_ptr=n_high.to(dev, torch.int32).contiguous(),
                  nl_ptr=n_low.to(dev, torch.int32).contiguous(), rows_ptr=tables.rows, pool_ptr=data,
                  num_kv_heads=hkv, width=tables.width, page_bytes=hi.page_bytes, m_hi=m_hi, m_total=max(m_total, 1),
                  G=g, GP=gp, D=d, NUM_SPLITS=s, N_HI=hi.tokens_per_page, N_LO=lo.tokens_per_page)
    hargs, largs = _tier_args(hi, "HI"), _tier_args(lo, "LO")
    step = _step_positions(hi, update_scores, position, dev)
    if streams:
        launch_streams(query, data, tables, common, hi, lo, logits, part_m, part_l, part_acc, float(scaling) * LOG2E,
                       _KIND[md], return_gain or update_scores, num_warps)
    else:
        paged_decode_split_kernel[(k, s)](
            q_ptr=query, lg_ptr=logits, m_ptr=part_m, l_ptr=part_l, acc_ptr=part_acc,
            stride_qb=query.stride(0), stride_qh=query.stride(1), qk_scale=float(scaling) * LOG2E,
            **_offsets(hi, "H"), **_offsets(lo, "L"), **common,
            **{kk: v for kk, v in {**hargs, **largs}.items() if kk not in ("N_HI", "N_LO")},
            META_KIND=_KIND[md], RAW_KIND=_KIND[rd], K_FIELDS=hi.key_meta_fields,
            STORE_LOGITS=return_gain or update_scores, PRECISION="ieee" if not data.is_cuda else "tf32x3",
            num_warps=cfg["num_warps"])
    paged_decode_reduce_kernel[(k, cfg["REDUCE_CHUNKS"])](
        m_ptr=part_m, l_ptr=part_l, acc_ptr=part_acc, lg_ptr=logits, out_ptr=out, gain_ptr=gain, step_ptr=step,
        stride_ob=out.stride(0), stride_oh=out.stride(1), hs_off=hi.score_offset, ls_off=lo.score_offset,
        hp_off=hi.pos_offset, lp_off=lo.pos_offset, lag=lag, SP=1 << (s - 1).bit_length(), BT=128,
        FIELD_BYTES=hi.score_bytes, WRITE_GAIN=return_gain, UPDATE_SCORES=update_scores, PEAK=peak, num_warps=4,
        **common)
    return out, gain if return_gain else None
