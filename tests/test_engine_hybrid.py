"""Serving engine on a hybrid model (Gemma-3: sliding-window + full-attention layers): exactness vs generate(),
the sliding layers' pages recycled within one pool, preemption / cancellation, byte accounting, the server."""

import dataclasses
import http.client
import json

import pytest
import torch
from test_engine import GREEDY, CharTokenizer, arrive_and_cancel, prompts, reference, staggered_equals_generate
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from diffkv import DiffKVConfig
from diffkv.engine import Engine, SamplingParams, make_cache
from diffkv.memory.owned import owned_bytes

WINDOW = 6


def tiny_gemma(window=WINDOW):
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                           sliding_window=window, layer_types=["sliding_attention", "full_attention"] * 2)
    model = Gemma3ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def engine(model, kind="fp16", pages=None, config=None, **kw):
    make = dict(raw_dtype="float32", config=config, max_slots=8, max_model_len=160)
    probe = make_cache(kind, model, kv_budget_bytes=1 << 20, **make)
    cache = make_cache(kind, model, kv_budget_bytes=probe.budget_for_pages(pages) if pages else 1 << 20, **make)
    return Engine(model, CharTokenizer(), cache, **kw)


def assert_pages_conserved(cache):
    """Every pool page is free, owned by one DiffKV head or held by one sliding-window block: exactly once."""
    pool, tables, sliding = cache.kv.pool, cache.kv.tables, cache.sliding
    start, free, _ = pool.state.tolist()
    free_ids = pool.ring.long()[(start + torch.arange(free)) % pool.num_pages]
    pages = tables.pages_flat.long()
    col = torch.arange(tables.width)[None, :]
    diffkv = tables.rows.long()[(col < pages[:, :1]) | (col >= tables.width - pages[:, 1:2])]
    held = sliding.owned_pages()
    assert held.numel() == sliding.held and bool((pool.refcount[held] == 1).all())
    count = torch.bincount(torch.cat([free_ids, diffkv, held]), minlength=pool.num_pages)
    assert bool((count == 1).all()), "a page is lost or owned twice"


def assert_pool_full(eng):
    pool = eng.cache.kv.pool
    assert pool.free_pages() == pool.num_pages and eng.cache.sliding.held == 0
    assert bool((eng.cache.sliding.pages == -1).all())
    pool.check_invariants(eng.cache.kv.tables)


def test_fp16_cache_equals_generate_with_staggered_arrivals():
    model = tiny_gemma()
    eng = engine(model)
    assert eng.cache.sliding.layers == [0, 2] and eng.cache.full_layers == [1, 3]
    ps = [*prompts(4), [7], *prompts(2, seed=9)]  # prompts shorter and longer than the window, one token
    reqs = []
    for i, p in enumerate(ps):  # arrivals every other step (two at once at the end: a batched prefill)
        reqs.append(eng.add_request(p, GREEDY))
        if i < len(ps) - 2:
            eng.step()
            eng.step()
            assert_pages_conserved(eng.cache)
    eng.run()
    for r, p in zip(reqs, ps, strict=True):
        assert r.finish_reason == "length" and r.output_ids == reference(model, p, 20)
    assert eng.peak_running >= 3
    assert_pool_full(eng)


def test_long_generation_recycles_the_sliding_pages():
    model = tiny_gemma()
    eng = engine(model)
    sliding = eng.cache.sliding
    bound = sliding.max_blocks * sliding.pages_per_block  # the window's pages, whatever the length
    r = eng.add_request([5, 9, 11], SamplingParams(max_new_tokens=120, ignore_eos=True))
    first_block, full_pages, states = [], [], []
    while eng.has_work():
        eng.step()
        assert sliding.held <= bound
        assert_pages_conserved(eng.cache)
        if r.slot is not None:
            first_block.append(sliding.first[r.slot])
            full_pages.append(eng.metrics()["pages_used"] - sliding.held)
            states.append((r.num_tokens - 1, 120 - len(r.output_ids), sliding.held))  # tokens held, ahead, pages
    # what the decode reserve counts for the window's growth bounds it from every step on (the window of 6 is not
    # a whole number of 4-token blocks: it holds 2 or 3); once full, it is the one boundary block
    for i, (held_tokens, ahead, pages) in enumerate(states):
        grows = sliding.growth_pages(held_tokens, ahead)
        assert max(p for *_, p in states[i:]) - pages <= grows
        assert grows == sliding.pages_per_block or held_tokens < WINDOW
    assert r.output_ids == reference(model, [5, 9, 11], 120)
    # 122 tokens in blocks of 4 (one page per sliding layer): ~30 blocks went back to the pool, <= 3 live at once,
    # while the full-attention layers kept every token
    assert sliding.tokens_per_page == 4 and bound == 3 * 2
    assert first_block[-1] >= 27 and full_pages[-1] >= 2 * 120 // 4
    assert_pool_full(eng)


@pytest.mark.parametrize("reserve", [None, (0.2, 0.05, 0.01)])  # none; a small decode reserve, jumping to 1
def test_preemption_and_cancellation_free_every_page(reserve):
    model = tiny_gemma()
    ps = prompts(8, seed=3, lo=10, hi=30)
    want = {i: reference(model, p, 20) for i, p in enumerate(ps)}
    eng = engine(model, pages=52, reserve=reserve)  # two or three requests at once
    reqs, cancelled = arrive_and_cancel(eng, ps, 0.08, each_step=lambda: assert_pages_conserved(eng.cache))
    assert eng.counters.preemptions > 0 and cancelled, "the pool was meant to force preemption, the rng to cancel"
    for i, r in reqs.items():
        if r.finish_reason == "cancelled":
            assert i in cancelled
        else:
            assert r.finish_reason == "length" and r.output_ids == want[i], f"request {i} changed"
    assert_pool_full(eng)


def test_diffkv_cache_counts_both_kinds_of_pages():
    model = tiny_gemma(window=8)
    cfg = DiffKVConfig(high="K8V4", low="K4V2", alpha_high=1.0, alpha_low=0.05, recent_window=4, score_window=4)
    eng = engine(model, kind="diffkv", config=cfg)
    cache, sliding = eng.cache, eng.cache.sliding
    assert cache.kv.tables.shape[1] == 2  # tables (and key centers) for the full-attention layers only
    per_layer = dataclasses.replace(cfg, layer_alphas=((9.0, 0.9), (1.0, 0.1), (8.0, 0.8), (2.0, 0.2)))
    assert engine(model, kind="diffkv", config=per_layer).cache.kv.config.layer_alphas == ((1.0, 0.1), (2.0, 0.2))
    full = cache.prefill_pages(40) - cache.sliding_pages(40)
    assert cache.sliding_pages(40) == sliding.pages_per_block * sliding.max_blocks
    assert cache.sliding_pages(3) == sliding.pages_per_block and full > 0
    high = cache.kv.tables.tokens_per_page_hl[0]  # decoded tokens: high tier (full), the window's growth
    assert cache.decode_pages([(3, 40)]) == -(-40 * 2 // high) + sliding.growth_pages(3, 40) > -(-40 * 2 // high)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts(4, lo=60, hi=90)]
    for _ in range(4):
        eng.step()
        assert owned_bytes(cache) == cache.nbytes() <= cache.kv_budget_bytes
        assert_pages_conserved(cache)
    m = eng.metrics()
    assert m["running"] == 4 and m["pages_sliding"] == sliding.held > 0
    # over every layer the sliding layers count every token seen but keep only their window
    assert m["compression_physical"] > m["compression_physical_compressed"] > 1
    eng.run()
    assert all(r.finish_reason == "length" and len(r.output_ids) == 12 for r in reqs)
    assert_pool_full(eng)


def test_the_decode_reserve_counts_a_full_window_by_its_boundary_block():
    """Admission keeps room for the tokens running requests may still write; a sliding layer whose window is full
    grows by at most one block (one leaves as one enters), not by a block per ``tokens_per_page`` tokens."""
    model = tiny_gemma()
    eng = engine(model, pages=170, reserve=(1.0, 1.0, 0.0))  # the whole decode reserved ahead
    cache, sliding = eng.cache, eng.cache.sliding
    full = 40 * 2 // 4  # 40 tokens in pages of 4 per full-attention layer (2 layers x 1 KV head)
    assert cache.decode_pages([(28, 40)]) == full + sliding.pages_per_block  # window of 6 full: the boundary
    assert cache.decode_pages([(2, 40)]) == full + 2 * sliding.pages_per_block  # fills its window, then the same
    assert cache.decode_pages([(2, 2)]) == 1  # one full-attention page (4 head-tokens); block 0 holds both
    assert cache.decode_pages([(28, 40)], 0.5) == full // 2 + sliding.pages_per_block
    ps = prompts(6, seed=4, lo=28, hi=29)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in ps]
    while eng.has_work():
        eng.step()
        assert_pages_conserved(cache)
    # 28 + 40 tokens: at most 34 full-attention pages + the window's 6 each; four fit in 170 pages (three when
    # the full windows' growth was counted as 20 pages each) and, the reserve being enough, none is preempted
    assert eng.peak_running == 4 and eng.counters.preemptions == 0
    for r, p in zip(reqs, ps, strict=True):
        assert r.finish_reason == "length" and r.output_ids == reference(model, p, 40)
    assert_pool_full(eng)


def test_a_request_whose_window_cannot_fit_is_refused_up_front():
    model = tiny_gemma()
    eng = engine(model, pages=10)
    # 12 tokens: 3 pages per full-attention layer (6) fit, not with the sliding layers' 3 blocks of 2 pages
    assert eng.cache.prefill_pages(12) == 6 + 6
    with pytest.raises(ValueError, match="KV pages"):
        eng.add_request([5] * 10, SamplingParams(max_new_tokens=2))
    r = eng.add_request([5] * 5, SamplingParams(max_new_tokens=2))
    eng.run()
    assert r.finish_reason == "length"
    with pytest.raises(ValueError, match="sliding_window"):
        bad = tiny_gemma()
        bad.config.sliding_window = None
        make_cache("fp16", bad, kv_budget_bytes=1 << 20)


def test_server_serves_a_hybrid_model():
    from test_server import CharTokenizer as ServerTokenizer

    from diffkv.serve.server import start_server

    model, tok = tiny_gemma(), ServerTokenizer()
    eng = engine(model)
    eng.tokenizer = tok
    with start_server(eng, "tiny-gemma") as handle:
        conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=30)
        body = {"prompt": "Hello there, world", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = json.loads(resp.read())
        conn.close()
    assert resp.status == 200 and out["usage"]["completion_tokens"] == 10
    assert out["choices"][0]["text"] == tok.decode(reference(model, tok("Hello there, world").input_ids, 10))
    assert_pool_full(eng)


@pytest.mark.real_model
def test_fp16_cache_equals_generate_on_gemma3():
    from diffkv.registry.models import load_model

    model, tok = load_model("gemma3-270m")
    ps = [tok(t).input_ids for t in ("The capital of France is", "def fib(n):\n    ")]
    cache = make_cache("fp16", model, kv_budget_bytes=64 << 20, raw_dtype="float32", max_slots=4,
                       max_model_len=256)
    staggered_equals_generate(model, tok, cache, ps, 8)
    assert cache.free_pages() == cache.num_pages and cache.sliding.held == 0


def test_gsm8k_prompts_without_a_chat_template_are_plain_text(monkeypatch):
    import diffkv.registry.data
    from diffkv.bench.serve import gsm8k_prompts

    rows = [{"question": f"q{i}?", "answer": f"#### {i}"} for i in range(4)]
    monkeypatch.setattr(diffkv.registry.data, "load_dataset", lambda name: rows)

    class BaseTokenizer:  # a base model's tokenizer (gemma3-270m): no chat template
        chat_template = None

        def __call__(self, text):
            return type("Enc", (), {"input_ids": [text]})()

    (one,) = gsm8k_prompts(BaseTokenizer(), 1)
    assert len(one) == 1 and "q0?" in one[0]
