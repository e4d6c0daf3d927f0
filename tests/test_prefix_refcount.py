"""Reference counts of shared prefix pages under random admit / hit / extend / finish / evict / preempt
(issue #45): no page is freed or written while a reader holds it, none leaks once every sequence is released."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from diffkv import DiffKVConfig
from diffkv.cache import prefix
from diffkv.cache.kv_store import KVStore
from diffkv.cache.prefix import freeze_scores, share_prefix
from diffkv.core.layout import plan_for_config
from diffkv.memory import PoolExhausted
from diffkv.memory.sharing import share

H_Q, H_KV, D, LAYERS = 4, 2, 16, 2
# compact means: the scores that drift most under readers' steps (the store freezes them again after each)
CFG = DiffKVConfig(alpha_high=1.5, alpha_low=0.5, recent_window=2, score_window=4, raw_dtype="float32",
                   page_bytes=256, compact_meta=True)
SCALE = D ** -0.5


def tokens(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, D, generator=g) * 2 for h in (H_Q, H_KV, H_KV))
    return q, k, v


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        plan = plan_for_config(CFG, D)
        self.store = KVStore(CFG, plan, num_layers=LAYERS, num_kv_heads=H_KV, max_slots=6, max_seq_len=64,
                             device="cpu", budget_bytes=8000 + 48 * plan.page_bytes, attention_backend="torch")
        self.sources: dict[int, torch.Tensor] = {}  # slot -> its pages' bytes when frozen
        self.readers: set[int] = set()
        self.seed = 0

    def _next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def _free_slot(self) -> bool:
        return len(self.sources) + len(self.readers) < 6

    def _pages(self, slot: int) -> torch.Tensor:
        rows = self.store.kv.tables.rows[self.store.kv.tables.select([slot]).items]
        return rows[rows >= 0].long()

    @precondition(lambda self: self._free_slot())
    @rule(length=st.integers(1, 30), fill=st.booleans())
    def admit_prefix(self, length, fill):
        slot = self.store.open_slot()
        q, k, v = tokens(length, self._next_seed())
        try:
            for layer in range(LAYERS):
                self.store.prefill(layer, [slot], q, k, v, torch.ones(1, length, dtype=torch.bool), SCALE,
                                   fill_pages=fill)
        except PoolExhausted:
            self.store.release([slot])
            return
        freeze_scores(self.store, slot)
        self.sources[slot] = self.store.kv.pool.data[self._pages(slot)].clone()

    @precondition(lambda self: self.sources and self._free_slot())
    @rule(data=st.data())
    def hit(self, data):
        source = data.draw(st.sampled_from(sorted(self.sources)))
        reader = self.store.open_slot()
        try:
            share_prefix(self.store, source, reader)
        except PoolExhausted:
            self.store.release([reader])
            return
        self.readers.add(reader)

    @precondition(lambda self: self.readers)
    @rule(data=st.data(), n=st.sampled_from([1, 1, 1, 3]))
    def extend(self, data, n):
        reader = data.draw(st.sampled_from(sorted(self.readers)))
        q, k, v = tokens(n, self._next_seed())
        try:
            for layer in range(LAYERS):  # the first layer reserves every layer's pages: all or nothing
                self.store.extend(layer, [reader], q, k, v, SCALE)
        except PoolExhausted:  # the engine preempts: the reader goes, its prefix stays
            self.finish_reader(reader)

    def finish_reader(self, reader: int) -> None:
        self.store.release([reader])
        self.readers.discard(reader)

    @precondition(lambda self: self.readers)
    @rule(data=st.data())
    def finish(self, data):
        self.finish_reader(data.draw(st.sampled_from(sorted(self.readers))))

    @precondition(lambda self: self.sources)
    @rule(data=st.data())
    def evict(self, data):
        source = data.draw(st.sampled_from(sorted(self.sources)))
        if self.store.shares.readers(source):
            before = self.store.kv.pool.refcount.clone()
            with pytest.raises(ValueError, match="still read"):
                self.store.release([source])
            assert torch.equal(before, self.store.kv.pool.refcount)
            return
        self.store.release([source])
        del self.sources[source]

    @invariant()
    def pages_are_conserved_and_shared_pages_untouched(self):
        kv = self.store.kv
        kv.pool.check_invariants(kv.tables)
        for source, data in self.sources.items():
            pages = self._pages(source)
            readers = len(self.store.shares.readers(source))
            assert int(kv.pool.refcount[pages].max()) <= 1 + readers
            assert torch.equal(kv.pool.data[pages], data), f"a shared page of slot {source} changed"

    def teardown(self):
        self.store.release(sorted(self.readers))
        self.store.release(sorted(self.sources))
        pool = self.store.kv.pool
        assert pool.free_pages() == pool.num_pages
        pool.check_invariants(self.store.kv.tables)


TestPrefixRefcounts = PrefixMachine.TestCase
TestPrefixRefcounts.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])


def _reader_run(monkeypatch, copy_low: bool):
    """A prefix of 21 tokens (partial last pages), one reader that appends 7 tokens one by one: (outputs, pages
    in use after each token, pages copied by ``copy_partial``)."""
    monkeypatch.setattr(prefix, "share", lambda *a, **kw: share(*a, **{**kw, "copy_low": copy_low}))
    plan = plan_for_config(CFG, D)
    store = KVStore(CFG, plan, num_layers=LAYERS, num_kv_heads=H_KV, max_slots=2, max_seq_len=64, device="cpu",
                    budget_bytes=8000 + 48 * plan.page_bytes, attention_backend="torch")
    source, reader = store.open_slot(), store.open_slot()
    q, k, v = tokens(21, 1)
    k = k * 0.05  # keys that draw about uniform attention: tokens below alpha_high / n, above alpha_low / n
    for layer in range(LAYERS):
        store.prefill(layer, [source], q, k, v, torch.ones(1, 21, dtype=torch.bool), SCALE)
    freeze_scores(store, source)
    counts = store.kv.tables.counts[:2, source].long()
    per_page = torch.tensor(store.kv.tables.tokens_per_page_hl)[:, None, None]
    partial_low = int(((counts % per_page)[1] > 0).sum())
    share_prefix(store, source, reader)
    outs, used = [], []
    q, k, v = tokens(7, 2)
    k = k * 0.05  # the reader's tokens too: demoted once old enough
    for i in range(7):
        outs.append(torch.stack([store.extend(layer, [reader], q[:, :, i:i + 1], k[:, :, i:i + 1],
                                              v[:, :, i:i + 1], SCALE) for layer in range(LAYERS)]))
        used.append(store.kv.pool.num_pages - store.kv.pool.free_pages())
        store.kv.pool.check_invariants(store.kv.tables)
    low = store.held([reader])["tokens_low"] - int(counts[1].sum())
    store.release([reader, source])
    assert store.kv.pool.free_pages() == store.kv.pool.num_pages
    return torch.stack(outs), used, partial_low, low


def test_a_reader_copies_the_shared_low_partial_pages_only_when_it_can_demote(monkeypatch):
    """``share_prefix`` leaves the prefix's partial low pages shared until the reader holds a token of its own
    old enough to demote (recent_window = 2): the outputs are the eager copy's bit for bit, the pages in use
    are fewer by the partial low pages until then and the same after."""
    lazy, used_lazy, partial, low = _reader_run(monkeypatch, False)
    eager, used_eager, _, _ = _reader_run(monkeypatch, True)
    assert partial > 0 and low > 0  # the reader demoted tokens into its low tiers
    assert torch.equal(lazy, eager)
    window = CFG.recent_window
    assert all(e - z == partial for e, z in zip(used_eager[:window], used_lazy[:window], strict=True))
    assert used_lazy[window:] == used_eager[window:]
