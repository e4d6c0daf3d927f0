"""Prefix caching in the engine (issue #45): a shared prefix compressed once, its pages read by every request."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_engine import assert_pool_full, engine, reference, tiny

from diffkv import DiffKVConfig
from diffkv.engine import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
# thresholds the tiny model's near-uniform attention splits into both tiers and pruning (peaks just above 1 / n)
# small pages (4 high / 8 low tokens), so a prefix fills some whole
SPLIT = DiffKVConfig(alpha_high=4.0, alpha_low=1.2, importance="peak", recent_window=4, score_window=8,
                     raw_dtype="float32", page_bytes=256)


def workload(n=5, prefix=40, seed=0):
    g = random.Random(seed)
    shared = [g.randrange(3, 96) for _ in range(prefix)]
    return shared, [shared + [g.randrange(3, 96) for _ in range(g.randrange(3, 9))] for _ in range(n)]


def run(eng, prompts, prefix, one_by_one=False):
    reqs = []
    for p in prompts:
        reqs.append(eng.add_request(p, GREEDY, prefix_tokens=prefix))
        if one_by_one:
            eng.run()
    eng.run()
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("kind", ["fp16", "diffkv"])
def test_hits_answer_as_misses_and_the_prefix_is_stored_once(kind):
    model = tiny()
    shared, prompts = workload()
    cfg = SPLIT if kind == "diffkv" else None
    eng = engine(model, kind, config=cfg, prefix_cache=True, batch_invariant=True)
    got = run(eng, prompts, len(shared))
    m = eng.metrics()
    assert m["prefix_misses"] == 1 and m["prefix_hits"] == len(prompts) - 1 and m["prefix_entries"] == 1
    assert m["prefix_hit_tokens"] == len(shared) * (len(prompts) - 1) and m["prefix_shared_bytes"] > 0
    for p, out in zip(prompts, got, strict=True):  # each one alone, a miss in a fresh engine
        alone = engine(model, kind, config=cfg, prefix_cache=True, batch_invariant=True)
        assert run(alone, [p], len(shared)) == [out]
    if kind == "fp16":  # lossless: as generate() over the whole prompt
        assert got == [reference(model, p, GREEDY.max_new_tokens) for p in prompts]
    eng.prefix.evict_one()
    assert_pool_full(eng)


@pytest.mark.parametrize("cfg", [SPLIT, dataclasses.replace(SPLIT, importance="mean", alpha_high=1.5, alpha_low=0.5,
                                                              compact_meta=True)], ids=["peak", "compact-mean"])
def test_readers_never_change_the_shared_pages(cfg):
    model = tiny()
    shared, prompts = workload(n=3, prefix=43)
    eng = engine(model, "diffkv", config=cfg, prefix_cache=True)
    first = eng.add_request(prompts[0], GREEDY, prefix_tokens=len(shared))
    eng.step()  # the prefix is prefilled and attached
    entry = next(iter(eng.prefix.entries.values()))
    pool, tables = eng.cache.kv.pool, eng.cache.kv.tables
    pages = tables.rows[tables.select([entry.slot]).items]
    pages = pages[pages >= 0].long()
    before = pool.data[pages].clone()
    assert eng.cache.store.held([entry.slot])["tokens_low"] > 0  # both tiers shared
    for p in prompts[1:]:
        eng.add_request(p, GREEDY, prefix_tokens=len(shared))
    most = 0
    while eng.has_work():
        eng.step()
        assert torch.equal(pool.data[pages], before), "a reader wrote into a shared page"
        pool.check_invariants(tables)
        most = max(most, int(pool.refcount[pages].max()))
    assert most == 4  # the prefix's full pages were read by all three requests at once
    assert first.finish_reason == "length" and int(pool.refcount[pages].min()) == 1


def test_unreferenced_prefixes_are_evicted_when_the_pool_is_short():
    model = tiny()
    eng = engine(model, "fp16", pages=64, prefix_cache=True)  # a prefix takes 32 pages, a prompt 52 at most
    for seed in range(4):  # four different prefixes, one request each, one after the other
        shared, prompts = workload(n=1, prefix=30, seed=seed)
        assert run(eng, prompts, len(shared)) == [reference(model, prompts[0], GREEDY.max_new_tokens)]
    assert eng.metrics()["prefix_entries"] < 4  # the pool holds fewer: the oldest went
    while eng.prefix.evict_one():
        pass
    assert_pool_full(eng)


def test_a_prefix_request_is_refused_without_the_cache_or_room_after_it():
    model = tiny()
    with pytest.raises(ValueError, match="prefix_cache"):
        engine(model).add_request([5, 6, 7], GREEDY, prefix_tokens=2)
    with pytest.raises(ValueError, match="prefix_tokens"):
        engine(model, prefix_cache=True).add_request([5, 6, 7], GREEDY, prefix_tokens=3)
