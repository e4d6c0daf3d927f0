"""Several token writes (any tiers) in one quantization pass and one scatter: the decode step's store (torch).

A decode step writes the new token into the high tier and the demoted victims into the low tier. Written one
call each (:func:`diffkv.store.store_tokens_ref`), that is two quantize / pack / scatter passes of a few dozen
small ops each; here the keys and values of every write go through **one** min / max / round pass (one row per
token and tensor, each row with its own code range) and every byte lands in **one** index_put. Elementwise the
arithmetic is :func:`diffkv.quant.quantize` / ``dequantize`` / ``pack``, so the bytes and the returned values are
bit-identical to one ``store_tokens_ref`` per write (tested). Used when every tensor of every write is quantized
with one group size (the published tiers); otherwise it falls back to one ``store_tokens_ref`` per write.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from diffkv.layout import TierLayout
from diffkv.quant import SCALE_FLOOR, round_to
from diffkv.store import _token_columns, resolve_dtypes, store_tokens_ref


class TierWrite(NamedTuple):
    """One write: ``layout`` of its tier; keys, values [M, D] float; page_ids, slots [M] int64 (distinct pairs);
    scores [M] fp32; positions [M] int32."""

    layout: TierLayout
    keys: torch.Tensor
    values: torch.Tensor
    page_ids: torch.Tensor
    slots: torch.Tensor
    scores: torch.Tensor
    positions: torch.Tensor


def _group(layout: TierLayout) -> int | None:
    """Channels per group when both tensors are quantized with the same group size, else None."""
    if layout.key_bits >= 16 or layout.value_bits >= 16:
        return None
    g = layout.head_dim // layout.key_groups
    return g if layout.head_dim // layout.value_groups == g else None


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``quant.pack`` for codes [M, D] uint8 below 2^bits, as byte-wide shifts and ors: [M, D * bits // 8]."""
    if bits == 8:
        return codes
    per = 8 // bits
    c = codes.view(codes.shape[0], -1, per)
    out = c[..., 0]
    for i in range(1, per):
        out = out | (c[..., i] << (i * bits))
    return out


def quantize_rows(x: torch.Tensor, qmax: torch.Tensor, group: int, meta_dtype: torch.dtype):
    """``quant.quantize`` of every row of x [R, D] fp32 with its own code range ``qmax`` [R, 1] fp32 (2^bits - 1).
    Returns codes [R, D] uint8, scale and zero [R, D // group] meta_dtype and the dequantized rows [R, D] fp32."""
    r, d = x.shape
    xg = x.view(r, d // group, group)
    lo, hi = torch.aminmax(xg, dim=-1)
    zero = round_to(lo + 0.0, meta_dtype, up=False)  # + 0.0: a -0 minimum becomes +0, as quant.quantize
    zf = zero.float()
    scale = round_to(((hi - zf) / qmax).clamp_min(SCALE_FLOOR), meta_dtype, up=True)
    sf = scale.float()
    q = torch.round((xg - zf.unsqueeze(-1)) / sf.unsqueeze(-1)).clamp_(min=0)
    codes = torch.minimum(q, qmax.unsqueeze(-1)).to(torch.uint8)
    stored = codes.float().mul_(sf.unsqueeze(-1)).add_(zf.unsqueeze(-1))  # quant.dequantize: multiply, then add
    return codes.view(r, d), scale, zero, stored.view(r, d)


_RANGES: dict = {}


def _code_range(bits: tuple[int, ...], sizes: tuple[int, ...], device) -> torch.Tensor:
    """fp32 [sum sizes, 1]: 2^bits[i] - 1 repeated sizes[i] times (cached: a decode step has few patterns)."""
    key = (bits, sizes, str(device))
    if key not in _RANGES:
        if len(_RANGES) > 4096:
            _RANGES.clear()
        _RANGES[key] = torch.tensor([float((1 << b) - 1) for b, m in zip(bits, sizes, strict=True) for _ in range(m)],
                                    device=device).view(-1, 1)
    return _RANGES[key]


def store_batch_ref(pool: torch.Tensor, writes: list[TierWrite], *, meta_dtype=None,
                    raw_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize and store every write into ``pool`` (uint8 [num_pages, page_bytes]) in place; no validation.

    Returns ``(keys, values)`` [sum M, D] fp32: what the pages now decode to, writes in order.
    """
    groups = {_group(w.layout) for w in writes}
    if len(groups) != 1 or None in groups:
        out = [store_tokens_ref(pool, w.layout, w.keys, w.values, w.page_ids, w.slots, w.scores, w.positions,
                                meta_dtype=meta_dtype, raw_dtype=raw_dtype, validate=False, return_stored=True)
               for w in writes]
        return torch.cat([k for k, _ in out]), torch.cat([v for _, v in out])
    meta_dtype = resolve_dtypes(writes[0].layout, meta_dtype, raw_dtype)[0]
    sizes = [w.keys.shape[0] for w in writes]
    n = sum(sizes)
    bits = [w.layout.key_bits for w in writes] + [w.layout.value_bits for w in writes]
    qmax = _code_range(tuple(bits), tuple(sizes * 2), pool.device)
    x = torch.cat([w.keys for w in writes] + [w.values for w in writes]).float()
    codes, scale, zero, stored = quantize_rows(x, qmax, groups.pop(), meta_dtype)
    meta = torch.stack([scale, zero], -1).view(torch.uint8).view(2 * n, -1)
    where, data, start = [], [], 0
    for w, m in zip(writes, sizes, strict=True):
        lay, ki, vi = w.layout, slice(start, start + m), slice(n + start, n + start + m)
        start += m
        if m == 0:
            continue
        data.append(torch.cat([_pack(codes[ki], lay.key_bits), meta[ki], _pack(codes[vi], lay.value_bits), meta[vi],
                               w.scores.contiguous().view(torch.uint8).view(m, 4),
                               w.positions.contiguous().view(torch.uint8).view(m, 4)], 1))
        col_off, col_row = _token_columns(lay, pool.device)
        where.append(w.page_ids[:, None] * lay.page_bytes + col_off + w.slots[:, None] * col_row)
    if data:
        pool.view(-1)[torch.cat([x.view(-1) for x in where])] = torch.cat([x.view(-1) for x in data])
    return stored[:n], stored[n:]
