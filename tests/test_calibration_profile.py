"""Profile artefact: JSON round trip, DiffKVCache.from_profile, and every load error path."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from diffkv import DiffKVConfig
from diffkv.calibration.profile import Profile, load_profile, model_fingerprint, save_profile
from diffkv.integrations.transformers import DiffKVCache

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()


def make(model, **config) -> Profile:
    cfg = DiffKVConfig(**{"alpha_high": 2.0, "alpha_low": 0.1, "recent_window": 4, "score_window": 4, **config})
    return Profile(model=model_fingerprint(model, "tiny"), config=cfg, calibration={"data": "pg-essays"},
                   measured={"kl": 0.01, "compression_physical": 4.2})


def write(tmp_path, d) -> str:
    p = tmp_path / "p.json"
    p.write_text(json.dumps(d) if not isinstance(d, str) else d)
    return p


def test_round_trip_and_from_profile(model, tmp_path):
    prof = make(model, layer_alphas=((1.0, 0.0), (3.0, 0.2)), high="K8V4-g16/8", center_keys=True)
    path = save_profile(prof, tmp_path / "sub" / "tiny.json")
    back = load_profile(path, model)
    assert back.config == prof.config and back.model == prof.model and back.measured == prof.measured
    d = json.loads(path.read_text())
    assert d["schema_version"] == 1 and d["tool"]["name"] == "diffkv" and d["created"]
    assert d["model"]["num_layers"] == 2 and d["config"]["layer_alphas"] == [[1.0, 0.0], [3.0, 0.2]]
    cache = DiffKVCache.from_profile(model, path)
    assert cache.config.alphas(1) == (3.0, 0.2) and cache.config.center_keys and d["config"]["center_keys"]
    with torch.no_grad():
        model.generate(torch.randint(3, 96, (1, 20)), max_new_tokens=3, past_key_values=cache, do_sample=False)
    assert cache.stats()["tokens_seen"] == 22
    cache.release()


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="diffkv calibrate"):
        load_profile(tmp_path / "nope.json")


@pytest.mark.parametrize("mutate, match", [
    (lambda d: "{not json", "not valid JSON"),
    (lambda d: [1, 2], "not a diffkv profile"),
    (lambda d: {**d, "schema": "other"}, "not a diffkv profile"),
    (lambda d: {**d, "schema_version": 99}, "schema_version 99"),
    (lambda d: {k: v for k, v in d.items() if k != "schema_version"}, "schema_version None"),
    (lambda d: {**d, "model": "tiny"}, "'model' is missing"),
    (lambda d: {**d, "config": None}, "'config' is missing"),
    (lambda d: {**d, "model": {**d["model"], "num_layers": "2"}}, "lacks integer"),
    (lambda d: {**d, "config": {**d["config"], "alpha_low": 5.0}}, "invalid config"),
    (lambda d: {**d, "config": {**d["config"], "high": "K9V9"}}, "invalid config"),
    (lambda d: {**d, "config": {**d["config"], "bogus": 1}}, "unknown config keys"),
    (lambda d: {**d, "config": {**d["config"], "layer_alphas": [[1.0, 0.0]]}}, "1 per-layer thresholds"),
])
def test_load_errors(model, tmp_path, mutate, match):
    d = make(model).to_dict()
    with pytest.raises(ValueError, match=match) as err:
        load_profile(write(tmp_path, mutate(d)))
    assert "diffkv" in str(err.value)  # every message says what to do


@pytest.mark.parametrize("change", [{"num_hidden_layers": 3}, {"num_key_value_heads": 1}, {"hidden_size": 128}])
def test_profile_for_another_shape(model, tmp_path, change):
    path = save_profile(make(model), tmp_path / "p.json")
    torch.manual_seed(0)
    other = LlamaForCausalLM(LlamaConfig(**{**SMALL, **change})).eval()
    with pytest.raises(ValueError, match="another shape"):
        load_profile(path, other)
    with pytest.raises(ValueError, match="another shape"):
        DiffKVCache.from_profile(other, path)
    assert load_profile(path, model.config).config.alpha_high == 2.0  # a config object works too
