"""Triton fused decode placement + store: one program per (sequence, KV head) item of a layer, one launch per layer.

Per item (docs/algorithm.md §4.4; the published ``compress_and_append_cache_decode_phase``), bit-exact with the torch
reference ``diffkv.ops.reference.place_store_ref`` (``policy.place_decode`` + ``PagedKV.read_at`` / ``write``):

1. walk the item's high pages (table columns 0, 1, ..) and low pages (columns T-1, T-2, ..) reading only the fp32
   score and int32 position fields, and find the weakest eligible token of each tier: ``mean = score /
   max(age - lag, 1)`` over the first ``count`` slots with ``age = position - pos >= max(recent_window, lag + 1)``
   (compact pages, ``DiffKVConfig.compact_meta``: the stored fp16 score is the mean, ``age`` is taken mod 2^16 from
   the int16 position, ``diffkv.core.bookkeeping``);
   the first slot wins a tie (the running minimum is replaced only by a strictly smaller one, ``tl.min`` breaks
   in-page ties to the left); with ``lag > 0`` (``score_after_window``) the scores of the high tokens whose age is
   ``lag`` are reset to 0 (``policy.window_exits``);
2. decide the case exactly as ``policy.decide_decode`` (thresholds ``fp32(1 / max(position, 1)) * fp32(alpha)``, the
   way torch evaluates ``alpha / base``);
3. demotion: dequantize the victim from its high slot (``paged_attention._dequant``), stage it as fp32 in a scratch
   row, and re-quantize it with its score and position (their stored bits) into its low slot (over the weakest low
   token, or appended);
4. quantize the new token into its high slot (the victim's slot, or appended) with score 0 and pos = position
   (compact: its low 16 bits);
5. write the new (n_high, n_low) into the tables' counts.

Planned decode (``PLANNED``, ``diffkv.ops.decode_plan``): the same program also applies the key transform
(``KEY_TRANSFORM``: ``(k - center) / scale`` rounded to the key dtype, as ``PagedKV.stored_keys``) and scales the
item's G queries by its key scale (``SCALE_Q``, as ``PagedKV.stored_queries``), writes the new counts clamped to the
plan's tier widths into ``cnt_ptr`` (what the attention kernels read: no gather, no out-of-bounds logits) and ORs
error bits into ``err_ptr`` (1: the new key or value is not finite: the item's step then stores, demotes and counts
nothing; 2: a count exceeds the plan's widths), checked on the host once per step.

Quantization and byte packing are the device functions of ``diffkv.kernels.quantize_store`` (symmetric keys, K_FIELDS 1:
scale-only key groups). Launch with ``enable_fp_fusion=False`` on the GPU: dequantization must round ``code * scale``
before adding ``zero`` as torch does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from diffkv.kernels.paged_attention import _ages, _dequant, _field_ptrs
from diffkv.kernels.quantize_store import _encode, _field_bits, _nonfinite, _store_encoded, _store_le


@triton.jit
def _means(sc, age, lag, FIELD_BYTES: tl.constexpr, PEAK: tl.constexpr):
    """fp32 importance from stored scores sc [BN] fp32 (``bookkeeping.means``): the sum over ``max(age - lag,
    1)``, or (compact, or PEAK: peak scores) the stored value itself."""
    if FIELD_BYTES == 2 or PEAK:
        mean = sc
    else:
        mean = tl.math.div_rn(sc, tl.maximum(age - lag, 1).to(tl.float32))
    return mean


@triton.jit
def _weakest(pool_ptr, row_ptr, count, col0, col_step, position, page_bytes, recent_window, lag,
             SCORE_OFF, POS_OFF, N: tl.constexpr, BN: tl.constexpr, FIELD_BYTES: tl.constexpr, RESET: tl.constexpr,
             PEAK: tl.constexpr):
    """(min mean fp32, its token index int32) over the eligible tokens of one tier; (inf, 0) when none. RESET: also
    zero the scores of the tokens whose age is ``lag`` (> 0), which are never eligible."""
    best = tl.full([], float("inf"), tl.float32)
    idx = tl.zeros([], tl.int32)
    min_age = tl.maximum(recent_window, lag + 1)
    slot = tl.arange(0, BN)
    for p in range(0, tl.cdiv(count, N)):
        page = tl.load(row_ptr + col0 + p * col_step).to(tl.int64)
        tmask = slot < tl.minimum(count - p * N, N)
        sp, pp = _field_ptrs(pool_ptr, page * page_bytes, SCORE_OFF, POS_OFF, FIELD_BYTES)
        sc = tl.load(sp + slot, mask=tmask, other=0.0).to(tl.float32)
        age = _ages(position, tl.load(pp + slot, mask=tmask, other=0), FIELD_BYTES)
        if RESET:
            tl.store(sp + slot, 0.0, mask=tmask & (age == lag) & (lag > 0))
        ok = tmask & (age >= min_age)
        mean = tl.where(ok, _means(sc, age, lag, FIELD_BYTES, PEAK), float("inf"))
        m, i = tl.min(mean, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = m < best
        idx = tl.where(better, p * N + i, idx)
        best = tl.where(better, m, best)
    return best, idx


@triton.jit
def _store_token(pool_ptr, k_ptr, v_ptr, tok, stride_k, stride_v, base, slot, ok, score_bits, pos,
                 K_OFF, KM_OFF, V_OFF, VM_OFF, SCORE_OFF, POS_OFF, D: tl.constexpr, KB: tl.constexpr,
                 VB: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr, META_KIND: tl.constexpr,
                 RAW_KIND: tl.constexpr, K_FIELDS: tl.constexpr, FIELD_BYTES: tl.constexpr):
    """``store_kernel`` for one token (vectors of length 1): row ``tok`` of k_ptr / v_ptr into ``slot`` of the page at
    byte ``base`` where ``ok``, with the low FIELD_BYTES bytes of ``score_bits`` and ``pos`` (int32); tokens with
    non-finite or overflowing values are not written."""
    MB: tl.constexpr = 4 if META_KIND == 2 else 2
    RB: tl.constexpr = 4 if RAW_KIND == 2 else 2
    kpl, ksc, kzp, kerr = _encode(k_ptr, tok, ok, stride_k, D, KB, KG, META_KIND, RAW_KIND, K_FIELDS, 1)
    vpl, vsc, vzp, verr = _encode(v_ptr, tok, ok, stride_v, D, VB, VG, META_KIND, RAW_KIND, 2, 1)
    ok = ok & ((kerr | verr) == 0)
    _store_encoded(pool_ptr, base, slot, ok, kpl, ksc, kzp, K_OFF, KM_OFF, D, KB, KG, MB, RB, K_FIELDS)
    _store_encoded(pool_ptr, base, slot, ok, vpl, vsc, vzp, V_OFF, VM_OFF, D, VB, VG, MB, RB, 2)
    _store_le(pool_ptr + base + SCORE_OFF + slot * FIELD_BYTES, score_bits, FIELD_BYTES, ok)
    _store_le(pool_ptr + base + POS_OFF + slot * FIELD_BYTES, pos, FIELD_BYTES, ok)


@triton.jit
def _cast(x, KIND: tl.constexpr):
    """fp32 ``x`` rounded to fp16 (0), bf16 (1) or fp32 (2), as torch's ``.to(dtype)``."""
    if KIND == 0:
        y = x.to(tl.float16)
    elif KIND == 1:
        y = x.to(tl.bfloat16)
    else:
        y = x
    return y


@triton.jit
def _scale_queries(q_ptr, qo_ptr, scale, k, num_kv_heads, stride_qb, stride_qh, stride_ob, stride_oh,
                   D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, Q_KIND: tl.constexpr):
    """The G queries of item ``k`` times its key scale [D] fp32, rounded to their dtype (``stored_queries``)."""
    g = tl.arange(0, GP)
    c = tl.arange(0, D)
    head = ((k % num_kv_heads) * G + g).to(tl.int64)
    seq = (k // num_kv_heads).to(tl.int64)
    gm = (g < G)[:, None]
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + c[None, :], mask=gm, other=0.0)
    tl.store(qo_ptr + seq * stride_ob + head[:, None] * stride_oh + c[None, :],
             _cast(q.to(tl.float32) * scale[None, :], Q_KIND), mask=gm)


@triton.jit
def place_store_kernel(
        pool_ptr, rows_ptr, counts_ptr, items_ptr, pos_ptr, k_ptr, v_ptr, scratch_ptr,
        stride_k, stride_v, num_items, width, page_bytes, recent_window, lag, alpha_low, alpha_quant,
        hk_off, hkm_off, hv_off, hvm_off, hs_off, hp_off, lk_off, lkm_off, lv_off, lvm_off, ls_off, lp_off,
        D: tl.constexpr, TWO_TIER: tl.constexpr,
        N_HI: tl.constexpr, BN_HI: tl.constexpr, KB_HI: tl.constexpr, VB_HI: tl.constexpr,
        KG_HI: tl.constexpr, VG_HI: tl.constexpr,
        N_LO: tl.constexpr, BN_LO: tl.constexpr, KB_LO: tl.constexpr, VB_LO: tl.constexpr,
        KG_LO: tl.constexpr, VG_LO: tl.constexpr,
        META_KIND: tl.constexpr, RAW_KIND: tl.constexpr, K_FIELDS: tl.constexpr, FIELD_BYTES: tl.constexpr,
        PEAK: tl.constexpr = False,
        cnt_ptr=None, err_ptr=None, num_k=0, cap_hi=0, cap_lo=0, center_ptr=None, kscale_ptr=None,
        q_ptr=None, qo_ptr=None, num_kv_heads=1, stride_qb=0, stride_qh=0, stride_ob=0, stride_oh=0,
        PLANNED: tl.constexpr = False, KEY_TRANSFORM: tl.constexpr = 0, K_KIND: tl.constexpr = 2,
        SCALE_Q: tl.constexpr = False, Q_KIND: tl.constexpr = 2, G: tl.constexpr = 1, GP: tl.constexpr = 1):
    """Decode placement and store of item ``program_id(0)``.

    pool_ptr: uint8 [num_pages, page_bytes]; rows_ptr: int32 [num_items, width] page tables; counts_ptr: int32
    [4, num_items] (n_high, n_low, ..) updated in place; items_ptr: int64 [K]; pos_ptr: int64 [K] the new token's
    position; k_ptr, v_ptr: [K, D] the new token (unit channel stride); scratch_ptr: fp32 [K, 3, D].
    lag: ``DiffKVConfig.score_lag``. alpha_quant: alpha_high (alpha_low with one tier). *_off: the tiers' segment
    byte offsets (TierLayout). K_FIELDS: key meta values per group (1: symmetric keys); FIELD_BYTES: bytes of the
    score and position fields (2: compact). PEAK: the scores are peaks (``DiffKVConfig.importance``).

    PLANNED (a decode plan's launch, module docstring): cnt_ptr int32 [2, num_k] gets (n_high, n_low) clamped to
    (cap_hi, cap_lo); err_ptr int32 [1] is ORed with 1 (non-finite key or value) and 2 (a clamped count).
    KEY_TRANSFORM 1: keys minus center_ptr's row ``item`` (fp32 [num_items, D]), 2: then divided by kscale_ptr's,
    rounded to K_KIND (the kind of k_ptr). SCALE_Q: q_ptr's G query heads of this item ([B, H_q, D], sequence
    ``k // num_kv_heads``) times kscale_ptr's row into qo_ptr (same shape, kind Q_KIND); GP: G padded to a power of 2.
    """
    k = tl.program_id(0)
    item = tl.load(items_ptr + k).to(tl.int64)
    position = tl.load(pos_ptr + k).to(tl.int64)
    n_hi = tl.load(counts_ptr + item).to(tl.int32)
    n_lo = tl.load(counts_ptr + num_items + item).to(tl.int32)
    row_ptr = rows_ptr + item * width
    c = tl.arange(0, D)
    bad = tl.zeros([], tl.int32)
    if PLANNED:
        key_in = tl.load(k_ptr + k.to(tl.int64) * stride_k + c).to(tl.float32)
        value_in = tl.load(v_ptr + k.to(tl.int64) * stride_v + c).to(tl.float32)
        bad = tl.max((_nonfinite(key_in) | _nonfinite(value_in)).to(tl.int32), axis=0)
    if SCALE_Q:
        _scale_queries(q_ptr, qo_ptr, tl.load(kscale_ptr + item * D + c), k, num_kv_heads, stride_qb, stride_qh,
                       stride_ob, stride_oh, D, G, GP, Q_KIND)
    mL, iL = _weakest(pool_ptr, row_ptr, n_hi, 0, 1, position, page_bytes, recent_window, lag, hs_off, hp_off,
                      N_HI, BN_HI, FIELD_BYTES, True, PEAK)
    if TWO_TIER:
        mR, iR = _weakest(pool_ptr, row_ptr, n_lo, width - 1, -1, position, page_bytes, recent_window, lag, ls_off,
                          lp_off, N_LO, BN_LO, FIELD_BYTES, False, PEAK)
    else:
        mR = tl.full([], float("inf"), tl.float32)
        iR = tl.zeros([], tl.int32)
    # policy.decide_decode
    rcp = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.maximum(position, 1).to(tl.float32))
    prune_thr = rcp * alpha_low
    quant_thr = rcp * alpha_quant
    keep = (n_hi + n_lo + 1) > recent_window
    prune_high = (mL < prune_thr) & (mL < mR) & keep
    demote = (mL < quant_thr) & (prune_high == 0) & keep & (bad == 0)  # PLANNED: a bad token changes nothing
    over_low = demote & (mR < prune_thr)
    append = (prune_high == 0) & (demote == 0)

    one = tl.arange(0, 1)
    tok = k.to(tl.int64) + one  # this item's row of k_ptr / v_ptr / scratch, as a length-1 vector
    # 3. demotion: victim iL (high) -> low slot (iR over a pruned token, else n_lo), with its score and position
    if demote:
        dmask = one == 0
        src_page = tl.load(row_ptr + iL // N_HI + one).to(tl.int64)
        src_base = src_page * page_bytes
        src_slot = (iL % N_HI + one).to(tl.int64)
        kx = _dequant(pool_ptr, src_base, src_slot, dmask, hk_off, hkm_off, D, KB_HI, KG_HI, META_KIND, RAW_KIND,
                      K_FIELDS, 1)
        vx = _dequant(pool_ptr, src_base, src_slot, dmask, hv_off, hvm_off, D, VB_HI, VG_HI, META_KIND, RAW_KIND, 2,
                      1)
        srow = scratch_ptr + tok[:, None] * (3 * D) + c[None, :]
        tl.store(srow, kx)
        tl.store(srow + D, vx)
        src_score = _field_bits(pool_ptr + src_base + hs_off, src_slot, dmask, FIELD_BYTES)  # stored bits
        src_pos = _field_bits(pool_ptr + src_base + hp_off, src_slot, dmask, FIELD_BYTES)
        tl.debug_barrier()  # the scratch row is complete and the victim's slot has been read
        dst = tl.where(over_low, iR, n_lo)
        dst_page = tl.load(row_ptr + (width - 1) - dst // N_LO + one).to(tl.int64)
        _store_token(pool_ptr, scratch_ptr, scratch_ptr + D, tok, 3 * D, 3 * D, dst_page * page_bytes,
                     (dst % N_LO + one).to(tl.int64), dmask, src_score, src_pos,
                     lk_off, lkm_off, lv_off, lvm_off, ls_off, lp_off, D, KB_LO, VB_LO, KG_LO, VG_LO,
                     META_KIND, RAW_KIND, K_FIELDS, FIELD_BYTES)
    # 4. the new token: high slot n_hi (append) or the victim's slot
    target = tl.where(append, n_hi, iL)
    nmask = one == 0
    page = tl.load(row_ptr + target // N_HI + one).to(tl.int64)
    if KEY_TRANSFORM != 0:  # stored keys: (k - center) / scale in fp32, rounded to the key dtype, via scratch row 2
        x = tl.load(k_ptr + k.to(tl.int64) * stride_k + c).to(tl.float32) - tl.load(center_ptr + item * D + c)
        if KEY_TRANSFORM == 2:
            x = tl.math.div_rn(x, tl.load(kscale_ptr + item * D + c))
        tl.store(scratch_ptr + k.to(tl.int64) * (3 * D) + 2 * D + c, _cast(x, K_KIND).to(tl.float32))
        tl.debug_barrier()
        _store_token(pool_ptr, scratch_ptr + 2 * D, v_ptr, tok, 3 * D, stride_v, page * page_bytes,
                     (target % N_HI + one).to(tl.int64), nmask, tl.zeros([1], tl.int32),
                     position.to(tl.int32) + one * 0, hk_off, hkm_off, hv_off, hvm_off, hs_off, hp_off, D, KB_HI,
                     VB_HI, KG_HI, VG_HI, META_KIND, RAW_KIND, K_FIELDS, FIELD_BYTES)
    else:
        _store_token(pool_ptr, k_ptr, v_ptr, tok, stride_k, stride_v, page * page_bytes,
                     (target % N_HI + one).to(tl.int64), nmask, tl.zeros([1], tl.int32),
                     position.to(tl.int32) + one * 0, hk_off, hkm_off, hv_off, hvm_off, hs_off, hp_off, D, KB_HI,
                     VB_HI, KG_HI, VG_HI, META_KIND, RAW_KIND, K_FIELDS, FIELD_BYTES)
    # 5. counts
    new_hi = n_hi + (append & (bad == 0)).to(tl.int32)  # (a bad token is not written: _store_token checks it)
    new_lo = n_lo + (demote & (over_low == 0)).to(tl.int32)
    tl.store(counts_ptr + item, new_hi)
    tl.store(counts_ptr + num_items + item, new_lo)
    if PLANNED:
        tl.store(cnt_ptr + k, tl.minimum(new_hi, cap_hi))
        tl.store(cnt_ptr + num_k + k, tl.minimum(new_lo, cap_lo))
        err = bad | (((new_hi > cap_hi) | (new_lo > cap_lo)).to(tl.int32) * 2)
        tl.atomic_or(err_ptr, err, mask=err != 0)
