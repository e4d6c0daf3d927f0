"""KVStore: the three pool kinds, positions planned once per step, errors; the hosts' tests drive it end to end."""

import pytest
import torch

from diffkv import DiffKVConfig
from diffkv.cache.kv_store import KVStore
from diffkv.core.layout import plan_for_config
from diffkv.memory import PagePool, PoolExhausted

CFG = DiffKVConfig(recent_window=4, score_window=4, alpha_high=1.0, alpha_low=0.05)
SHAPE = dict(num_layers=3, num_kv_heads=2, max_slots=4, max_seq_len=1024, device="cpu", attention_backend="torch")


def store(**kw) -> KVStore:
    return KVStore(CFG, plan_for_config(CFG, 64), **{**SHAPE, **kw})


def prompt(s: KVStore, slots: list[int], length: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    b = len(slots)
    q, k, v = (torch.randn(b, h, length, 64, generator=g) for h in (4, 2, 2))
    for layer in s.layers:
        s.prefill(layer, slots, q, k, v, torch.ones(b, length, dtype=torch.bool), 0.125)


def test_pool_kinds_and_budgets():
    plan = plan_for_config(CFG, 64)
    fixed = store(budget_bytes=1 << 20)
    per_page = plan.page_bytes + 8
    assert fixed.kv.pool.num_pages == ((1 << 20) - fixed.fixed_bytes) // per_page
    assert store(budget_bytes=1 << 20, other_bytes=10 * per_page).kv.pool.num_pages == fixed.kv.pool.num_pages - 10
    growing = store(budget_bytes=1 << 20, grow=True)
    assert growing.kv.pool.num_pages == 1 and growing.kv.max_pages == (1 << 20) // plan.page_bytes
    carved = 4 * 16 + sum(t.nbytes for t in (fixed.kv.tables.rows, fixed.kv.tables.counts, fixed.kv.key_center,
                                             fixed.kv.key_scale)) + 4  # + the table's scratch cell
    for pages in (7, 6):  # a buffer's tail holds the tables and key vectors, its head as many pages as fit
        over = store(buffer=torch.zeros(pages * per_page + PagePool.FIXED_BYTES + carved + 5, dtype=torch.uint8))
        assert over.kv.pool.num_pages == pages and over.kv.tables.rows.data_ptr() > over.kv.pool.data.data_ptr()
    with pytest.raises(ValueError, match="holds no .*grant more KV memory"):
        store(buffer=torch.zeros(carved, dtype=torch.uint8))
    with pytest.raises(ValueError, match="holds no .*raise the budget"):
        store(budget_bytes=fixed.fixed_bytes + per_page - 1)
    with pytest.raises(ValueError, match="holds no"):
        store(budget_bytes=10, grow=True)


def test_positions_are_planned_once_per_step_and_decode_runs_per_layer():
    s = store(budget_bytes=1 << 22)
    slots = [s.open_slot(), s.open_slot()]
    prompt(s, slots, 9)
    assert [s.seen[x] for x in slots] == [9, 9]
    with pytest.raises(RuntimeError, match="before begin_step"):
        s.decode(0, torch.zeros(2, 4, 64), torch.zeros(2, 2, 64), torch.zeros(2, 2, 64), 0.125)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        s.reserve(slots)
        comps = s.begin_step(slots)
        assert set(comps) == set(s.layers) and all(c.position.tolist() == [9 + step] * 2 for c in comps.values())
        for layer in s.layers:
            out = s.decode(layer, torch.randn(2, 4, 64, generator=g), torch.randn(2, 2, 64, generator=g),
                           torch.randn(2, 2, 64, generator=g), 0.125)
            assert out.shape == (2, 4, 64) and torch.isfinite(out).all()
    assert [s.seen[x] for x in slots] == [12, 12]
    tok = s.kv.tables.num_tokens[slots].long()
    assert (tok.sum(-1) <= 12).all() and (tok.sum(-1) > 0).all()
    assert s.step_bytes() > 0 and s.nbytes() == s.kv.nbytes() + s.step_bytes()
    s.release(slots)
    assert s.seen == {} and s.step_bytes() == 0 and s.kv.pool.free_pages() == s.kv.pool.num_pages


def test_layers_in_use_only_and_a_short_pool_refuses_whole():
    s = store(budget_bytes=1 << 22, layers=[1])
    slot = s.open_slot()
    prompt(s, [slot], 6)
    s.reserve([slot])
    assert set(s.begin_step([slot])) == {1}
    assert (s.kv.tables.num_pages[slot][[0, 2]] == 0).all()  # no page for the layers not in use
    tight = store(budget_bytes=plan_for_config(CFG, 64).page_bytes * 2 + 40_000, layers=[0])
    a = tight.open_slot()
    free = tight.kv.pool.free_pages()
    with pytest.raises(PoolExhausted):  # one layer's prompt needs more pages than the pool has
        prompt(tight, [a], 64 * tight.kv.pool.num_pages)
    assert tight.kv.pool.free_pages() == free and tight.seen[a] == 0  # nothing taken, nothing recorded


def test_arena_hands_out_aligned_disjoint_views_and_refuses_overflow():
    from diffkv.memory.arena import ALIGN, Arena

    buf = torch.zeros(100, dtype=torch.uint8)
    arena = Arena(buf)
    a = arena.full((3,), 7, torch.int32)  # 12 bytes at 0
    b = arena.full((2, 2), 1.5, torch.float32)  # 16 bytes at 16 (aligned)
    assert (a == 7).all() and (b == 1.5).all() and b.data_ptr() - buf.data_ptr() == ALIGN
    assert arena.used == 32 == Arena.bytes_for(((3,), torch.int32), ((2, 2), torch.float32))
    b.fill_(0.0)
    assert (a == 7).all()  # disjoint
    with pytest.raises(ValueError, match="hold no \\(20,\\) torch.float32 tensor after the 32 bytes"):
        arena.full((20,), 0.0, torch.float32)
    assert arena.used == 32  # a refused tensor takes nothing
    with pytest.raises(ValueError, match="contiguous uint8"):
        Arena(torch.zeros(4, dtype=torch.float32))
