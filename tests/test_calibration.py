"""Calibration: profiling pass, prediction vs measurement, search under a budget (tiny random Llama)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from diffkv import DiffKVConfig
from diffkv.calibration import search
from diffkv.calibration.hooks import recording
from diffkv.calibration.predict import config_alphas, predict
from diffkv.calibration.profiler import ImportanceRecorder, ImportanceStats, calibration_texts, profile_model
from diffkv.calibration.quality import measure_quality

CONTEXT, STEPS = 96, 16
BASE = DiffKVConfig(recent_window=8, score_window=8)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small ops on a shared 2-core box run ~100x faster on one thread than on two contended ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(one_thread):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a random model attends almost uniformly; sharpen its query heads, each differently
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.view(4, 16, 64).mul_(torch.tensor([50.0, 100.0, 200.0, 400.0])[:, None, None])
    return m


@pytest.fixture(scope="module")
def stats(model):
    ids = torch.randint(3, 96, (2, CONTEXT + STEPS + 1), generator=torch.Generator().manual_seed(1))
    return profile_model(model, ids, CONTEXT, BASE.score_window, progress=False)


def test_stats_shapes_and_round_trip(stats, tmp_path):
    assert stats.prefill_score.shape == (2, 2, 2, CONTEXT)
    assert stats.decode_gain.shape == (2, 2, 2, STEPS, CONTEXT + STEPS)
    assert stats.ref_logprobs.shape == (2, STEPS, 96)
    # decode query s sees tokens <= CONTEXT + s, and its group-max probabilities are a distribution's maxima
    assert stats.decode_gain[..., 0, CONTEXT + 1:].abs().max() == 0
    assert (stats.decode_gain.float().sum(-1) >= 0.99).all()
    stats.save(tmp_path / "s.safetensors")
    back = ImportanceStats.load(tmp_path / "s.safetensors")
    assert back.layers == stats.layers and back.meta == stats.meta
    assert torch.equal(back.decode_gain, stats.decode_gain) and torch.equal(back.ref_logprobs, stats.ref_logprobs)


def test_recording_restores_the_model(model):
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with recording(model, ImportanceRecorder(4, 2, 8)):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == before
    assert not any(hasattr(m, "_diffkv_recorder") for m in model.modules())


@pytest.mark.parametrize("alphas,after_window,compact", [
    ((0.0, 0.0), False, False), ((1.0, 0.0), False, False), ((1.5, 0.5), False, False), ((3.0, 1.0), False, False),
    ((1.5, 0.5), True, False), ((3.0, 1.0), True, False), ((1.5, 0.5), False, True), ((3.0, 1.0), True, True)])
def test_predicted_compression_matches_measured(model, stats, alphas, after_window, compact):
    # NOTE: the prediction simulates exact attention; with queries sharpened 50-400x, key rounding moves placements:
    # per-token keys stay within 3 %, smoothed keys (the default) were 3.2-4.1 % off at alphas 1.5 / 0.5 and 3 / 1.
    cfg = DiffKVConfig(alpha_high=alphas[0], alpha_low=alphas[1], recent_window=8, score_window=8, smooth_keys=False,
                       score_after_window=after_window, compact_meta=compact)
    pred = predict(stats, cfg, config_alphas(cfg, stats.layers))
    got = measure_quality(model, stats, cfg)
    assert float(pred.compression()[0]) == pytest.approx(got["compression_physical"], rel=0.03)
    for tier, frac in pred.tier_fractions().items():
        assert frac == pytest.approx(got["tier_fractions"][tier], abs=0.03)
    if alphas == (0.0, 0.0):
        assert got["tier_fractions"]["high"] == 1.0 and got["kl"] < 1e-3


def test_score_after_window_lets_decode_pruning_fire():
    """A token attended strongly while recent and ~never after: its paper mean (window steps included) stays far
    above alpha_low / n for hundreds of steps; counted from the window's end it falls below at once."""
    from diffkv.calibration.predict import simulate_layer

    length, steps, window = 8, 160, 16
    p = torch.arange(length, length + steps)[:, None]
    age = p - torch.arange(length + steps)[None, :]
    gain = torch.where(age <= 0, 0.0, torch.where(age < window, 1.0, 1e-4))  # [S, L + S]
    gain[:, 0] = 4.0  # an attention sink
    gain = (gain / gain.sum(-1, keepdim=True))[None, None]
    score = torch.full((1, 1, length), 0.1)
    score[..., 0] = 1.0
    pruned = {}
    for after in (False, True):
        cfg = DiffKVConfig(recent_window=window, score_window=window, score_after_window=after)
        n_hi, n_lo, *_ = simulate_layer(score, gain, torch.tensor([1.0]), torch.tensor([0.02]), cfg, (32, 48))
        pruned[after] = length + steps - int(n_hi.sum() + n_lo.sum())
    assert pruned[False] < 10 and pruned[True] > 100, pruned


def fake_evaluator(stats):
    """Quality from the prediction (KL = pruned mass + 0.2 low mass): the search logic without model runs."""
    calls = []

    def evaluate(cfg):
        pred = predict(stats, cfg, config_alphas(cfg, stats.layers))
        kl = float(pred.pruned_mass.sum() + 0.2 * pred.low_mass.sum())
        c = float(pred.compression()[0])
        calls.append(cfg)
        return {"kl": kl, "ppl_ratio": 1 + kl, "top1": 1.0, "compression_physical": c, "predicted_compression": c,
                "alpha_high": cfg.alpha_high, "alpha_low": cfg.alpha_low, "per_layer": cfg.layer_alphas is not None}

    return evaluate, calls


@pytest.mark.parametrize("max_kl", [0.12, 0.3])
def test_search_respects_budget(stats, max_kl):
    evaluate, calls = fake_evaluator(stats)
    budget = search.Budget(max_kl=max_kl)
    rows = search.global_sweep(evaluate, BASE, budget, highs=(0.5, 1.0, 2.0, 4.0), lows=(0.1, 0.3, 0.6))
    best = search.best_row(rows, budget)
    assert best is not None and best["kl"] <= max_kl
    assert all(r["compression_physical"] <= best["compression_physical"] for r in rows if budget.ok(r))
    for stage in ("alpha_high", "alpha_low"):  # each sweep stops at its first candidate over budget
        over = [i for i, r in enumerate(rows) if r["stage"] == stage and not budget.ok(r)]
        assert len(over) <= 1 and (not over or over[0] == max(i for i, r in enumerate(rows) if r["stage"] == stage))
    layer = search.per_layer_search(evaluate, stats, BASE, budget, rows, max_evals=4)
    assert len(layer["rows"]) <= 4
    assert layer["rows"] and all(r["per_layer"] for r in layer["rows"])
    if max_kl == 0.3:
        assert layer["best"] is not None
    if layer["best"] is not None:
        assert layer["best"]["kl"] <= max_kl
        assert layer["best"]["compression_physical"] > best["compression_physical"]
        assert len(layer["best"]["layer_alphas"]) == 2


def test_budget_and_data_errors():
    with pytest.raises(ValueError, match="budget"):
        search.Budget()
    with pytest.raises(ValueError, match=">= 0"):
        search.Budget(max_kl=-1.0)
    with pytest.raises(ValueError, match="never an evaluation set"):
        calibration_texts(None, "gsm8k", 1, 10)
