"""Storage path (reference): tokens of (slot, layer, kv_head) items in their two tiers of pages.

Binds a :class:`~diffkv.memory.PagePool`, its :class:`~diffkv.memory.HeadTables` and the page plan, and offers
per-tier write / read / score operations over any set of items, addressed through the tables
(``tables.token_address``). Reads return dense, padded ``[K, M, ...]`` tensors plus a validity mask, so the
policy and the reference attention stay batched over items; they are temporaries of one call (the decode backends
in ``diffkv.ops.decode_step`` read the pages, nothing keeps a dense copy).
"""

from __future__ import annotations

import torch

from diffkv.core import bookkeeping
from diffkv.core.config import DiffKVConfig
from diffkv.core.layout import PagePlan
from diffkv.core.page_io import load_pages_ref, load_tokens_ref
from diffkv.memory import HIGH_COL, LOW_COL, HeadTables, PagePool, PoolExhausted
from diffkv.memory.arena import Arena, full
from diffkv.ops.reference import add_scores_ref
from diffkv.ops.store_tokens import store_tokens

_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class PagedKV:
    """Token storage of every head in ``tables`` inside ``pool`` (``tier`` arguments: the column
    ``memory.HIGH_COL`` = 0 or ``memory.LOW_COL`` = 1 of the tier axis, ``memory.STORED_TIERS``).

    max_pages: None keeps the pool at its size (an engine's fixed budget); an int lets :meth:`with_room` grow the
    pool up to that many pages when an operation runs short (a cache that holds only what it uses).
    """

    GROWTH = 0.02  # a growing pool adds at least this fraction of its pages at a time

    def __init__(self, pool: PagePool, tables: HeadTables, plan: PagePlan, config: DiffKVConfig, *,
                 max_pages: int | None = None, arena: Arena | None = None):
        if pool.page_bytes != plan.page_bytes:
            raise ValueError(f"pool pages have {pool.page_bytes} B but the plan needs {plan.page_bytes} B")
        self.pool, self.tables, self.plan, self.config = pool, tables, plan, config
        low = config.low if config.two_tier else config.high
        self.layouts = {HIGH_COL: plan.layout(config.high), LOW_COL: plan.layout(low)}
        self.meta_dtype, self.raw_dtype = _DT[config.meta_dtype], _DT[config.raw_dtype]
        if plan.page_bytes % 4:
            raise ValueError(f"page_bytes must be a multiple of 4 (score and position fields), got {plan.page_bytes}")
        self.compact = self.layouts[HIGH_COL].compact
        self.score_dtype, self.pos_dtype = bookkeeping.field_dtypes(self.compact)
        self.max_pages = max_pages
        # allocated up front, so a budget counts them from the start: [S*L*H, D] fp32 each (in ``arena``'s buffer
        # when given)
        shape = self.key_vector_shape(tables, plan)
        self.key_center = self.key_scale = None  # center_keys: a center; smooth_keys: a center and a scale
        if config.key_vectors:
            self.key_center = full(arena, shape, 0.0, torch.float32, tables.device)
        if config.smooth_keys:
            self.key_scale = full(arena, shape, 1.0, torch.float32, tables.device)

    @staticmethod
    def key_vector_shape(tables: HeadTables, plan: PagePlan) -> tuple[int, int]:
        """[S*L*H, D]: one key center (and scale) per head, ``config.key_vectors`` of them."""
        return tables.num_items, plan.head_dim

    def with_room(self, op, *args, **kwargs):
        """``op(*args, **kwargs)`` (a memory operation: allocate, reserve, ...); when it finds the pool short and the
        pool may grow, grow it by what was missing (at least ``GROWTH`` of its size, at most to ``max_pages``) and
        run it again. A refused operation changed nothing, so the retry is safe. Raises PoolExhausted when the pool
        cannot grow enough."""
        try:
            return op(*args, **kwargs)
        except PoolExhausted as short:
            pool = self.pool
            limit = self.max_pages or pool.num_pages
            want = max(pool.num_pages + short.needed - short.free, pool.num_pages + int(pool.num_pages * self.GROWTH))
            if pool.num_pages + short.needed - short.free > limit:
                raise PoolExhausted(short.op, short.needed, short.free + limit - pool.num_pages) from None
            pool.grow(min(want, limit))
        return op(*args, **kwargs)

    def set_key_transform(self, items: torch.Tensor, center: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Record how keys of these heads are stored: ``(k - center) / scale``. items: int [K]; center, scale: [K, D]
        (scale only with config.smooth_keys)."""
        if self.key_center is None or (scale is None) != (self.key_scale is None):
            raise RuntimeError("key centers are kept only with config.center_keys, scales only with smooth_keys")
        self.key_center[items] = center.float()
        if scale is not None:
            self.key_scale[items] = scale.float()

    def stored_keys(self, items: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """keys [K, D] (head ``items[k]``) as they are stored: minus their heads' centers, divided by their scales."""
        if self.key_center is None:
            return keys
        out = keys.float() - self.key_center[items]
        return (out if self.key_scale is None else out / self.key_scale[items]).to(keys.dtype)

    def stored_queries(self, items: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """query [B, H_q, D] (KV head ``items[b * H + h]`` serves query heads ``h * G .. h * G + G - 1``) times its
        KV head's key scale, so that a dot product with a stored key is the true ``q . (k - center)``."""
        if self.key_scale is None:
            return query
        b, hq, d = query.shape
        scale = self.key_scale[items].view(b, -1, 1, d)  # [B, H, 1, D]
        return (query.float().view(b, scale.shape[1], -1, d) * scale).view(b, hq, d).to(query.dtype)

    # NOTE: page_bytes and score/pos offsets are multiples of the fields' sizes (4, compact: 2), so views of the
    # pool in the fields' dtypes address them exactly; views are taken per call because the pool's tensor is
    # replaced when it grows.
    @property
    def _scores(self) -> torch.Tensor:
        return self.pool.data.view(-1).view(self.score_dtype)

    @property
    def _positions(self) -> torch.Tensor:
        return self.pool.data.view(-1).view(self.pos_dtype)

    def nbytes(self) -> int:
        """Bytes of every tensor this storage owns: the pool (pages and ring), the tables, key centers and scales."""
        vectors = sum(t.nbytes for t in (self.key_center, self.key_scale) if t is not None)
        return self.pool.nbytes() + self.tables.nbytes() + vectors

    def _field_index(self, tier: int, items, index, offset_attr: str, before_trim: bool = False) -> torch.Tensor:
        """Flat index of a token's score (``offset_attr="score_offset"``) or position in :attr:`_scores` /
        :attr:`_positions`."""
        page, slot = self.tables.token_address(items, tier, index, before_trim=before_trim)
        lay = self.layouts[tier]
        size = lay.score_bytes if offset_attr == "score_offset" else lay.pos_bytes
        return (page * lay.page_bytes + getattr(lay, offset_attr)) // size + slot

    def write(self, tier: int, items: torch.Tensor, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              scores: torch.Tensor, positions: torch.Tensor, *, before_trim: bool = False,
              validate: bool = False, return_stored: bool = False):
        """Quantize and store M tokens: token ``index[m]`` of ``tier`` of head ``items[m]``.

        items, index: int [M]; keys, values: [M, D]; scores: [M] as stored (fp32 sums; compact: means, cast to
        fp16); positions: [M] int (compact: stored mod 2^16).
        validate: check values and targets (costs a device sync); callers check finiteness once per layer.
        return_stored: return (keys, values) [M, D] fp32 exactly as the pages now decode them.
        """
        page, slot = self.tables.token_address(items, tier, index, before_trim=before_trim)
        args = (self.pool.data, self.layouts[tier], keys, values, page, slot, scores.to(self.score_dtype),
                bookkeeping.encode_positions(positions, self.compact))
        return store_tokens(*args, meta_dtype=self.meta_dtype, raw_dtype=self.raw_dtype, validate=validate,
                            return_stored=return_stored)

    def _grid(self, count: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """valid [K, M] and the (row, index) of its True cells, for M = ``width`` slots per item."""
        valid = torch.arange(width, device=count.device)[None, :] < count[:, None]
        row, idx = valid.nonzero(as_tuple=True)
        return valid, row, idx

    def _page_ids(self, tier: int, items: torch.Tensor, n_pages: int) -> torch.Tensor:
        """int64 [K, n_pages]: the tier's pages of each item in token order; -1 (no page) reads as page 0."""
        col = torch.arange(n_pages, device=items.device)
        if tier == LOW_COL:
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
        """Token ``index[m]`` of ``tier`` of ``items[m]``: keys, values [M, D] fp32, scores [M], positions [M] as
        stored (fp32, int32; compact: fp16, int16), so that :meth:`write` puts them back unchanged."""
        page, slot = self.tables.token_address(items, tier, index)
        return load_tokens_ref(self.pool.data, self.layouts[tier], page, slot, torch.float32,
                               meta_dtype=self.meta_dtype, raw_dtype=self.raw_dtype, validate=False)

    def read_meta(self, tier: int, items: torch.Tensor, count: torch.Tensor, width: int,
                  position: torch.Tensor | None = None):
        """Scores [K, M] fp32 (stored: sums; compact: means) and positions [K, M] int64 of the first ``count``
        tokens (0 elsewhere), valid [K, M]. Compact pages keep positions mod 2^16: pass ``position`` [K] (each
        item's current position) to get true positions back (``bookkeeping.full_positions``)."""
        valid, row, idx = self._grid(count, width)
        scores = torch.zeros(items.numel(), width, dtype=torch.float32, device=items.device)
        pos = torch.zeros(items.numel(), width, dtype=torch.int64, device=items.device)
        if row.numel():
            scores[row, idx] = self._scores[self._field_index(tier, items[row], idx, "score_offset")].float()
            stored = self._positions[self._field_index(tier, items[row], idx, "pos_offset")]
            if self.compact:
                if position is None:
                    raise ValueError("read_meta of compact pages needs each item's current position")
                stored = bookkeeping.full_positions(position.to(items.device)[row], stored, True)
            pos[row, idx] = stored.long()
        return scores, pos, valid

    def add_scores(self, tier: int, items: torch.Tensor, count: torch.Tensor, delta: torch.Tensor,
                   position: torch.Tensor | None = None) -> None:
        """One step's attention ``delta`` [K, M] fp32 into the scores of the first ``count`` tokens of each item
        (M >= max count, token order as :meth:`read` returns it): ``score += delta``, compact: the mean update
        (``bookkeeping.updated``; needs ``position`` [K], the step's position)."""
        add_scores_ref(self.pool.data, self.tables, self.layouts[tier], tier == LOW_COL, items, count, delta,
                       position=position, lag=self.config.score_lag, peak=self.config.peak)

    def reset_scores(self, tier: int, items: torch.Tensor, index: torch.Tensor) -> None:
        """``score := 0`` for token ``index[m]`` of ``tier`` of ``items[m]`` (int [M])."""
        self._scores[self._field_index(tier, items, index, "score_offset")] = 0.0

    # ---- score addressing (tests set scores directly) ----
    def score_index(self, tier: int, items: torch.Tensor, width: int) -> torch.Tensor:
        """int64 [K, M]: flat index in :attr:`_scores` of the score of tokens ``0 .. M-1`` of ``tier`` of each item,
        M = ``width`` rounded up to whole pages (columns past a head's pages point into page 0: mask them)."""
        lay = self.layouts[tier]
        n = lay.tokens_per_page
        page_ids = self._page_ids(tier, items, -(-width // n))
        first = (page_ids * lay.page_bytes + lay.score_offset) // lay.score_bytes
        return (first[:, :, None] + torch.arange(n, device=items.device)).view(len(items), -1)

    def write_scores(self, where: torch.Tensor, scores: torch.Tensor) -> None:
        """Stored scores at flat indices ``where`` [M] := ``scores`` [M] (addresses from :meth:`score_index`; sums,
        compact: means)."""
        self._scores[where] = scores.to(self.score_dtype)
