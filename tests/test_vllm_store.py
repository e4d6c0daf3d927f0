"""The DiffKV vLLM backend's store (pages over a borrowed buffer, request slots, step plans) without vLLM: the
batches vLLM would send are built here (query_start_loc, seq_lens, block tables) from random K/V."""

from __future__ import annotations

import math

import pytest
import torch

from diffkv.integrations.vllm.admission import Admission, PoolReport
from diffkv.integrations.vllm.settings import ADMIT_ENV, CONFIG_ENV, read_settings
from diffkv.integrations.vllm.worker_pages import VllmKVStore
from diffkv.memory import PagePool

H_Q, H_KV, D, LAYERS, BLOCK = 4, 2, 32, 2, 16


def make_store(monkeypatch, config="exact", nbytes=1 << 22, slots=8):
    monkeypatch.setenv(CONFIG_ENV, config)
    monkeypatch.delenv("DIFFKV_VLLM_PROFILE", raising=False)
    settings = read_settings(D, "float32", LAYERS)
    buffer = torch.zeros(nbytes // 4, dtype=torch.float32)  # vLLM's KV memory, any dtype
    return VllmKVStore(settings, buffer, LAYERS, H_KV, D, max_slots=slots, max_model_len=256,
                       attention_backend="torch"), buffer


class Sequences:
    """Per request: its first block id, its K/V history per layer [T, H_kv, D] and its length."""

    def __init__(self):
        self.first, self.k, self.v = {}, {}, {}

    def batch(self, new: dict[str, tuple[int, int]], decode: list[str], next_block: list[int],
              chunks: dict[str, int] | None = None):
        """new: request -> (first block, prompt length or first chunk); decode: requests taking one token; chunks:
        request -> tokens of its prompt's next chunk. Returns the plan inputs and this step's q, k, v per layer
        [tokens, H, D]."""
        chunks = chunks or {}
        names = decode + list(chunks) + list(new)
        lengths, queries = [], []
        for r in names:
            if r in chunks:
                queries.append(chunks[r])
                lengths.append(self.k[r][0].shape[0] + chunks[r])
            elif r in new:
                self.first[r], n = new[r]
                self.k[r] = [torch.empty(0, H_KV, D) for _ in range(LAYERS)]
                self.v[r] = [torch.empty(0, H_KV, D) for _ in range(LAYERS)]
                queries.append(n)
                lengths.append(n)
            else:
                queries.append(1)
                lengths.append(self.k[r][0].shape[0] + 1)
        starts = [0] + list(torch.tensor(queries).cumsum(0).tolist())
        width = max(math.ceil(n / BLOCK) for n in lengths)
        table = torch.zeros(len(names), width, dtype=torch.int32)
        for i, (r, n) in enumerate(zip(names, lengths, strict=True)):
            blocks = [self.first[r]] + [next_block[0] + j for j in range(math.ceil(n / BLOCK) - 1)]
            next_block[0] += len(blocks) - 1
            table[i, :len(blocks)] = torch.tensor(blocks)
        step = [(torch.randn(starts[-1], H_Q, D), torch.randn(starts[-1], H_KV, D), torch.randn(starts[-1], H_KV, D))
                for _ in range(LAYERS)]
        return names, table, starts, lengths, step

    def reference(self, names, starts, layer, q, k, v, scale):
        """Causal attention of every query over its request's whole history (GQA): [tokens, H_q, D]."""
        out = torch.empty_like(q)
        for i, r in enumerate(names):
            s, e = starts[i], starts[i + 1]
            self.k[r][layer] = torch.cat([self.k[r][layer], k[s:e]])
            self.v[r][layer] = torch.cat([self.v[r][layer], v[s:e]])
            keys, values = self.k[r][layer], self.v[r][layer]
            n = keys.shape[0]
            qq = q[s:e].transpose(0, 1)[None]
            mask = torch.arange(n)[None, :] <= torch.arange(n - (e - s), n)[:, None]
            ref = torch.nn.functional.scaled_dot_product_attention(
                qq, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                enable_gqa=True)
            out[s:e] = ref[0].transpose(0, 1)
        return out


def run_step(store, seqs, new, decode, next_block, check=True, chunks=None):
    names, table, starts, lengths, step = seqs.batch(new, decode, next_block, chunks)
    plan = store.plan_step(table, BLOCK, starts, lengths)
    for layer, (q, k, v) in enumerate(step):
        out = torch.full_like(q, float("nan"))
        store.attend(layer, plan, q, k, v, D ** -0.5, out)
        want = seqs.reference(names, starts, layer, q, k, v, D ** -0.5)
        if check:
            torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    return plan


def test_exact_pages_give_full_attention_for_mixed_prefill_and_decode_steps(monkeypatch):
    torch.manual_seed(0)
    store, _ = make_store(monkeypatch)
    seqs, nb = Sequences(), [100]
    run_step(store, seqs, {"a": (1, 23), "b": (2, 40)}, [], nb)
    for t in range(5):
        new = {"c": (3, 7)} if t == 2 else {}
        run_step(store, seqs, new, ["a", "b"] + (["c"] if t > 2 else []), nb)
    stats = store.stats()
    assert stats["requests"] == 3
    # the fields every host reports (core.stats.tier_stats): a 23 + 5, b 40 + 5, c 7 + 2 tokens in every layer/head
    cells = (28 + 45 + 9) * LAYERS * H_KV
    tiers = stats["tokens_per_tier"]
    assert sum(tiers.values()) == cells and tiers["high"] == stats["tokens_high"] and tiers["pruned"] == 0
    assert stats["fp16_bytes"] == cells * 4 * D
    assert stats["compression_physical"] == stats["fp16_bytes"] / stats["bytes_in_pages"]


def test_ended_requests_are_released_when_their_first_block_returns(monkeypatch):
    torch.manual_seed(1)
    store, _ = make_store(monkeypatch)
    seqs, nb = Sequences(), [100]
    run_step(store, seqs, {"a": (1, 20), "b": (2, 20), "c": (3, 20)}, [], nb, check=False)
    full = store.stats()
    assert full["requests"] == 3 and full["free_pages"] < full["pages"]
    # a's first block starts a new prompt: a ended; b's first block is a middle block of d: b ended
    seqs.first["d"] = 4
    names, table, starts, lengths, step = seqs.batch({"e": (1, 5), "d": (4, 40)}, ["c"], nb)
    table[names.index("d"), 1] = 2
    plan = store.plan_step(table, BLOCK, starts, lengths)
    assert sorted(store.slot_of) == [1, 3, 4] and len(set(plan.slots)) == 3
    store.release(list(store.slot_of))
    after = store.stats()
    assert after["requests"] == 0 and after["free_pages"] == after["pages"]
    store.kv.pool.check_invariants(store.kv.tables)


def test_a_prompt_beyond_the_slots_is_refused_with_what_to_check(monkeypatch):
    store, _ = make_store(monkeypatch, slots=2)
    seqs = Sequences()
    run_step(store, seqs, {"a": (1, 5), "b": (2, 5)}, [], [100], check=False)
    with pytest.raises(RuntimeError, match="as many as it has slots: with the DiffKV KV connector"):
        run_step(store, seqs, {"c": (3, 5)}, ["a", "b"], [100], check=False)


def test_a_partial_prompt_or_unknown_decode_is_refused_with_what_to_change(monkeypatch):
    store, _ = make_store(monkeypatch)
    table = torch.tensor([[9, 10]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="no-enable-prefix-caching"):
        store.plan_step(table, BLOCK, [0, 8], [24])  # 8 new of 24 tokens of an unknown request: a prefix-cache hit
    assert store.stats()["requests"] == 0


def test_chunked_prefill_appends_later_chunks_beside_decode_steps(monkeypatch):
    """vLLM's chunked prefill: a 40-token prompt arrives as 16 + 16 + 8 while another request decodes in the same
    steps; exact pages give full attention for every query."""
    torch.manual_seed(3)
    store, _ = make_store(monkeypatch)
    seqs, nb = Sequences(), [100]
    run_step(store, seqs, {"a": (1, 20)}, [], nb)
    run_step(store, seqs, {"b": (2, 16)}, ["a"], nb)
    plan = run_step(store, seqs, {}, ["a"], nb, chunks={"b": 16})
    assert plan.kinds == ["decode", "extend"]
    run_step(store, seqs, {}, ["a"], nb, chunks={"b": 8})
    run_step(store, seqs, {}, ["a", "b"], nb)
    assert store.store.seen[store.slot_of[2]] == 41
    store.kv.pool.check_invariants(store.kv.tables)


@pytest.mark.parametrize("config", ["default", "exact"])  # default: smooth keys (a center and a scale per head)
def test_pages_tables_and_key_vectors_live_in_the_borrowed_buffer(monkeypatch, config):
    """vLLM's KV budget counts every byte DiffKV keeps: the tables and key vectors are views of vLLM's buffer (its
    tail), the pages fill the rest but for the pool's ring bookkeeping (8 B per page, outside)."""
    store, buffer = make_store(monkeypatch, config)
    pool, tables, kv = store.kv.pool, store.kv.tables, store.kv
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes
    assert pool.borrowed and pool.data.data_ptr() == start
    carved = [tables.rows, tables.counts] + [t for t in (kv.key_center, kv.key_scale) if t is not None]
    assert len(carved) == (4 if config == "default" else 2)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in [pool.data] + carved)
    assert spans[0][0] == start and spans[-1][1] <= end
    assert all(a[1] <= b[0] for a, b in zip(spans[:-1], spans[1:], strict=True))  # no two share a byte
    ring = pool.num_pages * pool.BYTES_PER_PAGE + pool.FIXED_BYTES
    assert sum(b - a for a, b in spans) + ring <= buffer.nbytes  # what DiffKV owns fits in what vLLM granted
    assert (pool.num_pages + 1) * (pool.page_bytes + pool.BYTES_PER_PAGE) + sum(t.nbytes for t in carved) \
        + 16 * len(carved) + pool.FIXED_BYTES > buffer.nbytes  # and not a page more
    stats = store.stats()
    assert stats["table_bytes"] + stats["key_vector_bytes"] + stats["pool_bytes"] <= stats["buffer_bytes"]
    assert (tables.rows == -1).all() and (tables.counts == 0).all()
    if config == "default":
        assert (kv.key_center == 0).all() and (kv.key_scale == 1).all()
    with pytest.raises(ValueError, match="cannot grow"):
        pool.grow(pool.num_pages + 1)
    with pytest.raises(ValueError, match="holds no"):
        PagePool.over(torch.zeros(3, dtype=torch.uint8), 64)


@pytest.mark.parametrize("config", ["default", "exact"])
def test_safe_admission_charges_at_least_what_the_pages_hold(monkeypatch, config):
    """What vLLM is told per token (safe) covers the pages DiffKV takes, slack included, prompt and decode."""
    torch.manual_seed(2)
    store, _ = make_store(monkeypatch, config, nbytes=1 << 24)
    per_token = store.settings.bytes_per_token(D, BLOCK, 4)
    seqs, nb = Sequences(), [100]
    lengths = {"a": 3, "b": 17, "c": 50}
    run_step(store, seqs, {r: (i + 1, n) for i, (r, n) in enumerate(lengths.items())}, [], nb, check=False)
    for _ in range(20):
        run_step(store, seqs, {}, list(lengths), nb, check=False)
        lengths = {r: n + 1 for r, n in lengths.items()}
        stats = store.stats()
        held = (stats["pages"] - stats["free_pages"]) * stats["page_bytes"]
        charged = sum(math.ceil(n / BLOCK) * BLOCK for n in lengths.values()) * per_token * H_KV * LAYERS
        assert held <= charged


def test_settings_refuse_unknown_values(monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, "turbo")
    with pytest.raises(ValueError, match=CONFIG_ENV):
        read_settings(D, "float32")
    monkeypatch.setenv(CONFIG_ENV, "default")
    for bad in ("0.5", "fast"):
        monkeypatch.setenv(ADMIT_ENV, bad)
        with pytest.raises(ValueError, match=ADMIT_ENV):
            read_settings(D, "float32")
    monkeypatch.setenv(ADMIT_ENV, "4")
    assert read_settings(D, "float16").bytes_per_token(D, BLOCK, 2) == 2 * D * 2 // 4


def test_a_prompt_takes_no_more_pages_than_the_admission_bound(monkeypatch):
    torch.manual_seed(3)
    store, _ = make_store(monkeypatch, "default", nbytes=1 << 24)
    report = PoolReport(store.free_pages(), *store.prompt_pages())
    for first, n in ((1, 5), (2, 37), (3, 120)):
        before = store.free_pages()
        run_step(store, Sequences(), {"r": (first, n)}, [], [100 * first], check=False)
        assert 0 < before - store.free_pages() <= report.prompt_pages(n)


def test_admission_waits_for_pages_and_one_prompt_at_a_time_before_a_report():
    adm = Admission()
    assert adm.admit(100) and not adm.admit(5)  # no report yet: one prompt at a time
    assert adm.step([], {"a": 7}) == []
    adm.reported(PoolReport(free_pages=1000, a=2.0, b=10))  # a prompt of n tokens: 2n + 10 pages
    assert adm.admit(200)  # 410 pages, leaving 590 >= 10 for a's next step
    assert not adm.admit(300)  # 610 pages: 1000 - 410 - 610 < 10 (one decode step of a)
    assert adm.admit(40)  # 90 pages: 1000 - 410 - 90 = 500 >= 10
    assert adm.step(["a", "unknown"], {"b": 9, "c": 11}) == [7]
    adm.reported(PoolReport(free_pages=120, a=2.0, b=10))
    assert not adm.admit(50)  # 110 pages: 120 - 110 = 10 < 2 running * 10
    assert adm.admit(45)  # 100 pages: 20 >= 20
    assert adm.step(["b", "c"], {}) == [9, 11]
    adm.reported(PoolReport(free_pages=5, a=2.0, b=10))
    assert adm.admit(1000) and not adm.admit(1)  # nothing held or promised: admitted (its prefill may fail)
    combined = PoolReport(50, 1.0, 4).combine(PoolReport(40, 2.0, 3))
    assert combined == PoolReport(40, 2.0, 4)


def test_room_blocks_leave_every_running_request_one_block_to_grow():
    adm = Admission()
    assert adm.room_blocks(16) is None  # no report yet
    adm.step([], {"a": 1, "b": 2})
    adm.reported(PoolReport(free_pages=1000, a=4.0, b=10))  # nothing held yet: the worst case, 4 pages a token
    assert adm.room_blocks(16) == (1000 - 2 * (64 + 10)) // 64
    adm.reported(PoolReport(free_pages=1000, a=4.0, b=10, pages_per_token=0.5))  # observed: 8 pages a block
    assert adm.room_blocks(16) == (1000 - 2 * (8 + 10)) // 8
    adm.reported(PoolReport(free_pages=20, a=4.0, b=10, pages_per_token=0.5))
    assert adm.room_blocks(16) == 0


def test_the_store_reports_pages_per_token_of_the_requests_it_holds(monkeypatch):
    store, _ = make_store(monkeypatch, "default", nbytes=1 << 22)
    assert store.pages_per_token(store.free_pages()) == 0.0
    run_step(store, Sequences(), {"a": (1, 40), "b": (2, 9)}, [], [100], check=False)
    free = store.free_pages()
    assert store.pages_per_token(free) == (store.kv.pool.num_pages - free) / 49
    store.release([1, 2])
    assert store.tokens_of == {} and store.pages_per_token(store.free_pages()) == 0.0


def test_no_request_sees_another_s_content(monkeypatch):
    """Isolation (#62 item 4b) in the plug-in's store, compressing (``DiffKVConfig()``): with the same lengths beside
    it, every bit of request a's attention output, over a prefill and five decode steps, stays the same when
    request b's queries, keys and values change (what remains is vLLM's GEMMs, whose bits follow the row count:
    ``DIFFKV_VLLM_BATCH_INVARIANT``)."""
    outputs = []
    for b_seed in (1, 2):
        store, _ = make_store(monkeypatch, config="default")
        seqs, next_block, got = Sequences(), [100], []
        for t in range(6):
            new = {"a": (1, 40), "b": (2, 33)} if t == 0 else {}
            names, table, starts, lengths, _ = seqs.batch(new, [] if t == 0 else ["a", "b"], next_block)
            assert names == ["a", "b"]
            plan = store.plan_step(table, BLOCK, starts, lengths)
            rows = {"a": torch.Generator().manual_seed(100 + t), "b": torch.Generator().manual_seed(1000 * b_seed + t)}
            for layer in range(LAYERS):
                q, k, v = (torch.cat([torch.randn(starts[i + 1] - starts[i], h, D, generator=rows[r]) * 3
                                      for i, r in enumerate(names)]) for h in (H_Q, H_KV, H_KV))
                out = torch.full_like(q, float("nan"))
                store.attend(layer, plan, q, k, v, D ** -0.5, out)
                got.append(out[starts[0]:starts[1]].clone())
        assert store.stats()["requests"] == 2
        outputs.append(got)
    assert all(torch.equal(x, y) for x, y in zip(*outputs, strict=True))
