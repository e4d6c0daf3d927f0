"""What hosts may know of a store's pool and tables (issue #61: hosts reach pages and slots only through
``KVStore``): counts of pages and slots, the page arithmetic, and the pages a host takes for an owner outside the
head tables (a staged prompt, sliding-window blocks). Mixed into :class:`~diffkv.cache.kv_store.KVStore`, which
provides ``kv`` (its ``PagedKV``)."""

from __future__ import annotations

import torch


class StorePages:
    """Read-only views of the pool and tables, and the pool's take/give for owners outside the tables."""

    @property
    def device(self) -> torch.device:
        return self.kv.tables.device

    @property
    def page_bytes(self) -> int:
        return self.kv.pool.page_bytes

    @property
    def num_pages(self) -> int:
        """Pages in the pool now (a growing pool adds pages as it needs them)."""
        return self.kv.pool.num_pages

    def free_pages(self) -> int:
        """Free pages now: one device->host read (counted in the pool's ``host_reads``)."""
        return self.kv.pool.free_pages()

    def take_pages(self, n: int, op: str) -> torch.Tensor:
        """``n`` pages for an owner outside the head tables (``PagePool.take_pages``; PoolExhausted, nothing taken,
        when fewer are free). int64 [n]."""
        return self.kv.pool.take_pages(n, op)

    def give_pages(self, ids: torch.Tensor) -> None:
        """Give back pages :meth:`take_pages` handed out."""
        self.kv.pool.give_pages(ids)

    @property
    def max_slots(self) -> int:
        return self.kv.tables.shape[0]

    def free_slots(self) -> int:
        return self.kv.tables.free_slots()

    @property
    def tokens_per_page(self) -> tuple[int, int]:
        """Tokens of one KV head a page holds in the high and in the low tier."""
        return self.kv.tables.tokens_per_page_hl

    def pages_of(self, slots: list[int]) -> int:
        """Pages the sequences of ``slots`` hold (every layer and head)."""
        return int(self.kv.tables.num_pages[slots].long().sum()) if slots else 0

    def tier_tokens(self, slots: list[int], layers: list[int]) -> torch.Tensor:
        """int64 [len(layers), H, 2]: tokens per (table layer, head, tier) summed over ``slots``."""
        tables = self.kv.tables
        index = torch.tensor(slots, device=tables.device)
        return tables.num_tokens[index][:, torch.tensor(layers, device=tables.device)].long().sum(0)

    def table_bytes(self) -> int:
        return self.kv.tables.nbytes()

    def key_vector_bytes(self) -> int:
        """Bytes of the per-channel key center and scale (``smooth_keys`` / ``center_keys``; 0 without)."""
        return sum(t.nbytes for t in (self.kv.key_center, self.kv.key_scale) if t is not None)

    def shared_pool(self):
        """The ``PagePool`` itself, for a co-owner that keeps its own blocks in it (the engine's sliding-window
        layers, ``diffkv.engine.sliding``): take, give and write only the pages it took."""
        return self.kv.pool

    def head_tokens(self, items: torch.Tensor) -> torch.Tensor:
        """int64 [K, 2]: (n_high, n_low) of flat heads ``items``."""
        return self.kv.tables.tokens_flat[items].long()
