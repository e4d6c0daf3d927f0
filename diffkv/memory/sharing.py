"""Pages shared read-only between heads (a prompt prefix stored once, read by every request that starts with it;
issue #45).

:func:`share` gives each destination head the pages of its source head: the full pages of each tier by reference
(the same page ids in the destination's row, their refcount raised by one), the partially filled last page of each
tier as a private copy (the destination appends there), and the source's token and page counts. A page's refcount
is the number of table cells that hold it. :func:`release_shared` is :func:`~diffkv.memory.release` for heads that
hold shared pages: it drops their references (a shared page stays with its other holders) and gives back only the
pages they own alone. The source keeps its pages until it is released itself, after every destination (a page is
free only when no cell holds it; :meth:`PagePool.check_invariants` checks this).
"""

from __future__ import annotations

import torch

from diffkv.memory.pool import OpResult, PagePool, PoolExhausted
from diffkv.memory.tables import HeadSet, HeadTables


def _rows(tables: HeadTables, heads: HeadSet) -> tuple[torch.Tensor, torch.Tensor]:
    """Row cells [K, T] (a copy) and counts [4, K] int64 (n_high, n_low, pages_high, pages_low) of ``heads``."""
    counts = tables.counts.view(-1).index_select(0, heads.count_index).view(4, len(heads)).long()
    return tables.rows.index_select(0, heads.items), counts


@torch.inference_mode()
def share(pool: PagePool, tables: HeadTables, src: HeadSet, dst: HeadSet) -> tuple[OpResult, torch.Tensor]:
    """Give every head of ``dst`` (empty, as many as ``src``: head k takes head k's pages) the tokens of its
    ``src`` head: the full pages by reference, the last partial page of each tier as a private copy (pages past
    the tokens, e.g. reserved ahead, are not given). Returns (``OpResult``, whose ``pages`` counts the copies
    taken; the shared full pages per head and tier, int32 [K, 2], what :func:`release_shared` needs). Raises
    ValueError (a ``dst`` head holds pages, or the sets differ in length) or :class:`PoolExhausted` (no room for
    the copies) before changing anything."""
    k, dev, t = len(src), tables.device, tables.width
    if len(dst) != k:
        raise ValueError(f"share needs one destination head per source head, got {k} and {len(dst)}")
    rows, counts = _rows(tables, src)
    _, old = _rows(tables, dst)
    if bool((old != 0).any()):
        raise ValueError("share: a destination head already holds pages or tokens; release it first")
    per_page = tables.tokens_per_page.to(torch.int64)[:, None]  # [2, 1] (N_hi, N_lo)
    full = counts[:2] // per_page  # [2, K] full pages per tier
    used = -(-counts[:2] // per_page)  # [2, K] pages holding tokens
    partial = used > full  # [2, K] a last page with room (copied)
    need = int(partial.sum())
    free = int(pool.read(pool.free_count))
    if need > free:
        raise PoolExhausted("share", need, free)
    col = torch.arange(t, device=dev)[None, :]
    rows = torch.where((col < used[0][:, None]) | (col >= t - used[1][:, None]), rows, -1)  # only token pages
    copies = pool.take_pages(need, "share") if need else torch.empty(0, dtype=torch.int64, device=dev)
    tier, head = partial.nonzero(as_tuple=True)  # tier-major, as ``copies``
    last = torch.where(tier == 0, full[0][head], t - 1 - full[1][head])  # column of each copied page
    pool.data[copies] = pool.data[rows[head, last].long()]
    rows[head, last] = copies.to(rows.dtype)
    is_shared = (col < full[0][:, None]) | (col >= t - full[1][:, None])
    refs = rows[(rows >= 0) & is_shared].long()
    pool._ref_buf.index_add_(0, refs, torch.ones_like(refs, dtype=torch.int32))
    tables._table_buf.index_copy_(0, (dst.items[:, None] * t + col).view(-1), rows.view(-1))
    new = torch.cat([counts[:2], used]).to(torch.int32)
    tables.counts.view(-1).index_copy_(0, dst.count_index, new.view(-1))
    return OpResult("share", need, k), full.t().to(torch.int32).contiguous()


@torch.inference_mode()
def release_shared(pool: PagePool, tables: HeadTables, heads: HeadSet, shared: torch.Tensor) -> OpResult:
    """Release heads whose first ``shared`` [K, 2] (high, low) full pages are shared (from :func:`share`): their
    references go (refcount - 1, cells -1), their own pages go back to the ring, their counts become 0."""
    rows, _ = _rows(tables, heads)
    t = tables.width
    col = torch.arange(t, device=tables.device)[None, :]
    shared = shared.to(device=tables.device, dtype=torch.int64)
    is_shared = (col < shared[:, :1]) | (col >= t - shared[:, 1:])
    held = rows >= 0
    refs = rows[held & is_shared].long()
    own = rows[held & ~is_shared]
    pool._ref_buf.index_add_(0, refs, torch.full_like(refs, -1, dtype=torch.int32))
    tables._table_buf.index_fill_(0, (heads.items[:, None] * t + col).view(-1), -1)
    tables.counts.view(-1).index_fill_(0, heads.count_index, 0)
    pool.give_pages(own.long())
    return OpResult("release_shared", int(own.numel()), len(heads))
