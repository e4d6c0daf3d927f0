"""Query-agnostic prompt scores (``prompt_scores="repeat"``): the scoring pass, its use at prefill, the errors."""

import pytest
import torch
from test_cache_hf import SMALL, generate, left_padded_batch, tiny

from diffkv import DiffKVConfig
from diffkv.core.config import ConfigError
from diffkv.core.points import context_point
from diffkv.eval.methods import get_method
from diffkv.hf.repeat_scores import copy_peaks, repeat_prefill, repeat_scores
from diffkv.integrations.transformers import DiffKVCache

BRIDGE = [5, 6, 7]
REPEAT = dict(importance="peak", prompt_scores="repeat", alpha_high=8.0, alpha_low=4.0, recent_window=4,
              score_window=4, raw_dtype="float32")


@pytest.mark.parametrize("hq,hkv,t,n,copy_start,chunk", [(4, 2, 21, 7, 10, 3), (6, 2, 17, 5, 5, 4),
                                                        (3, 1, 13, 6, 12, 256), (2, 2, 9, 4, 4, 1)])
def test_copy_peaks_equal_the_full_causal_softmax(hq, hkv, t, n, copy_start, chunk):
    g = torch.Generator().manual_seed(3 + t)
    q, k = torch.randn(hq, t, 8, generator=g), torch.randn(hkv, t, 8, generator=g)
    got = copy_peaks(q, k, n=n, copy_start=copy_start, scaling=0.4, chunk=chunk)
    logits = torch.einsum("htd,hsd->hts", q, k.repeat_interleave(hq // hkv, 0)) * 0.4
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(logits, -1)[:, copy_start:, :n].amax(1).view(hkv, hq // hkv, n).amax(1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_scores_are_per_prompt_zero_at_padding_and_none_for_sliding_layers():
    model = tiny("qwen2")
    ids, mask = left_padded_batch()
    batch = repeat_scores(model, ids, mask, BRIDGE)
    assert len(batch) == SMALL["num_hidden_layers"] and all(s.shape == (3, 2, 23) for s in batch)
    for row in range(3):
        n = int(mask[row].sum())
        alone = repeat_scores(model, ids[row:row + 1, 23 - n:], mask[row:row + 1, 23 - n:], BRIDGE)
        for layer in range(len(batch)):
            torch.testing.assert_close(batch[layer][row, :, 23 - n:], alone[layer][0], rtol=1e-5, atol=1e-6)
            assert (batch[layer][row, :, :23 - n] == 0).all()
    assert all(0 < float(s.max()) <= 1 for s in batch)
    assert model.config._attn_implementation != "diffkv_repeat_scores"  # restored
    gemma = repeat_scores(tiny("gemma3"), ids[:1], mask[:1], BRIDGE)
    assert [s is None for s in gemma] == [True, False, True, False]


def test_prefill_keeps_the_larger_peak():
    """With every repeat score at 1 nothing is pruned and every token is high; with zeros the window decides."""
    model = tiny("qwen2")
    ids, mask = left_padded_batch(lengths=(23, 23), seed=2)
    kept = {}
    for value in (0.0, 1.0):
        cache = DiffKVCache(model, DiffKVConfig(**REPEAT))
        cache.set_prompt_scores([torch.full((2, 2, 23), value)] * SMALL["num_hidden_layers"])
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        tok = cache.kv.tables.num_tokens[cache.slots].long()  # [B, L, H, 2]
        kept[value] = (int(tok[..., 0].sum()), int(tok[..., 1].sum()))
        cache.release()
    cells = 2 * SMALL["num_hidden_layers"] * 2 * 23
    assert kept[1.0] == (cells, 0)
    assert sum(kept[0.0]) < cells, "the window scores alone pruned nothing: the comparison is too weak"


def test_errors_name_the_fix():
    with pytest.raises(ConfigError, match="importance='peak'"):
        DiffKVConfig(prompt_scores="repeat")
    with pytest.raises(ValueError, match="one of"):
        DiffKVConfig(prompt_scores="question")
    model = tiny("qwen2")
    ids, mask = left_padded_batch(lengths=(23,))
    cache = DiffKVCache(model, DiffKVConfig(**REPEAT))
    with pytest.raises(ValueError, match="set_prompt_scores"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="needs DiffKVConfig"):
        DiffKVCache(model, DiffKVConfig()).set_prompt_scores([None, None])
    bad = DiffKVCache(model, DiffKVConfig(**REPEAT))
    bad.set_prompt_scores([torch.zeros(1, 2, 5)] * 2)  # not the prompt's shape
    with pytest.raises(ValueError, match=r"repeat scores of shape \(1, 2, 23\)"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=bad, use_cache=True)
    method = get_method('diffkv+importance="peak"+prompt_scores="repeat"')
    assert not method.engine and get_method("diffkv").engine


def test_the_cache_scores_the_prompt_itself():
    """prompt_scores="repeat" without set_prompt_scores: the cache runs the re-read pass on generate's prompt and
    stores what the scores set by hand store; the hook goes with release()."""
    model = tiny("qwen2")
    ids, mask = left_padded_batch(lengths=(23, 17))
    bridge = [5, 6, 7, 8]
    cfg = DiffKVConfig(**REPEAT)
    by_hand = DiffKVCache(model, cfg)
    by_hand.set_prompt_scores(repeat_scores(model, ids, mask, bridge))
    want = generate(model, by_hand, ids, mask, 6)
    auto = DiffKVCache(model, cfg, bridge_ids=bridge)
    got = generate(model, auto, ids, mask, 6)
    assert torch.equal(got, want)
    assert auto.stats()["tokens_per_tier"] == by_hand.stats()["tokens_per_tier"]
    assert len(model._forward_pre_hooks) == 2  # one per cache (by_hand's did nothing: its scores were set)
    auto.release()
    by_hand.release()
    assert len(model._forward_pre_hooks) == 0


@pytest.mark.parametrize("kind,spans", [("qwen2", False), ("qwen2", True), ("gemma3", False)])
def test_repeat_prefill_stores_what_a_prefill_with_the_scores_stores(kind, spans):
    """One forward that scores and stores the prompt: the same tiers as scores set by hand and a prefill, and the
    same tokens after it (the held-back tail fed through the cache, then generate)."""
    model = tiny(kind)
    ids, _ = left_padded_batch(lengths=(23,), seed=4)
    cfg = DiffKVConfig(**REPEAT, score_spans=spans)
    starts = [torch.rand(18, generator=torch.Generator().manual_seed(5)) < 0.4] if spans else None
    caches = []
    for merged in (False, True):
        cache = DiffKVCache(model, cfg)
        if spans:
            cache.set_word_starts(starts)
        if merged:
            repeat_prefill(model, cache, ids[:, :18], BRIDGE)
        else:
            cache.set_prompt_scores(repeat_scores(model, ids[:, :18], torch.ones_like(ids[:, :18]), BRIDGE))
            with torch.no_grad():
                model(ids[:, :18], past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 18
        caches.append(cache)
    assert caches[1].stats()["tokens_per_tier"] == caches[0].stats()["tokens_per_tier"]
    outs = [generate(model, c, ids, torch.ones_like(ids), 6) for c in caches]
    assert torch.equal(outs[1], outs[0])
    for cache in caches:
        cache.release()


def test_repeat_prefill_refuses_what_it_cannot_do():
    model = tiny("qwen2")
    ids, mask = left_padded_batch(lengths=(9, 9), total=9)
    with pytest.raises(ValueError, match="one prompt"):
        repeat_prefill(model, DiffKVCache(model, DiffKVConfig(**REPEAT)), ids, BRIDGE)
    with pytest.raises(ValueError, match="prompt_scores='repeat'"):
        repeat_prefill(model, DiffKVCache(model, DiffKVConfig()), ids[:1], BRIDGE)
    cache = DiffKVCache(model, DiffKVConfig(**REPEAT))
    repeat_prefill(model, cache, ids[:1], BRIDGE)
    with pytest.raises(ValueError, match="already holds tokens"):
        repeat_prefill(model, cache, ids[:1], BRIDGE)
    cache.release()


@pytest.mark.parametrize("given", ["repeat", "window"])
def test_for_context_scores_and_stores_a_context_in_one_forward(given):
    """for_context with repeat scores: what scores set by hand and a prefill store, through one forward (the model
    runs once: its forward hook counts the calls). A window config is run at its context point (#62: repeat scores,
    peak importance, thresholds x context_scale), unless the caller asks for window scores."""
    model = tiny("qwen2")
    ids, _ = left_padded_batch(lengths=(20,), total=20, seed=6)
    if given == "repeat":
        cfg = given_cfg = DiffKVConfig(**REPEAT)
    else:
        given_cfg = DiffKVConfig(**{**REPEAT, "importance": "mean", "prompt_scores": "window", "alpha_high": 0.5,
                                    "alpha_low": 0.1, "context_scale": 4.0})
        cfg = context_point(given_cfg)
        window = DiffKVCache.for_context(model, ids, given_cfg, scores="window", max_forks=0)
        assert window.config == given_cfg
        window.release()
        with pytest.raises(ValueError, match="tokenizer= or bridge_ids="):
            DiffKVCache.for_context(model, ids, given_cfg, max_forks=0)
    by_hand = DiffKVCache(model, cfg)
    by_hand.set_prompt_scores(repeat_scores(model, ids, torch.ones_like(ids), BRIDGE))
    with torch.no_grad():
        model(ids, past_key_values=by_hand, use_cache=True)
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    ctx = DiffKVCache.for_context(model, ids, given_cfg, bridge_ids=BRIDGE, max_forks=0)
    handle.remove()
    assert ctx.config == cfg and len(calls) == 1 and ctx.get_seq_length() == 20
    assert ctx.stats()["tokens_per_tier"] == by_hand.stats()["tokens_per_tier"]
    ctx.release()
    by_hand.release()
