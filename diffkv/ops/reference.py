"""The torch references of the decode-step ops, in one place: the oracle every backend (compiled CPU, Triton) is
tested against, bit-exact for stores and placement, within float tolerance for attention (docs/design.md §5).

Defined here, over pages and tables:

* :func:`paged_decode_attention_ref` -- decode attention over both tiers' pages (+ the score update);
* :func:`add_scores_ref` -- one step's attention into the stored scores (sums, compact means, peaks);
* :func:`place_store_ref` -- one decode step's placement (demote / prune / append) and stores.

Re-exported, so that this module names every reference: the per-token math they are built from, pure functions of
``diffkv.core`` (``store_tokens_ref`` / ``load_tokens_ref`` / ``load_pages_ref`` of ``core/page_io.py``,
``decode_attention_ref`` of ``core/attention.py``, ``prefill_scores_ref`` = ``core/policy.prefill_scores``). The
allocator's reference is ``backend="torch"`` of ``diffkv.memory.reserve`` / ``release`` (the same functions).
"""

from __future__ import annotations

import torch

from diffkv.core import bookkeeping, policy
from diffkv.core.attention import decode_attention_ref, decode_attention_tiers
from diffkv.core.page_io import load_pages_ref, load_tokens_ref, resolve_dtypes, store_tokens_ref
from diffkv.core.policy import prefill_scores as prefill_scores_ref
from diffkv.memory import HIGH_COL, LOW_COL

__all__ = ["add_scores_ref", "decode_attention_ref", "load_pages_ref", "load_tokens_ref", "paged_decode_attention_ref",
           "place_store_ref", "prefill_scores_ref", "store_tokens_ref"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def page_ids(tables, items: torch.Tensor, low: bool, n_pages: int) -> torch.Tensor:
    """int64 [K, n_pages] page ids of a tier in token order (as ``PagedKV._page_ids``); -1 reads as page 0."""
    col = torch.arange(n_pages, device=items.device)
    if low:
        col = tables.width - 1 - col
    return tables.rows[items][:, col].clamp_min(0).long()


def tier_widths(layouts, n_high: torch.Tensor, n_low: torch.Tensor) -> tuple[int, int]:
    """(M_hi, M_lo): page-granular token widths of the two tiers (one host sync)."""
    w_hi, w_lo = (int(x) for x in torch.stack([n_high.max(), n_low.max()]).tolist()) if n_high.numel() else (0, 0)
    return (cdiv(w_hi, layouts[0].tokens_per_page) * layouts[0].tokens_per_page,
            cdiv(w_lo, layouts[1].tokens_per_page) * layouts[1].tokens_per_page)


def field_index(pages: torch.Tensor, layout, offset: int, size: int) -> torch.Tensor:
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
    width = cdiv(delta.shape[1], n) * n
    if width == 0:
        return
    delta = torch.nn.functional.pad(delta, (0, width - delta.shape[1]))
    pages = page_ids(tables, items, low, width // n)
    valid = torch.arange(width, device=pool.device)[None, :] < count[:, None]
    score_dtype, pos_dtype = bookkeeping.field_dtypes(layout.compact)
    scores = pool.view(-1).view(score_dtype)
    where = field_index(pages, layout, layout.score_offset, layout.score_bytes)[valid]
    if peak:
        scores[where] = bookkeeping.updated(scores[where], delta[valid], None, lag, layout.compact, True)
        return
    if not layout.compact:
        scores[where] += delta[valid].float()
        return
    if position is None:
        raise ValueError("compact pages update their mean scores by age: pass position")
    pos = pool.view(-1).view(pos_dtype)[field_index(pages, layout, layout.pos_offset, layout.pos_bytes)[valid]]
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
    scaling : softmax scale. meta_dtype, raw_dtype : as in ``diffkv.core.page_io`` (``PagedKV.meta_dtype/raw_dtype``).
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
    for low, count, m in zip((False, True), (n_high, n_low), tier_widths(layouts, n_high, n_low), strict=True):
        lay = layouts[int(low)]
        md, rd = resolve_dtypes(lay, meta_dtype, raw_dtype)
        ids = page_ids(tables, items, low, m // lay.tokens_per_page)
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


def place_store_ref(kv, items: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                    alpha_high: float, alpha_low: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's placement (docs/algorithm.md §4.4) and stores for K items of one layer (torch reference).

    kv: the :class:`~diffkv.cache.paged_kv.PagedKV` (its config gives ``recent_window`` and ``two_tier``); items:
    int64 [K] flat head ids whose pages for this step are reserved; keys, values: [K, D] the new token; position:
    int [K] its index (tokens processed before it). Demotes / prunes as ``policy.place_decode`` decides, zeroes the
    score of the token leaving the window (``policy.window_exits``, only with ``score_after_window``), writes the new
    token in high precision (score 0, pos = position) and the new (n_high, n_low) into the tables. Returns them,
    int64 [K].
    """
    cfg, tables = kv.config, kv.tables
    n = tables.tokens_flat[items].long()
    n_hi, n_lo = n[:, 0], n[:, 1]
    w_hi, w_lo = (int(x) + 1 for x in torch.stack([n_hi.max(), n_lo.max()]).tolist())
    position = position.to(torch.int64)
    hs, hp, _ = kv.read_meta(HIGH_COL, items, n_hi, w_hi, position)
    ls, lp, _ = kv.read_meta(LOW_COL, items, n_lo, w_lo, position)
    place = policy.place_decode(hs, hp, n_hi, ls, lp, n_lo, position, alpha_high, alpha_low, cfg.recent_window,
                                two_tier=cfg.two_tier, lag=cfg.score_lag, compact=kv.compact, peak=cfg.peak)
    if cfg.score_lag:  # score_after_window: the token leaving the recent window starts a fresh score
        r, slot = policy.window_exits(hp, n_hi, position, cfg.score_lag).nonzero(as_tuple=True)
        kv.reset_scores(HIGH_COL, items[r], slot)
    demote = (place.case == policy.DEMOTE_OVER_LOW) | (place.case == policy.DEMOTE_APPEND_LOW)
    r = demote.nonzero(as_tuple=True)[0]
    if r.numel():  # re-quantize the victim from its stored high-precision values into the low tier
        kk, vv, ss, pp = kv.read_at(HIGH_COL, items[r], place.high_slot[r])
        kv.write(LOW_COL, items[r], place.low_slot[r], kk, vv, ss, pp)
    append = place.case == policy.APPEND
    target = torch.where(append, n_hi, place.high_slot)
    zeros = torch.zeros(len(items), dtype=torch.float32, device=keys.device)
    kv.write(HIGH_COL, items, target, keys, values, zeros, position)
    n_hi = n_hi + append.long()
    n_lo = n_lo + (place.case == policy.DEMOTE_APPEND_LOW).long()
    tables.tokens_flat[items] = torch.stack([n_hi, n_lo], -1).to(torch.int32)
    return n_hi, n_lo
