"""Paged decode attention over both tiers: torch reference and the Triton launcher (``diffkv.kernels.paged_attention``).

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

from diffkv.core import bookkeeping
from diffkv.core.attention import decode_attention_tiers
from diffkv.core.store import load_pages_ref, resolve_dtypes
from diffkv.ops.kernel_choice import use_triton

_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
LOG2E = 1.4426950408889634


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _page_ids(tables, items: torch.Tensor, low: bool, n_pages: int) -> torch.Tensor:
    """int64 [K, n_pages] page ids of a tier in token order (as ``PagedKV._page_ids``); -1 reads as page 0."""
    col = torch.arange(n_pages, device=items.device)
    if low:
        col = tables.width - 1 - col
    return tables.rows[items][:, col].clamp_min(0).long()


def _widths(layouts, n_high: torch.Tensor, n_low: torch.Tensor) -> tuple[int, int]:
    """(M_hi, M_lo): page-granular token widths of the two tiers (one host sync)."""
    w_hi, w_lo = (int(x) for x in torch.stack([n_high.max(), n_low.max()]).tolist()) if n_high.numel() else (0, 0)
    return (_cdiv(w_hi, layouts[0].tokens_per_page) * layouts[0].tokens_per_page,
            _cdiv(w_lo, layouts[1].tokens_per_page) * layouts[1].tokens_per_page)


def _field_index(pages: torch.Tensor, layout, offset: int, size: int) -> torch.Tensor:
    """[K, P * N] flat index, in a pool view of ``size``-byte elements, of a per-token field at ``offset``."""
    first = (pages * layout.page_bytes + offset) // size
    return (first[:, :, None] + torch.arange(layout.tokens_per_page, device=pages.device)).view(len(pages), -1)


def add_scores_ref(pool: torch.Tensor, tables, layout, low: bool, items, count, delta, *,
                   position: torch.Tensor | None = None, lag: int = 0, peak: bool = False) -> None:
    """One step's attention into the scores of the first ``count`` [K] tokens of one tier of each item; delta
    [K, M] fp32. ``score += delta``; compact layouts update their means (``bookkeeping.updated``), which needs
    ``position`` [K] (the step's position; ages are taken before the step) and the config's ``lag``; peak scores
    (``DiffKVConfig.importance``) become ``max(score, delta)``."""
    n = layout.tokens_per_page
    width = _cdiv(delta.shape[1], n) * n
    if width == 0:
        return
    delta = torch.nn.functional.pad(delta, (0, width - delta.shape[1]))
    pages = _page_ids(tables, items, low, width // n)
    valid = torch.arange(width, device=pool.device)[None, :] < count[:, None]
    score_dtype, pos_dtype = bookkeeping.field_dtypes(layout.compact)
    scores = pool.view(-1).view(score_dtype)
    where = _field_index(pages, layout, layout.score_offset, layout.score_bytes)[valid]
    if peak:
        scores[where] = bookkeeping.updated(scores[where], delta[valid], None, lag, layout.compact, True)
        return
    if not layout.compact:
        scores[where] += delta[valid].float()
        return
    if position is None:
        raise ValueError("compact pages update their mean scores by age: pass position")
    pos = pool.view(-1).view(pos_dtype)[_field_index(pages, layout, layout.pos_offset, layout.pos_bytes)[valid]]
    age = bookkeeping.ages(position.to(pool.device)[:, None].expand(-1, width)[valid], pos, True)
    scores[where] = bookkeeping.updated(scores[where], delta[valid], age, lag, True)


def paged_decode_attention_ref(query, pool, tables, items, n_high, n_low, layouts, scaling, *, meta_dtype=None,
                               raw_dtype=None, update_scores: bool = False, position=None, lag: int = 0,
                               peak: bool = False):
    """Decode attention of one query token per sequence over the pages of its KV heads (torch reference).

    Parameters
    ----------
    query : [B, H_q, D] float16 / bfloat16 / float32.
    pool : uint8 [num_pages, page_bytes] (or a ``PagePool``).
    tables : ``HeadTables``; ``items`` : int [B * H_kv], item ``b * H_kv + h`` is KV head h of sequence b.
    n_high, n_low : int [B * H_kv] tokens of each tier (``tables.tokens_flat[items]``).
    layouts : (high, low) ``TierLayout`` (``PagedKV.layouts``; single tier: low is high and n_low is 0).
    scaling : softmax scale. meta_dtype, raw_dtype : as in ``diffkv.core.store`` (``PagedKV.meta_dtype/raw_dtype``).
    update_scores : also add ``gain`` to the stored scores of the pages (compact pages: the mean update, which
        needs ``position`` [K], the step's position, and the config's ``lag``; see :func:`add_scores_ref`).
    peak : the scores are peaks (``DiffKVConfig.importance``): the update is ``max(score, gain)``.

    Returns
    -------
    out : [B, H_q, D] float32 (0 for a sequence whose heads hold no token).
    gain : [B * H_kv, M_hi + M_lo] float32, max over the GQA group of the probabilities (0 at empty slots).
    """
    data = getattr(pool, "data", pool)
    b, hq, d = query.shape
    k = items.numel()
    hkv = k // b
    tiers = []
    for low, count, m in zip((False, True), (n_high, n_low), _widths(layouts, n_high, n_low), strict=True):
        lay = layouts[int(low)]
        md, rd = resolve_dtypes(lay, meta_dtype, raw_dtype)
        ids = _page_ids(tables, items, low, m // lay.tokens_per_page)
        keys, values, _, _ = load_pages_ref(data, lay, ids, count=count.to(data.device), meta_dtype=md, raw_dtype=rd)
        valid = torch.arange(m, device=data.device)[None, :] < count[:, None]
        tiers.append((keys.view(b, hkv, m, d), values.view(b, hkv, m, d), valid.view(b, hkv, m)))
    out, probs = decode_attention_tiers(query, tiers, scaling)
    gain = probs.view(b, hkv, hq // hkv, -1).amax(2).reshape(k, -1)
    if update_scores:
        m_hi = tiers[0][0].shape[2]
        add_scores_ref(data, tables, layouts[0], False, items, n_high, gain[:, :m_hi], position=position, lag=lag,
                       peak=peak)
        add_scores_ref(data, tables, layouts[1], True, items, n_low, gain[:, m_hi:], position=position, lag=lag,
                       peak=peak)
    return out, gain


def launch_settings(num_items: int, max_pages: int, device: torch.device, num_splits: int | None = None,
                    num_warps: int | None = None) -> dict:
    """Split count (flash-decoding): enough programs for ~2 waves over the SMs, at least 4 pages per split.

    num_warps: 4 unless given (a power of two; benchmarks/gpu/README.md: 8 avoids register spills at head_dim 128,
    untimed so far).
    """
    if num_splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        want = _cdiv(2 * sms, max(num_items, 1))
        num_splits = max(1, min(want, _cdiv(max_pages, 4)))
    if num_warps is not None and (num_warps < 1 or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    return {"NUM_SPLITS": int(num_splits), "num_warps": num_warps or 4}


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
                           position=None, lag: int = 0, peak: bool = False):
    """Same arguments and results as :func:`paged_decode_attention_ref`; ``backend`` "auto" runs the Triton kernels
    when the pool is on CUDA and the reference otherwise ("triton" on CPU needs ``TRITON_INTERPRET=1``).

    return_gain : False skips the ``[K, M]`` gain output (then ``gain`` is None; useful with ``update_scores``).
    num_splits, num_warps : split-K partitions per item and warps per program (default: :func:`launch_settings`).
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
    m_hi, m_lo = _widths(layouts, n_high, n_low)
    m_total = m_hi + m_lo
    max_pages = m_hi // hi.tokens_per_page + m_lo // lo.tokens_per_page
    cfg = launch_settings(k, max_pages, data.device, num_splits, num_warps)
    s = cfg["NUM_SPLITS"]
    dev = data.device
    f32 = torch.float32
    logits = torch.empty(k * g * max(m_total, 1), dtype=f32, device=dev)
    part_m, part_l = torch.empty(k, s, g, dtype=f32, device=dev), torch.empty(k, s, g, dtype=f32, device=dev)
    part_acc = torch.empty(k, s, g, d, dtype=f32, device=dev)
    out = torch.empty(b, hq, d, dtype=f32, device=dev)
    gain = torch.zeros(k, m_total, dtype=f32, device=dev) if return_gain else logits
    gp = max(16, 1 << (g - 1).bit_length())
    common = dict(items_ptr=items.to(dev, torch.int64).contiguous(), nh_ptr=n_high.to(dev, torch.int32).contiguous(),
                  nl_ptr=n_low.to(dev, torch.int32).contiguous(), rows_ptr=tables.rows, pool_ptr=data,
                  num_kv_heads=hkv, width=tables.width, page_bytes=hi.page_bytes, m_hi=m_hi, m_total=max(m_total, 1),
                  G=g, GP=gp, D=d, NUM_SPLITS=s, N_HI=hi.tokens_per_page, N_LO=lo.tokens_per_page,
                  num_warps=cfg["num_warps"])
    hargs, largs = _tier_args(hi, "HI"), _tier_args(lo, "LO")
    step = _step_positions(hi, update_scores, position, dev)
    paged_decode_split_kernel[(k, s)](
        q_ptr=query, lg_ptr=logits, m_ptr=part_m, l_ptr=part_l, acc_ptr=part_acc,
        stride_qb=query.stride(0), stride_qh=query.stride(1), qk_scale=float(scaling) * LOG2E,
        **_offsets(hi, "H"), **_offsets(lo, "L"), **common,
        **{kk: v for kk, v in {**hargs, **largs}.items() if kk not in ("N_HI", "N_LO")},
        META_KIND=_KIND[md], RAW_KIND=_KIND[rd], K_FIELDS=hi.key_meta_fields, STORE_LOGITS=return_gain or update_scores,
        PRECISION="ieee" if not data.is_cuda else "tf32x3")
    paged_decode_reduce_kernel[(k,)](
        m_ptr=part_m, l_ptr=part_l, acc_ptr=part_acc, lg_ptr=logits, out_ptr=out, gain_ptr=gain, step_ptr=step,
        stride_ob=out.stride(0), stride_oh=out.stride(1), hs_off=hi.score_offset, ls_off=lo.score_offset,
        hp_off=hi.pos_offset, lp_off=lo.pos_offset, lag=lag, SP=1 << (s - 1).bit_length(), BT=128,
        FIELD_BYTES=hi.score_bytes, WRITE_GAIN=return_gain, UPDATE_SCORES=update_scores, PEAK=peak, **common)
    return out, gain if return_gain else None
