"""A context compressed once and read by several questions (issue #45, item 4): the forks of a
:class:`~diffkv.integrations.transformers.DiffKVCache` built by ``for_context(..., max_forks=N)`` share its pages.

Each fork is a cache of its own (own layers, own slots in the context's store) whose rows hold the context's full
pages by reference and a copy of each partial page (``diffkv.cache.prefix.share_prefix``; the low tier's only once
the fork can demote a token of its own); the context's tokens are frozen, so a fork's decode steps place only the
fork's own tokens and the shared pages never change. A fork costs its partial-page copies and the tokens it adds,
not the context's bytes again.
"""

from __future__ import annotations

import copy

from transformers.cache_utils import Cache

from diffkv.cache.prefix import freeze_scores, share_prefix
from diffkv.cache.staging import PromptStage
from diffkv.hf.layer import cache_layers


def can_share(cache, paged_layer: type) -> bool:
    """Whether ``cache`` (stored, nothing staged, only ``paged_layer`` layers) has a free slot per row for a
    sharing fork."""
    return (cache.store is not None and not cache.stage and all(isinstance(x, paged_layer) for x in cache.layers)
            and cache.store.free_slots() >= len(cache.slots) and not cache.config.score_lag)


def sharing_fork(cache, paged_layer: type):
    """A fork of ``cache`` that reads its pages (see the module docstring; :func:`can_share` must hold).
    paged_layer: the cache's layer class, built as ``paged_layer(cache, layer_idx)``."""
    store = cache.store
    twin = copy.copy(cache)
    Cache.__init__(twin, layers=cache_layers(cache.shape, lambda i: paged_layer(twin, i)))
    for mine, theirs in zip(twin.layers, cache.layers, strict=True):
        mine.processed, mine.filled = theirs.processed, theirs.filled
    twin.stage = PromptStage(cache.config.score_window, spare=max(cache.config.recent_window, 1))
    twin.prompt_scores, twin._repeat_hook = None, None
    twin.slots = []
    try:
        for source in cache.slots:
            if not store.shares.readers(source):
                freeze_scores(store, source)
            twin.slots.append(store.open_slot())
            share_prefix(store, source, twin.slots[-1])
    except BaseException:
        twin.release()
        raise
    return twin
