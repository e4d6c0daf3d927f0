"""The page pool: one byte tensor of equal-sized pages and a ring free list, all on one device (docs/design.md §4.1).

The ring holds page ids; the free ones are ``ring[(start + i) % num_pages]`` for ``i < free_count``, so pages taken
leave from ``start`` and pages given back are written after the tail, ``(start + free_count) % num_pages``. Unlike
the original's closed interval ``[start, end]`` the free count is explicit, so "empty" and "full" differ.
``start``, ``free_count`` and a ``refused`` counter are one int64 tensor ``state`` on the device: no operation
reads them back unless asked to (see :meth:`PagePool.free_pages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffkv.memory.arena import resolve_device

_STATE_FIELDS = ("start", "free", "refused")


class PoolExhausted(RuntimeError):
    """An operation needed more free pages than the pool had; nothing was changed."""

    def __init__(self, op: str, needed: int, free: int):
        self.op, self.needed, self.free = op, needed, free
        super().__init__(
            f"{op} needs {needed} pages but only {free} are free (nothing was changed); release or preempt "
            "requests, admit fewer, or give the pool a larger byte budget"
        )


@dataclass(slots=True)
class OpResult:
    """What one memory operation did.

    op: "allocate" | "trim" | "reserve" | "release".
    pages: pages taken from the ring (allocate, reserve) or given back to it (trim, release); an int after a
        synced call, a 0-d int64 device tensor after ``sync=False`` (0 if the device refused the operation).
    heads: number of (slot, layer, kv_head) items the operation covered.
    """

    op: str
    pages: int | torch.Tensor
    heads: int


class PagePool:
    """``num_pages`` pages of ``page_bytes`` bytes, a ring free list of their ids and their reference counts.

    Parameters
    ----------
    page_bytes: bytes per page (``diffkv.core.layout.plan_for_config(...).page_bytes``).
    num_pages: pages in the pool; or give ``budget_bytes`` and get ``budget_bytes // page_bytes`` pages.
    device: where the pages and all bookkeeping live (CPU or CUDA).
    allocate_data: False skips the byte tensor (bookkeeping-only pools for tests and benchmarks).

    Attributes
    ----------
    data: uint8 [num_pages, page_bytes] the page bytes (empty [0, page_bytes] without ``allocate_data``).
    ring: int32 [num_pages] page ids; the free region is ``ring[(start + i) % num_pages], i < free``.
    refcount: int32 [num_pages] how many table cells hold the page (1 for a head's own page, more for a page shared
        by :mod:`diffkv.memory.sharing`), 0 for a free page.
    state: int64 [3] (start, free, refused) on the device; ``refused`` counts ``sync=False`` operations the
        device turned down (they changed nothing).
    """

    BYTES_PER_PAGE = 8  # a ring entry and a refcount (int32 each), besides the page itself
    FIXED_BYTES = 8 + 3 * 8 + 2 * 8  # scratch ring and refcount entries, state, step constants

    def __init__(self, page_bytes: int, num_pages: int | None = None, *, budget_bytes: int | None = None,
                 device: str | torch.device = "cpu", allocate_data: bool = True):
        if not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
        if (num_pages is None) == (budget_bytes is None):
            raise ValueError("give exactly one of num_pages or budget_bytes")
        if num_pages is None:
            num_pages = int(budget_bytes) // page_bytes
        if num_pages < 1 or num_pages >= 2**30:  # NOTE: ring positions (< 2 * num_pages) are computed in int32
            raise ValueError(f"the pool needs 1 <= num_pages < 2**30, got {num_pages} pages of {page_bytes} B; "
                             "raise the byte budget or use smaller pages")
        self.page_bytes, self.num_pages = page_bytes, num_pages
        self.device = resolve_device(device)
        rows = num_pages if allocate_data else 0
        self.data = torch.empty((rows, page_bytes), dtype=torch.uint8, device=self.device)
        # NOTE: one scratch entry past the end of ring and refcount: masked writes of the torch ops go there
        # (index num_pages) instead of using data-dependent shapes, which would cost a device sync.
        self._ring_buf = torch.arange(num_pages + 1, dtype=torch.int32, device=self.device)
        self._ref_buf = torch.zeros(num_pages + 1, dtype=torch.int32, device=self.device)
        self.ring = self._ring_buf[:num_pages]
        self.refcount = self._ref_buf[:num_pages]
        self.state = torch.tensor([0, num_pages, 0], dtype=torch.int64, device=self.device)
        self._step = torch.tensor([1, -1], dtype=torch.int64, device=self.device)  # (start, free) per page taken
        self.host_reads = 0
        self.borrowed = False  # True: ``data`` is a view of memory another owner allocated (see :meth:`over`)

    @classmethod
    def over(cls, buffer: torch.Tensor, page_bytes: int) -> PagePool:
        """A pool whose pages are the bytes of ``buffer`` (any dtype and shape, contiguous; e.g. the KV memory a
        serving framework granted), ``buffer.nbytes // page_bytes`` pages of it; the tail is unused. The pool does
        not own the memory and cannot :meth:`grow`."""
        if not buffer.is_contiguous():
            raise ValueError("PagePool.over needs a contiguous buffer")
        flat = buffer.view(-1).view(torch.uint8)
        if flat.numel() < page_bytes:
            raise ValueError(f"a buffer of {flat.numel()} bytes holds no {page_bytes}-byte page")
        pool = cls(page_bytes, flat.numel() // page_bytes, device=buffer.device, allocate_data=False)
        pool.data = flat[:pool.num_pages * page_bytes].view(pool.num_pages, page_bytes)
        pool.borrowed = True
        return pool

    @property
    def start(self) -> torch.Tensor:
        """0-d int64 view: ring index of the first free page."""
        return self.state[0]

    @property
    def free_count(self) -> torch.Tensor:
        """0-d int64 view: number of free pages (device-side, no sync)."""
        return self.state[1]

    @property
    def tail(self) -> torch.Tensor:
        """0-d int64: ring index where the next page given back goes."""
        return (self.state[0] + self.state[1]) % self.num_pages

    def read(self, t: torch.Tensor) -> list:
        """The one place device values come to the host (counted in ``host_reads``). t: any small tensor."""
        self.host_reads += 1
        return t.tolist()

    def free_pages(self) -> int:
        """Free pages now: one device->host read. An engine reads it once per step to admit or preempt."""
        return int(self.read(self.state[1]))

    def status(self) -> dict[str, int]:
        """``{"start", "free", "refused"}`` in one device->host read."""
        return dict(zip(_STATE_FIELDS, self.read(self.state), strict=True))

    def take_pages(self, n: int, op: str = "take_pages") -> torch.Tensor:
        """Take ``n`` pages off the free ring for an owner outside the head tables (e.g. the engine's sliding-window
        blocks): int64 [n] page ids, from ``start`` on, each with refcount 1. One device->host read.

        Raises ValueError (``n`` not a non-negative int) or :class:`PoolExhausted` (fewer than ``n`` pages free;
        ``op`` names the operation in its message) before changing anything, so the pool is as before.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"take_pages needs a non-negative int, got {n!r}")
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        start, free = self.read(self.state[:2])
        if n > free:
            raise PoolExhausted(op, n, free)
        ids = self.ring[(start + torch.arange(n, device=self.device)) % self.num_pages].long()
        self.refcount[ids] = 1
        self._take(n)
        return ids

    def give_pages(self, ids: torch.Tensor) -> None:
        """Give back pages that :meth:`take_pages` handed out: ``ids`` int [n] (any integer dtype, on the pool's
        device) are written after the ring's tail in this order and their refcount becomes 0. No device read.

        Raises ValueError, nothing changed, when ``ids`` is not a 1-d integer tensor on the pool's device or holds
        more ids than the pool has pages. That the ids are distinct pages the caller owns is not checked (it would
        cost a device read): giving back a free page breaks conservation, which :meth:`check_invariants` reports.
        """
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"give_pages needs a 1-d integer tensor of page ids, got {ids.dtype} {tuple(ids.shape)}")
        if ids.device != self.ring.device:
            raise ValueError(f"give_pages: ids are on {ids.device}, the pool on {self.ring.device}")
        n = ids.numel()
        if n > self.num_pages:
            raise ValueError(f"give_pages: {n} ids for a pool of {self.num_pages} pages")
        if n:
            self.ring[(self.tail + torch.arange(n, device=self.device)) % self.num_pages] = ids.int()
            self.refcount[ids.long()] = 0
            self._give(n)

    def _take(self, n: torch.Tensor | int, refused: torch.Tensor | None = None) -> None:
        """Ring slots ``[start, start + n)`` were handed out. n: 0-d int64 (or int); refused: 0-d bool or None."""
        self.state[:2].add_(self._step * n)
        self.state[:1].remainder_(self.num_pages)
        if refused is not None:
            self.state[2:].add_(refused)

    def _give(self, n: torch.Tensor | int, refused: torch.Tensor | None = None) -> None:
        """n pages were written at the tail. n: 0-d int64 (or int); refused: 0-d bool or None."""
        self.state[1:2].add_(n)
        if refused is not None:
            self.state[2:].add_(refused)

    def nbytes(self) -> int:
        """Bytes of every tensor the pool owns: the pages, the ring, the refcounts and the state."""
        return sum(t.nbytes for t in (self.data, self._ring_buf, self._ref_buf, self.state, self._step))

    def grow(self, num_pages: int) -> None:
        """Enlarge the pool to ``num_pages`` pages (one host read). The new pages join the free region after the
        free pages already there; page ids, owned pages and their bytes are unchanged (the bytes are copied into
        a new tensor, so both exist for a moment). Used by caches that size their pool to what they hold."""
        old = self.num_pages
        if self.borrowed:
            raise ValueError("this pool's pages live in a borrowed buffer (PagePool.over); it cannot grow")
        if not old < num_pages < 2**30:
            raise ValueError(f"grow needs {old} < num_pages < 2**30, got {num_pages}")
        start, free = (int(x) for x in self.read(self.state[:2]))
        ring = torch.full((num_pages + 1,), -1, dtype=torch.int32, device=self.device)
        ring[:free] = self._ring_buf[(start + torch.arange(free, device=self.device)) % old]
        ring[free:free + num_pages - old] = torch.arange(old, num_pages, dtype=torch.int32, device=self.device)
        ring[num_pages] = num_pages  # the scratch entry
        ref = torch.zeros(num_pages + 1, dtype=torch.int32, device=self.device)
        ref[:old] = self._ref_buf[:old]
        if self.data.shape[0]:
            data = torch.empty((num_pages, self.page_bytes), dtype=torch.uint8, device=self.device)
            data[:old] = self.data
            self.data = data
        self._ring_buf, self._ref_buf = ring, ref
        self.ring, self.refcount = ring[:num_pages], ref[:num_pages]
        self.state[0], self.state[1] = 0, free + num_pages - old
        self.num_pages = num_pages

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of every bookkeeping tensor (scratch entries included), for bit-identity tests."""
        return {"ring": self._ring_buf.clone(), "refcount": self._ref_buf.clone(), "state": self.state.clone()}

    def check_invariants(self, *tables) -> None:
        """Debug check (host copies; tests only): conservation and no aliasing over these ``HeadTables``.

        Every page is either in the free region exactly once or held by table cells only (one (slot, layer, head,
        tier) position, or several when shared, :mod:`diffkv.memory.sharing`); a page's refcount is the number of
        cells holding it; unused table cells are -1; token counts fit the pages;
        inactive slots own nothing. Raises AssertionError naming the first violation.
        """
        n = self.num_pages
        start, free, refused = self.state.tolist()
        _expect(0 <= start < n and 0 <= free <= n and refused >= 0, f"bad ring state start={start} free={free}")
        ring = self.ring.cpu().long()
        free_ids = ring[(start + torch.arange(free)) % n]
        owned = [free_ids.new_empty(0)]
        for t in tables:
            rows, pages, tokens = t.rows.cpu().long(), t.pages_flat.cpu().long(), t.tokens_flat.cpu().long()
            col = torch.arange(t.width)[None, :]
            ph, pl = pages[:, 0:1], pages[:, 1:2]
            _expect(bool((pages >= 0).all() and (pages.sum(1) <= t.width).all()), "page counts out of [0, T]")
            mask = (col < ph) | (col >= t.width - pl)
            _expect(bool((rows[~mask] == -1).all()), "a table cell outside the owned columns is not -1")
            owned.append(rows[mask])
            _expect(bool((tokens >= 0).all()), "negative token count")
            _expect(bool((tokens <= pages * t.tokens_per_page.cpu().long()).all()), "token count exceeds its pages")
            if not t.two_tier:
                _expect(bool((pages[:, 1] == 0).all() and (tokens[:, 1] == 0).all()), "low tier in a one-tier table")
            idle = torch.ones(t.shape[0], dtype=torch.bool)
            idle[list(t.active_slots)] = False
            per_slot = (pages.abs() + tokens.abs()).reshape(t.shape[0], -1).sum(1)
            _expect(bool((per_slot[idle] == 0).all()), "an inactive slot still owns pages or tokens")
        owned_ids = torch.cat(owned)
        every = torch.cat([free_ids, owned_ids])
        _expect(bool(((every >= 0) & (every < n)).all()), "a page id out of range [0, num_pages)")
        in_ring = torch.bincount(free_ids, minlength=n)
        held = torch.bincount(owned_ids, minlength=n)
        wrong = torch.nonzero(((in_ring == 1) & (held == 0)) == ((in_ring == 0) & (held >= 1))).view(-1)[:8].tolist()
        _expect(not wrong, f"pages neither free exactly once nor held by table cells only: {wrong}")
        _expect(bool((self.refcount.cpu() == held.to(torch.int32)).all()), "refcount differs from the cells holding")

    def __repr__(self) -> str:
        return f"PagePool(num_pages={self.num_pages}, page_bytes={self.page_bytes}, device={self.device})"


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(f"memory invariant violated: {message}")
