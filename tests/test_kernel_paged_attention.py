"""Triton paged decode attention (interpreter on CPU) vs the torch reference over pages written by PagedKV."""

import pytest
import torch

from diffkv.cache.paged_kv import PagedKV
from diffkv.core.config import DiffKVConfig
from diffkv.core.layout import plan_for_config
from diffkv.memory import HIGH_COL, LOW_COL, HeadTables, PagePool, allocate, trim
from diffkv.ops.paged_attention import paged_decode_attention
from diffkv.ops.paged_attention_streams import use_streams
from diffkv.ops.reference import add_scores_ref, paged_decode_attention_ref


def _paged(cfg: DiffKVConfig, d: int, n_hi: list[list[int]], n_lo: list[list[int]], seed: int = 0,
           device: str = "cpu", position: int | None = None):
    """PagedKV with B sequences x H_kv heads holding n_hi[b][h] high and n_lo[b][h] low random tokens, at position 0
    or (``position``) at random ages 1 .. 200 before it."""
    torch.manual_seed(seed)
    b, h = len(n_hi), len(n_hi[0])
    plan = plan_for_config(cfg, d)
    pool = PagePool(plan.page_bytes, 64 * b * h + sum(map(sum, n_hi)) + sum(map(sum, n_lo)), device=device)
    pool.data.fill_(0xFF)  # stale NaN patterns everywhere: masked slots must never leak into the result
    tables = HeadTables.for_config(cfg, plan, b, 1, h, 8192, device=device)
    kv = PagedKV(pool, tables, plan, cfg)
    slots = [tables.acquire_slot() for _ in range(b)]
    heads = tables.select(slots, layers=[0])
    nh, nl = torch.tensor(n_hi, device=device).view(-1), torch.tensor(n_lo, device=device).view(-1)
    allocate(pool, tables, heads, (nh + nl).view(b, h).amax(1).clamp_min(1).tolist())
    tables.tokens_flat[heads.items] = torch.stack([nh, nl], 1).int()
    for tier, n in ((HIGH_COL, nh), (LOW_COL, nl)):
        if int(n.sum()) == 0:
            continue
        rows = torch.arange(b * h, device=device).repeat_interleave(n)
        idx = torch.cat([torch.arange(int(c), device=device) for c in n])
        keys, values = torch.randn(len(idx), d, device=device) * 2, torch.randn(len(idx), d, device=device)
        pos = torch.zeros(len(idx), dtype=torch.int64)
        if position is not None:
            pos = position - torch.randint(1, 201, (len(idx),))
        kv.write(tier, heads.items[rows], idx, keys, values, torch.rand(len(idx), device=device),
                 pos.to(device), before_trim=True)
    trim(pool, tables, heads)
    return kv, heads.items, nh, nl


def _check(kv, items, nh, nl, g, d, *, dtype=torch.float32, num_splits=None, update_scores=False, position=None,
           kernel="auto", reduce_chunks=None, query_scale=1.0):
    """Kernel vs reference: output and gain within float tolerance; with ``update_scores`` the pool after the kernel
    is, byte for byte, the pool before it with the reference's score update (``add_scores_ref``: fp32 sums, or
    compact fp16 means by age) applied to the kernel's own gain."""
    hkv = kv.tables.shape[2]
    bsz = items.numel() // hkv
    query = (torch.randn(bsz, hkv * g, d, device=items.device) * query_scale).to(dtype)
    args = (query, kv.pool.data, kv.tables, items, nh, nl, kv.layouts, d ** -0.5)
    kw = dict(meta_dtype=kv.meta_dtype, raw_dtype=kv.raw_dtype, position=position, lag=kv.config.score_lag)
    before = kv.pool.data.clone()
    out, gain = paged_decode_attention(*args, **kw, num_splits=num_splits, backend="triton",
                                       update_scores=update_scores, kernel=kernel, reduce_chunks=reduce_chunks)
    after = kv.pool.data.clone()
    kv.pool.data.copy_(before)
    ref_out, ref_gain = paged_decode_attention_ref(*args, **kw, update_scores=update_scores)
    # Output: per (sequence, query head) row, so one wrong head among many cannot hide in a global norm. Both
    # sides accumulate in fp32 from the same dequantized K/V: on CPU (interpreter, ieee dots) the row errors
    # measured <= 7e-7 of the row's norm; the GPU's tf32x3 dots and approximate exp2 over thousands of tokens get
    # 10x more room. The streams kernel with 16-bit queries (fp16, and bf16 scaled by a power of two into fp16)
    # sends the probabilities to the value dots as one fp16 part, as flash attention does: up to 1.4e-3 of the row
    # measured, about one fp16 ulp of the output, so 3e-3 there. An empty head's row is 0 in both (hence the small
    # absolute floor); NaN fails.
    assert out.shape == ref_out.shape
    err = (out - ref_out).float().norm(dim=-1)
    streams = use_streams(kernel, kv.layouts[HIGH_COL], kv.layouts[LOW_COL])
    fp16_probs = streams and dtype in (torch.float16, torch.bfloat16)
    rel = 3e-3 if fp16_probs else 1e-5 if out.device.type == "cpu" else 1e-4
    tol = rel * ref_out.float().norm(dim=-1) + 1e-6
    ok = err <= tol
    assert ok.all(), f"rows {(~ok).nonzero().tolist()[:6]}: error {err[~ok][:6].tolist()} > {tol[~ok][:6].tolist()}"
    assert gain.shape == ref_gain.shape
    # The gain (normalized attention, the scores' update): 1e-4; the streams kernel's fp16 queries dot 1024 + code
    # (the offset folded into the zero), whose fp32 sums keep ~10 bits fewer: 5e-4 there (1.2e-4 measured).
    torch.testing.assert_close(gain, ref_gain, atol=5e-4 if fp16_probs else 1e-4, rtol=0)
    if update_scores:
        assert not torch.equal(after, before)
        kv.pool.data.copy_(before)
        m_hi = _m_hi(kv, nh)
        for low, count, delta in ((False, nh, gain[:, :m_hi]), (True, nl, gain[:, m_hi:])):
            add_scores_ref(kv.pool.data, kv.tables, kv.layouts[int(low)], low, items, count, delta,
                           position=position, lag=kv.config.score_lag)
        diff = (after != kv.pool.data).nonzero()
        assert diff.numel() == 0, f"{len(diff)} pool bytes differ, first at {diff[:4].tolist()}"


def _m_hi(kv, nh) -> int:
    """Columns of the high tier in the gain (whole pages of the longest high tier)."""
    n = kv.layouts[HIGH_COL].tokens_per_page
    return -(-int(nh.max()) // n) * n


@pytest.mark.parametrize("num_splits", [1, 3])
def test_two_tiers_ragged_gqa3(num_splits):
    """Ragged heads: empty low tier, a single token, partly filled last pages, one fully empty head."""
    kv, items, nh, nl = _paged(DiffKVConfig(), 64, [[40, 1, 0], [70, 3, 5]], [[0, 0, 0], [64, 61, 2]])
    _check(kv, items, nh, nl, 3, 64, num_splits=num_splits)


@pytest.mark.parametrize("reduce_chunks", [None, 3])
def test_split_across_tier_boundary_fused_scores(reduce_chunks):
    """Split-K with splits spanning the high/low boundary; score += gain fused into the pages' score fields, by one
    or by three reduce programs per item (each a share of the tokens: 130 low tokens = 2 blocks of 128, 3 chunks)."""
    kv, items, nh, nl = _paged(DiffKVConfig(), 64, [[50, 7]], [[90, 130]])
    _check(kv, items, nh, nl, 3, 64, num_splits=3, update_scores=True, kernel="split", reduce_chunks=reduce_chunks)
    _check(kv, items, nh, nl, 3, 64, num_splits=3, update_scores=True, reduce_chunks=reduce_chunks)


@pytest.mark.parametrize("compact,symmetric_keys", [(False, False), (True, False), (False, True), (True, True)])
def test_compact_meta_and_symmetric_keys(compact, symmetric_keys):
    """Scale-only keys; compact pages' fp16 mean update with lagged counts, int16 positions across 2^16."""
    cfg = DiffKVConfig(compact_meta=compact, symmetric_keys=symmetric_keys, score_after_window=True, recent_window=4)
    position = 65536 + 50
    kv, items, nh, nl = _paged(cfg, 64, [[37, 2, 0]], [[45, 0, 3]], seed=11, position=position)
    _check(kv, items, nh, nl, 3, 64, num_splits=2, update_scores=True, position=torch.full((3,), position))


@pytest.mark.parametrize("g", [1, 7])
def test_gqa_ratios(g):
    kv, items, nh, nl = _paged(DiffKVConfig(), 64, [[33], [5]], [[20], [0]], seed=g)
    _check(kv, items, nh, nl, g, 64, num_splits=2)


def test_head_dim_256():
    kv, items, nh, nl = _paged(DiffKVConfig(), 256, [[9, 2]], [[4, 0]], seed=3)
    _check(kv, items, nh, nl, 2, 256)


def test_llama3_8b_head_shape_fp16():
    """head_dim 128, 4 query heads per KV head, fp16 queries: the shape benchmarks/gpu/bench_decode.py times."""
    kv, items, nh, nl = _paged(DiffKVConfig(), 128, [[12, 3]], [[20, 0]], seed=8)
    _check(kv, items, nh, nl, 4, 128, dtype=torch.float16, num_splits=2)


@pytest.mark.parametrize("tiers", [("K8V4", "K4V2-g32/16"), ("K16V16", "K16V16"), ("K4V4", "K3V3-g32/16")])
def test_presets(tiers):
    kv, items, nh, nl = _paged(DiffKVConfig(high=tiers[0], low=tiers[1]), 64, [[37, 1]],
                               [[45 if tiers[0] != tiers[1] else 0, 0]], seed=4)
    _check(kv, items, nh, nl, 2, 64, num_splits=2)


def test_one_bit_values_bf16_meta():
    kv, items, nh, nl = _paged(DiffKVConfig(high="K8V8", low="K4V1", meta_dtype="bfloat16"), 64, [[21]], [[30]], seed=6)
    _check(kv, items, nh, nl, 2, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_queries(dtype):
    kv, items, nh, nl = _paged(DiffKVConfig(), 64, [[20, 3]], [[7, 0]], seed=5)
    _check(kv, items, nh, nl, 2, 64, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("d,g", [(64, 3), (128, 4), (128, 7), (256, 2)])
def test_gpu_long_context(d, g):
    kv, items, nh, nl = _paged(DiffKVConfig(), d, [[900, 3000, 17], [1, 0, 2500]], [[2100, 0, 4000], [3, 700, 60]],
                               seed=d + g, device="cuda")
    _check(kv, items, nh, nl, g, d, update_scores=True)
    _check(kv, items, nh, nl, g, d, num_splits=7, dtype=torch.bfloat16)
    _check(kv, items, nh, nl, g, d, dtype=torch.float16)  # the PTX unpack and the folded 1024 (keys and values)
