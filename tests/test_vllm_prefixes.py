"""Shared prefixes compressed once inside vLLM (issue #45), without vLLM: the scheduler's PrefixMap, and the worker
storing a prime and extending readers over its pages, checked step by step against the same KVStore calls."""

from __future__ import annotations

import math

import pytest
import torch
from test_vllm_store import BLOCK, H_KV, H_Q, LAYERS, D, make_store

from diffkv.cache.prefix import freeze_scores, share_prefix
from diffkv.core.points import context_point
from diffkv.hf.repeat_scores import copy_peaks
from diffkv.integrations.vllm.prefix_map import PREFIX, PRIME, PrefixMap, Prime, prefix_key, prime_prompt

PEAK = '{"importance": "peak", "alpha_high": 2.0, "alpha_low": 0.5}'
MEAN = '{"alpha_high": 0.05, "alpha_low": 0.005}'  # x64: 3.2 / 0.32 at the context point
SCALE = D ** -0.5


# ---- scheduler side ----
def test_a_reader_waits_for_its_prime_then_hits_and_is_attached():
    m = PrefixMap()
    prompt, params = prime_prompt([5, 6, 7, 8], [1, 2])
    assert prompt == [5, 6, 7, 8, 1, 2, 5, 6, 7, 8] and params == {PRIME: 4}
    assert m.arrived("p", prompt, params, 1) is None
    assert m.arrived("r", [5, 6, 7, 8, 9, 9], {PREFIX: 4}, 16) is None
    assert m.arrived("other", [5, 6, 7, 9, 9], {PREFIX: 4}, 16) is None  # a prefix never primed
    assert m.prime_of("p") == Prime(prefix_key([5, 6, 7, 8]), 4, 6, 10)
    assert m.matched("r") is None and m.matched("other") == 0 and m.matched("plain") == 0
    m.finished("p", computed=True)
    assert m.matched("r") == 4 and m.prime_of("p") is None
    m.allocated("r", 31, 4)
    assert m.take() == ({31: prefix_key([5, 6, 7, 8])}, []) and m.take() == ({}, [])
    assert (m.hits, m.hit_tokens) == (1, 4)
    assert m.entries[prefix_key([5, 6, 7, 8])].readers == {"r"}
    m.finished("r", computed=True)
    assert m.entries[prefix_key([5, 6, 7, 8])].readers == set()


def test_a_prime_aborted_before_its_forward_leaves_nothing_held():
    m = PrefixMap()
    m.arrived("p", *prime_prompt([5, 6], [1]), 1)
    m.arrived("r", [5, 6, 9], {PREFIX: 2}, 8)
    m.finished("p", computed=False)
    assert m.matched("r") == 0 and m.entries == {}


@pytest.mark.parametrize("prompt, params, max_tokens, refuse, says", [
    ([5, 6, 1, 5, 7], {PRIME: 2}, 1, None, "prefix + bridge + prefix"),  # second copy differs
    ([5, 6, 1, 5, 6], {PRIME: 3}, 1, None, "prefix + bridge + prefix"),  # n beyond half the prompt
    ([5, 6, 1, 5, 6], {PRIME: "2"}, 1, None, "prefix + bridge + prefix"),
    ([5, 6, 1, 5, 6], {PRIME: 2}, 4, None, "max_tokens=1"),
    ([5, 6, 1, 5, 6] * 2, {PRIME: 5}, 1, None, "--max-num-batched-tokens"),
    ([5, 6, 1, 5, 6], {PRIME: 2}, 1, "needs score_after_window=False", "needs score_after_window=False"),
    ([5, 6, 7], {PREFIX: 3}, 4, None, "[1, 2]"),  # a reader's prefix must leave a token to compute
    ([5, 6, 7], {PREFIX: 0}, 4, None, "[1, 2]"),
])
def test_bad_prefix_params_are_ignored_with_a_warning_that_says_why(prompt, params, max_tokens, refuse, says):
    m = PrefixMap(max_step_tokens=8, refuse_primes=refuse)
    warning = m.arrived("x", prompt, params, max_tokens)
    assert says in warning
    assert m.entries == {} and m.primes == {} and m.reading == {}


def test_a_prefix_primed_again_is_a_plain_request_and_the_least_recently_read_unread_prefix_is_dropped():
    m = PrefixMap(max_prefixes=2)
    for name, prefix in (("a", [1, 1]), ("b", [2, 2])):
        m.arrived(f"prime-{name}", *prime_prompt(prefix, [0]), 1)
        m.finished(f"prime-{name}", computed=True)
    m.arrived("again", *prime_prompt([1, 1], [0]), 1)
    assert m.prime_of("again") is None and len(m.entries) == 2  # held already
    m.arrived("reader-a", [1, 1, 5], {PREFIX: 2}, 4)
    m.allocated("reader-a", 7, 2)  # a is read now (and most recently)
    m.arrived("prime-c", *prime_prompt([3, 3], [0]), 1)
    assert m.take()[1] == [prefix_key([2, 2])]  # b: ready and unread
    m.finished("prime-c", computed=True)
    m.arrived("prime-d", *prime_prompt([4, 4], [0]), 1)
    assert m.take()[1] == [prefix_key([3, 3])]  # a is still read, c is not
    m.arrived("prime-e", *prime_prompt([5, 5], [0]), 1)
    assert "every one is being primed or read" in m.arrived("prime-f", *prime_prompt([6, 6], [0]), 1)
    assert m.take()[1] == [] and len(m.entries) == 2  # a (read) and d (priming): no room, nothing dropped
    m.finished("reader-a", computed=True)
    m.finished("prime-d", computed=True)
    assert m.arrived("prime-e", *prime_prompt([5, 5], [0]), 1) is None
    assert m.take()[1] == [prefix_key([1, 1])]


# ---- worker side ----
def block_table(firsts: list[int], lengths: list[int], next_block: int = 1000) -> torch.Tensor:
    width = max(math.ceil(n / BLOCK) for n in lengths)
    table = torch.zeros(len(firsts), width, dtype=torch.int32)
    for i, (first, n) in enumerate(zip(firsts, lengths, strict=True)):
        rest = list(range(next_block + 100 * i, next_block + 100 * i + math.ceil(n / BLOCK) - 1))
        table[i, :len(rest) + 1] = torch.tensor([first] + rest)
    return table


def qkv(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [(torch.randn(tokens, H_Q, D), torch.randn(tokens, H_KV, D), torch.randn(tokens, H_KV, D))
            for _ in range(LAYERS)]


def rows(x: torch.Tensor, s: int, e: int) -> torch.Tensor:
    return x[s:e].transpose(0, 1)[None]  # [tokens, H, D] -> [1, H, n, D]


@pytest.mark.parametrize("settings", [PEAK, MEAN])
def test_a_prime_is_stored_once_and_readers_extend_and_decode_over_its_shared_pages(monkeypatch, settings):
    """The prime's tokens are placed by the config's context point (``context_point``: repeat scores, peak
    importance, thresholds x context_scale) whatever the config's own importance (#62)."""
    torch.manual_seed(0)
    store, _ = make_store(monkeypatch, config=settings)
    ref, _ = make_store(monkeypatch, config=settings)  # the same KVStore calls made directly
    full = store.free_pages()
    n, bridge = 110, 3
    total = 2 * n + bridge
    key = prefix_key(list(range(n)))
    store.update_prefixes({100: Prime(key, n, n + bridge, total)}, {}, [])
    plan = store.plan_step(block_table([100], [total]), BLOCK, [0, total], [total])
    assert plan.kinds == ["prime"] and store.slot_of == {}
    source = ref.store.open_slot()
    for layer, (q, k, v) in enumerate(qkv(total)):
        out = torch.full_like(q, float("nan"))
        store.attend(layer, plan, q, k, v, SCALE, out)
        want = torch.nn.functional.scaled_dot_product_attention(rows(q, 0, total), rows(k, 0, total),
                                                                rows(v, 0, total), is_causal=True, scale=SCALE,
                                                                enable_gqa=True)
        torch.testing.assert_close(out, want[0].transpose(0, 1))
        scores = copy_peaks(q.transpose(0, 1), k.transpose(0, 1), n, n + bridge, SCALE)[None]
        ref.store.prefill(layer, [source], rows(q, 0, n), rows(k, 0, n), rows(v, 0, n), torch.ones(1, n, dtype=bool),
                          SCALE, repeat_scores=scores, point=context_point(ref.store.config), fill_pages=True)
    freeze_scores(ref.store, source)
    prefix_pages = full - store.free_pages()
    assert prefix_pages == full - ref.free_pages() > 0

    # two readers: questions of 7 and 9 tokens after the prefix, one step, then two decode steps
    store.update_prefixes({}, {200: key, 300: key}, [])
    assert store.stats()["prefixes"] == 1 and store.tokens_of == {200: n, 300: n}
    readers = [ref.store.open_slot(), ref.store.open_slot()]
    for r in readers:
        share_prefix(ref.store, source, r)
    starts = [0, 7, 16]
    plan = store.plan_step(block_table([200, 300], [n + 7, n + 9]), BLOCK, starts, [n + 7, n + 9])
    assert plan.kinds == ["extend", "extend"]
    for layer, (q, k, v) in enumerate(qkv(16)):
        out = torch.full_like(q, float("nan"))
        store.attend(layer, plan, q, k, v, SCALE, out)
        for i, r in enumerate(readers):
            s, e = starts[i], starts[i + 1]
            want = ref.store.extend(layer, [r], rows(q, s, e), rows(k, s, e), rows(v, s, e), SCALE)
            assert torch.equal(out[s:e], want[0].transpose(0, 1))
    for step in range(2):
        lengths = [n + 8 + step, n + 10 + step]
        plan = store.plan_step(block_table([200, 300], lengths), BLOCK, [0, 1, 2], lengths)
        assert plan.kinds == ["decode", "decode"]
        ref.store.reserve(readers)
        ref.store.begin_step(readers, [x - 1 for x in lengths])
        for layer, (q, k, v) in enumerate(qkv(2)):
            out = torch.full_like(q, float("nan"))
            store.attend(layer, plan, q, k, v, SCALE, out)
            assert torch.equal(out, ref.store.decode(layer, q, k, v, SCALE))
    used = full - store.free_pages()
    assert used == full - ref.free_pages()
    shared = sum(int(pages.sum()) for _, pages in store.store.shares.of.values())  # full prefix pages, by reference
    reader_pages = store.store.held([store.slot_of[200], store.slot_of[300]])["pages"]  # each counts what it reads
    assert shared > 0 and used == prefix_pages + reader_pages - shared  # a shared page is held once

    store.release([200, 300])
    assert full - store.free_pages() == prefix_pages  # the prefix stays for the next reader
    store.update_prefixes({}, {}, [key])
    assert store.free_pages() == full and store.stats()["prefixes"] == 0
    store.kv.pool.check_invariants(store.kv.tables)


def test_a_prime_split_by_chunked_prefill_or_an_unknown_prefix_is_refused_and_nothing_leaks(monkeypatch):
    store, _ = make_store(monkeypatch, config=PEAK)
    full = store.free_pages()
    store.update_prefixes({100: Prime("k", 20, 22, 42)}, {}, [])
    with pytest.raises(RuntimeError, match="--max-num-batched-tokens"):
        store.plan_step(block_table([100], [32]), BLOCK, [0, 32], [32])
    with pytest.raises(KeyError, match="no prefix"):
        store.update_prefixes({}, {200: "never-primed"}, [])
    assert store.slot_of == {} and store.kv.tables.active_slots == frozenset()
    store.update_prefixes({101: Prime("k", 20, 22, 42)}, {}, [])
    store.release([101])  # the prime request ended before its forward: no longer expected
    assert store.prefixes.expected == {} and store.free_pages() == full


def test_many_readers_in_one_step_answer_as_each_alone(monkeypatch):
    """More readers than the store keeps plans for (MAX_PLANS), two of the same length (one extend together)."""
    torch.manual_seed(2)
    n, bridge, lengths = 30, 2, [3, 4, 5, 6, 7, 7]
    prime = qkv(2 * n + bridge)
    questions = [qkv(m) for m in lengths]
    outs = {}
    for mode in ("together", "alone"):
        store, _ = make_store(monkeypatch, config=PEAK, slots=16)
        store.update_prefixes({100: Prime("k", n, n + bridge, 2 * n + bridge)}, {}, [])
        plan = store.plan_step(block_table([100], [2 * n + bridge]), BLOCK, [0, 2 * n + bridge], [2 * n + bridge])
        for layer, (q, k, v) in enumerate(prime):
            store.attend(layer, plan, q, k, v, SCALE, torch.empty_like(q))
        firsts = [200 + i for i in range(len(lengths))]
        store.update_prefixes({}, dict.fromkeys(firsts, "k"), [])
        batches = [list(range(len(lengths)))] if mode == "together" else [[i] for i in range(len(lengths))]
        got = []
        for batch in batches:
            starts = [0] + torch.tensor([lengths[i] for i in batch]).cumsum(0).tolist()
            plan = store.plan_step(block_table([firsts[i] for i in batch], [n + lengths[i] for i in batch]), BLOCK,
                                   starts, [n + lengths[i] for i in batch])
            assert plan.kinds == ["extend"] * len(batch)
            per_layer = []
            for layer in range(LAYERS):
                q, k, v = (torch.cat([questions[i][layer][j] for i in batch]) for j in range(3))
                out = torch.full_like(q, float("nan"))
                store.attend(layer, plan, q, k, v, SCALE, out)
                per_layer.append(out)
            got.append(per_layer)
        outs[mode] = [torch.cat([g[layer] for g in got]) for layer in range(LAYERS)]
    for together, alone in zip(outs["together"], outs["alone"], strict=True):
        torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_a_prefix_primed_again_while_still_read_keeps_the_held_copy(monkeypatch):
    torch.manual_seed(3)
    store, _ = make_store(monkeypatch, config=PEAK)
    full = store.free_pages()

    def prime(first):
        store.update_prefixes({first: Prime("k", 20, 22, 42)}, {}, [])
        plan = store.plan_step(block_table([first], [42]), BLOCK, [0, 42], [42])
        for layer, (q, k, v) in enumerate(qkv(42)):
            store.attend(layer, plan, q, k, v, SCALE, torch.empty_like(q))
        store.prefixes.finish()

    prime(100)
    held, slot = full - store.free_pages(), store.prefixes.slots["k"]
    store.update_prefixes({}, {200: "k"}, [])
    store.update_prefixes({}, {}, ["k"])  # still read: kept (a warning)
    prime(101)
    assert store.prefixes.slots == {"k": slot} and store.stats()["prefixes"] == 1
    store.release([200])
    assert full - store.free_pages() == held  # the second copy was given back
    store.update_prefixes({}, {}, ["k"])
    assert store.free_pages() == full
