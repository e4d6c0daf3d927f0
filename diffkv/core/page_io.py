"""Store tokens into / load tokens from a paged pool: torch reference (the CPU production path, vectorized).

A pool is a contiguous uint8 tensor ``[num_pages, page_bytes]``. A page holds tokens of one tier, laid out as the
:class:`~diffkv.core.layout.TierLayout` says: per token and tensor (keys, values) the packed codes (``quant.pack``) or
the raw 16-bit values, the ``[groups, (scale, zero)]`` metadata, the fp32 score and the int32 position. Codes and
metadata are computed by :func:`diffkv.core.quant.quantize`, so this module is the bit-exact oracle for the Triton
store kernel (``diffkv.kernels.quantize_store``).
"""

from __future__ import annotations

import torch

from diffkv.core.bookkeeping import field_dtypes
from diffkv.core.layout import TierLayout
from diffkv.core.quant import dequantize, dequantize_packed, pack, quantize, symmetric_zero

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _as_dtype(d: torch.dtype | str | None, nbytes: int, what: str, kwarg: str) -> torch.dtype:
    if d is None:
        d = torch.float16 if nbytes == 2 else torch.float32
    d = _DTYPES.get(d, d) if isinstance(d, str) else d
    if d not in INPUT_DTYPES:
        raise ValueError(f"{kwarg} must be one of float16, bfloat16, float32, got {d!r}")
    if d.itemsize != nbytes:
        raise ValueError(f"{kwarg}={d} has {d.itemsize} bytes but the layout stores {nbytes}-byte {what}")
    return d


def resolve_dtypes(layout: TierLayout, meta_dtype=None, raw_dtype=None) -> tuple[torch.dtype, torch.dtype]:
    """(meta dtype, raw dtype) of ``layout``: 2 bytes -> float16 unless bfloat16 is asked for, 4 -> float32."""
    return (_as_dtype(meta_dtype, layout.meta_bytes, "scales/zeros", "meta_dtype"),
            _as_dtype(raw_dtype, layout.raw_bytes, "16-bit tensors", "raw_dtype"))


def check_targets(pool: torch.Tensor, layout: TierLayout, page_ids: torch.Tensor, slots: torch.Tensor,
                  validate: bool = True, unique: bool = True) -> int:
    """Validate the pool ``[num_pages, page_bytes]`` uint8 and the targets ``page_ids``, ``slots`` ``[N]``; return N.

    Shapes, dtypes and devices are always checked; with ``validate`` also the ranges and (with ``unique``) that no
    (page, slot) pair repeats.
    """
    if not isinstance(pool, torch.Tensor) or pool.dtype != torch.uint8 or pool.dim() != 2:
        raise ValueError(f"pool must be a uint8 tensor [num_pages, page_bytes], got {getattr(pool, 'dtype', pool)} "
                         f"{tuple(getattr(pool, 'shape', ()))}")
    if pool.shape[1] != layout.page_bytes:
        raise ValueError(f"pool pages have {pool.shape[1]} bytes but the layout expects {layout.page_bytes}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous (it is written in place through a flat byte view)")
    for name, t in (("page_ids", page_ids), ("slots", slots)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {getattr(t, 'dtype', t)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if t.device != pool.device:
            raise ValueError(f"{name} is on {t.device} but the pool is on {pool.device}")
    n = page_ids.shape[0]
    if slots.shape[0] != n:
        raise ValueError(f"page_ids has {n} entries but slots has {slots.shape[0]}")
    if not validate or n == 0:
        return n
    if layout.tokens_per_page == 0:
        raise ValueError(f"tier {layout.name} fits no token in a {layout.page_bytes}-byte page")
    bad = (page_ids < 0) | (page_ids >= pool.shape[0])
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"page id {int(page_ids[i])} (token {i}) is out of range [0, {pool.shape[0]})")
    bad = (slots < 0) | (slots >= layout.tokens_per_page)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"slot {int(slots[i])} (token {i}) is out of range: tier {layout.name} holds "
                         f"{layout.tokens_per_page} tokens per page")
    if not unique:
        return n
    key = page_ids.long() * layout.tokens_per_page + slots.long()
    uniq, counts = torch.unique(key, return_counts=True)
    if uniq.numel() != n:
        k = int(uniq[counts > 1][0])
        raise ValueError(f"duplicate target (page {k // layout.tokens_per_page}, slot {k % layout.tokens_per_page}) "
                         "in one call: each (page, slot) may be written once")
    return n


def check_store_args(pool, layout, keys, values, page_ids, slots, scores, positions, validate=True) -> int:
    """Validate everything a store takes (see :func:`store_tokens_ref`); return N."""
    n = check_targets(pool, layout, page_ids, slots, validate)
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dtype not in INPUT_DTYPES:
            raise ValueError(f"{name} must be a float16/bfloat16/float32 tensor, got {getattr(t, 'dtype', t)}")
        if tuple(t.shape) != (n, layout.head_dim):
            raise ValueError(f"{name} must have shape [N, head_dim] = {[n, layout.head_dim]}, got {list(t.shape)}")
    score_dtype, pos_dtype = field_dtypes(layout.compact)
    for name, t, want in (("scores", scores, score_dtype), ("positions", positions, pos_dtype)):
        if not isinstance(t, torch.Tensor) or t.dtype != want or tuple(t.shape) != (n,):
            raise ValueError(f"{name} must be a {want} tensor [{n}] (as this layout stores them), got "
                             f"{getattr(t, 'dtype', t)} {list(getattr(t, 'shape', []))}")
    for name, t in (("keys", keys), ("values", values), ("scores", scores), ("positions", positions)):
        if t.device != pool.device:
            raise ValueError(f"{name} is on {t.device} but the pool is on {pool.device}")
    return n


def _rows(layout: TierLayout, page_ids: torch.Tensor, slots: torch.Tensor, offset: int, row: int) -> torch.Tensor:
    """Flat pool byte indices [N, row] of row ``slot`` of a segment at ``offset`` holding ``row`` bytes per token."""
    base = page_ids.long() * layout.page_bytes + offset + slots.long() * row
    return base.unsqueeze(1) + torch.arange(row, device=page_ids.device)


def _fields(layout: TierLayout, which: str) -> int:
    """Meta values per group: 2 (scale, zero), or 1 (the scale) for symmetric keys."""
    return layout.key_meta_fields if which == "key" else 2


def _scale_zero(meta: torch.Tensor, bits: int, fields: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [...] from stored meta [..., fields]: a scale-only group's zero is quant.symmetric_zero."""
    return (meta[..., 0], meta[..., 1]) if fields == 2 else (meta[..., 0], symmetric_zero(meta[..., 0], bits))


def _segments(layout: TierLayout, which: str) -> tuple[int, int, int, int, int]:
    """(bits, groups, code offset, code row bytes, meta offset) of ``which`` in ('key', 'value')."""
    g = getattr
    return (g(layout, f"{which}_bits"), g(layout, f"{which}_groups"), g(layout, f"{which}_offset"),
            g(layout, f"{which}_row_bytes"), g(layout, f"{which}_meta_offset"))


def _encode(x: torch.Tensor, name: str, bits: int, groups: int, meta_dtype, raw_dtype, validate: bool,
            symmetric: bool = False):
    """Bytes of one tensor x [N, D]: (codes or raw [N, row bytes] uint8, meta [N, groups * fields * meta bytes] or
    None, what a load will return [N, D] fp32). symmetric: scale-only groups (quant.quantize)."""
    if validate and not torch.isfinite(x).all():
        i = int((~torch.isfinite(x)).any(1).nonzero()[0])
        raise ValueError(f"{name} contain NaN or Inf (token {i}); only finite values can be stored")
    n = x.shape[0]
    if bits == 16:
        raw = x.to(raw_dtype)
        if validate and not torch.isfinite(raw).all():
            raise ValueError(f"{name}: values up to {x.float().abs().max().item():.4g} overflow the {raw_dtype} raw "
                             "dtype of 16-bit tiers; use raw_dtype='bfloat16' or 'float32'")
        return raw.contiguous().view(torch.uint8), None, raw.float()
    try:
        codes, scale, zero = quantize(x, bits, x.shape[1] // groups, meta_dtype, validate=validate,
                                      symmetric=symmetric)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    fields = [scale] if symmetric else [scale, zero]
    meta = torch.stack(fields, dim=-1).contiguous().view(torch.uint8).reshape(n, -1)
    return pack(codes, bits), meta, dequantize(codes, scale, zero)


def store_tokens_ref(pool: torch.Tensor, layout: TierLayout, keys: torch.Tensor, values: torch.Tensor,
                     page_ids: torch.Tensor, slots: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor, *,
                     meta_dtype: torch.dtype | str | None = None, raw_dtype: torch.dtype | str | None = None,
                     validate: bool = True, return_stored: bool = False):
    """Quantize N tokens of one tier and write them into ``pool`` in place (torch reference).

    Parameters
    ----------
    pool : uint8 [num_pages, page_bytes], contiguous; ``page_bytes == layout.page_bytes``.
    layout : the tier's page layout (bits, groups, segment offsets).
    keys, values : [N, head_dim] float16 / bfloat16 / float32.
    page_ids, slots : [N] integer; the target page and in-page token index (< ``layout.tokens_per_page``).
        Every (page, slot) pair may occur once per call.
    scores : [N] float32, positions : [N] int32; compact layouts: float16 means and int16 positions mod 2^16
        (``diffkv.core.bookkeeping``): stored as given.
    meta_dtype : dtype of scales/zeros; default float16 for 2-byte metadata (bfloat16 allowed), float32 for 4.
    raw_dtype : dtype of 16-bit tensors; default float16 for 2-byte raw values (bfloat16 allowed), float32 for 4.
    validate : check targets and values; raises ``ValueError`` before anything is written.
    return_stored : also return ``(keys, values)`` [N, head_dim] fp32 exactly as a later load will decode them.
    """
    meta_dtype, raw_dtype = resolve_dtypes(layout, meta_dtype, raw_dtype)
    n = check_store_args(pool, layout, keys, values, page_ids, slots, scores, positions, validate)
    if n == 0:
        return (keys.float(), values.float()) if return_stored else None
    enc = {}
    for which, x in (("key", keys), ("value", values)):
        bits, groups = _segments(layout, which)[:2]
        enc[which] = _encode(x, which + "s", bits, groups, meta_dtype, raw_dtype, validate,
                             symmetric=_fields(layout, which) == 1)
    parts = [p for which in ("key", "value") for p in enc[which][:2] if p is not None]
    parts += [scores.contiguous().view(torch.uint8).reshape(n, layout.score_bytes),
              positions.contiguous().view(torch.uint8).reshape(n, layout.pos_bytes)]
    col_off, col_row = _token_columns(layout, pool.device)
    where = page_ids.long()[:, None] * layout.page_bytes + col_off + slots.long()[:, None] * col_row
    pool.view(-1)[where] = torch.cat(parts, 1)  # one scatter of every byte the N tokens own
    return (enc["key"][2], enc["value"][2]) if return_stored else None


_COLUMNS: dict = {}


def _token_columns(layout: TierLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per byte column of a stored token (key codes, key meta, value codes, value meta, score, pos, in that order):
    its in-page offset for slot 0 and the segment's bytes per token; the address of column j of slot s is
    ``page * page_bytes + col_off[j] + s * col_row[j]``. int64 [C] each, cached per layout and device."""
    key = (layout, str(device))
    if key not in _COLUMNS:
        segs = []
        for which in ("key", "value"):
            bits, groups, off, row, meta_off = _segments(layout, which)
            segs.append((off, row))
            if bits != 16:
                segs.append((meta_off, groups * _fields(layout, which) * layout.meta_bytes))
        segs += [(layout.score_offset, layout.score_bytes), (layout.pos_offset, layout.pos_bytes)]
        off = torch.cat([torch.arange(o, o + r) for o, r in segs])
        row = torch.cat([torch.full((r,), r) for _, r in segs])
        _COLUMNS[key] = (off.to(device), row.to(device))
    return _COLUMNS[key]


def load_tokens_ref(pool: torch.Tensor, layout: TierLayout, page_ids: torch.Tensor, slots: torch.Tensor,
                    dtype: torch.dtype = torch.float32, *, meta_dtype: torch.dtype | str | None = None,
                    raw_dtype: torch.dtype | str | None = None, validate: bool = True):
    """Gather, unpack and dequantize N stored tokens (inverse of :func:`store_tokens_ref`).

    pool : uint8 [num_pages, page_bytes]; page_ids, slots : [N] integer.
    Returns ``(keys [N, head_dim] dtype, values [N, head_dim] dtype, scores [N] float32, positions [N] int32)``
    (compact layouts: float16 and int16, as stored).
    """
    meta_dtype, raw_dtype = resolve_dtypes(layout, meta_dtype, raw_dtype)
    n = check_targets(pool, layout, page_ids, slots, validate, unique=False)
    flat = pool.reshape(-1)
    out = []
    for which in ("key", "value"):
        bits, groups, off, row, meta_off = _segments(layout, which)
        data = flat[_rows(layout, page_ids, slots, off, row)]
        if bits == 16:
            out.append(data.view(raw_dtype).to(dtype))
            continue
        f = _fields(layout, which)
        meta = flat[_rows(layout, page_ids, slots, meta_off, groups * f * layout.meta_bytes)]
        meta = meta.view(meta_dtype).reshape(n, groups, f)
        out.append(dequantize_packed(data, bits, *_scale_zero(meta, bits, f)).to(dtype))
    score_dtype, pos_dtype = field_dtypes(layout.compact)
    score = flat[_rows(layout, page_ids, slots, layout.score_offset, layout.score_bytes)].view(score_dtype)
    pos = flat[_rows(layout, page_ids, slots, layout.pos_offset, layout.pos_bytes)].view(pos_dtype)
    return out[0], out[1], score.reshape(n), pos.reshape(n)


def load_pages_ref(pool: torch.Tensor, layout: TierLayout, page_ids: torch.Tensor, dtype: torch.dtype = torch.float32,
                   *, count: torch.Tensor | None = None, meta_dtype: torch.dtype | str | None = None,
                   raw_dtype: torch.dtype | str | None = None):
    """Dequantize whole pages: every slot of ``page_ids`` in slot order (one row gather of the pages, then views).

    pool : uint8 [num_pages, page_bytes]; page_ids : int [K, P] (entries must be valid page ids).
    count : int [K] or None; tokens ``>= count[k]`` of row k decode as exactly 0 (their scale and zero are
        masked, so no stale or foreign bytes can produce NaN/Inf). Without it those slots hold garbage.
    Returns ``keys, values [K, P * N, head_dim] dtype, scores [K, P * N] float32, positions [K, P * N] int32``
    (compact layouts: float16, int16) with
    N = ``layout.tokens_per_page``; token i of a row is slot ``i % N`` of page ``page_ids[k, i // N]``.
    """
    meta_dtype, raw_dtype = resolve_dtypes(layout, meta_dtype, raw_dtype)
    k, p = page_ids.shape
    n, d = layout.tokens_per_page, layout.head_dim
    pages = pool.index_select(0, page_ids.reshape(-1).long())  # [K * P, page_bytes]: one row copy per page

    def seg(offset: int, row: int) -> torch.Tensor:  # a segment of every page, as a strided view [K, P, N, row]
        return pages[:, offset:offset + n * row].view(k, p, n, row)

    valid = None if count is None else (torch.arange(p * n, device=pool.device)[None, :] < count[:, None])
    valid4 = None if valid is None else valid.view(k, p, n)
    out = []
    for which in ("key", "value"):
        bits, groups, off, row, meta_off = _segments(layout, which)
        data = seg(off, row)
        if bits == 16:
            x = data.view(raw_dtype).to(dtype)
            x = x if valid4 is None else torch.where(valid4[..., None], x, 0)
            out.append(x.reshape(k, p * n, d))
            continue
        f = _fields(layout, which)
        meta = seg(meta_off, groups * f * layout.meta_bytes).view(meta_dtype).reshape(k, p, n, groups, f)
        if valid4 is not None:
            meta = torch.where(valid4[..., None, None], meta, 0)
        x = dequantize_packed(data, bits, *_scale_zero(meta, bits, f))  # [K, P, N, D] contiguous
        out.append(x.view(k, p * n, d).to(dtype))
    score_dtype, pos_dtype = field_dtypes(layout.compact)
    score = seg(layout.score_offset, layout.score_bytes).view(score_dtype).reshape(k, p * n)
    pos = seg(layout.pos_offset, layout.pos_bytes).view(pos_dtype).reshape(k, p * n)
    if valid is not None:
        score, pos = torch.where(valid, score, 0.0), torch.where(valid, pos, 0)
    return out[0], out[1], score, pos
