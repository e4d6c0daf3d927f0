"""Pages shared read-only between heads (a prompt prefix stored once, read by every request that starts with it;
issue #45).

:func:`share` gives each destination head the pages of its source head: the full pages of each tier by reference
(the same page ids in the destination's row, their refcount raised by one), the partially filled last page of each
tier as a private copy (the destination appends there), and the source's token and page counts; with
``copy_low=False`` the low tier's partial page is shared as well until :func:`copy_partial` copies it (a reader
whose low tier cannot grow yet: ``diffkv.cache.prefix``). A page's refcount
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
def share(pool: PagePool, tables: HeadTables, src: HeadSet, dst: HeadSet,
          copy_low: bool = True) -> tuple[OpResult, torch.Tensor]:
    """Give every head of ``dst`` (empty, as many as ``src``: head k takes head k's pages) the tokens of its
    ``src`` head: the full pages by reference, the last partial page of each tier as a private copy (pages past
    the tokens, e.g. reserved ahead, are not given). ``copy_low=False``: the low tier's partial page is shared too,
    until :func:`copy_partial` (the holder must call it before its low tier grows). Returns (``OpResult``, whose
    ``pages`` counts the copies taken; the shared pages per head and tier, int32 [K, 2], what
    :func:`release_shared` and :func:`copy_partial` need). Raises ValueError (a ``dst`` head holds pages, or the
    sets differ in length) or :class:`PoolExhausted` (no room for the copies) before changing anything."""
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
    shared = torch.stack([full[0], full[1] if copy_low else used[1]])  # [2, K] pages given by reference
    col = torch.arange(t, device=dev)[None, :]
    rows = torch.where((col < used[0][:, None]) | (col >= t - used[1][:, None]), rows, -1)  # only token pages
    copies = _copy_last(pool, tables, rows, used > shared, "share", used)
    refs = rows[(rows >= 0) & _in_shared(col, t, shared)].long()
    pool._ref_buf.index_add_(0, refs, torch.ones_like(refs, dtype=torch.int32))
    tables._table_buf.index_copy_(0, (dst.items[:, None] * t + col).view(-1), rows.view(-1))
    new = torch.cat([counts[:2], used]).to(torch.int32)
    tables.counts.view(-1).index_copy_(0, dst.count_index, new.view(-1))
    return OpResult("share", copies, k), shared.t().to(torch.int32).contiguous()


@torch.inference_mode()
def copy_partial(pool: PagePool, tables: HeadTables, heads: HeadSet,
                 shared: torch.Tensor) -> tuple[OpResult, torch.Tensor]:
    """Give every head of ``heads`` whose last shared page of a tier is partly filled (``share(copy_low=False)``)
    a private copy of it, in the same column, the shared page's refcount lowered by one. shared: int32 [K, 2] from
    :func:`share`. Returns (``OpResult``, pages copied; the new shared counts [K, 2]). Raises
    :class:`PoolExhausted` before changing anything."""
    t = tables.width
    rows, counts = _rows(tables, heads)
    shared = shared.to(device=tables.device, dtype=torch.int64).t()  # [2, K]
    partial = shared > counts[:2] // tables.tokens_per_page.to(torch.int64)[:, None]  # [2, K]
    old = rows.clone()
    copies = _copy_last(pool, tables, rows, partial, "copy_partial", shared)
    if copies:
        moved = rows != old
        pool._ref_buf.index_add_(0, old[moved].long(), torch.full_like(old[moved], -1, dtype=torch.int32))
        cells = (heads.items[:, None] * t + torch.arange(t, device=tables.device)[None, :])[moved]
        tables._table_buf.index_copy_(0, cells, rows[moved])
    return OpResult("copy_partial", copies, len(heads)), (shared - partial.long()).t().to(torch.int32).contiguous()


def _copy_last(pool: PagePool, tables: HeadTables, rows: torch.Tensor, which: torch.Tensor, op: str,
               pages: torch.Tensor) -> int:
    """Replace, in ``rows`` [K, T] (a copy, changed in place), the last of the first ``pages`` [2, K] pages of each
    tier and head where ``which`` [2, K] by a new page holding its bytes. Returns how many (PoolExhausted first
    when the pool has fewer free pages)."""
    need = int(which.sum())
    free = int(pool.read(pool.free_count))
    if need > free:
        raise PoolExhausted(op, need, free)
    if not need:
        return 0
    t = tables.width
    copies = pool.take_pages(need, op)
    tier, head = which.nonzero(as_tuple=True)  # tier-major, as ``copies``
    last = torch.where(tier == 0, pages[0][head] - 1, t - pages[1][head])  # column of each copied page
    pool.data[copies] = pool.data[rows[head, last].long()]
    rows[head, last] = copies.to(rows.dtype)
    return need


def _in_shared(col: torch.Tensor, t: int, shared: torch.Tensor) -> torch.Tensor:
    """bool [K, T]: the columns of the first ``shared`` [2, K] (high, low) pages of each row."""
    return (col < shared[0][:, None]) | (col >= t - shared[1][:, None])


@torch.inference_mode()
def release_shared(pool: PagePool, tables: HeadTables, heads: HeadSet, shared: torch.Tensor) -> OpResult:
    """Release heads whose first ``shared`` [K, 2] (high, low) full pages are shared (from :func:`share`): their
    references go (refcount - 1, cells -1), their own pages go back to the ring, their counts become 0."""
    rows, _ = _rows(tables, heads)
    t = tables.width
    col = torch.arange(t, device=tables.device)[None, :]
    shared = shared.to(device=tables.device, dtype=torch.int64)
    is_shared = _in_shared(col, t, shared.t())
    held = rows >= 0
    refs = rows[held & is_shared].long()
    own = rows[held & ~is_shared]
    pool._ref_buf.index_add_(0, refs, torch.full_like(refs, -1, dtype=torch.int32))
    tables._table_buf.index_fill_(0, (heads.items[:, None] * t + col).view(-1), -1)
    tables.counts.view(-1).index_fill_(0, heads.count_index, 0)
    pool.give_pages(own.long())
    return OpResult("release_shared", int(own.numel()), len(heads))
