"""Storage path: tokens written through the tables come back (page-granular and point reads) as quantized."""

import torch

from diffkv.cache.paged_kv import PagedKV
from diffkv.core.config import DiffKVConfig
from diffkv.core.layout import plan_for_config
from diffkv.core.quant import dequantize, quantize
from diffkv.memory import HIGH_COL, LOW_COL, HeadTables, PagePool, allocate, trim


def test_write_then_read_pages_and_points():
    torch.manual_seed(0)
    cfg = DiffKVConfig()
    d, layers, heads = 64, 2, 3
    plan = plan_for_config(cfg, d)
    pool = PagePool(plan.page_bytes, 400)
    pool.data.fill_(0xFF)  # stale bytes everywhere: NaN patterns in fp16 must not leak into reads
    tables = HeadTables.for_config(cfg, plan, 2, layers, heads, 512)
    kv = PagedKV(pool, tables, plan, cfg)
    slots = [tables.acquire_slot(), tables.acquire_slot()]
    hs = tables.select(slots, layers=[1])
    allocate(pool, tables, hs, [150, 70])
    n_hi = torch.tensor([40, 3, 77, 0, 10, 70])
    n_lo = torch.tensor([100, 1, 0, 59, 60, 0])
    tables.tokens_flat[hs.items] = torch.stack([n_hi, n_lo], 1).int()
    written = {}
    for tier, n in ((HIGH_COL, n_hi), (LOW_COL, n_lo)):
        rows = torch.arange(6).repeat_interleave(n)
        idx = torch.cat([torch.arange(int(c)) for c in n])
        keys, values = torch.randn(len(idx), d), torch.randn(len(idx), d)
        scores, pos = torch.rand(len(idx)), torch.randint(0, 1000, (len(idx),), dtype=torch.int32)
        kv.write(tier, hs.items[rows], idx, keys, values, scores, pos, before_trim=True, validate=True)
        written[tier] = (rows, idx, keys, values, scores, pos)
    trim(pool, tables, hs)
    pool.check_invariants(tables)
    for tier, n in ((HIGH_COL, n_hi), (LOW_COL, n_lo)):
        rows, idx, keys, values, scores, pos = written[tier]
        layout = kv.layouts[tier]
        gs = (layout.key_bits, d // layout.key_groups), (layout.value_bits, d // layout.value_groups)
        want_k, want_v = (dequantize(*quantize(x, b, g)) for x, (b, g) in zip((keys, values), gs, strict=True))
        k, v, s, p, valid = kv.read(tier, hs.items, n, int(n.max()))
        assert torch.equal(valid.sum(1), n)
        assert torch.equal(k[rows, idx], want_k) and torch.equal(v[rows, idx], want_v)
        assert torch.equal(s[rows, idx], scores) and torch.equal(p[rows, idx], pos)
        assert (k[~valid] == 0).all() and (v[~valid] == 0).all()  # invalid slots decode as exactly 0
        pk, pv, ps, pp = kv.read_at(tier, hs.items[rows], idx)
        assert torch.equal(pk, want_k) and torch.equal(pv, want_v) and torch.equal(pp, pos)
        ms, mp, _ = kv.read_meta(tier, hs.items, n, int(n.max()))
        assert torch.equal(ms[rows, idx], scores)
    kv.add_scores(HIGH_COL, hs.items, n_hi, torch.ones(6, int(n_hi.max())))
    s_after = kv.read(HIGH_COL, hs.items, n_hi, int(n_hi.max()))[2]
    rows, idx, *_, scores, _ = written[HIGH_COL]
    torch.testing.assert_close(s_after[rows, idx], scores + 1)
