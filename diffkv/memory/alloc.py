"""allocate / trim / reserve / release over any set of heads (docs/design.md §4.3-4.7).

Each operation is one pass: demand per item -> exclusive prefix sum seeded with a ring pointer -> one scatter /
gather over all items at once; there is no Python loop over heads or pages. With ``sync=True`` (default) an
operation reads the device once, *before* changing anything, and raises if it cannot be done whole
(:class:`PoolExhausted`, ``ValueError``): the state is then bit-identical to before the call. With ``sync=False``
it makes no device->host read: the device checks the same conditions and a refused operation changes nothing
except ``pool.state[2]`` (refused), which an engine reads with the free count once per step.

reserve / release take ``backend``: "torch" (these ops, the reference), "triton" (one fused kernel launch,
``diffkv.memory.ring_launch``), "cpu" (one compiled C call on CPU, ``diffkv.memory.ring_cpu``; "c" is its old name) or
"auto" (the default: Triton on CUDA, the compiled call on CPU where it builds, else torch); the same words as the
decode backends (``diffkv.core.backends``). All leave bit-identical state.
"""

from __future__ import annotations

import torch

from diffkv.core import backends
from diffkv.memory.pool import OpResult, PagePool, PoolExhausted
from diffkv.memory.tables import HeadSet, HeadTables

ALIASES = {"c": "cpu"}  # the compiled pass's name before it matched the decode backends' "cpu"


def _ceil_div(a: torch.Tensor, b) -> torch.Tensor:
    return (a + b - 1) // b


def _items(pool: PagePool, tables: HeadTables, heads: HeadSet) -> torch.Tensor:
    if not isinstance(heads, HeadSet):
        raise TypeError("expected a HeadSet from tables.select(...) or tables.select_items(...), "
                        f"got {type(heads).__name__}")
    if pool.device != tables.device or heads.items.device != tables.device:
        raise ValueError(f"pool ({pool.device}), tables ({tables.device}) and heads ({heads.items.device}) "
                         "must live on one device")
    tables.check_active(heads.slots)  # NOTE: a released slot's HeadSet is refused here (double release).
    return heads.items


def resolve_backend(backend: str, pool: PagePool) -> str:
    """Which implementation runs reserve / release on ``pool``'s device: "torch" (the reference), "triton" or "cpu"
    (the compiled C pass, ``diffkv.memory.ring_cpu``); ``diffkv.core.backends.resolve_backend``, "c" meaning "cpu".
    """
    from diffkv.memory import ring_cpu

    return backends.resolve_backend(backend, pool.device, what="backend", compiled=ring_cpu, aliases=ALIASES)


def _refuse(op: str, code: int, needed: int, widest: int, width: int, free: int, max_model_len: int) -> None:
    if code == -2:
        raise ValueError(f"{op}: a head would need {widest} pages but tables are {width} wide; its tokens "
                         f"exceed max_model_len ({max_model_len}): stop or preempt that request")
    if code == -1:
        raise PoolExhausted(op, needed, free)


@torch.inference_mode()
def allocate(pool: PagePool, tables: HeadTables, heads: HeadSet, num_tokens, *, pages=None,
             sync: bool = True) -> OpResult:
    """Worst-case pages for a prefill of ``num_tokens`` prompt tokens (docs/design.md §4.4). Heads must be empty.

    Every head of slot s gets ``ceil(L_s / min(N_hi, N_lo)) + 1`` pages (no +1 with one tier), in columns
    ``0 ..`` of its row, taken contiguously from the ring in item order. Sets num_tokens = (L_s, 0) and
    num_pages = (pages, 0). The storage path writes high tokens in the first pages and low tokens right after
    them (``tables.token_address(..., before_trim=True)``), or calls :func:`trim` first.
    num_tokens: int for every slot, or int [len(heads.slots)] per slot (host sequence or tensor).
    pages: int [K] pages per head instead of the worst case, when the tier split is already known (e.g.
        ``ceil(n_high / N_hi) + ceil(n_low / N_lo)``: then :func:`trim` gives nothing back).
    """
    items = _items(pool, tables, heads)
    k, n, t = len(items), pool.num_pages, tables.width
    if k == 0:
        return OpResult("allocate", 0, 0)
    lengths = torch.as_tensor(num_tokens, dtype=torch.int64).to(pool.device)
    if lengths.dim() == 0:
        lengths = lengths.expand(k)
    elif lengths.shape == (len(heads.slots),):
        lengths = lengths.index_select(0, heads.slot_index)
    else:
        raise ValueError(f"num_tokens must be an int or one length per slot ({len(heads.slots)}), "
                         f"got shape {tuple(lengths.shape)}")
    if pages is None:
        demand = tables.worst_pages(lengths)  # int64 [K]
    else:
        demand = torch.as_tensor(pages).to(pool.device, torch.int64).reshape(-1)
        if demand.shape != (k,):
            raise ValueError(f"pages must give one count per head ({k}), got shape {tuple(demand.shape)}")
    old = tables.counts.view(-1).index_select(0, heads.count_index).view(4, k)  # int32 [4, K]
    bad = ((old != 0).any(0) | (lengths < 0) | (demand < 0)).sum()
    ends = demand.cumsum(0)
    need, widest, ok, refused = ends[-1], demand.amax(), None, None
    if sync:
        need_h, free_h, widest_h, bad_h = pool.read(torch.stack([need, pool.free_count, widest, bad]))
        if bad_h:
            raise ValueError(f"allocate: {bad_h} heads already hold pages or tokens (or got a negative length); "
                             "release them before allocating again")
        if widest_h > t:
            raise ValueError(f"allocate: a prompt needs {widest_h} pages per head but tables are {t} wide; "
                             f"raise max_model_len (now {tables.max_model_len})")
        if need_h > free_h:
            raise PoolExhausted("allocate", need_h, free_h)
        width, pages = widest_h, need_h
    else:
        ok = (need <= pool.free_count) & (bad == 0) & (widest <= t)
        refused, width = ~ok, t
        demand, ends, need = demand * ok, ends * ok, need * ok
        pages = need
    col = torch.arange(width, device=pool.device)  # [W]
    take = col < demand[:, None]  # [K, W]
    new = pool._ring_buf.take((pool.start + (ends - demand)[:, None] + col) % n)  # int32 [K, W]
    cells = torch.where(take, items[:, None] * t + col, tables.num_items * t)
    tables._table_buf.scatter_(0, cells.view(-1), new.view(-1))
    pool._ref_buf.index_fill_(0, torch.where(take, new.long(), n).view(-1), 1)
    zero = torch.zeros_like(lengths)
    counts = torch.stack([lengths, zero, demand, zero]).to(torch.int32)
    counts = counts if ok is None else torch.where(ok, counts, old)
    tables.counts.view(-1).index_copy_(0, heads.count_index, counts.view(-1))
    pool._take(need, refused)
    return OpResult("allocate", pages, k)


@torch.inference_mode()
def trim(pool: PagePool, tables: HeadTables, heads: HeadSet, num_high=None, num_low=None, *,
         sync: bool = True) -> OpResult:
    """After prefill: keep ``ceil(n_high/N_hi) + ceil(n_low/N_lo)`` pages per head, give the rest back
    (docs/design.md §4.5).

    Low pages (the ones right after the high pages) move to the right end, low page j to column T-1-j; the
    pages given back go to the ring tail, item by item, in column order.
    num_high, num_low: int [K] (n_high, n_low) per item to set now, or None to use ``tables.num_tokens``.
    The heads must come from :func:`allocate` untrimmed (no low pages) and fit their tokens in what they hold.
    """
    items = _items(pool, tables, heads)
    k, n, t = len(items), pool.num_pages, tables.width
    if k == 0:
        return OpResult("trim", 0, 0)
    old = tables.counts.view(-1).index_select(0, heads.count_index).view(4, k)  # int32 [4, K]
    tok = torch.stack([old[i] if v is None else torch.as_tensor(v).to(pool.device, torch.int32).expand(k)
                       for i, v in enumerate((num_high, num_low))])  # int32 [2, K]
    keep = _ceil_div(tok, tables.tokens_per_page[:, None])  # int32 [2, K] pages kept per tier
    rel = old[2] - keep[0] - keep[1]  # [K] pages given back
    bad = (old[3] != 0) | (rel < 0) | (tok < 0).any(0)
    if not tables.two_tier:
        bad |= tok[1] != 0
    ends = rel.cumsum(0)
    bad, total, ok, refused = bad.sum(), ends[-1], None, None
    if sync:
        bad_h, pages, w = pool.read(torch.stack([bad, total, old[2].amax().long()]))
        if bad_h:
            raise ValueError(f"trim: {bad_h} heads are already trimmed, hold more tokens than their pages, or got "
                             "a low-tier count with one tier; trim only right after allocate, within its pages")
    else:
        ok = bad == 0
        refused, rel, ends, total = ~ok, rel * ok, ends * ok, total * ok
        pages, w = total, t
    # NOTE: an untrimmed head's pages are in columns [0, w): work on that window and the w rightmost columns
    lw, rw = (t, 0) if 2 * w >= t else (w, w)
    left = tables.rows[:, :lw].index_select(0, items)  # int32 [K, lw]
    col = torch.arange(lw, device=pool.device)
    hk, lk = keep[0][:, None], keep[1][:, None]  # [K, 1]
    used = hk + lk
    freed = (col >= used) & (col < used + rel[:, None])  # [K, lw]
    pos = (pool.tail + (ends - rel)[:, None] + col - used) % n
    pool._ring_buf.scatter_(0, torch.where(freed, pos, n).view(-1), left.view(-1))
    pool._ref_buf.index_fill_(0, torch.where(freed, left.long(), n).view(-1), 0)
    # NOTE: low pages sit in columns [hk, hk + lk) (allocate + prefill); low page j goes to column T-1-j.
    cols = torch.cat([col, torch.arange(t - rw, t, device=pool.device)])  # table column of each window cell
    src = torch.where(cols < hk, cols, hk + (t - 1) - cols).clamp_(0, lw - 1)
    new = torch.where((cols < hk) | (cols >= t - lk), left.gather(1, src.long()), -1)  # int32 [K, lw + rw]
    counts = torch.cat([tok, keep]).to(torch.int32)
    if ok is not None:
        new = torch.where(ok, new, torch.cat([left, tables.rows[:, t - rw:].index_select(0, items)], 1))
        counts = torch.where(ok, counts, old)
    tables.rows[:, :lw].index_copy_(0, items, new[:, :lw])
    if rw:
        tables.rows[:, t - rw:].index_copy_(0, items, new[:, lw:])
    tables.counts.view(-1).index_copy_(0, heads.count_index, counts.view(-1))
    pool._give(total, refused)
    return OpResult("trim", pages, k)


def _demand(tables: HeadTables, c: torch.Tensor, may_demote: torch.Tensor | None) -> torch.Tensor:
    """c: int32 [4, K] counts -> bool [2, K] (high, low) demand (see :func:`reserve_demand`)."""
    full = c[:2] >= c[2:] * tables.tokens_per_page[:, None]
    if not tables.two_tier:
        full[1] = False
    elif may_demote is None:
        full[1].bitwise_and_(c[0] >= (tables.recent_window or 0))
    else:
        full[1].bitwise_and_(may_demote.to(full.device, torch.bool))
    return full


def reserve_demand(tables: HeadTables, heads: HeadSet, may_demote: torch.Tensor | None = None) -> torch.Tensor:
    """Pages each head needs before a decode step: int32 [K, 2] (high, low), 0 or 1 each.

    A tier needs a page when its pages are full (``n >= pages * N``, so also at 0 pages). The low tier only
    counts with two tiers and when the head may gain a low token this step, i.e. by demotion (case 3 of
    docs/algorithm.md §4.4), which needs a demotable high token. ``may_demote``: bool [K], or None for
    ``n_high >= recent_window`` (NOTE: the B_buf - 1 newest tokens are protected and always high, so fewer high
    tokens leave none to demote; the rule is one token conservative so either window convention is safe; all heads
    if recent_window is None).
    """
    c = tables.counts.view(-1).index_select(0, heads.count_index).view(4, len(heads))
    return _demand(tables, c, may_demote).t().int()


@torch.inference_mode()
def reserve(pool: PagePool, tables: HeadTables, heads: HeadSet, may_demote: torch.Tensor | None = None, *,
            sync: bool = True, backend: str = "auto") -> OpResult:
    """Before a decode step: at most one new page per head and tier that is full (docs/design.md §4.6, see
    :func:`reserve_demand`). A new high page goes to column ``pages_high``, a new low page to ``T-1-pages_low``.
    Ring order: every new high page (in item order), then every new low page. ``backend``: see the module
    docstring (all give bit-identical results). may_demote: bool [K] or None.
    """
    items = _items(pool, tables, heads)
    k, n, t = len(items), pool.num_pages, tables.width
    if k == 0:
        return OpResult("reserve", 0, 0)
    if may_demote is not None and tuple(may_demote.shape) != (k,):
        raise ValueError(f"may_demote must be bool [{k}] (one per head), got {tuple(may_demote.shape)}")
    engine = resolve_backend(backend, pool)
    if engine == "cpu":
        from diffkv.memory.ring_cpu import reserve_cpu

        code, (taken, needed, widest, free) = reserve_cpu(pool, tables, items, may_demote, count_refusal=not sync)
        if sync:  # the call's outputs reach the host (a plain read on CPU): the one read of this operation
            pool.host_reads += 1
            _refuse("reserve", code, needed, widest, t, free, tables.max_model_len)
        return OpResult("reserve", taken, k)
    triton = engine == "triton"
    if triton and not sync:
        from diffkv.memory.ring_launch import reserve_triton

        return OpResult("reserve", reserve_triton(pool, tables, items, may_demote), k)
    c = tables.counts.view(-1).index_select(0, heads.count_index).view(4, k)  # int32: n_hi, n_lo, p_hi, p_lo
    full = _demand(tables, c, may_demote)  # bool [2, K]
    flat = full.view(-1)  # tier-major
    need, widest, refused = flat.count_nonzero(), (c[2:] + full).sum(0).amax(), None
    if sync:
        need_h, free_h, widest_h = pool.read(torch.stack([need, pool.free_count, widest]))
        _refuse("reserve", -2 if widest_h > t else -1 if need_h > free_h else 0, need_h, widest_h, t, free_h,
                tables.max_model_len)
        if triton:
            from diffkv.memory.ring_launch import reserve_triton

            reserve_triton(pool, tables, items, may_demote)
            return OpResult("reserve", need_h, k)
        pages = need_h
    else:
        ok = (need <= pool.free_count) & (widest <= t)
        refused, flat, need = ~ok, flat & ok, need * ok
        full, pages = flat.view(2, k), need
    # ring slot of each page taken; -1 + wrap where nothing is taken (then it is never used)
    pos = flat.cumsum(0, dtype=torch.int32).add_(pool.start - 1).remainder_(n)  # int32 [2K]
    new = pool._ring_buf.index_select(0, pos)  # int32 [2K]
    trash = tables.num_items * t
    cells = (heads.edge_cells + c[2:] * tables._column_step).sub_(trash).mul_(full).add_(trash)  # int64 [2, K]
    tables._table_buf.scatter_(0, cells.view(-1), new)
    pool._ref_buf.index_fill_(0, new.long().sub_(n).mul_(flat).add_(n), 1)
    c[2:].add_(full)
    tables.counts.view(-1).index_copy_(0, heads.count_index[2 * k:], c[2:].reshape(-1))
    pool._take(need, refused)
    return OpResult("reserve", pages, k)


@torch.inference_mode()
def release(pool: PagePool, tables: HeadTables, heads: HeadSet, *, sync: bool = True,
            backend: str = "auto") -> OpResult:
    """Give back every page of these heads (request finished or preempted; docs/design.md §4.7) and zero their counts.

    Pages go to the ring tail item by item, each head's in column order: high pages 0, 1, ..., then low pages
    from the last (column T - pages_low) to low page 0 (column T-1). ``sync=True`` reads the device once (how
    wide the owned columns are, and on CPU where the tail is), ``sync=False`` scans whole rows.
    """
    items = _items(pool, tables, heads)
    k, n, t = len(items), pool.num_pages, tables.width
    if k == 0:
        return OpResult("release", 0, 0)
    engine = resolve_backend(backend, pool)
    if engine == "cpu":
        from diffkv.memory.ring_cpu import release_cpu

        if sync:
            pool.host_reads += 1  # the C call returns its count to the host: the one read of this operation
        return OpResult("release", release_cpu(pool, tables, items), k)
    if sync:
        pg = tables.counts.view(-1).index_select(0, heads.count_index[2 * k:]).view(2, k)  # int32 (p_hi, p_lo)
        w_hi, w_lo, pages, start, free = pool.read(torch.cat([pg.amax(1).long(), pg.sum().view(1), pool.state[:2]]))
        tail = (start + free) % n
    else:
        w_hi = w_lo = t
    if engine == "triton":
        from diffkv.memory.ring_launch import release_triton

        freed = release_triton(pool, tables, items, w_hi, w_lo)
        return OpResult("release", pages if sync else freed, k)
    if w_hi + w_lo >= t:
        w_hi, w_lo = t, 0
    # NOTE: unused cells are -1, so a head's pages are exactly its cells >= 0 in these column windows.
    parts = [tables.rows[:, :w_hi]] + ([tables.rows[:, t - w_lo:]] if w_lo else [])
    win = torch.cat([p.index_select(0, items) for p in parts], 1)  # int32 [K, W], column order
    owned = win >= 0
    if sync and pool.device.type == "cpu":  # host knows the tail: the ring write is one or two slice copies
        ids = torch.masked_select(win, owned)  # [P]
        head = min(pages, n - tail)
        pool.ring[tail:tail + head] = ids[:head]
        pool.ring[:pages - head] = ids[head:]
        pool._ref_buf.index_fill_(0, ids.long(), 0)
    else:
        flat, ids = owned.view(-1), win.view(-1)
        rank = flat.cumsum(0)
        pool._ring_buf.scatter_(0, torch.where(flat, (pool.tail + rank - 1) % n, n), ids)
        pool._ref_buf.index_fill_(0, torch.where(flat, ids.long(), n), 0)
        pages = pages if sync else rank[-1]
    for p in parts:
        p.index_fill_(0, items, -1)
    tables.counts.view(-1).index_fill_(0, heads.count_index, 0)
    pool._give(pages)
    return OpResult("release", pages, k)


def release_slots(pool: PagePool, tables: HeadTables, slots, *, sync: bool = True, backend: str = "auto") -> OpResult:
    """Release every head of these requests and return their slots (a second release is a ValueError)."""
    heads = tables.select(slots)
    result = release(pool, tables, heads, sync=sync, backend=backend)
    tables.retire_slots(heads.slots)
    return result
