"""Every byte a cache holds is counted: ``stats()["bytes_held"]`` equals an independent walk over the cache object,
and a DiffKVCache's pool holds little beyond its pages (it grows with them, it is not preallocated)."""

import dataclasses

import pytest
import torch
from test_cache_hf import generate, left_padded_batch, tiny

from diffkv import DiffKVConfig
from diffkv.integrations.transformers import DiffKVCache
from diffkv.memory.owned import owned_bytes, owned_tensors

CFG = DiffKVConfig(recent_window=4, score_window=4, alpha_high=1.5, alpha_low=0.5)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("keys", ["plain", "center_keys", "smooth_keys"])
def test_stats_count_every_tensor_the_cache_owns(kind, keys):
    model = tiny(kind)
    ids, mask = left_padded_batch()
    cfg = dataclasses.replace(CFG, smooth_keys=keys == "smooth_keys", center_keys=keys == "center_keys")
    cache = DiffKVCache(model, cfg)
    generate(model, cache, ids, mask, 30)
    stats = cache.stats()
    walked = owned_bytes(cache)
    assert walked == stats["bytes_held"] == cache.nbytes(), sorted(
        (t.untyped_storage().nbytes(), tuple(t.shape), t.dtype) for t in owned_tensors(cache).values())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not params & {ptr for _, ptr in owned_tensors(cache)}, "the walk reached the model's weights"
    assert stats["compression_held"] == pytest.approx(stats["fp16_bytes"] / walked)


def test_pool_grows_with_the_pages_it_holds():
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(200, 150), total=200, seed=2)
    cache = DiffKVCache(model, CFG)
    generate(model, cache, ids, mask, 60)
    pool = cache.kv.pool
    used = pool.num_pages - pool.free_pages()
    assert pool.num_pages <= used * 1.05 + 8, (pool.num_pages, used)  # growth steps of 2 %, no worst case kept
    pool.check_invariants(cache.kv.tables)
    stats = cache.stats()
    assert stats["bytes_in_pages"] == used * cache.kv.plan.page_bytes + stats["key_center_bytes"]


def test_pool_growth_stops_at_the_budget():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    cache = DiffKVCache(model, CFG, kv_budget_bytes=1)
    with pytest.raises(ValueError, match="holds no"):
        generate(model, cache, ids, mask, 2)
    page = DiffKVCache(model, CFG).plan.page_bytes
    cache = DiffKVCache(model, CFG, kv_budget_bytes=3 * page)
    with pytest.raises(Exception, match="pages but only"):
        generate(model, cache, ids, mask, 2)
    assert torch.equal(cache.kv.pool.refcount.sum(), torch.tensor(cache.kv.pool.num_pages - cache.kv.pool.free_pages()))
