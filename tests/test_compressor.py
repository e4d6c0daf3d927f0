"""LayerCompressor's interface to its hosts: what ``prefill`` returns and ``begin_decode`` (a compressor built per
step resumes sequences another one stored)."""

import copy

import pytest
import torch
from test_decode_step import AGGRESSIVE, build

from diffkv import DiffKVConfig
from diffkv.cache.compressor import LayerCompressor
from diffkv.core import bookkeeping, policy


def prompt(comp, lengths, group: int = 2, seed: int = 0):
    """Random left-padded prompt inputs for ``comp``: (query, keys, values, valid, scaling)."""
    g = torch.Generator().manual_seed(seed)
    b, h, d, total = len(lengths), comp.num_kv_heads, comp.kv.plan.head_dim, max(lengths)
    q = torch.randn(b, h * group, total, d, generator=g)
    k, v = torch.randn(b, h, total, d, generator=g), torch.randn(b, h, total, d, generator=g)
    valid = torch.arange(total)[None, :] >= total - torch.tensor(lengths)[:, None]
    return q, k, v, valid, d ** -0.5


@pytest.mark.parametrize("cfg", [DiffKVConfig(**AGGRESSIVE), DiffKVConfig(**AGGRESSIVE, high="K8V8", low="K8V8")])
def test_prefill_returns_the_split_it_stored(cfg):
    comp = build(cfg, 3, 2, 64, backend="torch")
    lengths = [40, 23, 9]
    split = comp.prefill(*prompt(comp, lengths))
    assert isinstance(split, policy.PrefillSplit)
    assert split.tier.shape == (3, 2, 40) and split.tier.dtype == torch.int8
    assert split.n_high.shape == split.n_low.shape == (3, 2) and split.n_high.dtype == torch.int32
    for b, n in enumerate(lengths):  # left padding is PAD, every prompt token has a tier
        assert (split.tier[b, :, :40 - n] == policy.PAD).all() and (split.tier[b, :, 40 - n:] >= 0).all()
    assert torch.equal((split.tier == policy.HIGH).sum(-1, dtype=torch.int32), split.n_high)
    assert torch.equal((split.tier == policy.LOW).sum(-1, dtype=torch.int32), split.n_low)
    n_hi, n_lo = comp.counts()  # the page tables hold exactly that
    assert torch.equal(split.n_high.view(-1).long(), n_hi) and torch.equal(split.n_low.view(-1).long(), n_lo)
    assert (split.tier == policy.PRUNED).any()
    assert cfg.two_tier == bool((split.tier == policy.LOW).any())


def test_begin_decode_resumes_what_another_compressor_stored():
    """A compressor built for the same slots and given the positions decodes bit-identically to the one that
    prefilled (the engine and the vLLM store build one per step)."""
    cfg = DiffKVConfig(**AGGRESSIVE)
    first = build(cfg, 2, 2, 64, backend="torch")
    first.prefill(*prompt(first, [30, 17]))
    kept = copy.deepcopy(first)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        q, k, v = torch.randn(2, 4, 64, generator=g), torch.randn(2, 2, 64, generator=g), torch.randn(2, 2, 64,
                                                                                                   generator=g)
        want = first.decode(q, k, v, 0.125)
        fresh = LayerCompressor(kept.kv, 0, kept.slots, 2, attention_backend="torch")
        fresh.begin_decode(kept.position, kept.longest)
        assert fresh.position is not kept.position and fresh.position.dtype == torch.int64
        assert torch.equal(fresh.decode(q, k, v, 0.125), want)
        assert torch.equal(fresh.position, first.position) and fresh.longest == first.longest
        kept = fresh
    assert torch.equal(kept.kv.pool.data, first.kv.pool.data) and torch.equal(kept.kv.tables.counts,
                                                                              first.kv.tables.counts)


def test_begin_decode_checks_its_positions_and_feeds_the_length_check():
    comp = build(DiffKVConfig(**AGGRESSIVE, compact_meta=True), 2, 1, 64, backend="torch")
    comp.prefill(*prompt(comp, [12, 12]))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        comp.begin_decode(torch.tensor([12]), 12)
    assert comp.position.tolist() == [12, 12] and comp.longest == 12  # nothing changed
    comp.begin_decode(torch.tensor([12, 12], dtype=torch.int32), bookkeeping.COMPACT_MAX_TOKENS)
    assert comp.position.dtype == torch.int64 and comp.longest == bookkeeping.COMPACT_MAX_TOKENS
    q, k = torch.randn(2, 2, 64), torch.randn(2, 1, 64)
    with pytest.raises(ValueError, match="longer than compact metadata"):
        comp.decode(q, k, k, 0.125)
