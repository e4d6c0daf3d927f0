"""The prompt scorers (``diffkv.cache.scoring``): the chain ``prompt_scorer`` builds gives bit for bit the scores of
the policy functions called by hand (window scores, max with the repeat scores, pooling), and its errors."""

import pytest
import torch

from diffkv import DiffKVConfig
from diffkv.cache.scoring import PooledScorer, RepeatScorer, WindowScorer, prompt_scorer
from diffkv.core import policy
from diffkv.ops import prefill_scores as prefill_ops

CONFIGS = {
    "window": dict(),
    "window_peak": dict(importance="peak", alpha_high=8.0, alpha_low=4.0),
    "repeat": dict(importance="peak", prompt_scores="repeat", alpha_high=8.0, alpha_low=4.0),
    "pooled": dict(score_pool=5),
    "repeat_pooled": dict(importance="peak", prompt_scores="repeat", alpha_high=8.0, alpha_low=4.0, score_pool=3),
}


def prompt(seed: int = 0):
    """A left-padded batch: query [2, 4, 19, 16], keys [2, 2, 19, 16], valid [2, 19], repeat scores [2, 2, 19]."""
    g = torch.Generator().manual_seed(seed)
    query, keys = torch.randn(2, 4, 19, 16, generator=g), torch.randn(2, 2, 19, 16, generator=g)
    valid = torch.arange(19)[None, :] >= torch.tensor([0, 6])[:, None]
    return query, keys, valid, torch.rand(2, 2, 19, generator=g)


def by_hand(cfg: DiffKVConfig, query, keys, valid, scaling, repeat):
    score = policy.prefill_scores(query, keys, valid, scaling, cfg.score_window, peak=cfg.peak)
    if cfg.prompt_scores == "repeat":
        score = torch.maximum(score, repeat.to(score.device, score.dtype) * valid[:, None, :])
    return policy.pool_scores(score, valid, cfg.score_pool)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chain_equals_the_policy_functions(name):
    cfg = DiffKVConfig(score_window=6, **CONFIGS[name])
    query, keys, valid, repeat = prompt()
    got = prompt_scorer(cfg, "torch").score(query, keys, valid, 0.25, repeat)
    assert torch.equal(got, by_hand(cfg, query, keys, valid, 0.25, repeat))
    assert got.shape == (2, 2, 19) and (got[1, :, :6] == 0).all()


def test_chain_shape():
    base = WindowScorer(6, peak=True, triton=True)
    assert prompt_scorer(DiffKVConfig(), "cpu") == WindowScorer(64)
    assert prompt_scorer(DiffKVConfig(score_window=6, **CONFIGS["repeat_pooled"]), "triton", where="x") \
        == PooledScorer(RepeatScorer(base, "x"), 3)


def test_triton_chain_uses_the_kernels():
    """Backend "triton": the window scores are the Triton kernels' (the interpreter on CPU), then pooled."""
    cfg = DiffKVConfig(score_window=6, **CONFIGS["pooled"])
    query, keys, valid, _ = prompt(1)
    got = prompt_scorer(cfg, "triton").score(query, keys, valid, 0.25)
    window = prefill_ops.prefill_scores(query, keys, valid, 0.25, 6, backend="triton")
    assert torch.equal(got, policy.pool_scores(window, valid, 5))
    torch.testing.assert_close(got, by_hand(cfg, query, keys, valid, 0.25, None), rtol=0, atol=1e-4)


@pytest.mark.parametrize("bad", [None, torch.zeros(2, 2, 18)])
def test_repeat_needs_scores_of_the_prompts_shape(bad):
    cfg = DiffKVConfig(score_window=6, **CONFIGS["repeat"])
    query, keys, valid, _ = prompt()
    got = "None" if bad is None else r"\(2, 2, 18\)"
    with pytest.raises(ValueError, match=rf"^layer 3: prompt_scores='repeat' needs repeat scores of shape "
                                         rf"\(2, 2, 19\) .* got {got}$"):
        prompt_scorer(cfg, "torch", where="layer 3: ").score(query, keys, valid, 0.25, bad)
