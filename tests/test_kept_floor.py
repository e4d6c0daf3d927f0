"""Per-sequence floors (issue #60 item 2): ``DiffKVConfig.min_kept``, a prompt keeps at least that fraction of its
tokens per (sequence, head), the best-scored ones, in the low tier; ``min_high``, at least that fraction at the high
tier."""

from __future__ import annotations

import math

import pytest
import torch

from diffkv.core import policy
from diffkv.core.checks import ConfigError
from diffkv.core.config import DiffKVConfig


def split(score, lengths, min_kept, two_tier=True, min_high=0.0):
    return policy.split_prefill(score, lengths, 1.0, 0.5, recent_window=2, score_window=4, two_tier=two_tier,
                                peak=True, min_kept=min_kept, min_high=min_high)


@pytest.mark.parametrize("seed", range(4))
def test_the_floor_keeps_the_best_scored_tokens_and_moves_nothing_else(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([23, 17, 9])
    score = torch.rand(3, 2, 23, generator=g) * 0.01  # far below alpha_low / n: nearly all pruned
    score[0, 1, 5] = 1.0  # one high token
    base, floored = split(score, lengths, 0.0), split(score, lengths, 0.4)
    for b, n in enumerate(lengths.tolist()):
        need = math.ceil(0.4 * n)
        for h in range(2):
            kept = floored.tier[b, h] > policy.PRUNED
            assert int(kept.sum()) >= need and int(base.n_high[b, h]) == int(floored.n_high[b, h])
            moved = (base.tier[b, h] == policy.PRUNED) & kept
            assert (floored.tier[b, h][moved] == policy.LOW).all()
            if moved.any():  # every lifted token scores at least as high as every token left pruned
                left = (floored.tier[b, h] == policy.PRUNED)
                assert not left.any() or score[b, h][moved].min() >= score[b, h][left].max()
            unchanged = base.tier[b, h] != policy.PRUNED
            assert torch.equal(floored.tier[b, h][unchanged], base.tier[b, h][unchanged])
    assert (floored.tier[:, :, :23 - 9][2] == policy.PAD).all()  # padding stays padding


def test_no_floor_is_the_published_split_and_one_tier_lifts_to_high():
    score = torch.full((1, 1, 12), 1e-4)
    lengths = torch.tensor([12])
    assert torch.equal(split(score, lengths, 0.0).tier, policy.split_prefill(score, lengths, 1.0, 0.5, 2, 4, peak=True)
                       .tier)
    one = split(score, lengths, 0.5, two_tier=False)
    assert int(one.n_high[0, 0]) >= 6 and int(one.n_low[0, 0]) == 0


@pytest.mark.parametrize("seed", range(3))
def test_the_high_floor_moves_the_best_scored_tokens_up(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([21, 14])
    score = torch.rand(2, 3, 21, generator=g) / 21  # around the thresholds / n: all three tiers
    base, floored = split(score, lengths, 0.0), split(score, lengths, 0.0, min_high=0.6)
    for b, n in enumerate(lengths.tolist()):
        for h in range(3):
            row, was = floored.tier[b, h], base.tier[b, h]
            assert int((row == policy.HIGH).sum()) >= math.ceil(0.6 * n)
            moved = (was != policy.HIGH) & (row == policy.HIGH)
            below = (row != policy.HIGH) & (row != policy.PAD)
            if moved.any() and below.any():
                assert score[b, h][moved].min() >= score[b, h][below].max()
            assert torch.equal(row[~moved], was[~moved])  # nothing else moves


@pytest.mark.parametrize("field", ["min_kept", "min_high"])
@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.2"])
def test_the_floors_are_checked(field, bad):
    with pytest.raises(ConfigError, match=field):
        DiffKVConfig(**{field: bad})


def test_a_cache_keeps_the_floor_end_to_end():
    from test_cache_hf import tiny

    from diffkv.integrations.transformers import DiffKVCache

    model = tiny("llama")
    ids = torch.randint(3, 90, (1, 60), generator=torch.Generator().manual_seed(1))
    kept = {}
    for floor in (0.0, 0.5):
        cache = DiffKVCache(model, DiffKVConfig(importance="peak", alpha_high=16.0, alpha_low=8.0, recent_window=4,
                                                score_window=8, min_kept=floor))
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        tiers = cache.stats()["tokens_per_tier"]
        kept[floor] = (tiers["high"] + tiers["low"]) / sum(tiers.values())
        cache.release()
    assert kept[0.0] < 0.5 <= kept[0.5]
