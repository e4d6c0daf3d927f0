"""The torch decode fast path: dense mirror (always what the pages decode to), batched store, placement moves."""

import pytest
import torch

from diffkv import policy
from diffkv.compressor import LayerCompressor
from diffkv.config import DiffKVConfig
from diffkv.layout import plan_for_config
from diffkv.memory import HIGH, LOW, HeadTables, PagePool, release_slots, reserve
from diffkv.paged_kv import PagedKV
from diffkv.store import store_tokens_ref
from diffkv.store_batch import TierWrite, store_batch_ref

CFG = DiffKVConfig(alpha_high=2.5, alpha_low=1.0, recent_window=4, score_window=4)
D, HQ, HKV, LAYERS = 64, 4, 2, 2


def make_kv(cfg=CFG, slots=3, mirror=True):
    plan = plan_for_config(cfg, D)
    pool = PagePool(plan.page_bytes, 3000)
    tables = HeadTables.for_config(cfg, plan, slots, LAYERS, HKV, 512)
    return PagedKV(pool, tables, plan, cfg, mirror_budget_bytes=(1 << 30) if mirror else 0)


def prompt(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HQ, length, D, generator=g) * 3
    k, v = torch.randn(batch, HKV, length, D, generator=g), torch.randn(batch, HKV, length, D, generator=g)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1:, : length // 3] = False  # left padding
    return q, k, v, valid


def steps(batch, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, HQ, D, generator=g) * 3, torch.randn(batch, HKV, D, generator=g),
             torch.randn(batch, HKV, D, generator=g)) for _ in range(n)]


def run(kv, slots, n_steps, seed=0, length=48, order=None, switch=5):
    """Prefill both layers of ``slots``, then decode; from step ``switch`` on, with ``order`` given, new
    compressors see the slots in that order (as an engine whose batch changes)."""
    q, k, v, valid = prompt(len(slots), length, seed)
    comps = [LayerCompressor(kv, layer, slots, HKV, attention_backend="torch") for layer in range(LAYERS)]
    for c in comps:
        c.prefill(q, k, v, valid, 0.125)
    heads = kv.tables.select(slots)
    outs, perm = [], list(range(len(slots)))
    for i, (sq, sk, sv) in enumerate(steps(len(slots), n_steps, seed + 1)):
        if order is not None and i == switch:
            pos = [c.position[order] for c in comps]
            comps = [LayerCompressor(kv, layer, [slots[j] for j in order], HKV, attention_backend="torch")
                     for layer in range(LAYERS)]
            for c, p in zip(comps, pos, strict=True):
                c.position = p
            perm = order
        reserve(kv.pool, kv.tables, heads)
        outs.append(torch.stack([c.decode(sq[perm], sk[perm], sv[perm], 0.125, reserved=True) for c in comps]))
    return outs, comps


def assert_close_runs(got, want):
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def assert_mirror_is_pages(kv, comps):
    """Every mirrored row equals what its pages decode to, bit for bit (and the score addresses are right)."""
    m = kv.mirror
    for c in comps:
        bank, keys = m.banks[c.layer_idx], c._keys()
        rows = torch.tensor([m.row_of[i] for i in keys])
        n = kv.tables.tokens_flat[c.items].long()
        assert [m.counts[i] for i in keys] == [tuple(x) for x in n.tolist()]
        for t, col0 in ((HIGH, 0), (LOW, bank.caps[0])):
            width = int(n[:, t].max())
            if width == 0:
                continue
            k, v, s, p, valid = kv.read(t, c.items, n[:, t], width)
            cols = slice(col0, col0 + width)
            ok = valid[:, :width]
            assert torch.equal(bank.o[rows, cols], ok)
            assert torch.equal(bank.k[rows, cols][ok], k[:, :width][ok])
            assert torch.equal(bank.v[rows, cols][ok], v[:, :width][ok])
            assert torch.equal(bank.s[rows, cols][ok], s[:, :width][ok])
            assert torch.equal(bank.p[rows, cols][ok], p[:, :width][ok].long())
            assert torch.equal(kv._f32[bank.a[rows, cols][ok]], s[:, :width][ok])
            assert (bank.k[rows, cols][~ok] == 0).all() and (bank.s[rows, cols][~ok] == 0).all()


def _slots(kv, n):
    return [kv.tables.acquire_slot() for _ in range(n)]


@pytest.mark.parametrize("cfg", [CFG, DiffKVConfig(high="K8V4", low="K8V4", alpha_high=1.0, alpha_low=1.0,
                                                   recent_window=4, score_window=4)])
def test_mirror_path_matches_page_path_and_pages(cfg):
    kv, ref_kv = make_kv(cfg), make_kv(cfg, mirror=False)
    got, comps = run(kv, _slots(kv, 3), 40)
    want, _ = run(ref_kv, _slots(ref_kv, 3), 40)
    assert_close_runs(got, want)
    assert torch.equal(kv.tables.counts, ref_kv.tables.counts)
    assert ref_kv.mirror is None and kv.mirror is not None
    tok = kv.tables.num_tokens.sum((0, 1, 2))
    assert tok[0] > 0 and (tok[1] > 0) == cfg.two_tier
    seen = 40 + 48 + 2 * (48 - 48 // 3)
    assert kv.tables.num_tokens.sum() < seen * LAYERS * HKV  # some tokens were pruned
    assert_mirror_is_pages(kv, comps)


def test_rows_out_of_order_are_gathered():
    kv, ref_kv = make_kv(), make_kv(mirror=False)
    got, comps = run(kv, _slots(kv, 3), 30, order=[2, 0, 1])
    want, _ = run(ref_kv, _slots(ref_kv, 3), 30, order=[2, 0, 1])
    assert_close_runs(got, want)
    assert kv.mirror.banks[0].spans[comps[0]._keys()][1] is None  # the window was gathered, not a view
    assert_mirror_is_pages(kv, comps)


def test_over_budget_runs_the_page_path():
    kv, ref_kv = make_kv(), make_kv(mirror=False)
    kv.mirror_budget_bytes = 1000  # no step fits
    got, _ = run(kv, _slots(kv, 3), 10)
    want, _ = run(ref_kv, _slots(ref_kv, 3), 10)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert not kv.mirror.row_of


def test_released_slot_is_rebuilt_not_stale():
    kv, ref_kv = make_kv(slots=2), make_kv(slots=2, mirror=False)
    slots = _slots(kv, 2)
    run(kv, slots, 20, seed=3)
    release_slots(kv.pool, kv.tables, slots)
    assert _slots(kv, 2) == slots
    got, comps = run(kv, slots, 20, seed=11)  # the same slots and mirror rows, new prompts (kv.write invalidates)
    want, _ = run(ref_kv, _slots(ref_kv, 2), 20, seed=11)
    assert_close_runs(got, want)
    assert_mirror_is_pages(kv, comps)


@pytest.mark.parametrize("tiers", [("K8V4", "K4V2"), ("K8V8", "K4V1"), ("K4V2-g32/32", "K2V2-g32/32"),
                                   ("K16V16", "K8V4"), ("K8V4-g64/32", "K4V2")])
@pytest.mark.parametrize("meta", [torch.float16, torch.bfloat16])
def test_store_batch_is_bit_exact(tiers, meta):
    torch.manual_seed(0)
    cfg = DiffKVConfig(high=tiers[0], low=tiers[1])
    plan = plan_for_config(cfg, D)
    layouts = [plan.layout(cfg.high), plan.layout(cfg.low)]
    pool, ref = torch.zeros(40, plan.page_bytes, dtype=torch.uint8), torch.zeros(40, plan.page_bytes, dtype=torch.uint8)
    writes = []
    for t, m in ((0, 7), (1, 4)):
        scale = torch.tensor([1e-3, 1.0, 100.0, 0.0, 1e4])[torch.randint(0, 5, (m, 1))]
        x = torch.randn(m, D) * scale
        x[0] = 3.0  # a constant row
        x[1, ::2] = x[1, 1::2] = 0.5  # ties
        writes.append(TierWrite(layouts[t], x, -x.flip(1), torch.arange(m) + 20 * t,
                                torch.randint(0, layouts[t].tokens_per_page, (m,)), torch.rand(m),
                                torch.randint(0, 999, (m,), dtype=torch.int32)))
    k, v = store_batch_ref(pool, writes, meta_dtype=meta)
    want = [store_tokens_ref(ref, w.layout, w.keys, w.values, w.page_ids, w.slots, w.scores, w.positions,
                             meta_dtype=meta, validate=False, return_stored=True) for w in writes]
    assert torch.equal(pool, ref)
    assert torch.equal(k, torch.cat([x for x, _ in want])) and torch.equal(v, torch.cat([y for _, y in want]))


def test_decode_moves_is_decide_decode():
    g = torch.Generator().manual_seed(0)
    n = 4000
    pick = torch.tensor([0.0, 1e-4, 1e-3, 5e-3, 1e-2, float("inf")])
    mL, mR = pick[torch.randint(0, 6, (n,), generator=g)], pick[torch.randint(0, 6, (n,), generator=g)]
    iL, iR = torch.randint(0, 50, (n,), generator=g), torch.randint(0, 50, (n,), generator=g)
    n_hi, n_lo = torch.randint(0, 9, (n,), generator=g), torch.randint(0, 9, (n,), generator=g)
    position = torch.randint(0, 300, (n,), generator=g)
    for two_tier in (True, False):
        args = (n_hi, n_lo, position, 1.0, 0.02, 6, two_tier)
        place = policy.decide_decode(mL, iL, mR, iR, *args)
        append, demote, low_slot, low_append = policy.decode_moves(mL, iL, mR, iR, *args)
        assert torch.equal(append, place.case == policy.APPEND)
        assert torch.equal(demote, (place.case == policy.DEMOTE_OVER_LOW) | (place.case == policy.DEMOTE_APPEND_LOW))
        assert torch.equal(low_append, place.case == policy.DEMOTE_APPEND_LOW)
        assert torch.equal(low_slot[demote], place.low_slot[demote])
