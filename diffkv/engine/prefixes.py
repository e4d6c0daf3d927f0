"""Prefix caching in the serving engine (issue #45): a prompt prefix shared by many requests (a system prompt, a
document, few-shot examples) is compressed once and its pages are read by every request that starts with it.

A request names its shared prefix (``Engine.add_request(..., prefix_tokens=P)``: its first P prompt tokens). The
first request with a prefix prefills it alone into a slot of its own, scored without the request's question: by
default at the config's context point (``diffkv.core.points.context_point``: the re-read pass,
``diffkv.hf.repeat_scores``, which stores the prefix in the same forward, with peak importance and the context
thresholds; a config that keeps every token, fp16, needs no scores), or with ``scores="window"`` by the prefix's own
last queries at the config's thresholds (an explicit choice), and freezes it (``diffkv.cache.prefix``); every
request with that prefix, the first one too, then gets the prefix's pages (shared; the prefix is prefilled with its
last pages filled, ``fill_pages``, and a partial one left is copied when the request first writes there)
and appends the rest of its prompt with ``KVStore.extend``, so a hit gives the same tokens as a miss. The key of a
prefix is a hash of its token ids and of everything that decides its bytes (tiers, thresholds, page size, score
mode). Entries no request reads are evicted least recently used when a request cannot be admitted; their pages
count in the pool like any other.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from diffkv.cache.prefix import freeze_scores, share_prefix
from diffkv.core.points import context_point
from diffkv.core.spans import word_starts
from diffkv.engine.request import Request
from diffkv.hf.repeat_scores import BRIDGE, repeat_store
from diffkv.memory import PoolExhausted

PREFIX_SCORES = ("context", "window")  # what places a shared prefix's tokens (PrefixCache)


@dataclass
class PrefixEntry:
    slot: int  # the slot holding the prefix's pages
    tokens: int
    hits: int = 0


class PrefixCache:
    """The prefixes one engine holds, least recently used first. cache: the engine's ``PagedCache``; word_edges:
    the tokenizer's (``diffkv.core.spans.word_edges``) when the config has ``score_spans``, else None. scores:
    "context" (default: the config's context point) or "window" (the config itself) places a prefix's tokens."""

    def __init__(self, cache, model, tokenizer, word_edges: torch.Tensor | None = None, scores: str = "context"):
        if scores not in PREFIX_SCORES:
            raise ValueError(f"prefix scores must be one of {PREFIX_SCORES}, got {scores!r}")
        if cache.sliding is not None:
            raise ValueError("prefix caching needs a model whose layers are all full attention")
        if cache.config.score_lag:
            raise ValueError("prefix caching needs score_after_window=False")
        self.cache, self.model, self.word_edges = cache, model, word_edges
        self.point = context_point(cache.config) if scores == "context" else cache.config
        self.repeat = self.point.prompt_scores == "repeat"
        self.bridge = tokenizer(BRIDGE, add_special_tokens=False).input_ids if self.repeat else []
        self.fingerprint = repr((cache.config, self.point, cache.plan.page_bytes)).encode()
        self.entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.hits = self.misses = self.hit_tokens = 0

    def key(self, ids: list[int]) -> str:
        return hashlib.sha256(self.fingerprint + torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()

    def cached_tokens(self, req: Request) -> int:
        """Prompt tokens of ``req`` a held prefix already covers (0 when its prefix is not held)."""
        p = req.prefix_tokens
        return p if p and self.key(req.prompt_ids[:p]) in self.entries else 0

    def attach(self, ids: list[int], slot: int, device) -> bool:
        """Give ``slot`` (open, empty) the prefix ``ids``, prefilling it first on a miss. Returns whether it was a
        hit. Raises PoolExhausted (nothing kept: a prefix prefilled now is released again) when it does not fit."""
        key = self.key(ids)
        entry = self.entries.get(key)
        hit = entry is not None
        if entry is None:
            entry = PrefixEntry(self._prefill(ids, device), len(ids))
        try:
            share_prefix(self.cache.store, entry.slot, slot)
        except PoolExhausted:
            if not hit:
                self.cache.close_slot(entry.slot)
            raise
        self.entries[key] = entry
        self.entries.move_to_end(key)
        if hit:
            entry.hits += 1
            self.hits += 1
            self.hit_tokens += entry.tokens
        else:
            self.misses += 1
        return hit

    @torch.inference_mode()
    def _prefill(self, ids: list[int], device) -> int:
        """The prefix alone in a new slot, scored and frozen. Returns the slot."""
        slot = self.cache.open_slot()
        try:
            if self.word_edges is not None:  # score_spans: the prefix's scores pooled over its words
                self.cache.store.set_word_starts(slot, word_starts(torch.tensor(ids), self.word_edges))
            x = torch.tensor([ids], device=device)
            if self.repeat:  # scored and stored by the one re-read pass
                repeat_store(self.model, x, self.bridge, self._slot_sink(slot))
            else:
                self.model(input_ids=x, position_ids=torch.arange(len(ids), device=device)[None], use_cache=True,
                           past_key_values=self.cache.prefix_step_cache(slot, len(ids)), logits_to_keep=1)
            freeze_scores(self.cache.store, slot)
        except BaseException:
            self.cache.close_slot(slot)
            raise
        return slot

    def _slot_sink(self, slot: int):
        """repeat_store's sink: each layer's first copy prefilled into ``slot`` with its repeat scores."""
        store, table = self.cache.store, {layer: t for t, layer in enumerate(self.cache.full_layers)}

        def sink(layer_idx: int, q, k, v, scaling: float, scores) -> None:
            valid = torch.ones(1, k.shape[2], dtype=torch.bool, device=k.device)
            store.prefill(table[layer_idx], [slot], q, k, v, valid, scaling, scores[None], point=self.point,
                          fill_pages=True)

        return sink

    def evict_one(self) -> bool:
        """Release the least recently used prefix no request reads. Returns whether one was."""
        for key, entry in self.entries.items():
            if not self.cache.store.shares.readers(entry.slot):
                del self.entries[key]
                self.cache.close_slot(entry.slot)
                return True
        return False

    def held_pages(self) -> int:
        """Pages of the held prefixes (each counted once, however many requests read it)."""
        return self.cache.store.pages_of([e.slot for e in self.entries.values()])

    def metrics(self) -> dict:
        return {"prefix_entries": len(self.entries), "prefix_hits": self.hits, "prefix_misses": self.misses,
                "prefix_hit_tokens": self.hit_tokens,
                "prefix_shared_bytes": self.held_pages() * self.cache.plan.page_bytes}

    def attach_requests(self, reqs: list[Request], scheduler, chunks, close, device) -> None:
        """Give each request of ``reqs`` (admitted now, naming a prefix) a slot holding its shared prefix; the rest
        of its prompt waits in ``chunks`` (appended by the chunk path). On a pool too full even after evicting, it
        and the requests after it go back to the queue (FCFS; ``close`` frees its slot), the ones before go on."""
        for i, req in enumerate(reqs):
            ids = req.prompt_ids + req.output_ids
            req.slot = self.cache.open_slot()
            while True:
                try:
                    self.attach(ids[:req.prefix_tokens], req.slot, device)
                    break
                except PoolExhausted:
                    if self.evict_one():
                        continue
                    close(req)
                    scheduler.requeue(reqs[i:], worst_case=req)
                    return
            chunks.set_pending(req, ids[req.prefix_tokens:])
