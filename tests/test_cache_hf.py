"""DiffKVCache inside transformers generate(): exactness, invariants, errors (tiny random models)."""

import dataclasses

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from diffkv import DiffKVConfig
from diffkv.integrations.transformers import DiffKVCache

EXACT = DiffKVConfig(high="K16V16", low="K16V16", alpha_high=0.0, alpha_low=0.0, recent_window=4, score_window=8,
                     raw_dtype="float32", smooth_keys=False)
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SMALL)).eval()
    cfg = Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 32},
                           sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2)
    return Gemma3ForCausalLM(cfg).eval()


def left_padded_batch(lengths=(23, 17, 9), total=23, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (len(lengths), total), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, total - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def generate(model, cache, ids, mask, n, **kw):
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, past_key_values=cache,
                              pad_token_id=0, **kw)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("new_tokens", [2, 40])
def test_k16_no_pruning_equals_dynamic_cache(kind, new_tokens):
    model = tiny(kind)
    ids, mask = left_padded_batch()
    want = generate(model, DynamicCache(config=model.config), ids, mask, new_tokens)
    cache = DiffKVCache(model, EXACT)
    got = generate(model, cache, ids, mask, new_tokens)
    assert torch.equal(got, want)
    s = cache.stats()
    assert s["tokens_per_tier"]["pruned"] == 0 and s["tokens_per_tier"]["low"] == 0
    assert s["tokens_seen"] == sum([23, 17, 9]) + 3 * (new_tokens - 1)  # padding never cached; last token not fed


def test_padding_is_never_cached():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    cache = DiffKVCache(model, EXACT)
    generate(model, cache, ids, mask, 3)
    per_head = torch.tensor(cache.stats()["tokens_per_head"])  # [B, L, H]
    assert per_head.amax(dim=(1, 2)).tolist() == [25, 19, 11]  # prompt + 2 fed-back tokens


def test_decode_invariants_and_release():
    model = tiny("qwen2")
    with torch.no_grad():  # a random model attends almost uniformly; sharpen it so that importance varies
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
    cfg = DiffKVConfig(alpha_high=2.5, alpha_low=1.0, recent_window=4, score_window=4)
    cache = DiffKVCache(model, cfg)
    ids, mask = left_padded_batch(lengths=(40, 31), total=40)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=cache)
        tables = cache.kv.tables
        prev_tok, prev_pages = tables.num_tokens.clone(), tables.num_pages.clone()
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(30):
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            out = model(nxt, attention_mask=mask, past_key_values=cache)
            nxt = out.logits[:, -1:].argmax(-1)
            tok, pages = tables.num_tokens.clone(), tables.num_pages.clone()
            retained, prev_retained = tok.sum(-1), prev_tok.sum(-1)
            assert (retained >= prev_retained).all() and (retained - prev_retained <= 1).all()
            assert ((pages - prev_pages) >= 0).all() and ((pages - prev_pages) <= 1).all()
            cache.kv.pool.check_invariants(tables)
            prev_tok, prev_pages = tok, pages
    s = cache.stats()
    assert s["tokens_per_tier"]["low"] > 0 and s["tokens_per_tier"]["pruned"] > 0  # the policy did act
    assert s["compression_physical"] > 1
    pool = cache.kv.pool
    cache.release()
    assert pool.free_pages() == pool.num_pages
    cache.release()  # idempotent


def test_sampling_and_stats_shape():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    torch.manual_seed(3)
    cache = DiffKVCache(model, DiffKVConfig(recent_window=4, score_window=4))
    out = generate(model, cache, ids, mask, 10, do_sample=True, top_p=0.9)
    assert out.shape == (3, 33)
    s = cache.stats()
    assert set(s["tier_fractions"]) == {"high", "low", "pruned"}
    assert abs(sum(s["tier_fractions"].values()) - 1) < 1e-9
    assert s["bytes_in_pages"] == s["pages"] * s["page_bytes"] + s["key_center_bytes"]  # smooth_keys: 2 vectors


def test_gemma3_sliding_layers_stay_plain():
    model = tiny("gemma3")
    ids, mask = left_padded_batch()
    cache = DiffKVCache(model, DiffKVConfig(recent_window=4, score_window=4))
    generate(model, cache, ids, mask, 5)
    s = cache.stats()
    assert s["uncompressed_layers"] == [0, 2] and s["layers_compressed"] == 2
    # compression over every layer: the sliding layers' tokens are seen (fp16) and their window is kept (fp16)
    d, seen = 32, s["tokens_seen"]
    assert s["fp16_bytes"] == seen * 4 * 1 * 4 * d  # tokens x 4 layers x 1 KV head x (K+V) fp16
    window = sum(cache.layers[i].keys.shape[-2] for i in (0, 2))  # each sliding layer keeps <= 6 columns
    assert 0 < window <= 12 and s["window_layer_bytes"] == 3 * window * 4 * d  # batch 3
    assert s["bytes_kept"] == s["bytes_in_pages"] + s["window_layer_bytes"]
    assert s["compression_physical"] == pytest.approx(s["fp16_bytes"] / s["bytes_kept"])
    assert s["compression_physical_compressed"] == pytest.approx(seen * 2 * 4 * d / s["bytes_in_pages"])


def test_beam_search_is_a_clear_error():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with pytest.raises(NotImplementedError, match="beam search"):
        generate(model, DiffKVCache(model, DiffKVConfig()), ids, mask, 4, num_beams=2)


def test_other_caches_still_work_after_routing():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    before = generate(model, DynamicCache(config=model.config), ids, mask, 5)
    generate(model, DiffKVCache(model, DiffKVConfig()), ids, mask, 5)
    after = generate(model, DynamicCache(config=model.config), ids, mask, 5)
    assert torch.equal(before, after)


def run_with_key_transform(wide_channels: bool = False, **keys):
    """qwen2-like keys (a large offset on 4 channels; optionally 4 channels 30x wider) through exact storage with a
    key transform: the tokens and logits must be the full cache's. Returns (model, ids, mask, cache, k0, items):
    k0 [H, 17, D] are layer 0's prompt keys of sequence 1 (17 valid tokens, left-padded), items its heads."""
    model = tiny("qwen2")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias[:4] = 20.0
            if wide_channels:
                layer.self_attn.k_proj.weight[4:8] *= 30.0
    ids, mask = left_padded_batch()
    kw = dict(output_logits=True, return_dict_in_generate=True)
    want = generate(model, DynamicCache(config=model.config), ids, mask, 12, **kw)
    cache = DiffKVCache(model, dataclasses.replace(EXACT, **keys))
    got = generate(model, cache, ids, mask, 12, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-4)
    prompt = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=prompt, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    return model, ids, mask, cache, prompt.layers[0].keys[1, :, -17:], cache.layers[0].compressor.items.view(3, -1)[1]


def test_centered_keys_leave_attention_unchanged():
    """center_keys subtracts a per-head constant from every key: with exact storage the tokens are the full cache's,
    the recorded center is the median of the valid (unpadded) prompt keys, and the stats count its bytes."""
    model, ids, mask, cache, k0, items = run_with_key_transform(center_keys=True, smooth_keys=False)
    torch.testing.assert_close(cache.kv.key_center[items], k0.median(1).values, rtol=1e-5, atol=1e-5)
    plain = DiffKVCache(model, EXACT)
    generate(model, plain, ids, mask, 12)
    s, p = cache.stats(), plain.stats()
    assert s["key_center_bytes"] == 3 * 2 * 2 * 16 * 4 and p["key_center_bytes"] == 0  # B x L x H x D x fp32
    assert s["bytes_in_pages"] == p["bytes_in_pages"] + s["key_center_bytes"]


def test_smoothed_keys_leave_attention_unchanged():
    """smooth_keys stores (k - c) / s per channel and multiplies queries by s: with exact storage the tokens are the
    full cache's; c and s are the mid-range and half-range of the valid prompt keys; the stats count both vectors."""
    _, _, _, cache, k0, items = run_with_key_transform(wide_channels=True, smooth_keys=True)
    hi, lo = k0.amax(1), k0.amin(1)
    torch.testing.assert_close(cache.kv.key_center[items], (hi + lo) / 2)
    scale = cache.kv.key_scale[items]
    assert (scale >= (hi - lo) / 2 - 1e-6).all() and (scale >= (hi - lo).amax(-1, keepdim=True) / 128 - 1e-6).all()
    torch.testing.assert_close(scale.amax(-1), ((hi - lo) / 2).amax(-1))  # the widest channel is not floored
    s = cache.stats()
    assert s["key_center_bytes"] == 2 * 3 * 2 * 2 * 16 * 4  # center + scale, B x L x H x D x fp32


def test_smoothed_keys_quantize_outlier_channels_better():
    """qwen2-like keys (a large offset on some channels, a wide range on others): 4-bit per-token codes of the
    smoothed keys give attention logits q . k with a fraction of the plain codes' error; one-token prompts stay
    finite and well inside fp16."""
    from diffkv.cache.compressor import key_transform
    from diffkv.core import quant

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 40, 64, generator=g)
    keys[..., :4] += 60.0
    keys[..., 4:8] *= 25.0
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, :13] = False  # left padding: ignored
    keys[1, :, :13] = 1e4
    q = torch.randn(2, 3, 64, generator=g)
    center, scale = key_transform(keys, valid, smooth=True)
    assert center.abs().max() < 100 and (scale > 0).all()

    def logit_error(stored, back):
        deq = back(quant.dequantize(*quant.quantize(stored, 4)))
        return float(((deq - keys) * q[:, :, None]).sum(-1)[valid[:, None].expand(-1, 3, -1)].abs().mean())

    plain = logit_error(keys, lambda k: k)
    c, s = center[:, :, None], scale[:, :, None]
    smooth = logit_error((keys - c) / s, lambda k: k * s + c)
    assert smooth < plain / 2, (smooth, plain)  # measured: 3.2x less
    one = torch.zeros(1, 40, dtype=torch.bool)
    one[0, -1] = True
    center, scale = key_transform(keys[:1], one, smooth=True)
    assert torch.equal(center, keys[:1, :, -1])
    assert ((keys[:1] - center[:, :, None]) / scale[:, :, None]).abs().max() < 1e4


@pytest.mark.parametrize("keys", ["plain", "center_keys", "smooth_keys"])
def test_triton_paged_path_matches_reference_path(keys):
    """The CUDA dispatch (Triton kernels reading pages) run under the interpreter: same tokens as the torch path."""
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(12, 9), total=12)
    cfg = DiffKVConfig(recent_window=4, score_window=4, alpha_high=1.5, alpha_low=0.5,
                       smooth_keys=keys == "smooth_keys", center_keys=keys == "center_keys")
    ref_cache = DiffKVCache(model, cfg, attention_backend="torch")
    want = generate(model, ref_cache, ids, mask, 4)
    cache = DiffKVCache(model, cfg, attention_backend="triton")
    assert cache.attention_backend == "triton"
    got = generate(model, cache, ids, mask, 4)
    assert torch.equal(got, want)
    assert cache.layers[0].compressor.backend == "triton" and ref_cache.layers[0].compressor.backend == "torch"
    assert cache.stats()["tokens_per_tier"] == ref_cache.stats()["tokens_per_tier"]


@pytest.mark.gpu
def test_cuda_auto_runs_the_kernels_and_matches_the_reference_path(monkeypatch):
    """On CUDA, attention_backend="auto" decodes through the Triton kernels (counted) with the torch path's tokens."""
    from diffkv.ops import paged_attention, place_store

    model = tiny("llama").cuda()
    ids, mask = (t.cuda() for t in left_padded_batch(lengths=(40, 27), total=40))
    cfg = DiffKVConfig(recent_window=4, score_window=4, alpha_high=1.5, alpha_low=0.5)
    ref_cache = DiffKVCache(model, cfg, attention_backend="torch")
    want = generate(model, ref_cache, ids, mask, 16)
    calls = []

    def counted(fn, name):
        def call(*args, **kw):
            calls.append((name, kw.get("backend")))
            return fn(*args, **kw)
        return call

    for module, name in ((paged_attention, "paged_decode_attention"), (place_store, "place_store")):
        monkeypatch.setattr(module, name, counted(getattr(module, name), name))
    cache = DiffKVCache(model, cfg)
    got = generate(model, cache, ids, mask, 16)
    assert cache.layers[0].compressor.backend == "triton" and cache.layers[0].compressor.kv.pool.data.is_cuda
    assert set(calls) == {("paged_decode_attention", "triton"), ("place_store", "triton")}
    assert len(calls) >= 2 * 15 * len(cache.layers)  # every decode step of every layer
    assert torch.equal(got, want)
    assert cache.stats()["tokens_per_tier"] == ref_cache.stats()["tokens_per_tier"]


OPTIONS = dict(recent_window=4, score_window=4, alpha_high=3.0, alpha_low=1.0)  # all three tiers in use


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [
    DiffKVConfig(high="K8V3", low="K4V3", **OPTIONS),  # 3-bit codes (two planes)
    DiffKVConfig(high="K3V4-g8/16", low="K2V3-g8/8", symmetric_keys=True, **OPTIONS),  # keys below values
    DiffKVConfig(score_pool=5, compact_meta=True, **OPTIONS),  # pooled prefill scores
    DiffKVConfig(importance="peak", compact_meta=True, score_after_window=True, **OPTIONS),
    DiffKVConfig(page_bytes=1472, compact_meta=True, smooth_keys=True, **OPTIONS),  # a small fixed page
    DiffKVConfig(rotate_values=True, compact_meta=True, **OPTIONS),  # rotated values
], ids=["three-bit", "keys-below-values", "score-pool", "peak-after-window", "small-pages", "rotate-values"])
def test_cuda_triton_matches_the_torch_path_for_each_option(cfg):
    """Each option beyond the paper, through generate() on CUDA: the Triton kernels give the torch path's tokens."""
    model = tiny("llama").cuda()
    ids, mask = (t.cuda() for t in left_padded_batch(lengths=(40, 27), total=40))
    ref_cache = DiffKVCache(model, cfg, attention_backend="torch")
    want = generate(model, ref_cache, ids, mask, 12)
    cache = DiffKVCache(model, cfg, attention_backend="triton")
    got = generate(model, cache, ids, mask, 12)
    assert cache.layers[0].compressor.backend == "triton" and cache.layers[0].compressor.kv.pool.data.is_cuda
    assert torch.equal(got, want)
    assert cache.stats()["tokens_per_tier"] == ref_cache.stats()["tokens_per_tier"]


def test_full_pool_is_a_clear_error_and_leaks_nothing():
    from diffkv.memory import PoolExhausted

    model = tiny("llama")
    ids, mask = left_padded_batch()
    cache = DiffKVCache(model, DiffKVConfig(recent_window=4, score_window=4), kv_budget_bytes=4 * 1024)
    with pytest.raises(PoolExhausted, match="larger byte budget"):
        generate(model, cache, ids, mask, 3)
    pool = cache.kv.pool
    pool.check_invariants(cache.kv.tables)
    cache.release()
    assert pool.free_pages() == pool.num_pages


def test_attach_restores_the_model_and_frees_the_pages():
    import diffkv

    model = tiny("llama")
    before = model.config._attn_implementation
    ids, mask = left_padded_batch()
    want = generate(model, DynamicCache(config=model.config), ids, mask, 4)
    with diffkv.attach(model, EXACT) as cache:
        assert model.config._attn_implementation == "diffkv"
        assert torch.equal(generate(model, cache, ids, mask, 4), want)
        assert cache.kv.pool.free_pages() < cache.kv.pool.num_pages
    assert model.config._attn_implementation == before
    assert cache.kv.pool.free_pages() == cache.kv.pool.num_pages and cache.slots == []
    assert torch.equal(generate(model, DynamicCache(config=model.config), ids, mask, 4), want)
    with pytest.raises(ValueError, match="either config or profile"):
        with diffkv.attach(model, EXACT, profile="p.json"):
            pass


def test_teacher_forced_loop_matches_one_full_forward():
    from diffkv.hf.generation import continuation_nll, teacher_forced

    model = tiny("qwen2")
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits.float(), -1)[:, 11:-1]  # predictions of tokens 12..19
    got = torch.stack(list(teacher_forced(model, ids, 12, DynamicCache(config=model.config))), 1)
    assert got.shape == (2, 8, 96) and torch.allclose(got, ref, atol=1e-4)
    nll = continuation_nll(model, ids, 12, DynamicCache(config=model.config))
    want = -ref.gather(-1, ids[:, 12:, None])[..., 0].double().sum(1)
    assert torch.allclose(nll, want, atol=1e-3)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_page_size_changes_the_bytes_not_the_tokens(backend):
    """DiffKVConfig.page_bytes only repacks: the same tokens and tiers, other page counts."""
    model = tiny("llama")
    ids, mask = left_padded_batch()
    runs = []
    for page_bytes in (None, 256, 1024):
        cfg = DiffKVConfig(alpha_high=2.0, alpha_low=0.5, recent_window=4, score_window=4, page_bytes=page_bytes)
        cache = DiffKVCache(model, cfg, attention_backend=backend)
        runs.append((generate(model, cache, ids, mask, 30), cache.stats()))
    (want, ref), *others = runs
    for out, stats in others:
        assert torch.equal(out, want) and stats["tokens_per_tier"] == ref["tokens_per_tier"]
    assert [s["page_bytes"] for _, s in runs] == [992, 256, 1024]
    assert runs[1][1]["bytes_in_pages"] < ref["bytes_in_pages"]  # short sequences: less left empty at the ends
