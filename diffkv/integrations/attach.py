"""``with diffkv.attach(model, config) as cache:`` — DiffKV for the length of a block, the model restored after.

    with diffkv.attach(model, DiffKVConfig()) as cache:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=64)
    # here the cache's pages are freed and the model runs its previous attention implementation again

Building a :class:`DiffKVCache` directly keeps working; it routes the model's attention through diffkv until
:func:`~diffkv.hf.routing.uninstall_router` (which this context manager calls on exit).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from diffkv.core.config import DiffKVConfig
from diffkv.hf.routing import ATTN_NAME, uninstall_router
from diffkv.integrations.transformers import DiffKVCache


@contextmanager
def attach(model, config: DiffKVConfig | None = None, *, profile=None, **cache_kwargs) -> Iterator[DiffKVCache]:
    """A :class:`DiffKVCache` for ``model`` (from ``config``, or from the calibrated ``profile`` JSON path), with the
    model's attention implementation restored and the cache's pages released when the block ends.

    ``cache_kwargs`` go to the cache (``max_seq_len``, ``kv_budget_bytes``, ``attention_backend``). More caches
    may be built inside the block (one per ``generate`` call); they stop working when it ends.
    """
    if profile is not None and config is not None:
        raise ValueError("attach: pass either config or profile, not both")
    previous = model.config._attn_implementation
    cache = DiffKVCache.from_profile(model, profile, **cache_kwargs) if profile is not None \
        else DiffKVCache(model, config, **cache_kwargs)
    try:
        yield cache
    finally:
        cache.release()
        if previous != ATTN_NAME:  # an enclosing attach (or a cache built before) keeps the routing
            uninstall_router(model, previous)
