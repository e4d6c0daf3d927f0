"""Triton paged decode attention with the per-token scale and zero kept out of the dots ("streams" kernel).

The split kernel of ``diffkv.kernels.paged_attention`` turns every code into fp32 (``code * scale + zero``) and feeds
fp32 tiles to ``tf32x3`` dots: per page it runs several thousand instructions per warp and is bound by instruction
issue, not by memory (benchmarks/gpu/results/README.md). This kernel computes the same attention with the integer
codes themselves in the dots, as exact fp16/bf16 integers on the tensor cores, and applies the per-token metadata
to the [G, BN] score and probability tiles instead of to the [BN, D] key and value tiles:

* keys: ``q . k_t = s_t (q . c_t) + z_t sum(q)``; the codes of one byte are ``PER = 8 / bits`` bit fields, and field
  ``j`` of byte ``c`` is channel ``c * PER + j``, so field ``j`` of every byte ("stream j", ``[BN, D / PER]``) is
  dotted with the query channels ``j::PER`` and nothing is reshaped;
* values: ``sum_t p_t (s_t c_t + z_t) = (p * s) . c + (p . z)``; stream ``j`` accumulates output channels ``j::PER``
  (stored to those strided columns of the partial output). ``p * s`` (normalized by the page's largest scale) goes
  to the dot as one fp16 part for 16-bit queries, as flash attention sends its probabilities (~1e-3 of a row, about
  an fp16 ulp of the output), and as two fp16 parts (high and low) for fp32 queries, which keeps those within ~1e-6;
* fp16 queries go to the dots as they are (codes <= 8 bits are exact in fp16); bf16 queries times a power of two
  that brings them into fp16's range (exact: 8 significant bits of 11), so the codes' fp16 trick serves both; fp32
  queries as two fp16 parts. The scale and the zero of a token are one 32-bit load when they are fp16/bf16;
* codes become fp16 by the magic number ``code | 0x6400 = 1024 + code`` (inline PTX on CUDA, four bytes a call);
  with 16-bit queries the 1024 stays in the dots (no subtraction per code): the keys' ``1024 * scale`` is folded
  into the zero, the values' ``1024 * sum(p)`` taken off each page's dot outputs; the values' bit fields are not
  shifted down (``1024 + code * 2^(j * bits)``), each stream's accumulator scaled back when stored;
* each program walks pages of one tier only (programs ``0 .. S_HI-1`` the high pages, ``S_HI ..`` the low pages),
  so each tier's constexprs drive a loop of its own. The partials (max, sum, acc) and the logits have the layout of
  ``paged_decode_split_kernel``'s, so ``paged_decode_reduce_kernel`` merges them and applies the score update.

Formats: 2-, 4- and 8-bit keys and values with one metadata group per vector, ``D * bits / 8 >= 16``; everything
else (3-bit, 1-bit, 16-bit raw tiers, grouped metadata) runs the old split kernel (``diffkv.ops.paged_attention``
chooses, :func:`streams_supported`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from diffkv.kernels.paged_attention import NEG_BIG, _typed
from diffkv.kernels.stream_codes import STREAM_BITS, pow2_scale, stream


def streams_supported(layout) -> bool:
    """Whether this kernel reads tier ``layout`` (``diffkv.core.layout.TierLayout``)."""
    d = layout.head_dim
    return all(bits in STREAM_BITS and groups == 1 and d * bits // 8 >= 16 and d & (d - 1) == 0
               for bits, groups in ((layout.key_bits, layout.key_groups), (layout.value_bits, layout.value_groups)))


@triton.jit
def _meta(pool_ptr, base, META_OFF, slot, tmask, BITS: tl.constexpr, META_KIND: tl.constexpr, FIELDS: tl.constexpr):
    """(scale, zero) fp32 [BN] of tokens ``slot`` of the page at byte ``base``; fp16/bf16 pairs as one 32-bit word.
    FIELDS 1 (symmetric keys): the scale only, ``zero = -scale * qmax / 2`` (``diffkv.core.quant.symmetric_zero``)."""
    if META_KIND == 2 or FIELDS == 1:
        MB: tl.constexpr = 4 if META_KIND == 2 else 2
        mp = _typed(pool_ptr, META_KIND) + (base + META_OFF) // MB + slot * FIELDS
        sc = tl.load(mp, mask=tmask, other=0.0).to(tl.float32)
        if FIELDS == 1:
            zr = sc * (-(((1 << BITS) - 1) * 0.5))
        else:
            zr = tl.load(mp + 1, mask=tmask, other=0.0).to(tl.float32)
    else:
        w = tl.load(pool_ptr.to(tl.pointer_type(tl.int32)) + (base + META_OFF) // 4 + slot, mask=tmask, other=0)
        half = tl.float16 if META_KIND == 0 else tl.bfloat16
        sc = (w & 0xFFFF).to(tl.int16).to(half, bitcast=True).to(tl.float32)  # little-endian: scale first
        zr = ((w >> 16) & 0xFFFF).to(tl.int16).to(half, bitcast=True).to(tl.float32)
    return sc, zr


@triton.jit
def _qstream(q_ptr, qrow, gmask, J: tl.constexpr, PER: tl.constexpr, NB: tl.constexpr, LOW: tl.constexpr,
             Q_KIND: tl.constexpr):
    """Query channels ``J::PER`` [GP, NB]: fp16 and bf16 queries as they are (the caller scales bf16 ones into
    fp16); fp32 queries as their fp16 part (LOW False) or the fp16 rest ``q - fp16(q)`` (LOW True)."""
    c = tl.arange(0, NB) * PER + J
    q = tl.load(q_ptr + qrow[:, None] + c[None, :], mask=gmask[:, None], other=0.0)
    if Q_KIND == 2:
        hi = q.to(tl.float16)
        if LOW:
            q = (q - hi.to(tl.float32)).to(tl.float16)
        else:
            q = hi
    return q


@triton.jit
def _key_dots(kb, q0, q1, q2, q3, r0, r1, r2, r3, PER: tl.constexpr, BITS: tl.constexpr, Q_PARTS: tl.constexpr,
              ASM: tl.constexpr, OFFSET: tl.constexpr):
    """sum_j dot(q_j, stream_j(kb)^T) [GP, BN] fp32, with the fp32 queries' low parts r_j when Q_PARTS is 2."""
    c = tl.trans(stream(kb, 0, BITS, ASM, OFFSET))
    s = tl.dot(q0, c)
    if Q_PARTS == 2:
        s += tl.dot(r0, c)
    if PER > 1:
        c = tl.trans(stream(kb, 1, BITS, ASM, OFFSET))
        s += tl.dot(q1, c)
        if Q_PARTS == 2:
            s += tl.dot(r1, c)
    if PER > 2:
        c = tl.trans(stream(kb, 2, BITS, ASM, OFFSET))
        s += tl.dot(q2, c)
        if Q_PARTS == 2:
            s += tl.dot(r2, c)
        c = tl.trans(stream(kb, 3, BITS, ASM, OFFSET))
        s += tl.dot(q3, c)
        if Q_PARTS == 2:
            s += tl.dot(r3, c)
    return s


@triton.jit
def _value_dot(vb, J: tl.constexpr, BITS: tl.constexpr, ph, pl, P_PARTS: tl.constexpr, ASM: tl.constexpr,
               OFFSET: tl.constexpr):
    """dot(p, stream_J(vb)) [GP, NB] fp32 with p given as an fp16 high part and (P_PARTS 2) its fp16 low part; the
    codes unshifted (``stream``'s IN_PLACE), so the result is ``2^(J * BITS)`` times theirs (``_store_partial``
    scales it back)."""
    c = stream(vb, J, BITS, ASM, OFFSET, True)
    out = tl.dot(ph, c)
    if P_PARTS == 2:
        out += tl.dot(pl, c)
    return out


@triton.jit
def _tier_partial(q_ptr, qrow, gmask, qsum, pool_ptr, row, count, first, last, lg, col0, m_total, page_bytes, qk_scale,
                  K_OFF, KM_OFF, V_OFF, VM_OFF, LOW: tl.constexpr, width,
                  GP: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
                  D: tl.constexpr, META_KIND: tl.constexpr, K_FIELDS: tl.constexpr, Q_KIND: tl.constexpr,
                  STORE_LOGITS: tl.constexpr, ASM: tl.constexpr):
    """Online softmax over pages ``first .. last-1`` of one tier of one item (``count`` tokens in that tier).

    Returns (m [GP], den [GP], a0..a3 [GP, D / PER_V], zacc [GP]): the output channels ``j::PER_V`` are
    ``a_j + zacc`` (unnormalized, in the running max's frame)."""
    PK: tl.constexpr = 8 // KB
    PV: tl.constexpr = 8 // VB
    NK: tl.constexpr = D // PK
    NV: tl.constexpr = D // PV
    QP: tl.constexpr = 2 if Q_KIND == 2 else 1
    KOFF: tl.constexpr = QP == 1  # 16-bit queries: the key and value dots see 1024 + code
    q0 = _qstream(q_ptr, qrow, gmask, 0, PK, NK, False, Q_KIND)
    r0 = _qstream(q_ptr, qrow, gmask, 0, PK, NK, True, Q_KIND)
    q1, r1, q2, r2, q3, r3 = q0, r0, q0, r0, q0, r0
    if PK > 1:
        q1 = _qstream(q_ptr, qrow, gmask, 1, PK, NK, False, Q_KIND)
        r1 = _qstream(q_ptr, qrow, gmask, 1, PK, NK, True, Q_KIND)
    if PK > 2:
        q2 = _qstream(q_ptr, qrow, gmask, 2, PK, NK, False, Q_KIND)
        r2 = _qstream(q_ptr, qrow, gmask, 2, PK, NK, True, Q_KIND)
        q3 = _qstream(q_ptr, qrow, gmask, 3, PK, NK, False, Q_KIND)
        r3 = _qstream(q_ptr, qrow, gmask, 3, PK, NK, True, Q_KIND)
    qinv = 1.0  # the queries' scale undone on the key scales
    if Q_KIND == 1:  # bf16 queries in fp16 dots, exactly: scaled by a power of two, a scale and its inverse
        amax = tl.max(tl.max(tl.abs(q0.to(tl.float32)), axis=1), axis=0)
        if PK > 1:
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(q1.to(tl.float32)), axis=1), axis=0))
        if PK > 2:
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(q2.to(tl.float32)), axis=1), axis=0))
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(q3.to(tl.float32)), axis=1), axis=0))
        qscale, qinv = pow2_scale(amax)
        q0 = (q0.to(tl.float32) * qscale).to(tl.float16)
        q1 = (q1.to(tl.float32) * qscale).to(tl.float16)
        q2 = (q2.to(tl.float32) * qscale).to(tl.float16)
        q3 = (q3.to(tl.float32) * qscale).to(tl.float16)
    g = tl.arange(0, GP)
    slot = tl.arange(0, BN)
    m = tl.full((GP,), NEG_BIG, tl.float32)
    den = tl.zeros((GP,), tl.float32)
    zacc = tl.zeros((GP,), tl.float32)
    a0 = tl.zeros((GP, NV), tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    k_offs = K_OFF + slot[:, None] * NK + tl.arange(0, NK)[None, :]  # byte offsets in a page, loop-invariant
    v_offs = V_OFF + slot[:, None] * NV + tl.arange(0, NV)[None, :]
    for i in range(first, last):
        if LOW:
            page = tl.load(row + width - 1 - i)
        else:
            page = tl.load(row + i)
        tmask = slot < tl.minimum(count - i * N, N)
        base = page.to(tl.int64) * page_bytes
        kb = tl.load(pool_ptr + base + k_offs, mask=tmask[:, None], other=0)
        ks, kz = _meta(pool_ptr, base, KM_OFF, slot, tmask, KB, META_KIND, K_FIELDS)
        ks, kz = ks * qk_scale, kz * qk_scale  # qk_scale on the [BN] vectors, not on the [GP, BN] tile
        s = _key_dots(kb, q0, q1, q2, q3, r0, r1, r2, r3, PK, KB, QP, ASM, KOFF)
        if KOFF:
            kz -= 1024.0 * ks
        if Q_KIND == 1:
            ks = ks * qinv  # exact: a power of two
        s = s * ks[None, :] + qsum[:, None] * kz[None, :]  # log2 domain
        s = tl.where(tmask[None, :], s, float("-inf"))
        if STORE_LOGITS:
            tl.store(lg + g[:, None] * m_total + col0 + i * N + slot[None, :], s, mask=gmask[:, None] & tmask[None, :])
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        m = m_new
        den = den * alpha + tl.sum(p, axis=1)
        vb = tl.load(pool_ptr + base + v_offs, mask=tmask[:, None], other=0)
        vs, vz = _meta(pool_ptr, base, VM_OFF, slot, tmask, VB, META_KIND, 2)
        zacc = zacc * alpha + tl.sum(p * vz[None, :], axis=1)
        top = tl.maximum(tl.max(tl.abs(vs), axis=0), 1e-30)  # p * s / top <= 1: fp16 range, few subnormals
        pf = p * (vs / top)[None, :]
        ph = pf.to(tl.float16)
        pl = ph
        if QP == 2:
            pl = (pf - ph.to(tl.float32)).to(tl.float16)
        off = tl.zeros((GP,), tl.float32)  # what the dots' 1024 added, taken off each page's dots (not accumulated)
        if KOFF:
            off = 1024.0 * tl.sum(ph.to(tl.float32), axis=1)
        a0 = a0 * alpha[:, None] + (_value_dot(vb, 0, VB, ph, pl, QP, ASM, KOFF) - off[:, None]) * top
        if PV > 1:
            a1 = a1 * alpha[:, None] + (_value_dot(vb, 1, VB, ph, pl, QP, ASM, KOFF) - off[:, None]) * top
        if PV > 2:
            a2 = a2 * alpha[:, None] + (_value_dot(vb, 2, VB, ph, pl, QP, ASM, KOFF) - off[:, None]) * top
            a3 = a3 * alpha[:, None] + (_value_dot(vb, 3, VB, ph, pl, QP, ASM, KOFF) - off[:, None]) * top
    return m, den, a0, a1, a2, a3, zacc


@triton.jit
def _store_partial(m_ptr, l_ptr, acc_ptr, part, gmask, m, den, a0, a1, a2, a3, zacc, D: tl.constexpr,
                   PV: tl.constexpr):
    """Partials of one program: m, den [GP] and acc [GP, D] (stream j's accumulator a_j, which holds
    ``2^(j * 8 / PV)`` times its values (``_value_dot``), scaled back exactly, plus zacc, to channels j::PV)."""
    tl.store(m_ptr + part, m, mask=gmask)
    tl.store(l_ptr + part, den, mask=gmask)
    NV: tl.constexpr = D // PV
    VB: tl.constexpr = 8 // PV
    c = tl.arange(0, NV) * PV
    dst = acc_ptr + part[:, None] * D + c[None, :]
    tl.store(dst, a0 + zacc[:, None], mask=gmask[:, None])
    if PV > 1:
        tl.store(dst + 1, a1 * (1.0 / (1 << VB)) + zacc[:, None], mask=gmask[:, None])
    if PV > 2:
        tl.store(dst + 2, a2 * (1.0 / (1 << 2 * VB)) + zacc[:, None], mask=gmask[:, None])
        tl.store(dst + 3, a3 * (1.0 / (1 << 3 * VB)) + zacc[:, None], mask=gmask[:, None])


@triton.jit
def _tier_program(q_ptr, qrow, gmask, qsum, pool_ptr, row, n, split, SPLITS: tl.constexpr, lg, col0, m_total,
                  page_bytes, qk_scale, K_OFF, KM_OFF, V_OFF, VM_OFF, LOW: tl.constexpr, width, m_ptr, l_ptr, acc_ptr,
                  part, GP: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
                  D: tl.constexpr, META_KIND: tl.constexpr, K_FIELDS: tl.constexpr, Q_KIND: tl.constexpr,
                  STORE_LOGITS: tl.constexpr, ASM: tl.constexpr):
    """Split ``split`` of ``SPLITS`` over one tier's pages (``n`` tokens) of one item: attend, store partials."""
    pages = (n + N - 1) // N
    chunk = (pages + SPLITS - 1) // SPLITS
    first = split * chunk
    m, den, a0, a1, a2, a3, zacc = _tier_partial(
        q_ptr, qrow, gmask, qsum, pool_ptr, row, n, first, tl.minimum(first + chunk, pages), lg, col0, m_total,
        page_bytes, qk_scale, K_OFF, KM_OFF, V_OFF, VM_OFF, LOW, width, GP, N, BN, KB, VB, D, META_KIND, K_FIELDS,
        Q_KIND, STORE_LOGITS, ASM)
    _store_partial(m_ptr, l_ptr, acc_ptr, part, gmask, m, den, a0, a1, a2, a3, zacc, D, 8 // VB)


@triton.jit
def paged_decode_streams_kernel(
        q_ptr, pool_ptr, rows_ptr, items_ptr, nh_ptr, nl_ptr, lg_ptr, m_ptr, l_ptr, acc_ptr,
        stride_qb, stride_qh, num_kv_heads, width, page_bytes, m_hi, m_total, qk_scale,
        hk_off, hkm_off, hv_off, hvm_off, lk_off, lkm_off, lv_off, lvm_off,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, S_HI: tl.constexpr, S_LO: tl.constexpr,
        N_HI: tl.constexpr, BN_HI: tl.constexpr, KB_HI: tl.constexpr, VB_HI: tl.constexpr,
        N_LO: tl.constexpr, BN_LO: tl.constexpr, KB_LO: tl.constexpr, VB_LO: tl.constexpr,
        META_KIND: tl.constexpr, Q_KIND: tl.constexpr, K_FIELDS: tl.constexpr, STORE_LOGITS: tl.constexpr,
        ASM: tl.constexpr = False):
    """Partial attention of program ``(item k, split s)``: splits ``s < S_HI`` cover the high pages, the others the
    low pages, each tier's pages cut into equal contiguous chunks per item.

    q_ptr: [B, H_q, D] fp16 / bf16 / fp32 (Q_KIND 0 / 1 / 2); pool_ptr: uint8 [num_pages, page_bytes]; rows_ptr:
    int32 [items, width]; items_ptr, nh_ptr, nl_ptr: [K]. Writes, as ``paged_decode_split_kernel`` with
    ``NUM_SPLITS = S_HI + S_LO``: lg_ptr [K, G, m_total] log2-domain logits (STORE_LOGITS), m_ptr, l_ptr [K, S, G]
    and acc_ptr [K, S, G, D] fp32.
    """
    k = tl.program_id(0)
    split = tl.program_id(1)
    item = tl.load(items_ptr + k).to(tl.int64)
    g = tl.arange(0, GP)
    gmask = g < G
    qrow = (k // num_kv_heads).to(tl.int64) * stride_qb + ((k % num_kv_heads) * G + g).to(tl.int64) * stride_qh
    qsum = tl.sum(tl.load(q_ptr + qrow[:, None] + tl.arange(0, D)[None, :], mask=gmask[:, None],
                          other=0.0).to(tl.float32), axis=1)
    row = rows_ptr + item * width
    lg = lg_ptr + k.to(tl.int64) * G * m_total
    part = (k * (S_HI + S_LO) + split).to(tl.int64) * G + g
    if split < S_HI:  # each branch stores its own partials: the tiers' accumulators differ in shape
        _tier_program(q_ptr, qrow, gmask, qsum, pool_ptr, row, tl.load(nh_ptr + k).to(tl.int32), split, S_HI, lg, 0,
                      m_total, page_bytes, qk_scale, hk_off, hkm_off, hv_off, hvm_off, False, width, m_ptr, l_ptr,
                      acc_ptr, part, GP, N_HI, BN_HI, KB_HI, VB_HI, D, META_KIND, K_FIELDS, Q_KIND, STORE_LOGITS, ASM)
    else:
        _tier_program(q_ptr, qrow, gmask, qsum, pool_ptr, row, tl.load(nl_ptr + k).to(tl.int32), split - S_HI, S_LO,
                      lg, m_hi, m_total, page_bytes, qk_scale, lk_off, lkm_off, lv_off, lvm_off, True, width, m_ptr,
                      l_ptr, acc_ptr, part, GP, N_LO, BN_LO, KB_LO, VB_LO, D, META_KIND, K_FIELDS, Q_KIND,
                      STORE_LOGITS, ASM)
