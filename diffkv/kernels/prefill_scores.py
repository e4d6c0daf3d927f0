"""Triton prefill importance scores without materializing [B, H_q, W, L] logits (two passes over the keys).

Computes the project's aggregation (``diffkv.core.policy.prefill_scores``, docs/algorithm.md §4.1 and §7.2), the
"sum over queries of the per-query max over the GQA group":

    score[b, h, t] = sum_{w < W} max_{g < G} softmax_t(q[b, h*G + g, L-W+w] . k[b, h, t] * scaling)

with causal masking (key t visible to query row w iff t <= L-W+w) and left padding (``valid`` [B, L]: padded keys
get no probability, padded query rows contribute nothing).

* pass 1 (``row_stats_kernel``), grid (B * H_q, W / BLOCK_W): running max and sum (base 2) of every window row;
* pass 2 (``column_scores_kernel``), grid (B * H_kv, L / BLOCK_L): for a block of keys, every window row block and
  every query head of the group recompute the logits, normalize with the pass-1 stats, take the max over the
  group, and sum over the rows. Only [B, H_q, W] statistics and the [B, H_kv, L] result touch global memory.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _logits(q_ptr, k_ptr, qrow, w, t, length, window, D: tl.constexpr, PRECISION: tl.constexpr):
    """Scaled log2 logits [BW, BL] of window rows ``w`` (query base pointer qrow) against keys ``t``."""
    d = tl.arange(0, D)
    q = tl.load(q_ptr + qrow + (length - window + w).to(tl.int64)[:, None] * D + d[None, :],
                mask=(w < window)[:, None], other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t.to(tl.int64)[:, None] * D + d[None, :], mask=(t < length)[:, None], other=0.0)
    return tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)


@triton.jit
def _mask(valid_ptr, b, w, t, length, window, HAS_VALID: tl.constexpr):
    """[BW, BL] True where window row w may attend key t (causal, in range, both unpadded)."""
    ok = (t[None, :] <= (length - window + w)[:, None]) & (w < window)[:, None] & (t < length)[None, :]
    if HAS_VALID:
        vrow = valid_ptr + b.to(tl.int64) * length
        vk = tl.load(vrow + t, mask=t < length, other=0) != 0
        vq = tl.load(vrow + length - window + w, mask=w < window, other=0) != 0
        ok = ok & vk[None, :] & vq[:, None]
    return ok


@triton.jit
def row_stats_kernel(q_ptr, k_ptr, valid_ptr, m_ptr, l_ptr, num_q_heads, num_kv_heads, length, window, qk_scale,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr,
                     HAS_VALID: tl.constexpr, PRECISION: tl.constexpr):
    """Pass 1: m, l [B, H_q, W] fp32, the base-2 running max and sum of exp2 of each window row's logits.

    q_ptr: [B, H_q, L, D] contiguous; k_ptr: [B, H_kv, L, D] contiguous; valid_ptr: uint8 [B, L] (HAS_VALID).
    """
    bh = tl.program_id(0)
    b = bh // num_q_heads
    h = bh % num_q_heads
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    qrow = bh.to(tl.int64) * length * D
    kbase = k_ptr + (b * num_kv_heads + h // G).to(tl.int64) * length * D
    m = tl.full((BLOCK_W,), -1.0e30, tl.float32)
    den = tl.zeros((BLOCK_W,), tl.float32)
    last = tl.minimum(length - window + (tl.program_id(1) + 1) * BLOCK_W, length)
    for t0 in range(0, last, BLOCK_L):
        t = t0 + tl.arange(0, BLOCK_L)
        s = _logits(q_ptr, kbase, qrow, w, t, length, window, D, PRECISION) * qk_scale
        s = tl.where(_mask(valid_ptr, b, w, t, length, window, HAS_VALID), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        den = den * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    out = bh.to(tl.int64) * window + w
    tl.store(m_ptr + out, m, mask=w < window)
    tl.store(l_ptr + out, den, mask=w < window)


@triton.jit
def column_scores_kernel(q_ptr, k_ptr, valid_ptr, m_ptr, l_ptr, out_ptr, num_kv_heads, length, window, qk_scale,
                         G: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr,
                         HAS_VALID: tl.constexpr, PRECISION: tl.constexpr, PEAK: tl.constexpr = False):
    """Pass 2: out [B, H_kv, L] fp32 = sum (PEAK: max) over window rows of the max over the group of the
    probabilities."""
    bh = tl.program_id(0)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    t = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    kbase = k_ptr + bh.to(tl.int64) * length * D
    acc = tl.zeros((BLOCK_L,), tl.float32)
    first = tl.maximum(tl.program_id(1) * BLOCK_L - (length - window), 0)  # earlier rows cannot see these keys
    for w0 in range((first // BLOCK_W) * BLOCK_W, window, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        ok = _mask(valid_ptr, b, w, t, length, window, HAS_VALID)
        best = tl.zeros((BLOCK_W, BLOCK_L), tl.float32)
        for g in range(G):
            qh = (b * num_kv_heads * G + h * G + g).to(tl.int64)
            s = _logits(q_ptr, kbase, qh * length * D, w, t, length, window, D, PRECISION) * qk_scale
            mr = tl.load(m_ptr + qh * window + w, mask=w < window, other=0.0)
            lr = tl.load(l_ptr + qh * window + w, mask=w < window, other=0.0)
            inv = tl.where(lr > 0, 1.0 / lr, 0.0)
            p = tl.where(ok, tl.exp2(s - mr[:, None]) * inv[:, None], 0.0)
            best = tl.maximum(best, p)
        if PEAK:
            acc = tl.maximum(acc, tl.max(best, axis=0))
        else:
            acc += tl.sum(best, axis=0)
    tl.store(out_ptr + bh.to(tl.int64) * length + t, acc, mask=t < length)
