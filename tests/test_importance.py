"""Peak importance (DiffKVConfig.importance="peak"): a token's score is the largest attention it received from one
query, against independent computations (brute-force prefill maxima, running maxima of the sum scores' increments)."""

import dataclasses

import pytest
import torch
from test_bookkeeping import peaked_tiny
from test_cache_hf import generate, left_padded_batch
from test_decode_step import build, prefill

from diffkv import DiffKVConfig
from diffkv.core import bookkeeping, policy
from diffkv.core.checks import ConfigError
from diffkv.eval.methods import scale_thresholds
from diffkv.integrations.transformers import DiffKVCache
from diffkv.memory import HIGH_COL
from diffkv.ops.prefill_scores import prefill_scores
from diffkv.profile import config_from_dict, config_to_dict

NEVER_MOVE = dict(alpha_high=0.0, alpha_low=0.0, recent_window=4, score_window=4)  # every new token is appended


def test_update_is_a_max_rounded_once():
    score = torch.tensor([0.0, 0.25, 0.5, 1e-3], dtype=torch.float16)
    gain = torch.tensor([0.1, 0.2, 0.75, 1e-3 + 1e-7])
    got = bookkeeping.updated(score, gain, torch.zeros(4, dtype=torch.int64), 0, True, peak=True)
    want = torch.maximum(score.float(), gain).half()
    assert got.dtype == torch.float16 and torch.equal(got, want)
    fp32 = bookkeeping.updated(score.float(), gain, None, 0, False, peak=True)
    assert torch.equal(fp32, torch.maximum(score.float(), gain))
    age = torch.tensor([5, 9, 100, 1])  # peaks are compared as they are: no division by age
    assert torch.equal(bookkeeping.means(fp32, age, 0, False, peak=True), fp32)
    assert not torch.equal(bookkeeping.means(fp32, age, 0, False), fp32)
    prompt = torch.tensor([0.3, 0.01])
    assert torch.equal(bookkeeping.encode_prefill(prompt, torch.tensor([0, 1]), torch.tensor(9), 0, True, True),
                       prompt.half())


@pytest.mark.parametrize("g,pad", [(1, None), (3, [0, 5])])
def test_prefill_peak_is_the_largest_window_probability(g, pad):
    torch.manual_seed(g)
    b, hkv, length, d, window = 2, 2, 23, 16, 8
    q, k = torch.randn(b, hkv * g, length, d), torch.randn(b, hkv, length, d)
    valid = None if pad is None else torch.arange(length)[None, :] >= torch.tensor(pad)[:, None]
    got = policy.prefill_scores(q, k, valid, d ** -0.5, window, peak=True)
    want = torch.zeros(b, hkv, length)
    for bi in range(b):
        first = 0 if pad is None else pad[bi]
        for h in range(hkv):
            for row in range(length - window, length):  # one query at a time, causal, no padding keys
                logits = q[bi, h * g:(h + 1) * g, row] @ k[bi, h, first:row + 1].T * d ** -0.5  # [g, row + 1 - first]
                p = torch.softmax(logits, -1).amax(0)
                want[bi, h, first:row + 1] = torch.maximum(want[bi, h, first:row + 1], p)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    summed = policy.prefill_scores(q, k, valid, d ** -0.5, window)
    assert (summed >= got - 1e-6).all() and (summed > got + 1e-3).any()


def test_triton_prefill_peak_matches_the_reference():
    torch.manual_seed(3)
    q, k = torch.randn(2, 6, 19, 64), torch.randn(2, 2, 19, 64)
    valid = torch.arange(19)[None, :] >= torch.tensor([0, 7])[:, None]
    got = prefill_scores(q, k, valid, 0.125, 8, backend="triton", block_l=16, peak=True)
    torch.testing.assert_close(got, policy.prefill_scores(q, k, valid, 0.125, 8, peak=True), atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_decode_keeps_the_running_max_of_each_steps_attention(backend):
    """Nothing moves (thresholds 0), so a sum-score cache and a peak-score cache hold the same tokens in the same
    slots and see the same attention; every step's increment of the sums is that step's gain, and the peaks must be
    the running max of the gains (and of the prompt peaks)."""
    summed = build(DiffKVConfig(**NEVER_MOVE), 2, 2, 64, backend=backend)
    peaked = build(DiffKVConfig(importance="peak", **NEVER_MOVE), 2, 2, 64, backend=backend)
    for comp in (summed, peaked):  # the same prompt
        prefill(comp, [17, 9], 2, torch.Generator().manual_seed(11))
    gen = torch.Generator().manual_seed(12)

    def read(comp):
        n = comp.kv.tables.tokens_flat[comp.items, HIGH_COL].long()
        return comp.kv.read_meta(HIGH_COL, comp.items, n, int(n.max()), comp.position.repeat_interleave(2))[0]

    running = read(summed)  # prompt sums: replaced by the peaks below (the prefill rule is tested above)
    want = None
    for _ in range(12):
        before = torch.nn.functional.pad(read(summed), (0, 1))
        q, k, v = torch.randn(2, 4, 64, generator=gen), torch.randn(2, 2, 64, generator=gen), torch.randn(2, 2, 64,
                                                                                                          generator=gen)
        torch.testing.assert_close(summed.decode(q, k, v, 0.125), peaked.decode(q, k, v, 0.125), atol=0, rtol=0)
        gain = read(summed) - before
        assert (gain >= 0).all()
        want = gain if want is None else torch.maximum(torch.nn.functional.pad(want, (0, 1)), gain)
    got = read(peaked)
    prompt = running.shape[1]
    torch.testing.assert_close(got[:, prompt:], want[:, prompt:], atol=1e-5, rtol=1e-5)  # sums' fp32 rounding
    assert (got[:, :prompt] >= want[:, :prompt] - 1e-5).all()


def test_peak_prunes_and_the_compiled_step_agrees_on_a_model():
    model, backend = peaked_tiny(), "cpu"
    ids, mask = left_padded_batch()
    cfg = DiffKVConfig(importance="peak", score_after_window=True, compact_meta=True, alpha_high=8.0,
                       alpha_low=2.0, recent_window=4, score_window=4, smooth_keys=False)
    out = {}
    for name in ("torch", backend):
        cache = DiffKVCache(model, cfg, attention_backend=name)
        out[name] = (generate(model, cache, ids, mask, 40), cache.stats()["tokens_per_tier"])
    assert out[backend][1]["pruned"] > 0 and out[backend][1]["low"] > 0, out[backend][1]
    assert torch.equal(out["torch"][0], out[backend][0]) and out["torch"][1] == out[backend][1]


def test_config_and_profile_fields():
    with pytest.raises(ConfigError, match="importance"):
        DiffKVConfig(importance="max")
    with pytest.raises(ConfigError, match="alpha_low.*peak"):
        DiffKVConfig(alpha_low=2.0)  # a mean above uniform attention is never pruned
    cfg = DiffKVConfig(importance="peak", alpha_high=40.0, alpha_low=3.0, layer_alphas=((8.0, 2.0), (9.0, 1.5)))
    assert cfg.peak and config_from_dict(config_to_dict(cfg)) == cfg
    old = config_to_dict(DiffKVConfig())
    del old["importance"]  # profiles written before the field: the paper's mean
    assert config_from_dict(old).importance == "mean"
    assert scale_thresholds(cfg, 4.0).alpha_low == 12.0  # no cap at 1 for peaks
    assert scale_thresholds(dataclasses.replace(cfg, importance="mean", alpha_low=0.5, layer_alphas=None),
                            4.0).alpha_low == 1.0


def test_the_calibration_predictor_refuses_peaks():
    from diffkv.calibration.predict import simulate_layer

    with pytest.raises(ValueError, match="mean importance only"):
        simulate_layer(torch.zeros(1, 1, 4), torch.zeros(1, 1, 2, 6), torch.ones(1), torch.zeros(1),
                       DiffKVConfig(importance="peak"), (4, 4))
