"""Pooled prefill scores (``DiffKVConfig.score_pool``): the pooling against a loop, its use at prefill, the errors."""

import pytest
import torch
from test_decode_step import AGGRESSIVE, build

from diffkv import DiffKVConfig
from diffkv.core import policy
from diffkv.core.checks import ConfigError
from diffkv.profile import config_from_dict, config_to_dict


def pooled_by_loop(score: torch.Tensor, valid: torch.Tensor, kernel: int) -> torch.Tensor:
    """The max over the valid tokens within kernel // 2 of each valid token; 0 at padding."""
    b, h, length = score.shape
    out = torch.zeros_like(score)
    r = kernel // 2
    for bi in range(b):
        for t in range(length):
            if not valid[bi, t]:
                continue
            near = [u for u in range(max(0, t - r), min(length, t + r + 1)) if valid[bi, u]]
            out[bi, :, t] = score[bi, :, near].amax(-1)
    return out


@pytest.mark.parametrize("kernel", [3, 7, 31])
def test_pool_is_the_max_over_the_centred_window(kernel):
    gen = torch.Generator().manual_seed(kernel)
    valid = torch.arange(13)[None, :] >= torch.tensor([0, 4, 11])[:, None]  # left padding, one 2-token prompt
    score = torch.rand(3, 2, 13, generator=gen) * valid[:, None, :]
    got = policy.pool_scores(score, valid, kernel)
    torch.testing.assert_close(got, pooled_by_loop(score, valid, kernel), rtol=0, atol=0)
    assert (got >= score).all() and (got > score).any()


def test_pool_of_one_is_the_score_itself():
    score = torch.rand(2, 3, 9)
    assert policy.pool_scores(score, torch.ones(2, 9, dtype=torch.bool), 1) is score


def test_a_number_is_kept_whole():
    """The question reads one digit of a 7-token number sharply; pooled, its neighbours score as high."""
    score = torch.full((1, 1, 40), 1e-4)
    score[0, 0, 20] = 0.5  # the digit the question's queries found
    valid = torch.ones(1, 40, dtype=torch.bool)
    args = (torch.tensor([40]), 1.0, 0.02, 4, 4)
    plain = policy.split_prefill(score, *args).tier[0, 0]
    pooled = policy.split_prefill(policy.pool_scores(score, valid, 7), *args).tier[0, 0]
    assert plain[17:24].tolist() == [policy.PRUNED] * 3 + [policy.HIGH] + [policy.PRUNED] * 3
    assert pooled[17:24].tolist() == [policy.HIGH] * 7
    assert (pooled[:17] == policy.PRUNED).all() and (pooled[24:36] == policy.PRUNED).all()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefill_stores_the_split_of_the_pooled_scores(backend):
    """The compressor's prefill (every backend calls the same code) splits on the pooled scores: its tiers equal
    split_prefill of policy.pool_scores over the reference prefill scores, and pooling prunes fewer tokens."""
    lengths, group, d = [29, 5, 18], 2, 64
    splits = {}
    for pool in (1, 3):
        cfg = DiffKVConfig(score_pool=pool, **dict(AGGRESSIVE, alpha_high=4.0, alpha_low=1.0))
        comp = build(cfg, len(lengths), 2, d, backend=backend)
        gen = torch.Generator().manual_seed(11)
        total = max(lengths)
        q = torch.randn(3, 2 * group, total, d, generator=gen)
        k = torch.randn(3, 2, total, d, generator=gen) * 3.0
        v = torch.randn(3, 2, total, d, generator=gen)
        valid = torch.arange(total)[None, :] >= total - torch.tensor(lengths)[:, None]
        splits[pool] = comp.prefill(q, k, v, valid, d ** -0.5)
        score = policy.pool_scores(policy.prefill_scores(q, k, valid, d ** -0.5, cfg.score_window), valid, pool)
        want = policy.split_prefill(score, valid.sum(1), cfg.alpha_high, cfg.alpha_low, cfg.recent_window,
                                    cfg.score_window)
        assert torch.equal(splits[pool].tier, want.tier)
    pruned = {p: int((s.tier == policy.PRUNED).sum()) for p, s in splits.items()}
    assert 0 < pruned[3] < pruned[1]


@pytest.mark.parametrize("bad", [0, 2, 256, True, 3.0, "7"])
def test_bad_pool_sizes_are_refused(bad):
    with pytest.raises(ConfigError, match="score_pool"):
        DiffKVConfig(score_pool=bad)


def test_profiles_keep_the_pool_and_the_prompt_scores():
    cfg = DiffKVConfig(score_pool=9, importance="peak", prompt_scores="repeat", alpha_high=4.0, alpha_low=2.0)
    back = config_from_dict(config_to_dict(cfg))
    assert back.score_pool == 9 and back.prompt_scores == "repeat" and back == cfg
    old = config_to_dict(DiffKVConfig())  # the options at their defaults are not written: profiles and calibration
    assert "score_pool" not in old and "prompt_scores" not in old  # cache keys stay as they were before them
    assert config_from_dict(old).score_pool == 1
