"""Storage path (reference): tokens of (slot, layer, kv_head) items in their two tiers of pages.

Binds a :class:`~diffkv.memory.PagePool`, its :class:`~diffkv.memory.HeadTables` and the page plan, and offers
per-tier write / read / score operations over any set of items, addressed through the tables
(``tables.token_address``). Reads return dense, padded ``[K, M, ...]`` tensors plus a validity mask, so the
policy and the reference attention stay batched over items. The torch decode path keeps a
:class:`~diffkv.mirror.DenseMirror` of what the pages decode to (:meth:`PagedKV.dense_mirror`); any write other
than :meth:`PagedKV.store_decode` invalidates the mirror rows of the items it touches.
"""

from __future__ import annotations

import torch

from diffkv.config import DiffKVConfig
from diffkv.layout import PagePlan
from diffkv.memory import HIGH, LOW, HeadTables, PagePool
from diffkv.mirror import DenseMirror
from diffkv.ops.store import store_tokens
from diffkv.store import load_pages_ref, load_tokens_ref, store_tokens_ref

MIRROR_BUDGET_BYTES = 2 << 30
_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class PagedKV:
    """Token storage of every head in ``tables`` inside ``pool`` (tiers ``memory.HIGH`` = 0, ``memory.LOW`` = 1)."""

    def __init__(self, pool: PagePool, tables: HeadTables, plan: PagePlan, config: DiffKVConfig, *,
                 mirror_budget_bytes: int = MIRROR_BUDGET_BYTES):
        if pool.page_bytes != plan.page_bytes:
            raise ValueError(f"pool pages have {pool.page_bytes} B but the plan needs {plan.page_bytes} B")
        self.pool, self.tables, self.plan, self.config = pool, tables, plan, config
        low = config.low if config.two_tier else config.high
        self.layouts = {HIGH: plan.layout(config.high), LOW: plan.layout(low)}
        self.meta_dtype, self.raw_dtype = _DT[config.meta_dtype], _DT[config.raw_dtype]
        flat = pool.data.view(-1)
        # NOTE: page_bytes and score/pos offsets are multiples of 4, so fp32/int32 views address them exactly.
        self._f32 = flat.view(torch.float32) if flat.numel() % 4 == 0 else None
        self._i32 = flat.view(torch.int32) if flat.numel() % 4 == 0 else None
        self.mirror_budget_bytes, self.mirror = mirror_budget_bytes, None
        self.key_center: torch.Tensor | None = None  # [S*L*H, D] fp32 with config.center_keys (set at prefill)

    def set_key_center(self, items: torch.Tensor, center: torch.Tensor) -> None:
        """Record the constant subtracted from every key of these heads. items: int [K]; center: [K, D]."""
        if self.key_center is None:
            self.key_center = torch.zeros(self.tables.num_items, center.shape[-1], dtype=torch.float32,
                                          device=self.tables.device)
        self.key_center[items] = center.float()

    def centered_keys(self, items: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """keys [K, D] (head ``items[k]``) minus their heads' centers, in the keys' dtype."""
        if self.key_center is None:
            raise RuntimeError("config.center_keys is set but no key centers were recorded: prefill first")
        return keys - self.key_center[items].to(keys.dtype)

    def dense_mirror(self) -> DenseMirror | None:
        """The dense mirror of the torch decode path (created on first use); None when its budget is 0."""
        if self.mirror is None and self.mirror_budget_bytes > 0 and self._f32 is not None:
            self.mirror = DenseMirror(self, self.mirror_budget_bytes)
        return self.mirror

    def _field_index(self, tier: int, items, index, offset_attr: str, before_trim: bool = False) -> torch.Tensor:
        page, slot = self.tables.token_address(items, tier, index, before_trim=before_trim)
        lay = self.layouts[tier]
        return (page * lay.page_bytes + getattr(lay, offset_attr)) // 4 + slot

    def write(self, tier: int, items: torch.Tensor, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              scores: torch.Tensor, positions: torch.Tensor, *, before_trim: bool = False,
              validate: bool = False, return_stored: bool = False):
        """Quantize and store M tokens: token ``index[m]`` of ``tier`` of head ``items[m]``.

        items, index: int [M]; keys, values: [M, D]; scores: [M] fp32; positions: [M] int32.
        validate: check values and targets (costs a device sync); callers check finiteness once per layer.
        return_stored: return (keys, values) [M, D] fp32 exactly as the pages now decode them.
        """
        if self.mirror is not None:
            self.mirror.invalidate(items)
        page, slot = self.tables.token_address(items, tier, index, before_trim=before_trim)
        args = (self.pool.data, self.layouts[tier], keys, values, page, slot, scores.float(), positions.to(torch.int32))
        kw = dict(meta_dtype=self.meta_dtype, raw_dtype=self.raw_dtype, validate=validate)
        if self.pool.device.type == "cpu":  # the torch reference returns what it stored: no read-back
            return store_tokens_ref(*args, **kw, return_stored=return_stored)
        store_tokens(*args, **kw)
        return self.read_at(tier, items, index)[:2] if return_stored else None

    def _grid(self, count: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """valid [K, M] and the (row, index) of its True cells, for M = ``width`` slots per item."""
        valid = torch.arange(width, device=count.device)[None, :] < count[:, None]
        row, idx = valid.nonzero(as_tuple=True)
        return valid, row, idx

    def _page_ids(self, tier: int, items: torch.Tensor, n_pages: int) -> torch.Tensor:
        """int64 [K, n_pages]: the tier's pages of each item in token order; -1 (no page) reads as page 0."""
        col = torch.arange(n_pages, device=items.device)
        if tier == LOW:
            col = self.tables.width - 1 - col
        return self.tables.rows[items][:, col].clamp_min(0).long()

    def read(self, tier: int, items: torch.Tensor, count: torch.Tensor, width: int, dtype=torch.float32):
        """Dequantized tokens ``0 .. count-1`` of ``tier`` of each item, page by page.

        items, count: int [K]; width: max of ``count`` (host int). Returns keys, values [K, M, D] (exactly 0 where
        invalid), scores [K, M] fp32, positions [K, M] int32 and valid [K, M] bool, with M = ``ceil(width / N) * N``.
        """
        lay = self.layouts[tier]
        page_ids = self._page_ids(tier, items, -(-width // lay.tokens_per_page))
        keys, values, scores, pos = load_pages_ref(self.pool.data, lay, page_ids, dtype, count=count,
                                                   meta_dtype=self.meta_dtype, raw_dtype=self.raw_dtype)
        valid = torch.arange(keys.shape[1], device=items.device)[None, :] < count[:, None]
        return keys, values, scores, pos, valid

    def read_at(self, tier: int, items: torch.Tensor, index: torch.Tensor):
        """Token ``index[m]`` of ``tier`` of ``items[m]``: keys, values [M, D] fp32, scores [M], positions [M] int32."""
        page, slot = self.tables.token_address(items, tier, index)
        k, v, s, p = load_tokens_ref(self.pool.data, self.layouts[tier], page, slot, torch.float32,
                                     meta_dtype=self.meta_dtype, raw_dtype=self.raw_dtype, validate=False)
        return k, v, s, p.to(torch.int32)

    def read_meta(self, tier: int, items: torch.Tensor, count: torch.Tensor, width: int):
        """Scores [K, M] fp32 and positions [K, M] int64 of the first ``count`` tokens (0 elsewhere), valid [K, M]."""
        valid, row, idx = self._grid(count, width)
        scores = torch.zeros(items.numel(), width, dtype=torch.float32, device=items.device)
        pos = torch.zeros(items.numel(), width, dtype=torch.int64, device=items.device)
        if row.numel():
            scores[row, idx] = self._f32[self._field_index(tier, items[row], idx, "score_offset")]
            pos[row, idx] = self._i32[self._field_index(tier, items[row], idx, "pos_offset")].long()
        return scores, pos, valid

    def add_scores(self, tier: int, items: torch.Tensor, count: torch.Tensor, delta: torch.Tensor) -> None:
        """``score += delta`` for the first ``count`` tokens of each item. delta: [K, M] fp32 (M >= max count,
        token order as :meth:`read` returns it)."""
        if self.mirror is not None:
            self.mirror.invalidate(items)
        lay = self.layouts[tier]
        n = lay.tokens_per_page
        width = -(-delta.shape[1] // n) * n
        delta = torch.nn.functional.pad(delta, (0, width - delta.shape[1]))
        page_ids = self._page_ids(tier, items, width // n)  # [K, P]
        where = ((page_ids * lay.page_bytes + lay.score_offset) // 4)[:, :, None] + torch.arange(n, device=items.device)
        valid = torch.arange(width, device=items.device)[None, :] < count[:, None]
        # NOTE: only valid slots are touched: columns past a head's pages alias page 0, owned by someone else.
        where = where.view(len(items), width)[valid]
        self._f32[where] += delta[valid].float()

    # ---- the dense-mirror decode path (torch) ----
    def score_index(self, tier: int, items: torch.Tensor, width: int) -> torch.Tensor:
        """int64 [K, M]: flat fp32 pool index of the score of tokens ``0 .. M-1`` of ``tier`` of each item,
        M = ``width`` rounded up to whole pages (columns past a head's pages point into page 0: mask them)."""
        lay = self.layouts[tier]
        n = lay.tokens_per_page
        page_ids = self._page_ids(tier, items, -(-width // n))
        where = ((page_ids * lay.page_bytes + lay.score_offset) // 4)[:, :, None] + torch.arange(n, device=items.device)
        return where.view(len(items), -1)

    def write_scores(self, where: torch.Tensor, scores: torch.Tensor) -> None:
        """Pool fp32 at flat indices ``where`` [M] := ``scores`` [M] (addresses from the mirror)."""
        self._f32[where] = scores
