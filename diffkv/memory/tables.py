"""Per-(slot, layer, kv_head) page tables with two tiers growing from both ends (docs/design.md §4.2).

Row ``table[s, l, h]`` holds page ids: high-tier page i at column i (from the left), low-tier page j at column
``T - 1 - j`` (from the right); unused columns hold -1. A *head set* (:class:`HeadSet`) names the rows an
operation covers; heads are addressed by the flat id ``(slot * L + layer) * H + kv_head``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diffkv.core.tiers import Tier
from diffkv.memory.arena import Arena, full, resolve_device

# The tier axis of every per-tier table and array (``num_tokens``, ``num_pages``, ``tokens_per_page``, the two ends of
# a table row, ``PagedKV.layouts``): the stored tiers in this order. The ``tier`` argument of the memory and storage
# methods is a column of that axis, a plain int (it indexes tensors and reaches kernels and C calls as is), never a
# ``Tier`` label.
STORED_TIERS = (Tier.HIGH, Tier.LOW)
HIGH_COL, LOW_COL = STORED_TIERS.index(Tier.HIGH), STORED_TIERS.index(Tier.LOW)  # 0, 1


@dataclass(frozen=True, slots=True, eq=False)
class HeadSet:
    """A validated set of distinct heads, built by :meth:`HeadTables.select` / :meth:`HeadTables.select_items`.

    items: int64 [K] flat head ids ``(slot * L + layer) * H + kv_head`` on the tables' device, distinct.
    slots: the distinct slots of ``items``, in order of first appearance (host).
    slot_index: int64 [K] position in ``slots`` of each item's slot (device).
    count_index: int64 [4K] flat index into ``counts`` of (n_high, n_low, pages_high, pages_low) of every item.
    edge_cells: int64 [2, K] flat table cells of column 0 and column T-1 of each item's row.
    (All on the tables' device; the last two are precomputed so every op gathers in one call.)
    """

    items: torch.Tensor
    slots: tuple[int, ...]
    slot_index: torch.Tensor
    count_index: torch.Tensor
    edge_cells: torch.Tensor

    def __len__(self) -> int:
        return self.items.numel()


def head_set_bytes(heads: HeadSet) -> int:
    """Bytes of the index tensors of a head set."""
    return sum(t.nbytes for t in (heads.items, heads.slot_index, heads.count_index, heads.edge_cells))


class HeadTables:
    """Page tables, token counts and page counts of up to ``max_slots`` requests, all on ``device``.

    Parameters
    ----------
    tokens_per_page: (N_hi, N_lo) tokens of the high / low tier in one page
        (``PagePlan.layout(tier).tokens_per_page``).
    max_model_len: most tokens a head may hold; the table width is ``T = ceil(max_model_len / min(N)) + 2``.
    two_tier: False for a single-tier config (no low tier; ``N_lo`` is ignored).
    recent_window: B_buf of the decode policy, used by ``reserve`` to decide which heads may demote (None: all).

    Attributes
    ----------
    table: int32 [S, L, H, T] page ids, -1 where unused.
    counts: int32 [4, S, L, H] (n_high, n_low, pages_high, pages_low) per head (one contiguous vector per
        field, so the ops gather all four in one call and work on contiguous vectors), with the views
    num_tokens: int32 [S, L, H, 2] (n_high, n_low) tokens stored per head; the caller (policy / storage path)
        sets them, e.g. ``tables.num_tokens[s, l] = ...`` (a view: writes go to ``counts``).
    num_pages: int32 [S, L, H, 2] (pages_high, pages_low) owned per head; only the memory ops change them.
    """

    def __init__(self, max_slots: int, num_layers: int, num_kv_heads: int, tokens_per_page: tuple[int, int],
                 max_model_len: int, *, two_tier: bool = True, recent_window: int | None = None,
                 device: str | torch.device = "cpu", arena: Arena | None = None):
        for name, v in (("max_slots", max_slots), ("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("max_model_len", max_model_len)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        n_hi, n_lo = tokens_per_page if two_tier else (tokens_per_page[0], tokens_per_page[0])
        if min(n_hi, n_lo) < 1:
            raise ValueError(f"tokens_per_page must be positive, got {tokens_per_page}")
        self.shape = (max_slots, num_layers, num_kv_heads)
        self.num_items = max_slots * num_layers * num_kv_heads
        self.tokens_per_page_hl = (n_hi, n_lo)
        self.two_tier, self.recent_window, self.max_model_len = two_tier, recent_window, max_model_len
        self.width = math.ceil(max_model_len / min(n_hi, n_lo)) + 2
        self.device = resolve_device(device) if arena is None else arena.buffer.device
        # page ids and counts: in a host's buffer when ``arena`` is given
        # NOTE: one scratch cell past the last row: masked table writes of the torch ops land there.
        self._table_buf = full(arena, (self.num_items * self.width + 1,), -1, torch.int32, self.device)
        self.table = self._table_buf[:-1].view(*self.shape, self.width)
        # NOTE: one gather of `counts` serves every op; a table cell is -1 unless it holds an owned page, so the
        # pages of a row are its cells >= 0 in column order (release relies on this).
        self.counts = full(arena, (4, *self.shape), 0, torch.int32, self.device)
        self.num_tokens, self.num_pages = self.counts[:2].permute(1, 2, 3, 0), self.counts[2:].permute(1, 2, 3, 0)
        self.tokens_per_page = torch.tensor([n_hi, n_lo], dtype=torch.int32, device=self.device)
        self._column_step = torch.tensor([[1], [-1]], dtype=torch.int32, device=self.device)  # high right, low left
        self._free_slots: deque[int] = deque(range(max_slots))
        self._active: set[int] = set()

    @classmethod
    def for_config(cls, config, plan, max_slots: int, num_layers: int, num_kv_heads: int, max_model_len: int,
                   device: str | torch.device = "cpu", arena: Arena | None = None) -> HeadTables:
        """Tables for a :class:`DiffKVConfig` and its :class:`PagePlan` (``layout.plan_for_config``); with ``arena``
        the page ids and counts are views of its buffer (``device="meta"`` sizes them without memory)."""
        n_hi = plan.layout(config.high).tokens_per_page
        n_lo = plan.layout(config.low).tokens_per_page if config.two_tier else n_hi
        return cls(max_slots, num_layers, num_kv_heads, (n_hi, n_lo), max_model_len, two_tier=config.two_tier,
                   recent_window=config.recent_window, device=device, arena=arena)

    def worst_pages(self, num_tokens):
        """Most pages one head takes for a prompt of ``num_tokens`` tokens (int, or an int64 tensor of counts):
        every token in the tier with the fewest tokens per page, plus one page of the other tier. ``allocate``
        reserves this without exact pages; the store's and the engine's admission bounds are built on it."""
        return -(-num_tokens // min(self.tokens_per_page_hl)) + int(self.two_tier)

    def arena_tensors(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of the tensors an arena holds for these tables (:meth:`Arena.bytes_for`)."""
        return [(tuple(t.shape), t.dtype) for t in (self._table_buf, self.counts)]

    def nbytes(self) -> int:
        """Bytes of every tensor the tables own (page ids, counts, and two tiny constants)."""
        return sum(t.nbytes for t in (self._table_buf, self.counts, self.tokens_per_page, self._column_step))

    # flat views: rows [S*L*H, T]; counts [4, S*L*H]; (tokens, pages) [S*L*H, 2] (strided views)
    @property
    def rows(self) -> torch.Tensor:
        return self._table_buf[:-1].view(self.num_items, self.width)

    @property
    def counts_flat(self) -> torch.Tensor:
        return self.counts.view(4, self.num_items)

    @property
    def tokens_flat(self) -> torch.Tensor:
        return self.counts_flat[:2].t()

    @property
    def pages_flat(self) -> torch.Tensor:
        return self.counts_flat[2:].t()

    # ---- slots (host side, as the original's CPU deque of free slots) ----
    @property
    def active_slots(self) -> frozenset[int]:
        return frozenset(self._active)

    def free_slots(self) -> int:
        """How many slots :meth:`acquire_slot` can still hand out."""
        return len(self._free_slots)

    def acquire_slot(self) -> int:
        """A free slot for a new request (its heads are empty)."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.shape[0]} slots are in use; release a request or raise max_slots")
        s = self._free_slots.popleft()
        self._active.add(s)
        return s

    def check_active(self, slots: Sequence[int]) -> None:
        bad = [s for s in slots if s not in self._active]
        if bad:
            raise ValueError(f"slots {bad} are not active (never acquired, or already released); "
                             f"active slots: {sorted(self._active)}")

    def retire_slots(self, slots: Sequence[int]) -> None:
        """Return released slots to the free list. Call only after ``release`` emptied their heads."""
        self.check_active(slots)
        for s in slots:
            self._active.remove(s)
            self._free_slots.append(s)

    # ---- head sets ----
    def select(self, slots: Sequence[int] | int, layers: Sequence[int] | int | None = None,
               heads: Sequence[int] | int | None = None) -> HeadSet:
        """All (slot, layer, head) combinations, slot-major: e.g. ``select(slots)`` for an engine step (every layer)
        or ``select(slots, layers=[l])`` for one layer of the HF cache. Every slot must be active."""
        s, ly, h = (self._index_list(v, n, name) for v, n, name in ((slots, self.shape[0], "slots"),
                    (layers, self.shape[1], "layers"), (heads, self.shape[2], "heads")))
        self.check_active(s)
        s_t, l_t, h_t = (torch.tensor(v, dtype=torch.int64) for v in (s, ly, h))
        items = (s_t[:, None, None] * self.shape[1] + l_t[None, :, None]) * self.shape[2] + h_t[None, None, :]
        slot_index = torch.arange(len(s)).repeat_interleave(len(ly) * len(h))
        return self._head_set(items.reshape(-1), tuple(s), slot_index)

    def select_items(self, slot: torch.Tensor, layer: torch.Tensor, head: torch.Tensor) -> HeadSet:
        """Any set of distinct heads, given as int [K] index tensors (copied to the host once to validate)."""
        s, ly, h = (torch.as_tensor(x).to("cpu", torch.int64).reshape(-1) for x in (slot, layer, head))
        if not (s.shape == ly.shape == h.shape):
            raise ValueError(f"slot, layer and head need one shape, got {tuple(s.shape)}, {tuple(ly.shape)}, "
                             f"{tuple(h.shape)}")
        for v, n, name in ((s, self.shape[0], "slot"), (ly, self.shape[1], "layer"), (h, self.shape[2], "head")):
            if v.numel() and (v.min() < 0 or v.max() >= n):
                raise IndexError(f"{name} index out of range [0, {n}): min {int(v.min())}, max {int(v.max())}")
        items = (s * self.shape[1] + ly) * self.shape[2] + h
        if items.unique().numel() != items.numel():
            raise ValueError("select_items got the same (slot, layer, head) twice; each head may appear once")
        slots = tuple(dict.fromkeys(s.tolist()))
        self.check_active(slots)
        pos = {v: i for i, v in enumerate(slots)}
        slot_index = torch.tensor([pos[v] for v in s.tolist()], dtype=torch.int64)
        return self._head_set(items, slots, slot_index)

    def _head_set(self, items: torch.Tensor, slots: tuple[int, ...], slot_index: torch.Tensor) -> HeadSet:
        """items, slot_index: int64 [K] on the host."""
        fields = items + torch.arange(4)[:, None] * self.num_items
        edges = torch.stack([items * self.width, items * self.width + self.width - 1])
        items_d, index_d, fields_d, edges_d = (x.to(self.device) for x in (items, slot_index, fields.view(-1), edges))
        return HeadSet(items_d, slots, index_d, fields_d, edges_d)

    @staticmethod
    def _index_list(v, n: int, name: str) -> list[int]:
        out = list(range(n)) if v is None else [int(v)] if isinstance(v, int) else [int(x) for x in v]
        if any(x < 0 or x >= n for x in out):
            raise IndexError(f"{name} {out} out of range [0, {n})")
        if len(set(out)) != len(out):
            raise ValueError(f"{name} {out} has duplicates; each may appear once")
        return out

    # ---- token addressing for the storage / attention path ----
    def token_address(self, items: torch.Tensor, tier: int | torch.Tensor, index: torch.Tensor,
                      *, before_trim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Page id and in-page slot of token ``index`` of ``tier`` of head ``items`` (vectorized, no checks).

        items: int64 [M] flat head ids; tier: HIGH_COL (0) / LOW_COL (1) or int [M]; index: int [M] token index within
        the tier. High token i -> ``table[.., i // N_hi]``, slot ``i % N_hi``; low token j ->
        ``table[.., T - 1 - j // N_lo]``, slot ``j % N_lo``. ``before_trim=True`` addresses low tokens of a head
        fresh from ``allocate`` (pages right after the high ones, column ``ceil(n_high / N_hi) + j // N_lo`` with
        the head's current n_high: set ``num_tokens`` first); ``trim`` moves exactly those page ids to the right
        end, so data written either way stays put.
        NOTE: ``index`` must be below the tier's page capacity (``pages * N``); nothing checks it here.
        Returns (page int64 [M], slot int64 [M]).
        """
        items, index = items.to(torch.int64), index.to(torch.int64)
        tier = torch.as_tensor(tier, device=items.device).to(torch.int64).expand_as(index)
        tpp = self.tokens_per_page.to(torch.int64)[tier]
        page_col = index // tpp
        if before_trim:
            n_hi, per_page = self.counts_flat[0].index_select(0, items).to(torch.int64), self.tokens_per_page_hl[0]
            low_col = (n_hi + per_page - 1) // per_page + page_col
        else:
            low_col = self.width - 1 - page_col
        col = torch.where(tier == HIGH_COL, page_col, low_col)
        return self.rows[items, col].to(torch.int64), index % tpp

    def __repr__(self) -> str:
        return (f"HeadTables(slots={self.shape[0]}, layers={self.shape[1]}, kv_heads={self.shape[2]}, "
                f"width={self.width}, tokens_per_page={self.tokens_per_page_hl}, two_tier={self.two_tier})")
