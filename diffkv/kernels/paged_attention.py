"""Triton paged decode attention over the two DiffKV tiers, GQA-shared, split-K (flash-decoding) with a reduce step.

Replaces the published ``sparse_paged_attention`` + ``reduce_kernel`` (departures: docs/algorithm.md §7.4):

* one program per (item = sequence x KV head, split) serves all G query heads of the group from one read of each
  page (the G queries form a [GP, D] tile, GP = G padded to a power of two >= 16, rows >= G masked; ``tl.dot``);
* the program walks the item's page list ``high pages 0 .. p_hi-1, then low pages 0 .. p_lo-1`` (high page i at
  table column i, low page j at column T-1-j, docs/design.md §4.2) and dequantizes keys/values in registers (codes
  unpacked with shifts and masks, little-endian within bytes; ``x = code * scale + zero`` in fp32, scale/zero in the
  meta dtype);
* one online softmax (base 2) across both tiers; split s of S covers walk indices ``[s*c, (s+1)*c)`` with
  ``c = ceil((p_hi + p_lo) / S)`` *per item*, so a split may span the tier boundary and every token is addressed
  by its own tier's page and slot (there is no ``token // PARTITION`` to go wrong, docs/algorithm.md §7.4);
* score update: the split kernel writes each token's scaled logits per query head into a scratch ``[K, G, M]``
  buffer; the reduce kernel merges the splits' (max, sum, acc) into the output, then turns the logits into
  probabilities with the final (max, sum) and writes ``gain = max over the group`` and/or adds it in place to the
  pages' fp32 score fields (each token belongs to one item: no races); compact pages (``DiffKVConfig.compact_meta``,
  FIELD_BYTES 2) update their fp16 mean scores instead, ``m += (gain - m) / max(age + 1 - lag, 1)`` in fp32 with
  the age from the int16 position mod 2^16, rounded once (``diffkv.core.bookkeeping.updated``);
* symmetric keys (``DiffKVConfig.symmetric_keys``, K_FIELDS 1) store the scale only: ``zero = scale * -(qmax / 2)``
  in fp32 (``diffkv.core.quant.symmetric_zero``).
"""

from __future__ import annotations

import triton
import triton.language as tl

KINDS = {"float16": 0, "bfloat16": 1, "float32": 2}  # META_KIND / RAW_KIND / Q dtype codes
NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so empty tiles give exp2(-inf - NEG_BIG) = 0 and no NaN


@triton.jit
def _typed(pool_ptr, KIND: tl.constexpr):
    """The byte pool seen as fp16 (0), bf16 (1) or fp32 (2) elements."""
    if KIND == 0:
        p = pool_ptr.to(tl.pointer_type(tl.float16))
    elif KIND == 1:
        p = pool_ptr.to(tl.pointer_type(tl.bfloat16))
    else:
        p = pool_ptr.to(tl.pointer_type(tl.float32))
    return p


@triton.jit
def _field_ptrs(pool_ptr, base, SCORE_OFF, POS_OFF, FIELD_BYTES: tl.constexpr):
    """Typed pointers to slot 0 of the score and position fields of the page(s) at byte ``base``: fp32 and int32, or
    (FIELD_BYTES 2, compact) fp16 and int16."""
    if FIELD_BYTES == 2:
        sp = pool_ptr.to(tl.pointer_type(tl.float16)) + (base + SCORE_OFF) // 2
        pp = pool_ptr.to(tl.pointer_type(tl.int16)) + (base + POS_OFF) // 2
    else:
        sp = pool_ptr.to(tl.pointer_type(tl.float32)) + (base + SCORE_OFF) // 4
        pp = pool_ptr.to(tl.pointer_type(tl.int32)) + (base + POS_OFF) // 4
    return sp, pp


@triton.jit
def _ages(position, pos, FIELD_BYTES: tl.constexpr):
    """int64 ``position - pos`` of stored positions; compact: mod 2^16 (``bookkeeping.ages``)."""
    age = position - pos.to(tl.int64)
    if FIELD_BYTES == 2:
        age = age & 0xFFFF
    return age


@triton.jit
def _dequant(pool_ptr, base, slot, tmask, CODE_OFF, META_OFF, D: tl.constexpr, BITS: tl.constexpr,
             GROUPS: tl.constexpr, META_KIND: tl.constexpr, RAW_KIND: tl.constexpr, FIELDS: tl.constexpr,
             BN: tl.constexpr):
    """Keys or values of one page as fp32 [BN, D]: token ``slot`` [BN] of the page at byte ``base``; 0 where masked.

    BITS 16: raw values of RAW_KIND. Otherwise packed codes ``[N, D*BITS/8]`` and ``[N, GROUPS, FIELDS]`` metadata
    of META_KIND: (scale, zero), or (FIELDS 1, symmetric keys) the scale only (inverse of docs/algorithm.md §3.2-3.3).
    """
    c = tl.arange(0, D)
    if BITS == 16:
        RB: tl.constexpr = 4 if RAW_KIND == 2 else 2
        idx = (base + CODE_OFF) // RB + slot[:, None] * D + c[None, :]
        x = tl.load(_typed(pool_ptr, RAW_KIND) + idx, mask=tmask[:, None], other=0.0).to(tl.float32)
    else:
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = D * BITS // 8
        GS: tl.constexpr = D // GROUPS
        MB: tl.constexpr = 4 if META_KIND == 2 else 2
        row = pool_ptr + base + CODE_OFF + slot[:, None] * NB
        if BITS == 3:  # a 2-bit plane of the low bits [D / 4 B], then a 1-bit plane of the high bit [D / 8 B]
            low = tl.load(row + tl.arange(0, D // 4)[None, :], mask=tmask[:, None], other=0).to(tl.int32)
            high = tl.load(row + D // 4 + tl.arange(0, D // 8)[None, :], mask=tmask[:, None], other=0).to(tl.int32)
            q = (tl.reshape((low[:, :, None] >> (tl.arange(0, 4) * 2)[None, None, :]) & 3, (BN, D))
                 + tl.reshape((high[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1, (BN, D)) * 4)
            q = q.to(tl.float32)
        else:
            byt = tl.load(row + tl.arange(0, NB)[None, :], mask=tmask[:, None], other=0).to(tl.int32)
            if PER == 1:
                q = byt.to(tl.float32)
            else:
                sh = tl.arange(0, PER) * BITS
                q = tl.reshape(((byt[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)).to(tl.float32),
                               (BN, D))
        g = tl.arange(0, GROUPS)
        mp = (_typed(pool_ptr, META_KIND) + (base + META_OFF) // MB + slot[:, None] * (FIELDS * GROUPS)
              + FIELDS * g[None, :])
        sc = tl.load(mp, mask=tmask[:, None], other=0.0).to(tl.float32)
        if FIELDS == 1:
            zr = sc * (-(((1 << BITS) - 1) * 0.5))  # quant.symmetric_zero
        else:
            zr = tl.load(mp + 1, mask=tmask[:, None], other=0.0).to(tl.float32)
        x = tl.reshape(tl.reshape(q, (BN, GROUPS, GS)) * sc[:, :, None] + zr[:, :, None], (BN, D))
    return x


@triton.jit
def _attend_page(pool_ptr, page, count, q, m, den, acc, lg_ptr, col0, m_total, page_bytes,
                 K_OFF, KM_OFF, V_OFF, VM_OFF, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                 N: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, KG: tl.constexpr,
                 VG: tl.constexpr, META_KIND: tl.constexpr, RAW_KIND: tl.constexpr, K_FIELDS: tl.constexpr,
                 STORE_LOGITS: tl.constexpr, PRECISION: tl.constexpr):
    """Online-softmax update of (m [GP], den [GP], acc [GP, D]) with the first ``count`` tokens of one page."""
    slot = tl.arange(0, BN)
    tmask = slot < tl.minimum(count, N)
    base = page.to(tl.int64) * page_bytes
    kt = _dequant(pool_ptr, base, slot, tmask, K_OFF, KM_OFF, D, KB, KG, META_KIND, RAW_KIND, K_FIELDS, BN)
    s = tl.dot(q, tl.trans(kt), input_precision=PRECISION)  # [GP, BN], log2 domain (q carries scale * log2 e)
    s = tl.where(tmask[None, :], s, float("-inf"))
    if STORE_LOGITS:
        g = tl.arange(0, GP)
        tl.store(lg_ptr + g[:, None] * m_total + col0 + slot[None, :], s, mask=(g < G)[:, None] & tmask[None, :])
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    vt = _dequant(pool_ptr, base, slot, tmask, V_OFF, VM_OFF, D, VB, VG, META_KIND, RAW_KIND, 2, BN)
    acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision=PRECISION)
    return m_new, den * alpha + tl.sum(p, axis=1), acc


@triton.jit
def paged_decode_split_kernel(
        q_ptr, pool_ptr, rows_ptr, items_ptr, nh_ptr, nl_ptr, lg_ptr, m_ptr, l_ptr, acc_ptr,
        stride_qb, stride_qh, num_kv_heads, width, page_bytes, m_hi, m_total, qk_scale,
        hk_off, hkm_off, hv_off, hvm_off, lk_off, lkm_off, lv_off, lvm_off,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        N_HI: tl.constexpr, BN_HI: tl.constexpr, KB_HI: tl.constexpr, VB_HI: tl.constexpr,
        KG_HI: tl.constexpr, VG_HI: tl.constexpr,
        N_LO: tl.constexpr, BN_LO: tl.constexpr, KB_LO: tl.constexpr, VB_LO: tl.constexpr,
        KG_LO: tl.constexpr, VG_LO: tl.constexpr,
        META_KIND: tl.constexpr, RAW_KIND: tl.constexpr, K_FIELDS: tl.constexpr, STORE_LOGITS: tl.constexpr,
        PRECISION: tl.constexpr):
    """Partial attention of split ``program_id(1)`` of item ``program_id(0)`` over its share of the page walk.

    q_ptr: [B, H_q, D] (any float dtype); pool_ptr: uint8 [num_pages, page_bytes]; rows_ptr: int32 [items, width]
    page tables; items_ptr, nh_ptr, nl_ptr: [K] item id, n_high, n_low (item k = b * H_kv + h serves query heads
    h*G .. h*G+G-1 of sequence b). Writes lg_ptr [K, G, m_total] log2-domain logits (high tokens at columns
    0.., low tokens at m_hi..), m_ptr, l_ptr [K, S, G] running max / sum and acc_ptr [K, S, G, D] (unnormalized).
    """
    k = tl.program_id(0)
    split = tl.program_id(1)
    item = tl.load(items_ptr + k).to(tl.int64)
    n_hi = tl.load(nh_ptr + k).to(tl.int32)
    n_lo = tl.load(nl_ptr + k).to(tl.int32)
    p_hi = (n_hi + N_HI - 1) // N_HI
    total = p_hi + (n_lo + N_LO - 1) // N_LO
    chunk = (total + NUM_SPLITS - 1) // NUM_SPLITS
    start = split * chunk
    end = tl.minimum(start + chunk, total)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    qrow = (k // num_kv_heads).to(tl.int64) * stride_qb + ((k % num_kv_heads) * G + g).to(tl.int64) * stride_qh
    q = tl.load(q_ptr + qrow[:, None] + d[None, :], mask=(g < G)[:, None], other=0.0).to(tl.float32) * qk_scale
    m = tl.full((GP,), NEG_BIG, tl.float32)
    den = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    row = rows_ptr + item * width
    lg = lg_ptr + k.to(tl.int64) * G * m_total
    for i in range(start, tl.minimum(end, p_hi)):
        page = tl.load(row + i)
        m, den, acc = _attend_page(pool_ptr, page, n_hi - i * N_HI, q, m, den, acc, lg, i * N_HI, m_total, page_bytes,
                                 hk_off, hkm_off, hv_off, hvm_off, G, GP, D, N_HI, BN_HI, KB_HI, VB_HI, KG_HI, VG_HI,
                                 META_KIND, RAW_KIND, K_FIELDS, STORE_LOGITS, PRECISION)
    for j in range(tl.maximum(start - p_hi, 0), end - p_hi):
        page = tl.load(row + width - 1 - j)
        m, den, acc = _attend_page(pool_ptr, page, n_lo - j * N_LO, q, m, den, acc, lg, m_hi + j * N_LO, m_total,
                                 page_bytes, lk_off, lkm_off, lv_off, lvm_off, G, GP, D, N_LO, BN_LO, KB_LO, VB_LO,
                                 KG_LO, VG_LO, META_KIND, RAW_KIND, K_FIELDS, STORE_LOGITS, PRECISION)
    part = (k * NUM_SPLITS + split).to(tl.int64) * G + g
    gm = g < G
    tl.store(m_ptr + part, m, mask=gm)
    tl.store(l_ptr + part, den, mask=gm)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=gm[:, None])


@triton.jit
def _update_scores(pool_ptr, page, slot, tm, gain, page_bytes, score_off, pos_off, position, lag,
                   FIELD_BYTES: tl.constexpr, PEAK: tl.constexpr):
    """One step's ``gain`` [BT] into the scores of tokens ``slot`` of pages ``page`` [BT] where ``tm``: ``score +=
    gain`` (fp32 sums), or compact (FIELD_BYTES 2) ``m += (gain - m) / max(age + 1 - lag, 1)`` in fp32, rounded once
    to fp16 (``bookkeeping.updated``; age before the step, from the int16 position mod 2^16); PEAK: ``max(score,
    gain)`` rounded once to the stored dtype."""
    sp, pp = _field_ptrs(pool_ptr, page * page_bytes, score_off, pos_off, FIELD_BYTES)
    m = tl.load(sp + slot, mask=tm, other=0.0).to(tl.float32)
    if PEAK and FIELD_BYTES == 2:
        tl.store(sp + slot, tl.maximum(m, gain).to(tl.float16), mask=tm)
    elif PEAK:
        tl.store(sp + slot, tl.maximum(m, gain), mask=tm)
    elif FIELD_BYTES == 2:
        age = _ages(position, tl.load(pp + slot, mask=tm, other=0), FIELD_BYTES)
        m = m + tl.math.div_rn(gain - m, tl.maximum(age + 1 - lag, 1).to(tl.float32))
        tl.store(sp + slot, m.to(tl.float16), mask=tm)
    else:
        tl.store(sp + slot, m + gain, mask=tm)


@triton.jit
def _gain_tier(lg, gain_row, pool_ptr, row, n, col0, m_total, mx, inv, page_bytes, score_off, pos_off, position, lag,
               width, G: tl.constexpr, GP: tl.constexpr, N: tl.constexpr, LOW: tl.constexpr, BT: tl.constexpr,
               FIELD_BYTES: tl.constexpr, WRITE_GAIN: tl.constexpr, UPDATE_SCORES: tl.constexpr, PEAK: tl.constexpr):
    """gain[t] = max over the group of exp2(logit - max) / sum for this program's chunk of the n tokens of one tier
    (chunk ``program_id(1)`` of ``num_programs(1)``, whole BT blocks); write and/or add."""
    g = tl.arange(0, GP)
    chunks = tl.num_programs(1)
    per = tl.cdiv(tl.cdiv(n, chunks), BT) * BT
    first = tl.program_id(1) * per
    for t0 in range(first, tl.minimum(first + per, n), BT):
        t = t0 + tl.arange(0, BT)
        tm = t < n
        s = tl.load(lg + g[:, None] * m_total + col0 + t[None, :], mask=(g < G)[:, None] & tm[None, :],
                    other=float("-inf"))
        gain = tl.max(tl.exp2(s - mx[:, None]) * inv[:, None], axis=0)
        if WRITE_GAIN:
            tl.store(gain_row + col0 + t, gain, mask=tm)
        if UPDATE_SCORES:
            col = t // N
            if LOW:
                col = width - 1 - col
            page = tl.load(row + col, mask=tm, other=0).to(tl.int64)
            _update_scores(pool_ptr, page, t % N, tm, gain, page_bytes, score_off, pos_off, position, lag,
                           FIELD_BYTES, PEAK)


@triton.jit
def paged_decode_reduce_kernel(
        m_ptr, l_ptr, acc_ptr, lg_ptr, out_ptr, gain_ptr, pool_ptr, rows_ptr, items_ptr, nh_ptr, nl_ptr, step_ptr,
        stride_ob, stride_oh, num_kv_heads, width, page_bytes, m_hi, m_total, hs_off, ls_off, hp_off, lp_off, lag,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, SP: tl.constexpr,
        N_HI: tl.constexpr, N_LO: tl.constexpr, BT: tl.constexpr, FIELD_BYTES: tl.constexpr,
        WRITE_GAIN: tl.constexpr, UPDATE_SCORES: tl.constexpr, PEAK: tl.constexpr = False):
    """Merge the splits of item ``program_id(0)`` (flash-decoding reduce), write out [B, H_q, D] fp32, then the
    per-token group-max probabilities: gain_ptr [K, m_total] (WRITE_GAIN) and/or the score update of the pages'
    score fields (UPDATE_SCORES; :func:`_update_scores`: compact pages need the step's position, step_ptr [K] int64,
    otherwise unread, and ``lag``, ``DiffKVConfig.score_lag``; PEAK: peak scores, ``max(score, gain)``). An item
    with no token gets a zero output. Grid (K, C): the C programs of an item share its tokens' probabilities (each
    merges the splits' max and sum itself; program 0 writes the output), so a small batch still fills the GPU."""
    k = tl.program_id(0)
    g = tl.arange(0, GP)
    gm = g < G
    sp = tl.arange(0, SP)
    part = (k * NUM_SPLITS + sp).to(tl.int64)[:, None] * G + g[None, :]
    pm = (sp < NUM_SPLITS)[:, None] & gm[None, :]
    ms = tl.load(m_ptr + part, mask=pm, other=NEG_BIG)
    mx = tl.max(ms, axis=0)  # [GP]
    total = tl.sum(tl.load(l_ptr + part, mask=pm, other=0.0) * tl.exp2(ms - mx[None, :]), axis=0)
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    d = tl.arange(0, D)
    o = tl.zeros((GP, D), tl.float32)
    for s in range(NUM_SPLITS):
        pr = (k * NUM_SPLITS + s).to(tl.int64) * G + g
        w = tl.exp2(tl.load(m_ptr + pr, mask=gm, other=NEG_BIG) - mx)
        o += tl.load(acc_ptr + pr[:, None] * D + d[None, :], mask=gm[:, None], other=0.0) * w[:, None]
    orow = (k // num_kv_heads).to(tl.int64) * stride_ob + ((k % num_kv_heads) * G + g).to(tl.int64) * stride_oh
    tl.store(out_ptr + orow[:, None] + d[None, :], o * inv[:, None], mask=gm[:, None] & (tl.program_id(1) == 0))
    if WRITE_GAIN or UPDATE_SCORES:
        item = tl.load(items_ptr + k).to(tl.int64)
        row = rows_ptr + item * width
        lg = lg_ptr + k.to(tl.int64) * G * m_total
        gain_row = gain_ptr + k.to(tl.int64) * m_total
        position = tl.zeros([], tl.int64)
        if FIELD_BYTES == 2 and UPDATE_SCORES:
            position = tl.load(step_ptr + k).to(tl.int64)
        _gain_tier(lg, gain_row, pool_ptr, row, tl.load(nh_ptr + k).to(tl.int32), 0, m_total, mx, inv, page_bytes,
                   hs_off, hp_off, position, lag, width, G, GP, N_HI, False, BT, FIELD_BYTES, WRITE_GAIN,
                   UPDATE_SCORES, PEAK)
        _gain_tier(lg, gain_row, pool_ptr, row, tl.load(nl_ptr + k).to(tl.int32), m_hi, m_total, mx, inv,
                   page_bytes, ls_off, lp_off, position, lag, width, G, GP, N_LO, True, BT, FIELD_BYTES, WRITE_GAIN,
                   UPDATE_SCORES, PEAK)
