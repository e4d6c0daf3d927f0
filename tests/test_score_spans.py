"""Scores pooled over words (``DiffKVConfig.score_spans``, ``diffkv.core.spans``): word starts from a tokenizer, the
pooling against a loop, its use at prefill and in the engine, the errors of the hosts that do not support it."""

import dataclasses
import random

import pytest
import torch
from test_decode_step import AGGRESSIVE, build
from test_engine import CharTokenizer, assert_pool_full, engine, tiny

from diffkv import DiffKVConfig
from diffkv.core import policy
from diffkv.core.checks import ConfigError
from diffkv.core.spans import SPAN_MAX, pool_spans, word_edges, word_starts
from diffkv.engine import Engine, SamplingParams, make_cache
from diffkv.hf.auto_words import WordsOnFirstForward
from diffkv.integrations.transformers import DiffKVCache
from diffkv.profile import config_from_dict, config_to_dict


class WordTokenizer(CharTokenizer):
    """CharTokenizer's ids with a BPE-like vocabulary: id t is " X" (a word's first piece) when t % 4 == 0, "X\\n"
    when t % 9 == 0, else "X"; id 95 decodes to nothing (a hole)."""

    def __len__(self):
        return 96

    def convert_ids_to_tokens(self, ids):
        return [None if t == 95 else ("\u0120" if t % 4 == 0 else "") + chr(65 + t % 26) + ("\n" if t % 9 == 0 else "")
                for t in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens).replace("\u0120", " ")


def starts_by_rule(ids):
    return [i == 0 or ids[i] % 4 == 0 or ids[i] == 95 or ids[i - 1] % 9 == 0 or ids[i - 1] == 95
            for i in range(len(ids))]


def pooled_by_loop(score, starts, valid):
    """The max over each token's word (a run from a start to before the next, cut every SPAN_MAX tokens)."""
    b, h, length = score.shape
    out = torch.zeros_like(score)
    for bi in range(b):
        spans, cur = [], []
        for t in range(length):
            if not valid[bi, t]:
                continue
            if cur and (starts[bi, t] or len(cur) == SPAN_MAX):
                spans.append(cur)
                cur = []
            cur.append(t)
        spans += [cur] if cur else []
        for span in spans:
            out[bi, :, span] = score[bi, :, span].amax(-1, keepdim=True)
    return out


def test_word_starts_follow_whitespace_at_either_end_of_a_token():
    tok = WordTokenizer()
    edges = word_edges(tok)
    assert edges.shape == (2, 96) and edges[:, 95].all()  # a hole counts as whitespace
    ids = [5, 7, 8, 9, 10, 11, 12, 95, 13, 3]
    assert word_starts(torch.tensor(ids), edges).tolist() == starts_by_rule(ids)
    with pytest.raises(ValueError, match="another tokenizer"):
        word_starts(torch.tensor([3, 96]), edges)
    assert word_starts(torch.tensor([], dtype=torch.long), edges).numel() == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pool_is_the_max_over_each_word(seed):
    gen = torch.Generator().manual_seed(seed)
    length = 2 * SPAN_MAX + 30
    valid = torch.arange(length)[None, :] >= torch.tensor([0, 9, length - 3])[:, None]  # left padding
    starts = torch.rand(3, length, generator=gen) < 0.3
    starts[0, 10:10 + SPAN_MAX + 7] = False  # a word longer than SPAN_MAX: cut into two pieces
    score = torch.rand(3, 2, length, generator=gen) * valid[:, None, :]
    got = pool_spans(score, starts, valid)
    torch.testing.assert_close(got, pooled_by_loop(score, starts, valid), rtol=0, atol=0)
    assert (got >= score).all() and (got > score).any() and (got[~valid[:, None, :].expand_as(got)] == 0).all()


def test_a_uuid_is_kept_whole_where_a_window_is_not():
    """The question reads two pieces of a 36-token word sharply; pooled over the word, all of it scores as high."""
    score = torch.full((1, 1, 80), 1e-4)
    score[0, 0, [25, 40]] = 0.5
    valid = torch.ones(1, 80, dtype=torch.bool)
    starts = torch.ones(1, 80, dtype=torch.bool)
    starts[0, 21:56] = False  # the word is tokens 20 .. 55
    args = (torch.tensor([80]), 1.0, 0.02, 4, 4)
    words = policy.split_prefill(pool_spans(score, starts, valid), *args).tier[0, 0]
    window = policy.split_prefill(policy.pool_scores(score, valid, 7), *args).tier[0, 0]
    assert (words[20:56] == policy.HIGH).all() and (words[:20] == policy.PRUNED).all()
    assert (words[56:76] == policy.PRUNED).all()
    assert (window[20:56] == policy.PRUNED).any()


def test_prefill_stores_the_split_of_the_word_pooled_scores():
    lengths, group, d = [29, 5, 18], 2, 64
    cfg = DiffKVConfig(score_spans=True, **dict(AGGRESSIVE, alpha_high=4.0, alpha_low=1.0))
    comp = build(cfg, len(lengths), 2, d)
    gen = torch.Generator().manual_seed(3)
    total = max(lengths)
    q = torch.randn(3, 2 * group, total, d, generator=gen)
    k = torch.randn(3, 2, total, d, generator=gen) * 3.0
    v = torch.randn(3, 2, total, d, generator=gen)
    valid = torch.arange(total)[None, :] >= total - torch.tensor(lengths)[:, None]
    starts = torch.rand(3, total, generator=gen) < 0.4
    with pytest.raises(ValueError, match="word starts"):
        comp.prefill(q, k, v, valid, d ** -0.5)
    assert comp.kv.pool.free_pages() == comp.kv.pool.num_pages  # refused before taking a page
    split = comp.prefill(q, k, v, valid, d ** -0.5, word_starts=starts)
    score = pool_spans(policy.prefill_scores(q, k, valid, d ** -0.5, cfg.score_window), starts, valid)
    want = policy.split_prefill(score, valid.sum(1), cfg.alpha_high, cfg.alpha_low, cfg.recent_window,
                                cfg.score_window)
    assert torch.equal(split.tier, want.tier)


# thresholds the tiny model's near-uniform attention splits into both tiers and pruning
SPLIT = DiffKVConfig(alpha_high=4.0, alpha_low=1.2, importance="peak", recent_window=4, score_window=8,
                     raw_dtype="float32", page_bytes=256)
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def run_engine(config, prompts, tokenizer, **kw):
    """The engine's answers to ``prompts`` and the most tokens its pages held at once."""
    model = tiny()
    cache = make_cache("diffkv", model, kv_budget_bytes=1 << 20, raw_dtype="float32", config=config, max_slots=8,
                       max_model_len=128)
    eng = Engine(model, tokenizer, cache, **kw)
    reqs = [eng.add_request(p, GREEDY) for p in prompts]
    peak = 0
    while eng.has_work():
        eng.step()
        peak = max(peak, int(eng.cache.kv.tables.tokens_flat.sum()))
    assert eng.cache.store.words == {} and all(r.finish_reason == "length" for r in reqs)
    assert_pool_full(eng)
    return [r.output_ids for r in reqs], peak


@pytest.mark.parametrize("chunked", [None, 16], ids=["whole", "deferred-chunks"])
def test_engine_pools_each_prompt_over_its_own_words(chunked):
    """One word per token pools nothing (the answers of the unpooled config); real words keep more tokens, and every
    slot's word starts are dropped with it."""
    g = random.Random(5)
    prompts = [[g.randrange(3, 95) for _ in range(n)] for n in (40, 23, 31)]
    kw = {} if chunked is None else {"prefill_chunk": chunked}
    spans = dataclasses.replace(SPLIT, score_spans=True)
    plain, plain_peak = run_engine(SPLIT, prompts, CharTokenizer(), **kw)
    ones = WordTokenizer()
    ones.convert_ids_to_tokens = lambda ids: [" X"] * len(ids)  # every token starts a word
    singles, singles_peak = run_engine(spans, prompts, ones, **kw)
    assert singles == plain and singles_peak == plain_peak
    _, words_peak = run_engine(spans, prompts, WordTokenizer(), **kw)
    assert words_peak > plain_peak


def test_engine_refuses_a_prompt_without_word_starts():
    with pytest.raises(ValueError, match="Hugging Face tokenizer"):
        engine(tiny(), "diffkv", config=dataclasses.replace(SPLIT, score_spans=True))  # CharTokenizer has no vocab
    eng = engine(tiny(), "diffkv", config=SPLIT)
    eng.cache.store.config = dataclasses.replace(SPLIT, score_spans=True)  # as if a host forgot the word starts
    r = eng.add_request([5, 6, 7, 8, 9, 10], GREEDY)
    eng.run()
    assert r.finish_reason == "error" and "set_word_starts" in r.error
    assert_pool_full(eng)


def test_config_checks_and_profiles():
    with pytest.raises(ConfigError, match="score_spans"):
        DiffKVConfig(score_spans=1)
    with pytest.raises(ConfigError, match="set one"):
        DiffKVConfig(score_spans=True, score_pool=7)
    cfg = DiffKVConfig(score_spans=True)
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert "score_spans" not in config_to_dict(DiffKVConfig())


def generate_spans(config, tokenizer, ids, mask, **kw):
    """Greedy tokens of a DiffKVCache and the tokens its tiers held (high + low) right after the prompt."""
    model = tiny()
    cache = DiffKVCache(model, config, tokenizer=tokenizer, **kw)
    kept = {}
    first = next(layer for layer in cache.layers if hasattr(layer, "prefill_listeners"))
    first.prefill_listeners.append(lambda layer, split: kept.setdefault("n", int((split.n_high + split.n_low).sum())))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert cache.store.words == {} and hooks(model) == int(config.score_spans)  # used by the prefill, not kept
    cache.release()
    assert hooks(model) == 0
    return out[:, ids.shape[1]:].tolist(), kept["n"]


def hooks(model):
    return sum(isinstance(h, WordsOnFirstForward) for h in model._forward_pre_hooks.values())


def test_transformers_cache_reads_each_rows_words_from_its_ids():
    """Left-padded rows: each row's words come from its own tokens; one word per token pools nothing (the answers of
    the unpooled config), real words keep more tokens, and by hand (set_word_starts) equals the hook."""
    g = random.Random(9)
    rows = [[g.randrange(3, 95) for _ in range(n)] for n in (37, 22)]
    ids = torch.tensor([[0] * (37 - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (37 - len(r)) + [1] * len(r) for r in rows])
    spans = dataclasses.replace(SPLIT, score_spans=True)
    plain, plain_kept = generate_spans(SPLIT, None, ids, mask)
    ones = WordTokenizer()
    ones.convert_ids_to_tokens = lambda ids: [" X"] * len(ids)
    assert generate_spans(spans, ones, ids, mask) == (plain, plain_kept)
    words, words_kept = generate_spans(spans, WordTokenizer(), ids, mask)
    assert words_kept > plain_kept
    model = tiny()
    cache = DiffKVCache(model, spans, tokenizer=WordTokenizer())
    edges = word_edges(WordTokenizer())
    cache.set_word_starts([word_starts(torch.tensor(r), edges) for r in rows])
    cache._words_hook.remove()  # by hand only
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert out[:, ids.shape[1]:].tolist() == words
    cache.release()


def test_transformers_cache_errors():
    model = tiny()
    spans = dataclasses.replace(SPLIT, score_spans=True)
    with pytest.raises(ValueError, match="deferred"):
        DiffKVCache(model, spans, tokenizer=WordTokenizer(), chunked_prefill="deferred")
    with pytest.raises(ValueError, match="score_spans=True"):
        DiffKVCache(model, SPLIT).set_word_starts([torch.ones(3, dtype=torch.bool)])
    cache = DiffKVCache(model, spans, tokenizer=WordTokenizer())
    with pytest.raises(ValueError, match="inputs_embeds"), torch.no_grad():
        model(inputs_embeds=torch.randn(1, 5, 64), past_key_values=cache, use_cache=True)
    cache.release()
    cache = DiffKVCache(model, spans, tokenizer=WordTokenizer())
    cache.set_word_starts([torch.ones(3, dtype=torch.bool)] * 2)  # two rows for a batch of one
    cache._words_hook.remove()
    with pytest.raises(ValueError, match="one entry per batch row"), torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)


def test_vllm_refuses_it(monkeypatch):
    from diffkv.integrations.vllm.settings import CONFIG_ENV, read_settings

    monkeypatch.setenv(CONFIG_ENV, '{"score_spans": true}')
    with pytest.raises(ValueError, match="vLLM plug-in does not pass"):
        read_settings(64, "float32")
