"""Page counts and byte accounting of the engine's paged KV cache (:class:`~diffkv.engine.cache.PagedCache`).

What the scheduler asks before it commits pages (all counts are pool pages, upper bounds unless said otherwise):

* ``prefill_pages`` — a prefill at its worst case (every token in the high tier), also what ``check_fits`` uses;
* ``admission_pages`` — a prefill as expected from the compression the stored tokens achieve now;
* ``decode_pages`` — the growth of running requests while they decode: full-attention layers at the high tier's
  size, sliding-window layers (hybrid models) by what each window can still grow, the boundary block once full.

And what the cache holds: ``nbytes`` (every tensor, within ``kv_budget_bytes``), ``budget_for_pages`` (the budget
of a pool of a given size), ``stats`` (pool use and physical compression, per kind of layer) and ``slot_stats``
(what one request holds, in the fields of ``DiffKVCache.stats()``).
"""

from __future__ import annotations

import math

from diffkv.cache.kv_store import MAX_PLANS
from diffkv.core.stats import tier_stats
from diffkv.memory import PagePool
from diffkv.ops.decode_plan import workspace_bound_bytes


class PageAccounting:
    """The page counts and byte accounting half of :class:`~diffkv.engine.cache.PagedCache`, which provides
    ``kv`` (pool and tables), ``plan``, ``config``, ``full_layers``, ``num_layers``, ``num_kv_heads``, ``num_heads``,
    ``head_dim``, ``max_model_len``, ``device``, ``attention_backend`` (resolved),
    ``sliding`` (None without sliding-window layers), ``fixed_bytes``, ``kv_budget_bytes``, ``name`` and ``store``
    (the :class:`~diffkv.cache.kv_store.KVStore`, whose bytes include its step plan)."""

    # ---- bytes ----
    def bookkeeping_bytes(self, slots: int) -> int:
        """Most bytes of the per-step objects for ``slots`` running requests: the head set of every layer (4 int64
        per head, 8 counting the index cells: 64 B), the same again split by layer, and each layer's positions; on
        the Triton backend also the decode workspace and plan buffers at their largest
        (``diffkv.ops.decode_plan.workspace_bound_bytes``)."""
        heads = slots * len(self.full_layers) * self.num_kv_heads
        steps = 2 * 64 * heads + 8 * slots * len(self.full_layers)
        if self.attention_backend != "triton":
            return steps
        return steps + workspace_bound_bytes(
            (self.plan.tiers[0], self.plan.tiers[-1]), self.config.two_tier, max_slots=slots,
            num_layers=len(self.full_layers), num_kv_heads=self.num_kv_heads, num_heads=self.num_heads,
            head_dim=self.head_dim, max_seq_len=self.max_model_len, device=self.device, plans=MAX_PLANS)

    def budget_for_pages(self, pages: int) -> int:
        """The ``kv_budget_bytes`` that gives a cache like this one exactly ``pages`` pages."""
        return self.fixed_bytes + pages * (self.plan.page_bytes + PagePool.BYTES_PER_PAGE)

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds now (at most ``kv_budget_bytes``)."""
        return self.store.nbytes() + (self.sliding.nbytes() if self.sliding else 0)

    # ---- pages ----
    def free_pages(self) -> int:
        return self.store.free_pages()

    def sliding_pages(self, num_tokens: int) -> int:
        """Most pages the sliding-window layers hold for a request of ``num_tokens`` tokens (0 without them)."""
        return self.sliding.max_pages(num_tokens) if self.sliding else 0

    def prefill_pages(self, num_tokens: int) -> int:
        """Pages a prefill of ``num_tokens`` takes at most (every token high, plus one low page per head; the
        sliding layers' window)."""
        return self.store.prompt_pages(num_tokens) + self.sliding_pages(num_tokens)

    def admission_pages(self, num_tokens: int, compression: float | None) -> int:
        """Pages to expect for a prefill of ``num_tokens`` when stored tokens compress ``compression``x (physical,
        vs fp16, in the full-attention layers): one layer at its worst case (a margin: each layer's split is known
        only once it is prefilled, and then exactly its pages are allocated) plus the other layers at that
        compression, plus the sliding layers' window; the worst case when ``compression`` is None or below 1."""
        worst = self.prefill_pages(num_tokens)
        if compression is None or compression <= 1:
            return worst
        full, window = len(self.full_layers), self.sliding_pages(num_tokens)
        return min(worst, (worst - window) // full + self._expected_pages(num_tokens, compression, full - 1) + window)

    def _expected_pages(self, num_tokens: int, compression: float, layers: int) -> int:
        """Pages that ``num_tokens`` tokens of every head of ``layers`` layers take at ``compression`` (vs fp16)."""
        fp16 = num_tokens * self.num_kv_heads * 4 * self.head_dim * layers
        return -(-int(fp16 / compression) // self.plan.page_bytes)

    def decode_pages(self, requests: list[tuple[int, int]], ratio: float = 1.0) -> int:
        """Pages that decoding adds at most to ``requests`` (per request: tokens it holds, or counted for its
        prefill, and tokens it may still write), ``ratio`` of those tokens reserved (the scheduler's decode
        reserve), all layers and heads together. Full-attention layers: a decoded token enters the high tier and a
        step adds at most one token per head (docs/algorithm.md §4.4), whatever the compression of the stored tokens;
        sliding-window layers: only what each request's window can still grow
        (:meth:`~diffkv.engine.sliding.SlidingWindowStore.growth_pages`)."""
        high = self.store.tokens_per_page[0]
        ahead = math.ceil(sum(a for _, a in requests) * ratio)
        window = sum(self.sliding.growth_pages(n, math.ceil(a * ratio)) for n, a in requests) if self.sliding else 0
        return -(-ahead * len(self.full_layers) * self.num_kv_heads // high) + window

    # ---- stats ----
    def stats(self, slots: list[int], tokens: list[int]) -> dict:
        """Pool use and compression of the requests in ``slots`` (``tokens``: tokens each has seen):
        ``compression_physical`` over every layer (fp16 bytes of every token seen ÷ bytes of the pages held, as
        ``DiffKVCache.stats()``), ``compression_physical_compressed`` over the full-attention layers only (what
        admission expects of a new prompt; the same without sliding layers)."""
        store = self.store
        used = store.num_pages - store.free_pages()
        window = self.sliding.held if self.sliding else 0
        per_layer = sum(tokens) * self.num_kv_heads * 4 * self.head_dim
        fp16, held, full_held = per_layer * self.num_layers, used * self.plan.page_bytes, (used - window)
        full_held *= self.plan.page_bytes
        return {"cache": self.name, "pages_total": store.num_pages, "pages_used": used, "pages_sliding": window,
                "page_bytes": self.plan.page_bytes, "bytes_used": held, "fp16_bytes": fp16,
                "compression_physical": fp16 / held if held else None,
                "compression_physical_compressed":
                    per_layer * len(self.full_layers) / full_held if full_held else None,
                "bytes_held": self.nbytes(), "kv_budget_bytes": self.kv_budget_bytes}

    def slot_stats(self, slot: int, tokens_seen: int) -> dict:
        """What request ``slot`` holds after feeding ``tokens_seen`` tokens, in the fields of
        ``DiffKVCache.stats()`` (one sequence): tokens per tier over (token, layer, KV head) cells, ``bytes_in_pages``
        (its pages, key centers and scales included), ``bytes_kept`` (plus its sliding-window tokens at fp16, as the
        transformers cache counts them), ``fp16_bytes`` of every token seen in every layer, and the physical and
        theoretical compression."""
        cfg, h, d = self.config, self.num_kv_heads, self.head_dim
        layers = len(self.full_layers)
        cells = tokens_seen * layers * h
        held = self.store.held([slot])
        high, low, pages, in_pages = held["tokens_high"], held["tokens_low"], held["pages"], held["bytes_in_pages"]
        window_layers = self.num_layers - layers
        window = min(tokens_seen, self.sliding.window - 1) if self.sliding else 0
        kept = in_pages + window_layers * window * h * 4 * d
        fp16 = tokens_seen * self.num_layers * h * 4 * d
        return {"tokens_seen": tokens_seen, **tier_stats(cfg, cells, high, low, fp16, kept), "pages": pages,
                "page_bytes": self.plan.page_bytes, "bytes_in_pages": in_pages, "bytes_kept": kept}
