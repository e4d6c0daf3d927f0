"""Prefix caching in the engine (issue #45): a shared prefix compressed once, its pages read by every request."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_engine import assert_pool_full, engine, reference, tiny

from diffkv import DiffKVConfig
from diffkv.core.points import context_point
from diffkv.engine import SamplingParams
from diffkv.hf.repeat_scores import repeat_scores
from diffkv.integrations.transformers import DiffKVCache

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
# thresholds the tiny model's near-uniform attention splits into both tiers and pruning (peaks just above 1 / n)
# small pages (4 high / 8 low tokens), so a prefix fills some whole; context_scale 1: a shared prefix (placed at
# the context point, repeat scores) splits at the same thresholds
SPLIT = DiffKVConfig(alpha_high=4.0, alpha_low=1.2, importance="peak", recent_window=4, score_window=8,
                     raw_dtype="float32", page_bytes=256, context_scale=1.0)
# mean scores whose context point (peak importance, thresholds x 8) splits the tiny model's prefix too
MEAN = DiffKVConfig(alpha_high=0.5, alpha_low=0.15, recent_window=4, score_window=8, raw_dtype="float32",
                    page_bytes=256, context_scale=8.0)


def workload(n=5, prefix=40, seed=0):
    g = random.Random(seed)
    shared = [g.randrange(3, 96) for _ in range(prefix)]
    return shared, [shared + [g.randrange(3, 96) for _ in range(g.randrange(3, 9))] for _ in range(n)]


def filled(counts: torch.Tensor, n: int, per_page: tuple[int, int]) -> torch.Tensor:
    """The (high, low) counts [2, ...] of a prompt of n tokens once ``policy.fill_last_pages`` has filled each
    tier's last page with the best tokens below it (a shared prefix is prefilled so)."""
    hi, lo = counts
    up = lambda c, p: -(-c // p) * p  # noqa: E731
    hi2 = torch.minimum(up(hi, per_page[0]), torch.full_like(hi, n))
    lo_left = (lo - (hi2 - hi)).clamp_min(0)
    return torch.stack([hi2, torch.minimum(up(lo_left, per_page[1]), n - hi2)])


def run(eng, prompts, prefix, one_by_one=False):
    reqs = []
    for p in prompts:
        reqs.append(eng.add_request(p, GREEDY, prefix_tokens=prefix))
        if one_by_one:
            eng.run()
    eng.run()
    return [r.output_ids for r in reqs]


REPEAT = dataclasses.replace(SPLIT, prompt_scores="repeat")  # the prefix scored by the re-read pass


@pytest.mark.parametrize("kind,cfg,scores", [("fp16", None, "context"), ("diffkv", SPLIT, "context"),
                                             ("diffkv", SPLIT, "window"), ("diffkv", REPEAT, "context")],
                         ids=["fp16", "diffkv", "diffkv-window", "diffkv-repeat"])
def test_hits_answer_as_misses_and_the_prefix_is_stored_once(kind, cfg, scores):
    model = tiny()
    shared, prompts = workload()
    eng = engine(model, kind, config=cfg, prefix_cache=True, batch_invariant=True, prefix_scores=scores)
    got = run(eng, prompts, len(shared))
    m = eng.metrics()
    assert m["prefix_misses"] == 1 and m["prefix_hits"] == len(prompts) - 1 and m["prefix_entries"] == 1
    assert m["prefix_hit_tokens"] == len(shared) * (len(prompts) - 1) and m["prefix_shared_bytes"] > 0
    for p, out in zip(prompts, got, strict=True):  # each one alone, a miss in a fresh engine
        alone = engine(model, kind, config=cfg, prefix_cache=True, batch_invariant=True, prefix_scores=scores)
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


@pytest.mark.parametrize("cfg", [REPEAT, MEAN], ids=["repeat", "mean"])
def test_a_repeat_scored_prefix_is_run_once_and_stored_as_scores_set_by_hand(cfg):
    """A shared prefix is placed at the config's context point (#62: repeat scores, peak importance, thresholds x
    context_scale; a repeat config is its own): scored and stored by one forward over prefix + bridge + prefix (no
    forward over the prefix alone), it holds the tiers a DiffKVCache at that point stores with the same scores set
    by hand, whatever the engine's own importance."""
    model = tiny()
    shared, prompts = workload(n=1, prefix=37)
    eng = engine(model, "diffkv", config=cfg, prefix_cache=True, batch_invariant=True)
    assert eng.prefix.point == context_point(cfg) and eng.prefix.point.prompt_scores == "repeat"
    lengths = []
    handle = model.register_forward_pre_hook(
        lambda m, args, kw: lengths.append((args[0] if args else kw["input_ids"]).shape[1]), with_kwargs=True)
    try:
        req = eng.add_request(prompts[0], GREEDY, prefix_tokens=len(shared))
        eng.step()
    finally:
        handle.remove()
    bridge = eng.prefix.bridge
    assert lengths[0] == 2 * len(shared) + len(bridge) and len(shared) not in lengths
    entry = next(iter(eng.prefix.entries.values()))
    x = torch.tensor([shared])
    by_hand = DiffKVCache(model, context_point(cfg))
    by_hand.set_prompt_scores(repeat_scores(model, x, torch.ones_like(x), bridge))
    with torch.no_grad():
        model(x, past_key_values=by_hand, use_cache=True)
    held = eng.cache.store.kv.tables.counts[:2, entry.slot].long()  # [2, layers, heads]
    by_hand_held = by_hand.store.kv.tables.counts[:2, by_hand.slots[0]].long()
    assert torch.equal(held, filled(by_hand_held, len(shared), eng.cache.store.kv.tables.tokens_per_page_hl))
    assert by_hand_held[1].sum() > 0 and by_hand_held.sum(0).min() < len(shared)  # low and pruned tokens
    by_hand.release()
    eng.run()
    assert req.finish_reason == "length"
    eng.prefix.evict_one()
    assert_pool_full(eng)


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
