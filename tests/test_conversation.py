"""A DiffKVCache that lives as long as a conversation: chunked prefill, multi-token turns and cropping (tiny models).

Lossless settings (K16V16, alpha = 0) must give DynamicCache's tokens exactly; compressing settings must give the
tokens of feeding the same tokens one decode step at a time (``extend`` is n decode steps)."""

import dataclasses

import pytest
import torch
from test_cache_hf import EXACT, generate, left_padded_batch, tiny
from transformers import DynamicCache

from diffkv import DiffKVConfig
from diffkv.integrations.transformers import DiffKVCache

BACKENDS = ["torch", "cpu", "triton"]  # triton under TRITON_INTERPRET=1 (conftest)
SQUEEZE = DiffKVConfig(recent_window=4, score_window=4, alpha_high=3.0, alpha_low=1.0)  # demotes at every step


def forward(model, cache, ids):
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True).logits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_in_generate_equals_dynamic_cache(backend, chunk):
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(23,), total=23)
    want = generate(model, DynamicCache(config=model.config), ids, mask, 12)
    cache = DiffKVCache(model, EXACT, attention_backend=backend)
    got = generate(model, cache, ids, mask, 12, prefill_chunk_size=chunk)
    assert torch.equal(got, want)
    assert cache.seen_tokens().tolist() == [23 + 11]


@pytest.mark.parametrize("chunk", [5, 16])
def test_deferred_chunks_store_what_a_whole_prefill_stores(chunk):
    """chunked_prefill="deferred": the chunks are held at full precision and split as one prompt at the first
    decode step, so a compressing cache gives the whole prefill's tokens and tiers; the held bytes are counted."""
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(23, 17))
    whole = DiffKVCache(model, SQUEEZE)
    want = generate(model, whole, ids, mask, 10)
    deferred = DiffKVCache(model, SQUEEZE, chunked_prefill="deferred")
    got = generate(model, deferred, ids, mask, 10, prefill_chunk_size=chunk)
    assert torch.equal(got, want)
    assert deferred.stats()["tokens_per_tier"] == whole.stats()["tokens_per_tier"]
    assert not deferred.stage
    held = DiffKVCache(model, SQUEEZE, chunked_prefill="deferred")
    forward(model, held, ids[:, :chunk])
    staged = held.stage.nbytes()
    assert staged > 0 and held.nbytes() >= staged
    forward(model, held, ids[:, chunk:])
    held.finish_prefill()
    assert not held.stage and held.stats()["tokens_per_tier"]["high"] > 0


def test_deferred_prompt_with_drafts_drops_the_rejected_and_stores_the_rest():
    """Assisted decoding sends the prompt and the first drafts in one call: a crop while they are staged drops the
    rejected drafts and stores the prompt then, so generation equals DynamicCache (lossless) and compresses."""
    model = tiny("llama")
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(7)).repeat(1, 3)
    mask = torch.ones_like(ids)
    want = generate(model, DynamicCache(config=model.config), ids, mask, 16)
    cache = DiffKVCache(model, dataclasses.replace(EXACT, recent_window=16), chunked_prefill="deferred")
    assert torch.equal(generate(model, cache, ids, mask, 16, prompt_lookup_num_tokens=4), want)
    assert not cache.stage
    held = DiffKVCache(model, SQUEEZE, chunked_prefill="deferred")
    forward(model, held, ids[:, :30])
    held.crop(-3)
    assert not held.stage and held.seen_tokens().tolist() == [27] and held.get_seq_length() == 27
    with pytest.raises(ValueError, match="at most 4"):
        staged = DiffKVCache(model, SQUEEZE, chunked_prefill="deferred")
        forward(model, staged, ids[:, :30])
        staged.crop(-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_turn_chat_equals_dynamic_cache(backend):
    """generate() again on the same cache with the conversation so far: each turn is appended by extend."""
    model = tiny("qwen2")
    g = torch.Generator().manual_seed(3)
    turns = [torch.randint(3, 96, (1, n), generator=g) for n in (19, 7, 11)]
    outs = {}
    for name, cache in (("dynamic", DynamicCache(config=model.config)),
                        ("diffkv", DiffKVCache(model, EXACT, attention_backend=backend))):
        ids = torch.empty(1, 0, dtype=torch.long)
        for turn in turns:
            ids = torch.cat([ids, turn], 1)
            ids = generate(model, cache, ids, torch.ones_like(ids), 6)
        outs[name] = ids
    assert torch.equal(outs["diffkv"], outs["dynamic"])


def test_extend_equals_one_token_steps_when_compressing():
    """With thresholds that prune and demote, an n-token call stores and answers as n single-token calls."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(5)
    prompt, more = torch.randint(3, 96, (2, 30), generator=g), torch.randint(3, 96, (2, 9), generator=g)
    chunked, stepped = DiffKVCache(model, SQUEEZE), DiffKVCache(model, SQUEEZE)
    forward(model, chunked, prompt)
    forward(model, stepped, prompt)
    low_after_prompt = chunked.stats()["tokens_per_tier"]["low"]
    got = forward(model, chunked, more)
    want = torch.cat([forward(model, stepped, more[:, i:i + 1]) for i in range(more.shape[1])], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert chunked.stats()["tokens_per_tier"] == stepped.stats()["tokens_per_tier"]
    assert chunked.stats()["tokens_per_tier"]["low"] > low_after_prompt  # the decode rule demoted tokens
    chunked.kv.pool.check_invariants(chunked.kv.tables)


def test_padding_among_new_tokens_is_refused():
    model = tiny("llama")
    cache = DiffKVCache(model, EXACT)
    forward(model, cache, torch.randint(3, 96, (1, 12)))
    ids = torch.randint(3, 96, (1, 4))
    mask = torch.cat([torch.ones(1, 12, dtype=torch.long), torch.tensor([[0, 1, 1, 1]])], 1)
    with torch.no_grad(), pytest.raises(ValueError, match="must not be padding"):
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    ids, mask = left_padded_batch(lengths=(23, 17))
    with pytest.raises(ValueError, match="all padding"):  # row 2's 6 padding columns outlast a 4-token chunk
        generate(model, DiffKVCache(model, EXACT), ids, mask, 2, prefill_chunk_size=4)
    with pytest.raises(ValueError, match="chunked_prefill must be one of"):
        DiffKVCache(model, EXACT, chunked_prefill="later")


@pytest.mark.parametrize("backend", BACKENDS)
def test_assisted_generation_equals_dynamic_cache(backend):
    """Prompt-lookup decoding drafts tokens, the model verifies them in one call, the cache crops the rejected."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 96, (1, 12), generator=g).repeat(1, 3)  # repeated text: the lookup finds drafts
    mask = torch.ones_like(ids)
    cfg = dataclasses.replace(EXACT, recent_window=16)
    want = generate(model, DynamicCache(config=model.config), ids, mask, 16)
    cache = DiffKVCache(model, cfg, attention_backend=backend)
    dropped = []
    crop = DiffKVCache.crop

    def counted(self, tokens_to_remove):
        dropped.append(self.get_seq_length())
        crop(self, tokens_to_remove)
        dropped[-1] -= self.get_seq_length()

    DiffKVCache.crop = counted
    try:
        got = generate(model, cache, ids, mask, 16, prompt_lookup_num_tokens=4)
    finally:
        DiffKVCache.crop = crop
    assert torch.equal(got, want)
    assert sum(dropped) > 0  # drafts were rejected and cropped


def test_crop_drops_appended_tokens_and_refuses_what_it_cannot_undo():
    model = tiny("llama")
    cache = DiffKVCache(model, dataclasses.replace(EXACT, recent_window=8))
    forward(model, cache, torch.randint(3, 96, (1, 10)))
    forward(model, cache, torch.randint(3, 96, (1, 2)))  # 12 tokens: the newest 8 (positions 4-11) can go
    before = cache.stats()["tokens_per_tier"]
    with pytest.raises(ValueError, match="recent window"):
        cache.crop(-9)
    cache.crop(-3)  # two added tokens and the prompt's last one
    assert cache.seen_tokens().tolist() == [9] and cache.get_seq_length() == 9
    assert cache.stats()["tokens_per_tier"]["high"] == before["high"] - 3 * 2 * 2  # 3 tokens x 2 layers x 2 heads
    cache.kv.pool.check_invariants(cache.kv.tables)
    with pytest.raises(ValueError, match="recent window of the prompt"):
        cache.crop(-6)  # position 3 was placed at prefill (outside the prompt's window of 8)
    assert cache.seen_tokens().tolist() == [9]
    # the model continues from the cropped state as if the dropped tokens had never come
    tail = torch.randint(3, 96, (1, 2))
    forward(model, cache, tail)
    assert cache.seen_tokens().tolist() == [11]
    cache.kv.pool.check_invariants(cache.kv.tables)


def test_crop_refuses_single_token_steps_that_moved_older_tokens():
    model = tiny("llama")
    cache = DiffKVCache(model, SQUEEZE)
    forward(model, cache, torch.randint(3, 96, (1, 30)))
    for tok in torch.randint(3, 96, (3, 1, 1)):  # decode steps: no undo records
        forward(model, cache, tok)
    held = cache.stats()["tokens_per_tier"]
    with pytest.raises(ValueError, match="cannot be undone"):
        cache.crop(-3)
    assert cache.stats()["tokens_per_tier"] == held and cache.get_seq_length() == 33


def stored_tokens(cache):
    """Per table layer and tier: (counts, keys, values, scores, positions) exactly as the pages decode them."""
    from diffkv.memory import HIGH_COL, LOW_COL

    kv, out = cache.kv, []
    for layer in cache.store.layers:
        items = kv.tables.select(cache.slots, layers=[layer]).items
        counts = kv.tables.tokens_flat[items].long()
        for tier in (HIGH_COL, LOW_COL):
            n = counts[:, tier]
            keys, values, scores, pos, valid = kv.read(tier, items, n, int(n.max()) + 1)
            out.append((n, keys[valid], values[valid], scores[valid], pos[valid]))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_crop_of_a_verified_chunk_undoes_its_placements(backend):
    """Draft tokens fed in one call while the decode rule prunes and demotes: cropping them brings back exactly the
    tokens, tiers and scores of a cache that only got the accepted ones (the dropped queries' attention too)."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(11)
    prompt, drafts = torch.randint(3, 96, (2, 30), generator=g), torch.randint(3, 96, (2, 6), generator=g)
    cropped = DiffKVCache(model, SQUEEZE, attention_backend=backend)
    accepted = DiffKVCache(model, SQUEEZE, attention_backend=backend)
    for cache in (cropped, accepted):
        forward(model, cache, prompt)
    low_before = cropped.stats()["tokens_per_tier"]["low"]
    forward(model, cropped, drafts)
    assert cropped.stats()["tokens_per_tier"]["low"] > low_before  # the drafts' steps demoted older tokens
    cropped.crop(-4)
    forward(model, accepted, drafts[:, :2])
    assert cropped.seen_tokens().tolist() == accepted.seen_tokens().tolist() == [32, 32]
    for before, after in zip(stored_tokens(cropped), stored_tokens(accepted), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    cropped.kv.pool.check_invariants(cropped.kv.tables)
    assert cropped.store.crop_log.nbytes() > 0


def test_prompt_lookup_decoding_runs_on_a_compressing_cache():
    """It runs, and says (once a crop drops drafts that came with the prompt) that the prompt's split saw them and
    what gives plain decoding's tokens; with the prompt staged (chunked_prefill="deferred") nothing to say."""
    import warnings

    model = tiny("llama")
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(7)).repeat(1, 3)
    cache = DiffKVCache(model, SQUEEZE)
    with pytest.warns(UserWarning, match="chunked_prefill='deferred'"):
        out = generate(model, cache, ids, torch.ones_like(ids), 16, prompt_lookup_num_tokens=4)
    assert out.shape[1] == 36 + 16
    cache.kv.pool.check_invariants(cache.kv.tables)
    staged = DiffKVCache(model, SQUEEZE, chunked_prefill="deferred")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="DiffKVCache.crop")
        assert torch.equal(generate(model, staged, ids, torch.ones_like(ids), 16, prompt_lookup_num_tokens=4), out)


def test_only_the_recent_window_of_a_long_call_keeps_undo_records():
    """A call longer than recent_window (4 here) records undo data for its last 4 steps only: a crop reaches no
    further."""
    model = tiny("llama")
    cache = DiffKVCache(model, SQUEEZE)
    forward(model, cache, torch.randint(3, 96, (1, 30)))
    forward(model, cache, torch.randint(3, 96, (1, 10)))
    assert len(cache.store.crop_log.steps[0]) == 4
    with pytest.raises(ValueError, match="recent window"):
        cache.crop(-5)
    cache.crop(-4)
    assert cache.get_seq_length() == 36 and not cache.store.crop_log.steps[0]
    cache.kv.pool.check_invariants(cache.kv.tables)


@pytest.mark.parametrize("n_drafts,kept", [(6, 2), (1, 1), (1, 0)])
def test_drafts_sent_with_the_prompt_are_decode_steps_when_the_prompt_length_is_known(n_drafts, kept):
    """set_prompt_length: the first call's prompt is stored as if alone and its drafts as decode steps, so after a
    crop that keeps ``kept`` of them the cache holds exactly what plain decoding stores (tokens, tiers, scores).
    One draft (assisted decoding's first round can send one) is a one-token step of each layer after that layer's
    prompt, not a step planned for every layer at the first, and keeps its undo record (a crop may drop it)."""
    import warnings

    from diffkv.engine.invariance import invariant_rows

    model = tiny("llama")
    g = torch.Generator().manual_seed(17)
    prompt, drafts = torch.randint(3, 96, (1, 30), generator=g), torch.randint(3, 96, (1, n_drafts), generator=g)
    with invariant_rows(model), warnings.catch_warnings():
        warnings.filterwarnings("error", message="DiffKVCache.crop")
        lookup = DiffKVCache(model, SQUEEZE)
        lookup.set_prompt_length(30)
        forward(model, lookup, torch.cat([prompt, drafts], 1))
        if n_drafts > kept:
            lookup.crop(30 + kept)
        plain = DiffKVCache(model, SQUEEZE)
        for ids in (prompt, *(drafts[:, i:i + 1] for i in range(kept))):
            forward(model, plain, ids)
    assert lookup.seen_tokens().tolist() == plain.seen_tokens().tolist() == [30 + kept]
    for a, b in zip(stored_tokens(lookup), stored_tokens(plain), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="before the first call"):
        lookup.set_prompt_length(30)
    with pytest.raises(ValueError, match="chunked_prefill='extend'"):
        DiffKVCache(model, SQUEEZE, chunked_prefill="deferred").set_prompt_length(30)


def test_score_copies_only_for_calls_of_draft_size():
    """A call of at most SCORED_CALL tokens keeps each step's scores (an exact crop); a longer one (a turn, a chunk)
    keeps none: its undo records stay a few slots per step however long the context."""
    from diffkv.cache.undo import SCORED_CALL

    model = tiny("llama")
    cache = DiffKVCache(model, SQUEEZE)
    forward(model, cache, torch.randint(3, 96, (1, 30)))
    forward(model, cache, torch.randint(3, 96, (1, SCORED_CALL + 1)))
    assert all(r.scores is None for r in cache.store.crop_log.steps[0])
    forward(model, cache, torch.randint(3, 96, (1, 3)))
    records = cache.store.crop_log.steps[0]  # the long call's last recent_window (4) steps, then the short call's 3
    assert [r.scores is None for r in records] == [True] * 4 + [False] * 3
    assert all(len(r.scores) == int(r.counts.sum()) for r in records[4:])


@pytest.mark.parametrize("config", [EXACT, SQUEEZE], ids=["exact", "compressing"])
def test_a_context_compressed_once_answers_like_one_prefilled_per_question(config):
    """for_context + fork: each question through its own fork gives what a cache that prefilled the context for
    that question gives, and the forks share no page."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(13)
    context, questions = torch.randint(3, 96, (1, 30), generator=g), torch.randint(3, 96, (2, 1, 6), generator=g)
    ctx = DiffKVCache.for_context(model, context, config, max_forks=0, scores="window")  # forks copy the pages
    for q in questions:
        ids = torch.cat([context, q], 1)
        fresh = DiffKVCache(model, config)
        forward(model, fresh, context)
        want = generate(model, fresh, ids, torch.ones_like(ids), 8)
        fork = ctx.fork()
        assert fork.kv.pool.data.data_ptr() != ctx.kv.pool.data.data_ptr()
        assert torch.equal(generate(model, fork, ids, torch.ones_like(ids), 8), want)
        fork.release()
    assert ctx.seen_tokens().tolist() == [30]  # the context itself is untouched


@pytest.mark.parametrize("config", [EXACT, dataclasses.replace(SQUEEZE, page_bytes=256)], ids=["exact", "compressing"])
def test_forks_of_a_context_read_its_pages(config):
    """for_context(max_forks=2): the forks share the context's full pages (refcount 3), never write them, answer
    alike for one question, losslessly with the exact config; the context is released after its forks."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(13)
    context, q = torch.randint(3, 96, (1, 40), generator=g), torch.randint(3, 96, (1, 6), generator=g)
    ids = torch.cat([context, q], 1)
    ctx = DiffKVCache.for_context(model, context, config, max_forks=2, scores="window")
    pool, tables = ctx.kv.pool, ctx.kv.tables
    pages = tables.rows[tables.select(ctx.slots, layers=ctx.store.layers).items]
    pages = pages[pages >= 0].long()
    forks = [ctx.fork(), ctx.fork()]
    before = pool.data[pages].clone()
    assert all(f.kv.pool is pool for f in forks) and int(pool.refcount[pages].max()) == 3
    answers = [generate(model, f, ids, torch.ones_like(ids), 8) for f in forks]
    assert torch.equal(answers[0], answers[1]) and torch.equal(pool.data[pages], before)
    if config is EXACT:
        want = DynamicCache(config=model.config)
        assert torch.equal(answers[0], generate(model, want, ids, torch.ones_like(ids), 8))
    with pytest.raises(ValueError, match="still read"):
        ctx.release()
    with pytest.raises(ValueError, match="other slots read"):
        forward(model, ctx, q)
    for f in forks:
        f.release()
    pool.check_invariants(tables)
    ctx.release()
    assert pool.free_pages() == pool.num_pages


def test_cropping_one_sequence_of_a_batch_leaves_the_other_consistent():
    """KVStore.crop of one slot of two extended together: the other one's drafts can no longer be undone (their
    records went with the shared steps), so its crop is refused rather than half done."""
    model = tiny("llama")
    cache = DiffKVCache(model, SQUEEZE)
    forward(model, cache, torch.randint(3, 96, (2, 30)))
    forward(model, cache, torch.randint(3, 96, (2, 3)))
    a, b = cache.slots
    held_b = cache.kv.tables.tokens_flat[cache.kv.tables.select([b]).items].clone()
    cache.store.crop(a, 2)
    assert cache.store.seen[a] == 31 and cache.store.seen[b] == 33
    with pytest.raises(ValueError):
        cache.store.crop(b, 2)
    assert torch.equal(cache.kv.tables.tokens_flat[cache.kv.tables.select([b]).items], held_b)
    cache.kv.pool.check_invariants(cache.kv.tables)
