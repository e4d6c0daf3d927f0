"""Triton quantize-and-store kernel: writes tokens of one tier into a uint8 page pool, bit-exact with
``diffkv.core.page_io``.

Implements docs/algorithm.md §3.2 (per token, per contiguous channel group asymmetric min-max quantization in fp32,
round-half-to-even, clamp, little-endian packing) with the deviations of ``diffkv.core.quant``:

* ``zero = min`` rounded *down* to the meta dtype, ``scale = max(((max - zero) / (2^b - 1)), 2^-24)`` rounded *up*,
  and codes ``clamp(rint((x - zero) / scale), 0, 2^b - 1)`` computed with the stored values;
* every division is IEEE round-to-nearest (``tl.math.div_rn``; a plain ``/`` is approximate on the GPU);
* fp16 rounding uses the hardware RNE conversion and then steps one ulp on the int16 pattern (as
  ``quant.round_to`` does with ``nextafter``);
  bf16 RNE is done with integer ops (the interpreter's bf16 arithmetic is wrong); fp32 metadata is not rounded;
* round-half-even by the magic number ``(t + 1.5 * 2^23) - 1.5 * 2^23`` (exact for 0 <= t < 2^22; here t <= 2^b);
* symmetric keys (``DiffKVConfig.symmetric_keys``, FIELDS 1): ``scale = max(max|x| / (qmax / 2), 2^-24)`` rounded up,
  ``zero = scale * -(qmax / 2)`` in fp32 (``quant.symmetric_zero``), only the scale stored. On the GPU launch with
  ``enable_fp_fusion=False``: with fp32 metadata ``x - scale * c`` must not become one fused multiply-add.

Every multi-byte field (scale/zero patterns, raw 16/32-bit values, score, position) is written byte by byte,
little-endian, so no pool pointer casts or alignment assumptions are needed. Score and position fields are 4 bytes
(fp32 sum, int32) or 2 (compact: fp16 mean, int16 position mod 2^16), stored as given. Tokens whose values are
non-finite or whose metadata / raw values overflow are *not* written; their error bits go to ``err_ptr`` (1: NaN/Inf
input, 2: scale/zero overflow, 4: raw overflow).
"""

from __future__ import annotations

import triton
import triton.language as tl

META_KINDS = {"float16": 0, "bfloat16": 1, "float32": 2}  # also the raw kinds (RAW_KIND)


@triton.jit
def _to16(x, KIND: tl.constexpr):
    """Round fp32 ``x`` to nearest-even 16-bit (KIND 0: fp16, 1: bf16); returns the pattern in int32 [0, 65535]."""
    if KIND == 0:
        hb = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        xb = x.to(tl.int32, bitcast=True)
        hb = ((xb + 0x7FFF + ((xb >> 16) & 1)) >> 16) & 0xFFFF
    return hb


@triton.jit
def _from16(hb, KIND: tl.constexpr):
    """fp32 value of a 16-bit pattern held in int32 (KIND 0: fp16, 1: bf16)."""
    if KIND == 0:
        v = hb.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        v = (hb << 16).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _inf16(hb, KIND: tl.constexpr):
    """True where the 16-bit pattern is Inf or NaN (all exponent bits set)."""
    if KIND == 0:
        bad = (hb & 0x7C00) == 0x7C00
    else:
        bad = (hb & 0x7F80) == 0x7F80
    return bad


@triton.jit
def _round_meta(x, UP: tl.constexpr, KIND: tl.constexpr):
    """Round fp32 ``x`` towards +inf (UP) or -inf to the meta dtype; returns (fp32 value, bit pattern, bad)."""
    if KIND == 2:
        bits = x.to(tl.int32, bitcast=True)
        v = x
        bad = (bits & 0x7F800000) == 0x7F800000
    else:
        hb = _to16(x, KIND)
        hf = _from16(hb, KIND)
        neg = (hb & 0x8000) != 0
        if UP:
            off = hf < x
            stepped = tl.where((hb & 0x7FFF) == 0, 0x0001, hb + tl.where(neg, -1, 1))
        else:
            off = hf > x
            stepped = tl.where((hb & 0x7FFF) == 0, 0x8001, hb + tl.where(neg, 1, -1))
        bits = tl.where(off, stepped, hb)
        v = _from16(bits, KIND)
        bad = _inf16(bits, KIND)
    return v, bits, bad


@triton.jit
def _nonfinite(x):
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def _store_le(ptrs, bits, NBYTES: tl.constexpr, mask):
    """Write the low NBYTES bytes of int32 ``bits`` little-endian at byte pointers ``ptrs`` (same shape)."""
    for k in tl.static_range(NBYTES):
        tl.store(ptrs + k, ((bits >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _encode_raw(x_ptr, tok, tmask, stride, D: tl.constexpr, RAW_KIND: tl.constexpr):
    """Raw patterns [BN, D] int32 of a 16-bit tensor and the per-token error bits [BN]."""
    c = tl.arange(0, D)
    x = tl.load(x_ptr + tok[:, None] * stride + c[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    if RAW_KIND == 2:
        bits = x.to(tl.int32, bitcast=True)
        over = _nonfinite(x)
    else:
        bits = _to16(x, RAW_KIND)
        over = _inf16(bits, RAW_KIND)
    nf = tl.max(_nonfinite(x).to(tl.int32), axis=1)
    over = tl.max(over.to(tl.int32), axis=1)
    return bits, tl.where(nf != 0, 1, tl.where(over != 0, 4, 0))


@triton.jit
def _group_meta(x, QMAX: tl.constexpr, META_KIND: tl.constexpr, FIELDS: tl.constexpr):
    """Scale and zero of groups x [BN, GROUPS, GS] (``quant.quantize``): (scale, zero fp32, scale bits, zero bits,
    bad) [BN, GROUPS]. FIELDS 1 (symmetric): the zero is ``scale * -(qmax / 2)``, its bits a copy of the scale's."""
    if FIELDS == 1:
        amax = tl.max(tl.abs(x), axis=2)
        s = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, QMAX * 0.5, tl.float32)), 5.960464477539063e-08)
        sf, sbits, sbad = _round_meta(s, True, META_KIND)
        zf = sf * (-(QMAX * 0.5))
        zbits = sbits
        bad = sbad | _nonfinite(zf)
    else:
        zf, zbits, zbad = _round_meta(tl.min(x, axis=2) + 0.0, False, META_KIND)  # + 0.0: -0 -> +0
        s = tl.math.div_rn(tl.max(x, axis=2) - zf, tl.full(zf.shape, QMAX, tl.float32))
        s = tl.maximum(s, 5.960464477539063e-08)  # 2^-24 = quant.SCALE_FLOOR
        sf, sbits, sbad = _round_meta(s, True, META_KIND)
        bad = zbad | sbad
    return sf, zf, sbits, zbits, bad


@triton.jit
def _encode_quant(x_ptr, tok, tmask, stride, D: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr,
                  META_KIND: tl.constexpr, FIELDS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packed codes [BN, D*BITS/8], scale and zero patterns [BN, GROUPS] int32, per-token error bits [BN]."""
    GS: tl.constexpr = D // GROUPS
    PER: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    g = tl.arange(0, GROUPS)
    e = tl.arange(0, GS)
    offs = tok[:, None, None] * stride + (g[None, :, None] * GS + e[None, None, :])
    x = tl.load(x_ptr + offs, mask=tmask[:, None, None], other=0.0).to(tl.float32)
    nf = tl.max(tl.max(_nonfinite(x).to(tl.int32), axis=2), axis=1)
    sf, zf, sbits, zbits, bad = _group_meta(x, QMAX, META_KIND, FIELDS)
    over = tl.max(bad.to(tl.int32), axis=1)
    t = tl.math.div_rn(x - zf[:, :, None], sf[:, :, None])
    q = (t + 12582912.0) - 12582912.0
    q = tl.minimum(tl.maximum(q, 0.0), QMAX * 1.0).to(tl.int32)
    if BITS == 3:  # the codes themselves [BN, D]: _store_quant writes them as a 2-bit and a 1-bit plane
        packed = tl.reshape(q, (BLOCK_N, D))
    else:
        q = tl.reshape(q, (BLOCK_N, D // PER, PER))
        shifts = tl.arange(0, PER) * BITS
        packed = tl.sum(q << shifts[None, None, :], axis=2)
    err = tl.where(nf != 0, 1, tl.where(over != 0, 2, 0))
    return packed, sbits, zbits, err


@triton.jit
def _store_quant(pool_ptr, base, slot, ok, packed, sbits, zbits, CODE_OFF, META_OFF, D: tl.constexpr,
                 BITS: tl.constexpr, GROUPS: tl.constexpr, MB: tl.constexpr, FIELDS: tl.constexpr):
    """Codes, then per group the scale and (FIELDS 2) the zero. BITS 3: ``packed`` holds the codes [BN, D], written
    as the 2-bit plane of their low bits, then the 1-bit plane of their high bit (``quant.pack``)."""
    NB: tl.constexpr = D * BITS // 8
    row = pool_ptr + (base + CODE_OFF + slot * NB)[:, None]
    if BITS == 3:
        BN: tl.constexpr = packed.shape[0]
        low = tl.sum(tl.reshape(packed & 3, (BN, D // 4, 4)) << (tl.arange(0, 4) * 2)[None, None, :], axis=2)
        high = tl.sum(tl.reshape((packed >> 2) & 1, (BN, D // 8, 8)) << tl.arange(0, 8)[None, None, :], axis=2)
        tl.store(row + tl.arange(0, D // 4)[None, :], low.to(tl.uint8), mask=ok[:, None])
        tl.store(row + D // 4 + tl.arange(0, D // 8)[None, :], high.to(tl.uint8), mask=ok[:, None])
    else:
        tl.store(row + tl.arange(0, NB)[None, :], packed.to(tl.uint8), mask=ok[:, None])
    g = tl.arange(0, GROUPS)
    mptr = pool_ptr + (base + META_OFF + slot * (GROUPS * FIELDS * MB))[:, None] + g[None, :] * (FIELDS * MB)
    _store_le(mptr, sbits, MB, ok[:, None])
    if FIELDS == 2:
        _store_le(mptr + MB, zbits, MB, ok[:, None])


@triton.jit
def _store_raw(pool_ptr, base, slot, ok, bits, CODE_OFF, D: tl.constexpr, RB: tl.constexpr):
    c = tl.arange(0, D)
    _store_le(pool_ptr + (base + CODE_OFF + slot * (D * RB))[:, None] + c[None, :] * RB, bits, RB, ok[:, None])


@triton.jit
def _encode(x_ptr, tok, tmask, stride, D: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr,
            META_KIND: tl.constexpr, RAW_KIND: tl.constexpr, FIELDS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tensor of BLOCK_N tokens encoded for its tier: (payload, scale bits, zero bits, error bits [BN]). The
    payload is the raw patterns of a 16-bit tensor (its scale and zero are unused placeholders) or packed codes.
    FIELDS: meta values per group, 2 (scale, zero) or 1 (symmetric keys)."""
    if BITS == 16:
        payload, err = _encode_raw(x_ptr, tok, tmask, stride, D, RAW_KIND)
        sbits = err
        zbits = err
    else:
        payload, sbits, zbits, err = _encode_quant(x_ptr, tok, tmask, stride, D, BITS, GROUPS, META_KIND, FIELDS,
                                                      BLOCK_N)
    return payload, sbits, zbits, err


@triton.jit
def _store_encoded(pool_ptr, base, slot, ok, payload, sbits, zbits, CODE_OFF, META_OFF, D: tl.constexpr,
                   BITS: tl.constexpr, GROUPS: tl.constexpr, MB: tl.constexpr, RB: tl.constexpr,
                   FIELDS: tl.constexpr):
    """Write what :func:`_encode` returned into ``slot`` of the page at byte ``base`` where ``ok``."""
    if BITS == 16:
        _store_raw(pool_ptr, base, slot, ok, payload, CODE_OFF, D, RB)
    else:
        _store_quant(pool_ptr, base, slot, ok, payload, sbits, zbits, CODE_OFF, META_OFF, D, BITS, GROUPS, MB,
                     FIELDS)


@triton.jit
def _field_bits(ptr, tok, tmask, NBYTES: tl.constexpr):
    """int32 bit patterns of the [N] values at ``ptr + tok``: 4-byte (fp32 / int32) or 2-byte (fp16 / int16)."""
    if NBYTES == 2:
        bits = tl.load(ptr.to(tl.pointer_type(tl.int16)) + tok, mask=tmask, other=0).to(tl.int32)
    else:
        bits = tl.load(ptr.to(tl.pointer_type(tl.int32)) + tok, mask=tmask, other=0)
    return bits


@triton.jit
def store_kernel(pool_ptr, k_ptr, v_ptr, page_ptr, slot_ptr, score_ptr, pos_ptr, err_ptr,
                 n_tokens, stride_k, stride_v, page_bytes,
                 key_off, key_meta_off, value_off, value_meta_off, score_off, pos_off,
                 HEAD_DIM: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                 K_GROUPS: tl.constexpr, V_GROUPS: tl.constexpr, META_KIND: tl.constexpr, RAW_KIND: tl.constexpr,
                 K_FIELDS: tl.constexpr, FIELD_BYTES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Quantize and store BLOCK_N tokens per program.

    pool_ptr: uint8 [num_pages, page_bytes]; k_ptr, v_ptr: [N, HEAD_DIM] fp16/bf16/fp32, row strides stride_k/v,
    unit channel stride; page_ptr, slot_ptr: [N] int64; score_ptr: [N] fp32 (FIELD_BYTES 2: fp16); pos_ptr: [N]
    int32 (FIELD_BYTES 2: int16); err_ptr: [N] int32 (written for every token). K_GROUPS/V_GROUPS are 0 for 16-bit
    tensors. META_KIND and RAW_KIND: 0 float16, 1 bfloat16, 2 float32. K_FIELDS: 1 for scale-only keys, else 2.
    """
    MB: tl.constexpr = 4 if META_KIND == 2 else 2
    RB: tl.constexpr = 4 if RAW_KIND == 2 else 2
    tok = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = tok < n_tokens
    page = tl.load(page_ptr + tok, mask=tmask, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=tmask, other=0).to(tl.int64)
    base = page * page_bytes
    kpl, ksc, kzp, kerr = _encode(k_ptr, tok, tmask, stride_k, HEAD_DIM, K_BITS, K_GROUPS, META_KIND, RAW_KIND,
                                  K_FIELDS, BLOCK_N)
    vpl, vsc, vzp, verr = _encode(v_ptr, tok, tmask, stride_v, HEAD_DIM, V_BITS, V_GROUPS, META_KIND, RAW_KIND, 2,
                                  BLOCK_N)
    err = kerr | verr
    tl.store(err_ptr + tok, err, mask=tmask)
    ok = tmask & (err == 0)
    _store_encoded(pool_ptr, base, slot, ok, kpl, ksc, kzp, key_off, key_meta_off, HEAD_DIM, K_BITS, K_GROUPS, MB, RB,
                   K_FIELDS)
    _store_encoded(pool_ptr, base, slot, ok, vpl, vsc, vzp, value_off, value_meta_off, HEAD_DIM, V_BITS, V_GROUPS,
                   MB, RB, 2)
    score = _field_bits(score_ptr, tok, tmask, FIELD_BYTES)
    pos = _field_bits(pos_ptr, tok, tmask, FIELD_BYTES)
    _store_le(pool_ptr + base + score_off + slot * FIELD_BYTES, score, FIELD_BYTES, ok)
    _store_le(pool_ptr + base + pos_off + slot * FIELD_BYTES, pos, FIELD_BYTES, ok)
