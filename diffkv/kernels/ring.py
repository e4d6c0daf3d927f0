"""Ring free-list kernels: reserve and release as one fused demand -> ``tl.cumsum`` -> scatter pass.

Based on DiffKV's "parallel KV compaction" (docs/design.md §4.3). One program walks the items in blocks
of ``BLOCK``; within a block every item is one lane, its ring offset is the exclusive ``tl.cumsum`` of the
demands plus a running carry, so freed page ids land in consecutive ring slots however scattered they were.
Launchers: ``diffkv.memory.ring_launch``; torch reference: ``diffkv.memory.alloc.reserve`` / ``release``.
"""

import triton
import triton.language as tl


@triton.jit
def _block_demand(items_ptr, b, num_items, counts_ptr, stride, demote_ptr, tokens_hi, tokens_lo, recent,
                  TWO_TIER: tl.constexpr, HAS_DEMOTE: tl.constexpr, BLOCK: tl.constexpr):
    """Items ``b .. b + BLOCK - 1``: their positions, mask, head ids, page demand per tier and pages held per tier."""
    offs = b + tl.arange(0, BLOCK)
    mask = offs < num_items
    item = tl.load(items_ptr + offs, mask=mask, other=0)
    n_hi = tl.load(counts_ptr + item, mask=mask, other=0)
    n_lo = tl.load(counts_ptr + stride + item, mask=mask, other=0)
    p_hi = tl.load(counts_ptr + 2 * stride + item, mask=mask, other=0)
    p_lo = tl.load(counts_ptr + 3 * stride + item, mask=mask, other=0)
    d_hi = ((n_hi >= p_hi * tokens_hi) & mask).to(tl.int32)
    if TWO_TIER:
        if HAS_DEMOTE:
            may = tl.load(demote_ptr + offs, mask=mask, other=0) != 0
        else:
            may = n_hi >= recent
        d_lo = ((n_lo >= p_lo * tokens_lo) & may & mask).to(tl.int32)
    else:
        d_lo = tl.zeros_like(d_hi)
    return offs, mask, item, d_hi, d_lo, p_hi, p_lo


@triton.jit
def reserve_kernel(ring_ptr, ref_ptr, table_ptr, counts_ptr, items_ptr, demote_ptr, state_ptr, out_ptr,
                   num_items, stride, num_pages, width, tokens_hi, tokens_lo, recent,
                   TWO_TIER: tl.constexpr, HAS_DEMOTE: tl.constexpr, BLOCK: tl.constexpr):
    """Computes ``reserve`` (at most one page per head and tier) for ``num_items`` heads; grid (1,).

    Pass 1 sums the demand per tier and the widest row; if they do not fit (free pages, table width) the call is
    a no-op except ``state[2] += 1``. Pass 2 takes pages from the ring at ``state[0]``: every high page in item
    order, then every low page. ring: int32 [N]; ref: int32 [N]; table: int32 [S*L*H, width]; counts: int32
    [4, stride] (n_hi, n_lo, pages_hi, pages_lo); items: int64 [K]; demote: int8 [K] (HAS_DEMOTE);
    state: int64 [3] (start, free, refused); out: int64 [1] pages taken.
    """
    need_hi = tl.zeros([], tl.int64)
    need_lo = tl.zeros([], tl.int64)
    widest = tl.zeros([], tl.int64)
    for b in range(0, num_items, BLOCK):
        offs, mask, item, d_hi, d_lo, p_hi, p_lo = _block_demand(items_ptr, b, num_items, counts_ptr, stride,
                                                                 demote_ptr, tokens_hi, tokens_lo, recent, TWO_TIER,
                                                                 HAS_DEMOTE, BLOCK)
        need_hi += tl.sum(d_hi, 0).to(tl.int64)
        need_lo += tl.sum(d_lo, 0).to(tl.int64)
        widest = tl.maximum(widest, tl.max(p_hi + p_lo + d_hi + d_lo, 0).to(tl.int64))
    start = tl.load(state_ptr)
    free = tl.load(state_ptr + 1)
    ok = ((need_hi + need_lo <= free) & (widest <= width)).to(tl.int32)
    carry_hi = tl.zeros([], tl.int64)
    carry_lo = need_hi
    for b in range(0, num_items, BLOCK):
        offs, mask, item, d_hi, d_lo, p_hi, p_lo = _block_demand(items_ptr, b, num_items, counts_ptr, stride,
                                                                 demote_ptr, tokens_hi, tokens_lo, recent, TWO_TIER,
                                                                 HAS_DEMOTE, BLOCK)
        d_hi = d_hi * ok
        d_lo = d_lo * ok
        first_hi = carry_hi + (tl.cumsum(d_hi, 0) - d_hi).to(tl.int64)  # exclusive prefix sums + carries
        first_lo = carry_lo + (tl.cumsum(d_lo, 0) - d_lo).to(tl.int64)
        take_hi = d_hi > 0
        take_lo = d_lo > 0
        page_hi = tl.load(ring_ptr + (start + first_hi) % num_pages, mask=take_hi, other=0)
        page_lo = tl.load(ring_ptr + (start + first_lo) % num_pages, mask=take_lo, other=0)
        row = item * width
        tl.store(table_ptr + row + p_hi, page_hi, mask=take_hi)
        tl.store(table_ptr + row + (width - 1 - p_lo), page_lo, mask=take_lo)
        tl.store(ref_ptr + page_hi, 1, mask=take_hi)
        tl.store(ref_ptr + page_lo, 1, mask=take_lo)
        tl.store(counts_ptr + 2 * stride + item, p_hi + d_hi, mask=mask)
        tl.store(counts_ptr + 3 * stride + item, p_lo + d_lo, mask=mask)
        carry_hi += tl.sum(d_hi, 0).to(tl.int64)
        carry_lo += tl.sum(d_lo, 0).to(tl.int64)
    taken = (need_hi + need_lo) * ok
    tl.store(state_ptr, (start + taken) % num_pages)
    tl.store(state_ptr + 1, free - taken)
    tl.store(state_ptr + 2, tl.load(state_ptr + 2) + 1 - ok)
    tl.store(out_ptr, taken)


@triton.jit
def release_kernel(ring_ptr, ref_ptr, table_ptr, counts_ptr, items_ptr, state_ptr, out_ptr,
                   num_items, stride, num_pages, width, max_high, max_low, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr):
    """Computes ``release`` for ``num_items`` heads; grid (1,).

    Every page of a head goes to the ring tail ``(state[0] + state[1]) % N`` at the head's exclusive prefix sum,
    in column order: high pages 0, 1, ..., then low page pages_low-1, ..., 0 (columns up to width-1). Cells become -1,
    refcounts and counts 0. ``max_high``/``max_low`` bound the pages per tier of any item (a scan of BLOCK_W
    columns at a time). Shapes as in :func:`reserve_kernel`; out: int64 [1] pages freed.
    """
    start = tl.load(state_ptr)
    free = tl.load(state_ptr + 1)
    tail = (start + free) % num_pages
    carry = tl.zeros([], tl.int64)
    for b in range(0, num_items, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        mask = offs < num_items
        item = tl.load(items_ptr + offs, mask=mask, other=0)
        p_hi = tl.load(counts_ptr + 2 * stride + item, mask=mask, other=0)
        p_lo = tl.load(counts_ptr + 3 * stride + item, mask=mask, other=0)
        count = p_hi + p_lo
        base = tail + carry + (tl.cumsum(count, 0) - count).to(tl.int64)  # [BLOCK] ring slot of each item's first
        row = item * width
        for w in range(0, max_high, BLOCK_W):
            i = w + tl.arange(0, BLOCK_W)
            take = mask[:, None] & (i[None, :] < p_hi[:, None])
            cell = table_ptr + row[:, None] + i[None, :]
            page = tl.load(cell, mask=take, other=0)
            tl.store(ring_ptr + (base[:, None] + i[None, :]) % num_pages, page, mask=take)
            tl.store(ref_ptr + page, 0, mask=take)
            tl.store(cell, -1, mask=take)
        for w in range(0, max_low, BLOCK_W):
            j = w + tl.arange(0, BLOCK_W)
            take = mask[:, None] & (j[None, :] < p_lo[:, None])
            cell = table_ptr + row[:, None] + (width - 1 - j[None, :])
            page = tl.load(cell, mask=take, other=0)
            rank = p_hi[:, None] + (p_lo[:, None] - 1 - j[None, :])
            tl.store(ring_ptr + (base[:, None] + rank) % num_pages, page, mask=take)
            tl.store(ref_ptr + page, 0, mask=take)
            tl.store(cell, -1, mask=take)
        zero = tl.zeros_like(p_hi)
        for f in tl.static_range(4):
            tl.store(counts_ptr + f * stride + item, zero, mask=mask)
        carry += tl.sum(count, 0).to(tl.int64)
    tl.store(state_ptr + 1, free + carry)
    tl.store(out_ptr, carry)

