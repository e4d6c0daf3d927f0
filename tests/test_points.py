"""The two operating points of a config (#62, ``diffkv.core.points``): window scores for a prompt with its question,
the context point (repeat scores, peak importance, thresholds x context_scale) for a context before its question."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from diffkv.core.checks import ConfigError
from diffkv.core.config import DiffKVConfig
from diffkv.core.points import SCORING_FIELDS, check_same_storage, context_point, keeps_everything
from diffkv.engine.cache import fp16_config
from diffkv.profile import config_from_dict, config_to_dict, profile_from_dict

ROOT = Path(__file__).resolve().parents[1]


def test_the_context_point_scores_by_repeat_at_scaled_thresholds_and_stores_alike():
    cfg = DiffKVConfig(alpha_high=2.0, alpha_low=0.3, layer_alphas=((1.0, 0.5), (4.0, 0.25)), context_scale=8.0,
                       compact_meta=True, page_bytes=1472)
    point = context_point(cfg)
    assert (point.importance, point.prompt_scores) == ("peak", "repeat")
    assert (point.alpha_high, point.alpha_low) == (16.0, 2.4)  # peaks: alpha_low may pass 1
    assert point.layer_alphas == ((8.0, 4.0), (32.0, 2.0))
    check_same_storage(cfg, point)
    assert context_point(point) is point  # a repeat config is its own context point
    assert context_point(DiffKVConfig()).alpha_high == 64.0  # the default scale


def test_a_config_that_keeps_every_token_needs_no_context_point():
    assert keeps_everything(fp16_config()) and context_point(fp16_config()) == fp16_config()
    assert not keeps_everything(DiffKVConfig())
    one_tier = DiffKVConfig(high="K8V4", low="K8V4", alpha_low=0.1)  # one tier that prunes: still placed
    assert not keeps_everything(one_tier) and context_point(one_tier).prompt_scores == "repeat"


@pytest.mark.parametrize("change", [dict(high="K4V4"), dict(recent_window=8), dict(page_bytes=2048),
                                    dict(smooth_keys=False), dict(compact_meta=True)])
def test_a_point_that_stores_otherwise_is_refused(change):
    with pytest.raises(ConfigError, match=f"it changes {next(iter(change))}"):
        check_same_storage(DiffKVConfig(), dataclasses.replace(DiffKVConfig(), **change), "layer 3: ")
    assert {"importance", "prompt_scores", "layer_alphas"} <= set(SCORING_FIELDS)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "64", True])
def test_context_scale_is_checked(bad):
    with pytest.raises(ConfigError, match="context_scale"):
        DiffKVConfig(context_scale=bad)


def test_profiles_carry_both_points_and_version_2_files_still_load():
    """Schema 3 adds ``config.context_scale`` (written when not the default); a version-2 file loads with the
    default scale."""
    shipped = json.loads((ROOT / "benchmarks" / "calibration" / "qwen2.5-0.5b-full-compact.json").read_text())
    assert shipped["schema_version"] == 2  # the calibration shipped until 2026-12-07, kept as it was
    old = profile_from_dict(shipped)
    assert old.config.context_scale == 64.0 and context_point(old.config).alpha_high == 64 * old.config.alpha_high
    cfg = dataclasses.replace(old.config, context_scale=16.0)
    d = config_to_dict(cfg)
    assert d["context_scale"] == 16.0 and config_from_dict(d) == cfg
    assert "context_scale" not in config_to_dict(old.config)  # the default is not written
    new = profile_from_dict({**shipped, "schema_version": 3, "config": d})
    assert new.to_dict()["schema_version"] == 3 and new.config.context_scale == 16.0


def test_eval_ask_after_runs_a_diffkv_method_at_its_context_point_unless_its_spec_says_otherwise():
    from test_cache_hf import tiny

    from diffkv.eval.methods import get_method
    from diffkv.eval.runner import build_cache

    model, rc = tiny("llama"), {"budget": None, "profile": None}
    caches = {spec: build_cache(get_method(spec), model, rc, ask_after=True)
              for spec in ("diffkv", 'diffkv+prompt_scores="window"')}
    caches["in-prompt"] = build_cache(get_method("diffkv"), model, rc)
    try:
        assert caches["diffkv"].config == context_point(DiffKVConfig())
        assert caches['diffkv+prompt_scores="window"'].config == DiffKVConfig()
        assert caches["in-prompt"].config == DiffKVConfig()
    finally:
        for cache in caches.values():
            cache.release()


def test_the_server_says_at_start_up_which_scores_each_path_uses():
    from test_cache_hf import tiny
    from test_engine import engine

    from diffkv.serve.serve_cli import scores_line

    model = tiny("llama")
    cfg = DiffKVConfig(raw_dtype="float32", context_scale=16.0)
    assert scores_line(engine(model, "fp16")) == "scores: none (every token kept)"
    assert scores_line(engine(model, "diffkv", config=cfg)) == ("scores: prompts by window scores (mean importance); "
                                                                "shared prefixes off (--prefix-cache)")
    line = scores_line(engine(model, "diffkv", config=cfg, prefix_cache=True))
    assert line.endswith("shared prefixes by repeat scores (peak importance, thresholds x 16)"), line
    line = scores_line(engine(model, "diffkv", config=cfg, prefix_cache=True, prefix_scores="window"))
    assert line.endswith("shared prefixes by window scores (mean importance, the same thresholds)"), line


@pytest.mark.parametrize("name,scale", [("qwen2.5-0.5b", 32.0), ("smollm2-135m", 8.0), ("qwen2.5-1.5b", 32.0),
                                        ("gemma3-270m", 32.0)])
def test_shipped_profiles_carry_their_calibrated_context_point(name, scale):
    """Pinned to what `diffkv calibrate --model NAME --context-of ...` measured (2026-12-07): the most compressive
    scale within the profile's KL budget of 0.02 (qwen2.5-0.5b x32: 4.15x at KL 0.0104, x64 0.0286; smollm2-135m
    x8: 4.58x at 0.0112, x16 0.0206; qwen2.5-1.5b x32: 4.38x at 0.0087, x64 0.0230; gemma3-270m x32: 20.8x at
    0.0146, x64 0.0363), the next scale over it."""
    from diffkv.profile import load_profile

    prof = load_profile(ROOT / "profiles" / f"{name}.json")
    rows = {r["context_scale"]: r for r in prof.search["context_rows"]}
    assert prof.config.context_scale == scale and rows[scale]["kl"] <= 0.02 < rows[2 * scale]["kl"]
    within = [r["compression_physical"] for r in rows.values() if r["kl"] <= 0.02]
    assert rows[scale]["compression_physical"] == max(within)
