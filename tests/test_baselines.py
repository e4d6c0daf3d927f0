"""Baseline caches (KIVI, H2O, SnapKV, StreamingLLM) on a tiny random Llama: budgets, exactness, stats."""

import json
import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from diffkv.baselines import EvictionCache, H2OPolicy, KIVICache, SnapKVPolicy, StreamingLLMPolicy
from diffkv.eval.methods import DEFAULT_BUDGET, METHODS, derive_budget, method_stats

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
LENGTHS = (60, 40, 15)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    with torch.no_grad():  # sharpen attention so that scores differ between tokens
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
    return m


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (len(LENGTHS), max(LENGTHS)), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        mask[i, max(LENGTHS) - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def generate(model, cache, n=12):
    ids, mask = batch()
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, past_key_values=cache,
                              do_sample=False, pad_token_id=0)


def layers(cache):
    return [x for x in cache.layers if hasattr(x, "kept")]


@pytest.mark.parametrize("policy", [H2OPolicy(0.3), StreamingLLMPolicy(0.3), H2OPolicy(0.55)])
def test_eviction_keeps_its_budget(model, policy):
    cache = EvictionCache(model, policy)
    generate(model, cache, n=12)
    seen = torch.tensor(LENGTHS) + 11  # prompt + fed-back tokens (the last one is never fed)
    want = torch.clamp(torch.ceil(seen * policy.ratio).long(), min=policy.min_keep())
    for layer in layers(cache):
        assert layer.seen.tolist() == seen.tolist()
        assert (layer.kept() == want[:, None]).all()
        assert (layer.pos.max(-1).values == (seen - 1)[:, None]).all()  # the newest token is always kept
    s = method_stats(cache, model, int(seen.sum()))
    assert s["tokens_per_tier"]["high"] == int(want.sum()) * 2 * 2
    assert s["compression_theoretical"] == pytest.approx(int(seen.sum()) / int(want.sum()))


def test_streamingllm_keeps_sinks_and_recent(model):
    cache = EvictionCache(model, StreamingLLMPolicy(0.3, sinks=4))
    generate(model, cache, n=5)
    layer = layers(cache)[0]
    for b, n in enumerate(torch.tensor(LENGTHS) + 4):
        kept = sorted(p for p in layer.pos[b, 0].tolist() if p >= 0)
        budget = max(math.ceil(0.3 * int(n)), 5)
        assert kept == list(range(4)) + list(range(int(n) - budget + 4, int(n)))


def test_snapkv_compresses_prompt_only(model):
    cache = EvictionCache(model, SnapKVPolicy(0.3, window=8))
    generate(model, cache, n=10)
    prompt_keep = torch.clamp(torch.ceil(torch.tensor(LENGTHS) * 0.3).long(), min=8)
    for layer in layers(cache):
        assert (layer.kept() == (prompt_keep + 9)[:, None]).all()
        for b, n in enumerate(LENGTHS):  # the observation window is kept
            assert set(range(n - 8, n)) <= set(layer.pos[b, 0].tolist())


def test_full_budget_and_wide_residual_are_exact(model):
    want = generate(model, DynamicCache(config=model.config), n=8)
    assert torch.equal(generate(model, EvictionCache(model, H2OPolicy(1.0)), n=8), want)
    assert torch.equal(generate(model, KIVICache(model, bits=2, group_size=8, residual=128), n=8), want)


def test_kivi_flushes_whole_residuals(model):
    cache = KIVICache(model, bits=2, group_size=8, residual=16)
    generate(model, cache, n=10)  # 60 columns + 9 fed = 69 -> 64 quantized + 5 residual
    layer = cache.layers[0]
    assert layer.token_counts() == (64, 5)
    s = cache.stats()
    assert s["tokens_per_tier"] == {"high": 5 * 3 * 2 * 2, "low": 64 * 3 * 2 * 2, "pruned": 0}
    # head_dim 32, 2 bits, group 8: K+V codes 16 B + K and V meta 2 * 4 * 32 / 8 = 32 B vs 128 B fp16
    assert s["bytes_in_pages"] == 3 * 2 * 2 * (64 * 48 + 5 * 128)
    assert 1 < s["compression_physical"] < s["compression_theoretical"]


def test_every_method_builds_and_generates(model):
    for name, method in METHODS.items():
        cache = method.build(model, 0.5 if method.uses_budget else None, None)
        out = generate(model, cache, n=3)
        assert out.shape == (3, max(LENGTHS) + 3), name
        s = method_stats(cache, model, sum(LENGTHS) * 1 + 2 * 3)
        assert s["compression_physical"] > 0 and set(s["tokens_per_tier"]) == {"high", "low", "pruned"}, name
        if hasattr(cache, "release"):
            cache.release()


def test_lean_metadata_methods_set_only_their_options(model):
    from dataclasses import replace

    from diffkv.core.config import DiffKVConfig

    published = DiffKVConfig(smooth_keys=False)  # diffkv's config without a profile
    for name, options in (("diffkv-compact", {"compact_meta": True, "symmetric_keys": True}),
                          ("diffkv-compact-meta", {"compact_meta": True}),
                          ("diffkv-symmetric-keys", {"symmetric_keys": True})):
        cache = METHODS[name].build(model, None, None)
        assert cache.config == replace(published, **options), name
        assert f"with {' and '.join(options)} (" in METHODS[name].description, name


def test_derive_budget(tmp_path):
    assert derive_budget(tmp_path) == (DEFAULT_BUDGET, "default")
    (tmp_path / "diffkv").mkdir()
    (tmp_path / "diffkv" / "metrics.json").write_text(json.dumps({"compression_physical": 4.0}))
    ratio, source = derive_budget(tmp_path)
    assert ratio == 0.25 and source.endswith("metrics.json")


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="budget ratio"):
        H2OPolicy(0.0)
    with pytest.raises(ValueError, match="multiple of group_size"):
        KIVICache(model, residual=40)
