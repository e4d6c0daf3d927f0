"""Fused decode placement + store kernel (interpreter on CPU) vs its torch reference: bit-identical pool bytes and
token counts over decode steps on fresh random pages (few steps under the interpreter, ~0.15 s per item and step;
many on a GPU). Scores are redrawn every step so the cases and ties vary; the seeds are chosen to hit every case."""

import pytest
import torch

from diffkv.cache.paged_kv import PagedKV
from diffkv.core import policy
from diffkv.core.config import DiffKVConfig
from diffkv.core.layout import plan_for_config
from diffkv.memory import HIGH_COL, LOW_COL, HeadTables, PagePool, allocate, reserve, trim
from diffkv.ops.place_store import place_store
from diffkv.ops.reference import place_store_ref

ALPHAS = (1.5, 0.5)  # alpha_high, alpha_low


def _paged(cfg, d, n_hi, n_lo, start, seed, steps=8, device="cpu"):
    """PagedKV of one layer with K = len(n_hi) heads holding random tokens at random positions in
    ``[max(start - 40, 0), start)``."""
    torch.manual_seed(seed)
    k = len(n_hi)
    plan = plan_for_config(cfg, d)
    pool = PagePool(plan.page_bytes, 8 * k + (sum(n_hi) + sum(n_lo) + steps * k) // 4, device=device)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, dtype=torch.uint8))  # stale bytes everywhere
    tables = HeadTables.for_config(cfg, plan, 1, 1, k, max(n_hi) + max(n_lo) + steps + 8, device=device)
    kv = PagedKV(pool, tables, plan, cfg)
    heads = tables.select([tables.acquire_slot()], layers=[0])
    nh, nl = torch.tensor(n_hi), torch.tensor(n_lo)
    allocate(pool, tables, heads, [max(int((nh + nl).max()), 1)])
    tables.tokens_flat[heads.items] = torch.stack([nh, nl], 1).int().to(device)
    for tier, n in ((HIGH_COL, nh), (LOW_COL, nl)):
        if int(n.sum()):
            rows = torch.arange(k).repeat_interleave(n)
            idx = torch.cat([torch.arange(int(c)) for c in n])
            x = [torch.randn(len(idx), d) * 2, torch.randn(len(idx), d), torch.zeros(len(idx)),
                 torch.randint(max(start - 40, 0), start, (len(idx),), dtype=torch.int32)]
            kv.write(tier, heads.items[rows.to(device)], idx.to(device), *(t.to(device) for t in x),
                     before_trim=True)
    trim(pool, tables, heads)
    return kv, heads


def _rescore(kv, items, position, gen):
    """Fresh scores so the weakest tokens' means straddle both thresholds; a fifth are 0 (ties). Compact pages store
    the means themselves (fp16: more ties)."""
    n = kv.tables.tokens_flat[items].long()
    for tier in (HIGH_COL, LOW_COL):
        count = n[:, tier]
        if int(count.max()) == 0:
            continue
        _, pos, valid = kv.read_meta(tier, items, count, int(count.max()), position)
        age = 1.0 if kv.compact else (position[:, None] - pos).clamp_min(1).float()
        u = torch.rand(valid.shape, generator=gen) * 2.5
        u = torch.where(torch.rand(valid.shape, generator=gen) < 0.2, 0.0, u).to(position.device)
        where = kv.score_index(tier, items, valid.shape[1])[:, :valid.shape[1]]
        kv.write_scores(where[valid], (u * age / position[:, None].float())[valid])


def _cases(kv, items, position, cfg):
    n = kv.tables.tokens_flat[items].long()
    w = [int(n[:, t].max()) + 1 for t in (0, 1)]
    hs, hp, _ = kv.read_meta(HIGH_COL, items, n[:, 0], w[0], position)
    ls, lp, _ = kv.read_meta(LOW_COL, items, n[:, 1], w[1], position)
    return policy.place_decode(hs, hp, n[:, 0], ls, lp, n[:, 1], position, *ALPHAS, cfg.recent_window,
                               two_tier=cfg.two_tier, lag=cfg.score_lag, compact=kv.compact).case


def _run(cfg, d, n_hi, n_lo, steps, seed=0, dtype=torch.float32, device="cpu", start=40):
    kv, heads = _paged(cfg, d, n_hi, n_lo, start=start, seed=seed, steps=steps, device=device)
    items, k = heads.items, len(n_hi)
    gen = torch.Generator().manual_seed(seed + 1)
    position = (torch.full((k,), start, dtype=torch.int64) + torch.arange(k)).to(device)
    seen = set()
    for _ in range(steps):
        reserve(kv.pool, kv.tables, heads)
        _rescore(kv, items, position, gen)
        seen |= set(_cases(kv, items, position, cfg).tolist())
        keys = (torch.randn(k, d, generator=gen) * 3).to(device, dtype)
        values = torch.randn(k, d, generator=gen).to(device, dtype)
        _step(kv, items, keys, values, position, ALPHAS)
        position += 1
    return seen


def _step(kv, items, keys, values, position, alphas):
    """One step by the kernel and by the reference from the same state: same pool bytes, counts and result."""
    pool0, counts0 = kv.pool.data.clone(), kv.tables.counts.clone()
    got = place_store(kv, items, keys, values, position, *alphas, backend="triton")
    pool1, counts1 = kv.pool.data.clone(), kv.tables.counts.clone()
    kv.pool.data.copy_(pool0)
    kv.tables.counts.copy_(counts0)
    want = place_store_ref(kv, items, keys, values, position, *alphas)
    assert torch.equal(counts1, kv.tables.counts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    diff = (pool1 != kv.pool.data).nonzero()
    assert diff.numel() == 0, f"{len(diff)} pool bytes differ, first at {diff[:4].tolist()}"
    return want


def test_two_tiers_ragged_all_cases():
    """Empty low tier, a single token, partly filled last pages, a short head (append only); all four cases."""
    cfg = DiffKVConfig(high="K8V4", low="K4V2", recent_window=4, alpha_high=ALPHAS[0], alpha_low=ALPHAS[1])
    seen = _run(cfg, 64, [70, 1, 9, 2], [0, 0, 60, 1], steps=3, seed=1)
    assert seen == {policy.APPEND, policy.PRUNE_HIGH, policy.DEMOTE_OVER_LOW, policy.DEMOTE_APPEND_LOW}


def test_grouped_tiers_head_dim_256_half_inputs():
    cfg = DiffKVConfig(high="K8V4", low="K4V2-g64/32", recent_window=3, alpha_high=ALPHAS[0], alpha_low=ALPHAS[1])
    seen = _run(cfg, 256, [12, 5], [3, 0], steps=3, seed=0, dtype=torch.bfloat16)
    assert len(seen) >= 3


def test_three_bit_tiers_keys_below_values():
    """3-bit codes (two bit planes) in both tiers, keys below values in the high one: demotion re-packs them."""
    cfg = DiffKVConfig(high="K3V4", low="K3V2-g32/64", recent_window=3, alpha_high=ALPHAS[0], alpha_low=ALPHAS[1])
    seen = _run(cfg, 64, [70, 1, 9, 2], [0, 0, 60, 1], steps=3, seed=2)
    assert policy.DEMOTE_OVER_LOW in seen or policy.DEMOTE_APPEND_LOW in seen


def test_sixteen_bit_high_tier():
    """High tier of raw fp16 values: the demoted token is re-quantized from them."""
    cfg = DiffKVConfig(high="K16V16", low="K4V2", recent_window=3, alpha_high=ALPHAS[0], alpha_low=ALPHAS[1])
    seen = _run(cfg, 64, [14, 6], [2, 0], steps=3, seed=0, dtype=torch.float16)
    assert policy.DEMOTE_OVER_LOW in seen or policy.DEMOTE_APPEND_LOW in seen


def test_score_after_window():
    """Lagged means and eligibility; the scores of the tokens at age ``lag`` (random positions: several per head,
    and the new tokens after 4 steps) are reset to 0 in both."""
    cfg = DiffKVConfig(recent_window=4, alpha_high=ALPHAS[0], alpha_low=ALPHAS[1], score_after_window=True)
    seen = _run(cfg, 64, [70, 9, 2], [0, 60, 1], steps=6, seed=3)
    assert {policy.PRUNE_HIGH, policy.DEMOTE_APPEND_LOW} <= seen or {policy.PRUNE_HIGH, policy.DEMOTE_OVER_LOW} <= seen


def test_one_tier():
    cfg = DiffKVConfig(high="K8V4", low="K8V4", recent_window=4, alpha_high=ALPHAS[0], alpha_low=ALPHAS[1])
    seen = _run(cfg, 64, [70, 1, 7], [0, 0, 0], steps=3, seed=0)
    assert seen == {policy.APPEND, policy.PRUNE_HIGH}


@pytest.mark.parametrize("compact,symmetric_keys", [(True, False), (False, True), (True, True)])
def test_compact_meta_and_symmetric_keys(compact, symmetric_keys):
    """fp16 mean scores and int16 positions (stored positions straddle 2^16: ages mod 2^16; score_after_window
    resets fp16 scores) and scale-only keys (demoted keys re-quantized from them): same bytes and counts."""
    cfg = DiffKVConfig(recent_window=4, alpha_high=ALPHAS[0], alpha_low=ALPHAS[1], score_after_window=compact,
                       compact_meta=compact, symmetric_keys=symmetric_keys)
    seen = _run(cfg, 64, [45, 9, 2], [0, 21, 1], steps=3, seed=3, start=65536 + 20)
    assert seen == {policy.APPEND, policy.PRUNE_HIGH, policy.DEMOTE_OVER_LOW, policy.DEMOTE_APPEND_LOW}


def test_mean_exactly_at_the_prune_threshold():
    """torch evaluates ``alpha / base`` as ``fp32(1 / base) * fp32(alpha)``, 1 ulp below ``fp32(alpha) / base`` at
    alpha 0.3, base 41: a token whose mean equals that threshold is not pruned (it is demoted) in both."""
    alphas = (1.5, 0.3)
    cfg = DiffKVConfig(recent_window=4, alpha_high=alphas[0], alpha_low=alphas[1])
    kv, heads = _paged(cfg, 64, [10], [0], start=30, seed=2)
    items, position = heads.items, torch.tensor([41])
    thr = (alphas[1] / position.clamp_min(1).to(torch.float32))  # the torch expression of policy.decide_decode
    assert thr < torch.tensor(alphas[1], dtype=torch.float32) / 41
    idx = torch.arange(10)
    kv.write_scores(kv._field_index(HIGH_COL, items.expand(10), idx, "score_offset"), torch.full((10,), 100.0))
    kv.write_scores(kv._field_index(HIGH_COL, items[:1], idx[3:4], "score_offset"), thr * 8)  # age 8: mean == thr
    kv._positions[kv._field_index(HIGH_COL, items[:1], idx[3:4], "pos_offset")] = 41 - 8
    reserve(kv.pool, kv.tables, heads)
    n_hi, n_lo = _step(kv, items, torch.randn(1, 64), torch.randn(1, 64), position, alphas)
    assert (int(n_hi[0]), int(n_lo[0])) == (10, 1)  # demoted (case 3), not pruned


def _positions(kv, items):
    """Stored positions of each tier's tokens of the first item, slot by slot."""
    n = kv.tables.tokens_flat[items].long()
    return [kv.read_meta(t, items, n[:, t], int(n[0, t]), torch.tensor([0]))[1][0].tolist()
            for t in (HIGH_COL, LOW_COL)]


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_cpu_backends_are_the_reference(backend):
    """On a CPU pool both backends run the reference: one exact placement, worked out from the policy rule below,
    and the same pool bytes as ``place_store_ref`` from the same state."""
    cfg = DiffKVConfig(recent_window=2, alpha_high=ALPHAS[0], alpha_low=ALPHAS[1])
    kv, heads = _paged(cfg, 64, [5], [2], start=10, seed=9)
    items, position = heads.items, torch.tensor([10])
    reserve(kv.pool, kv.tables, heads)
    # The seeded state: every score 0 (so every mean is 0), high positions 5 0 8 8 8, low positions 3 5. At
    # position 10 every token has age >= recent_window 2, so all are victim candidates and the weakest of each tier
    # is its first slot (ties: the first minimum). High mean 0 is not below low mean 0: no prune; it is below
    # alpha_high / 10: demote; the low victim's 0 is below alpha_low / 10: over it (case 2, DEMOTE_OVER_LOW). So
    # high slot 0 (position 5) replaces low slot 0 (position 3), the new token (position 10) takes high slot 0,
    # and the counts stay (5, 2).
    assert _positions(kv, items) == [[5, 0, 8, 8, 8], [3, 5]]
    assert _cases(kv, items, position, cfg).tolist() == [policy.DEMOTE_OVER_LOW]
    keys, values = torch.randn(1, 64), torch.randn(1, 64)
    pool0, counts0 = kv.pool.data.clone(), kv.tables.counts.clone()
    n_hi, n_lo = place_store(kv, items, keys, values, position, *ALPHAS, backend=backend)
    assert (n_hi.tolist(), n_lo.tolist()) == ([5], [2])
    assert kv.tables.tokens_flat[items].tolist() == [[5, 2]]
    assert _positions(kv, items) == [[10, 0, 8, 8, 8], [5, 5]]
    pool1 = kv.pool.data.clone()
    kv.pool.data.copy_(pool0)
    kv.tables.counts.copy_(counts0)
    place_store_ref(kv, items, keys, values, position, *ALPHAS)
    assert torch.equal(pool1, kv.pool.data)


def _many_steps(low, d, heads, steps, device):
    """Ragged heads (some empty) over many steps; a one-tier config (``low`` == high) seeds no low-tier tokens."""
    cfg = DiffKVConfig(high="K8V4", low=low, recent_window=8, alpha_high=ALPHAS[0], alpha_low=ALPHAS[1])
    n_hi = [(37 * i) % 300 for i in range(heads)]
    n_lo = [(53 * i) % 200 if cfg.two_tier and i % 5 else 0 for i in range(heads)]
    seen = _run(cfg, d, n_hi, n_lo, steps=steps, seed=11, device=device, dtype=torch.float16)
    assert len(seen) == (4 if cfg.two_tier else 2)


def test_many_steps_one_tier_small():
    """CPU twin of ``test_gpu_many_steps[K8V4-64]`` (4 heads, 3 steps)."""
    _many_steps("K8V4", 64, heads=4, steps=3, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("low,d", [("K4V2", 128), ("K4V2-g64/32", 256), ("K8V4", 64), ("K3V3", 128)])
def test_gpu_many_steps(low, d):
    _many_steps(low, d, heads=48, steps=200, device="cuda")
