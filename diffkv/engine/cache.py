"""KV caches of the serving engine: where a request's keys and values live between steps.

The engine talks to its cache only through :class:`EngineCache`; both shipped cache kinds are a
:class:`PagedCache` over one :class:`~diffkv.memory.PagePool` and its prefix-sum allocator, with different
storage configurations:

* ``fp16`` — one 16-bit tier, nothing pruned: a paged fp16 cache (``raw_dtype`` float32 for exactness tests);
* ``diffkv`` — DiffKV tiers and thresholds (defaults, a :class:`DiffKVConfig` or a calibrated profile).

Hybrid models (Gemma-3): the full-attention layers are stored as above; the sliding-window layers keep only their
window, uncompressed (``raw_dtype``), in pages of the same pool (:mod:`diffkv.engine.sliding`), and every count
(prefill, admission, decode growth, bytes: :mod:`diffkv.engine.page_accounting`) includes them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from diffkv.cache.hosting import check_config, full_layers, table_config
from diffkv.cache.kv_store import KVStore
from diffkv.cache.paged_kv import PagedKV
from diffkv.core.config import DiffKVConfig, fp16_config
from diffkv.core.layout import plan_for_config
from diffkv.engine.page_accounting import PageAccounting
from diffkv.engine.sliding import SlidingWindowStore
from diffkv.engine.step_cache import DeferredTarget, LayerTarget, StepCache, pad_groups
from diffkv.hf.routing import install_router
from diffkv.hf.shape import kv_shape
from diffkv.memory import PoolExhausted
from diffkv.ops.decode_step import resolve_backend

CACHE_KINDS = ("fp16", "diffkv")


class EngineCache(Protocol):
    """What the engine needs from its KV cache (all page counts are pool pages)."""

    name: str
    num_pages: int
    max_slots: int
    max_model_len: int

    def free_pages(self) -> int: ...
    def prefill_pages(self, num_tokens: int) -> int: ...
    def admission_pages(self, num_tokens: int, compression: float | None) -> int: ...
    def decode_pages(self, requests: list[tuple[int, int]], ratio: float = 1.0) -> int: ...
    def open_slot(self) -> int: ...
    def close_slot(self, slot: int) -> None: ...
    def prefill_cache(self, slots: list[int], lengths: list[int], alone: bool = False) -> StepCache: ...
    def reserve_step(self, slots: list[int]) -> None: ...
    def decode_cache(self, slots: list[int], positions: list[int]) -> StepCache: ...
    def end_step(self) -> None: ...
    def stats(self, slots: list[int], tokens: list[int]) -> dict: ...
    def slot_stats(self, slot: int, tokens_seen: int) -> dict: ...


class PagedCache(PageAccounting):
    """Pages for up to ``max_slots`` concurrent requests of ``model`` in ``kv_budget_bytes``: every byte the cache
    holds (pages, ring, tables, bookkeeping) fits the budget (``nbytes()``). A hybrid model's sliding-window layers
    (``sliding``: :class:`~diffkv.engine.sliding.SlidingWindowStore`, None without them) keep their window in pages
    of the same pool; ``full_layers``: the model layers stored with ``config``.

    config: storage and policy (:func:`fp16_config` or a DiffKV configuration).
    max_model_len: most tokens per request (prompt + generated); sizes the page tables.
    attention_backend: as :class:`~diffkv.integrations.transformers.DiffKVCache` ("auto", "cpu", "torch", "triton").
    """

    def __init__(self, model, config: DiffKVConfig, *, kv_budget_bytes: int, max_slots: int = 64,
                 max_model_len: int = 4096, name: str = "diffkv", attention_backend: str = "auto"):
        shape = kv_shape(model)
        self.name, self.config = name, config
        self.num_layers, self.num_kv_heads, self.head_dim = shape.num_layers, shape.num_kv_heads, shape.head_dim
        self.num_heads = shape.num_heads
        self.full_layers = full_layers(shape, type(model).__name__)
        check_config(config, num_layers=self.num_layers, head_dim=self.head_dim)
        self.max_model_len = min(max_model_len, shape.max_position_embeddings or max_model_len)
        self.max_slots = max_slots
        self.plan = plan_for_config(config, self.head_dim)
        device = self.device = next(model.parameters()).device
        self.attention_backend = resolve_backend(attention_backend, device)  # the budget depends on it
        # the pages, tables and compressors know only the full-attention layers: table layer t is model layer
        # full_layers[t] (its thresholds too)
        paged = table_config(config, self.full_layers)
        sliding = [i for i in range(self.num_layers) if i not in self.full_layers]
        self.sliding = None if not sliding else SlidingWindowStore(
            self.plan.page_bytes, sliding, self.num_kv_heads, self.head_dim, shape.sliding_window,
            getattr(torch, config.raw_dtype), max_slots, device)
        # The budget is every byte the cache holds: the store's tables, key centers and scales, the sliding
        # layers' block table, the per-step head sets and positions (at their largest, every slot running), and per
        # page its bytes plus its ring and refcount entries.
        other = self.bookkeeping_bytes(max_slots) + (self.sliding.nbytes() if self.sliding else 0)
        self.store = KVStore(paged, self.plan, num_layers=len(self.full_layers), num_kv_heads=self.num_kv_heads,
                             max_slots=max_slots, max_seq_len=self.max_model_len, device=device,
                             budget_bytes=kv_budget_bytes, other_bytes=other, attention_backend=self.attention_backend)
        self.fixed_bytes = self.store.fixed_bytes + other
        if self.sliding:
            self.sliding.pool = self.store.shared_pool()
        self.num_pages = self.store.num_pages
        self.kv_budget_bytes = kv_budget_bytes
        self.router = install_router(model)

    @property
    def kv(self) -> PagedKV:
        """The pages and tables (the store's)."""
        return self.store.kv

    # ---- request lifecycle ----
    def open_slot(self) -> int:
        return self.store.open_slot()

    def close_slot(self, slot: int) -> None:
        """Give every page of ``slot`` back and retire it (the slot may hold no pages yet)."""
        self.store.release([slot])
        if self.sliding:
            self.sliding.release(slot)

    # ---- model calls ----
    def _per_layer(self, make) -> list:
        """Per model layer: ``make(t)`` for the full-attention layer of table layer t, None for a sliding one."""
        table = {layer: t for t, layer in enumerate(self.full_layers)}
        return [make(table[i]) if i in table else None for i in range(self.num_layers)]

    def prefill_cache(self, slots: list[int], lengths: list[int], alone: bool = False,
                      log: list | None = None) -> StepCache:
        """The cache of one forward over the prompts of ``slots`` (``lengths`` tokens each) packed into one row, in
        that order; each group of similar lengths gets one compressor per layer (:func:`pad_groups`; ``alone``: one
        group per prompt, so its scores and codes are those of a prefill of it alone). Takes the sliding layers'
        pages now (:class:`~diffkv.memory.PoolExhausted`: none taken). log: the stores are recorded there and run
        after the forward (:class:`DeferredTarget`; full-attention models)."""
        groups = [[i] for i in range(len(slots))] if alone else pad_groups(lengths) if len(slots) > 1 else [[0]]

        def target(i: int, g: list[int]):
            t = LayerTarget(self.store, i, tuple(slots[j] for j in g))
            return t if log is None else DeferredTarget(t, log)

        comps = self._per_layer(lambda i: [target(i, g) for g in groups])
        sliding = self.sliding.prefill_step(list(slots), list(lengths)) if self.sliding else None
        return StepCache(self.router, comps, "prefill", list(lengths), groups, sliding)

    def prefix_step_cache(self, slot: int, length: int) -> StepCache:
        """The cache of one forward over a prompt prefix of ``length`` tokens alone into ``slot`` (a full-attention
        model; with ``prompt_scores="repeat"`` the prefix is stored by the re-read pass instead,
        ``diffkv.engine.prefixes``)."""
        comps = self._per_layer(lambda t: [LayerTarget(self.store, t, (slot,), fill_pages=True)])
        return StepCache(self.router, comps, "prefill", [length], [[0]])

    def reserve_step(self, slots: list[int]) -> None:
        """One prefix-sum pass reserving this step's pages for every layer and head of ``slots`` (the sliding
        layers first give back the pages that left their window); raises :class:`~diffkv.memory.PoolExhausted`
        (nothing reserved) when the pool cannot cover it."""
        added = self.sliding.reserve(slots) if self.sliding else []
        try:
            self.store.reserve(slots)
        except PoolExhausted:
            if added:
                self.sliding.unreserve(added)
            raise

    def decode_cache(self, slots: list[int], positions: list[int]) -> StepCache:
        """positions: index of each sequence's new token (= tokens it has seen). The engine calls
        :meth:`end_step` after the forward."""
        self.store.begin_step(slots, positions, explicit_end=True)
        sliding = self.sliding.decode_step(slots, positions) if self.sliding else None
        return StepCache(self.router, self._per_layer(lambda t: [LayerTarget(self.store, t, tuple(slots))]), "decode",
                         sliding=sliding)

    def end_step(self) -> None:
        """After the decode forward: ``KVStore.end_step`` (its one host sync, outside the forward; ValueError if a
        layer's new token was not finite)."""
        self.store.end_step()


def make_cache(kind: str, model, *, kv_budget_bytes: int, config: DiffKVConfig | None = None,
               profile: str | None = None, raw_dtype: str = "float16", **kwargs) -> PagedCache:
    """``fp16`` or ``diffkv`` (``config``, else the calibrated ``profile``, else the defaults)."""
    if kind == "fp16":
        return PagedCache(model, fp16_config(raw_dtype), kv_budget_bytes=kv_budget_bytes, name="fp16", **kwargs)
    if kind == "diffkv":
        if config is None and profile is not None:
            from diffkv.profile import load_profile

            config = load_profile(profile, model).config
        return PagedCache(model, config or DiffKVConfig(), kv_budget_bytes=kv_budget_bytes, name="diffkv",
                          **kwargs)
    raise ValueError(f"unknown KV cache kind {kind!r}; choose one of {CACHE_KINDS}")
