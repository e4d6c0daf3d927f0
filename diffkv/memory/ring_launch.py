"""Launchers of the ring kernels (``diffkv.kernels.ring``); triton is imported on first use only.

Each checks devices, dtypes and contiguity, then makes exactly one launch with grid (1,) and no host sync. The
torch path in ``diffkv.memory.alloc`` is the reference (and the CPU path); on CPU these run under
``TRITON_INTERPRET=1`` (tests, tiny shapes only).
"""

from __future__ import annotations

import torch

from diffkv.memory.pool import PagePool
from diffkv.memory.tables import HeadTables


def _block(k: int, cap: int) -> int:
    """Items per block: a power of two in [16, cap]."""
    return max(16, min(cap, 1 << max(k - 1, 0).bit_length()))


def _check(pool: PagePool, tables: HeadTables, items: torch.Tensor) -> None:
    for name, t, dtype in (("items", items, torch.int64), ("ring", pool._ring_buf, torch.int32),
                           ("refcount", pool._ref_buf, torch.int32), ("table", tables._table_buf, torch.int32),
                           ("counts", tables.counts, torch.int32), ("state", pool.state, torch.int64)):
        if t.device != pool.device or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"ring kernel: {name} must be a contiguous {dtype} tensor on {pool.device}, "
                             f"got {t.dtype} on {t.device}")


def reserve_triton(pool: PagePool, tables: HeadTables, items: torch.Tensor,
                   may_demote: torch.Tensor | None = None) -> torch.Tensor:
    """Fused ``reserve``. items: int64 [K] distinct flat head ids; may_demote: bool [K] or None.

    Returns a 0-d int64 device tensor: pages taken (0 if the device refused: not enough free pages or a row
    would overflow the table; then ``pool.state[2]`` was incremented and nothing else changed).
    """
    from diffkv.kernels.ring import reserve_kernel

    _check(pool, tables, items)
    out = torch.zeros(1, dtype=torch.int64, device=pool.device)
    demote = items if may_demote is None else may_demote.to(device=pool.device, dtype=torch.int8).contiguous()
    n_hi, n_lo = tables.tokens_per_page_hl
    reserve_kernel[(1,)](
        ring_ptr=pool._ring_buf, ref_ptr=pool._ref_buf, table_ptr=tables._table_buf, counts_ptr=tables.counts,
        items_ptr=items, demote_ptr=demote, state_ptr=pool.state, out_ptr=out,
        num_items=items.numel(), stride=tables.num_items, num_pages=pool.num_pages, width=tables.width,
        tokens_hi=n_hi, tokens_lo=n_lo, recent=tables.recent_window or 0,
        TWO_TIER=tables.two_tier, HAS_DEMOTE=may_demote is not None, BLOCK=_block(items.numel(), 1024),
    )
    return out[0]


def release_triton(pool: PagePool, tables: HeadTables, items: torch.Tensor, max_high: int,
                   max_low: int) -> torch.Tensor:
    """Fused ``release``. items: int64 [K] distinct flat head ids; max_high/max_low: upper bounds of the pages
    per tier of any item (``tables.width`` when unknown). Returns a 0-d int64 device tensor: pages freed."""
    from diffkv.kernels.ring import release_kernel

    _check(pool, tables, items)
    if not (0 <= max_high <= tables.width and 0 <= max_low <= tables.width):
        raise ValueError(f"max_high/max_low must lie in [0, {tables.width}], got {max_high}, {max_low}")
    out = torch.zeros(1, dtype=torch.int64, device=pool.device)
    release_kernel[(1,)](
        ring_ptr=pool._ring_buf, ref_ptr=pool._ref_buf, table_ptr=tables._table_buf, counts_ptr=tables.counts,
        items_ptr=items, state_ptr=pool.state, out_ptr=out,
        num_items=items.numel(), stride=tables.num_items, num_pages=pool.num_pages, width=tables.width,
        max_high=max_high, max_low=max_low,
        BLOCK=_block(items.numel(), 256), BLOCK_W=16,
    )
    return out[0]
