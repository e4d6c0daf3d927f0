"""vLLM's shared prefixes under random prime / attach / step / release / drop (issue #45), through
``VllmKVStore`` as the backend and the connector drive it: no page of a held prefix changes while readers read and
decode over it, and once every reader has ended and every prefix is dropped the pool is full again."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_vllm_store import BLOCK, H_KV, H_Q, LAYERS, D, make_store

from diffkv.integrations.vllm.prefix_map import Prime

PEAK = '{"importance": "peak", "alpha_high": 2.0, "alpha_low": 0.5}'
KEYS = ("a", "b", "c")
SCALE = D ** -0.5


def table(firsts: list[int], lengths: list[int]) -> torch.Tensor:
    width = max(math.ceil(n / BLOCK) for n in lengths)
    out = torch.zeros(len(firsts), width, dtype=torch.int32)
    for i, (first, n) in enumerate(zip(firsts, lengths, strict=True)):
        blocks = [first] + [10_000 + 100 * first + j for j in range(math.ceil(n / BLOCK) - 1)]
        out[i, :len(blocks)] = torch.tensor(blocks)
    return out


class VllmPrefixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store, _ = make_store(_Env(), config=PEAK, nbytes=1 << 21, slots=8)
        self.full = self.store.free_pages()
        self.held: dict[str, torch.Tensor] = {}  # key -> the prefix's page bytes when stored
        self.readers: dict[int, tuple[str, int]] = {}  # first block -> (key, tokens)
        self.next_first = 1

    def _step(self, firsts: list[int], lengths: list[int], queries: list[int]) -> None:
        starts = [0] + torch.tensor(queries).cumsum(0).tolist()
        plan = self.store.plan_step(table(firsts, lengths), BLOCK, starts, lengths)
        for layer in range(LAYERS):
            q, k, v = (torch.randn(starts[-1], h, D) for h in (H_Q, H_KV, H_KV))
            self.store.attend(layer, plan, q, k, v, SCALE, torch.empty_like(q))

    def _bytes(self, key: str) -> torch.Tensor:
        slot = self.store.prefixes.slots[key]
        rows = self.store.kv.tables.rows[self.store.kv.tables.select([slot]).items]
        return self.store.kv.pool.data[rows[rows >= 0].long()].clone()

    @precondition(lambda self: len(self.held) < len(KEYS) and len(self.readers) < 5)
    @rule(n=st.integers(4, 40), bridge=st.integers(1, 4))
    def prime(self, n, bridge):
        key = next(k for k in KEYS if k not in self.held)
        first, self.next_first = self.next_first, self.next_first + 1
        self.store.update_prefixes({first: Prime(key, n, n + bridge, 2 * n + bridge)}, {}, [])
        self._step([first], [2 * n + bridge], [2 * n + bridge])
        self.store.prefixes.finish()
        self.held[key] = self._bytes(key)

    @precondition(lambda self: self.held and len(self.readers) < 5)
    @rule(data=st.data(), question=st.integers(1, 12))
    def read(self, data, question):
        key = data.draw(st.sampled_from(sorted(self.held)))
        first, self.next_first = self.next_first, self.next_first + 1
        self.store.update_prefixes({}, {first: key}, [])
        n = self.store.tokens_of[first]
        self._step([first], [n + question], [question])
        self.readers[first] = (key, n + question)

    @precondition(lambda self: self.readers)
    @rule()
    def decode(self):
        firsts = sorted(self.readers)
        lengths = [self.readers[f][1] + 1 for f in firsts]
        self._step(firsts, lengths, [1] * len(firsts))
        for f, n in zip(firsts, lengths, strict=True):
            self.readers[f] = (self.readers[f][0], n)

    @precondition(lambda self: self.readers)
    @rule(data=st.data())
    def end_reader(self, data):
        first = data.draw(st.sampled_from(sorted(self.readers)))
        self.store.release([first])
        del self.readers[first]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def drop(self, data):
        key = data.draw(st.sampled_from(sorted(self.held)))
        self.store.update_prefixes({}, {}, [key])
        if any(k == key for k, _ in self.readers.values()):
            assert key in self.store.prefixes.slots  # still read: kept
        else:
            assert key not in self.store.prefixes.slots
            del self.held[key]

    @invariant()
    def shared_pages_never_change_and_the_pool_is_consistent(self):
        for key, before in self.held.items():
            assert torch.equal(self._bytes(key), before)
        self.store.kv.pool.check_invariants(self.store.kv.tables)

    def teardown(self):
        self.store.release(list(self.readers))
        self.store.update_prefixes({}, {}, list(self.held))
        assert self.store.free_pages() == self.full and self.store.kv.tables.active_slots == frozenset()


class _Env:
    """make_store's monkeypatch (the machine has no fixture): sets the variables it names."""

    def setenv(self, name, value):
        import os

        os.environ[name] = value

    def delenv(self, name, raising=True):
        import os

        os.environ.pop(name, None)


TestVllmPrefixRefcount = VllmPrefixMachine.TestCase
TestVllmPrefixRefcount.settings = settings(max_examples=25, stateful_step_count=12, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
