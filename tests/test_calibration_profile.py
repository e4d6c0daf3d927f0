"""Profile artefact: JSON round trip, DiffKVCache.from_profile, and every load error path."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from diffkv import DiffKVConfig
from diffkv.core.errors import UsageError
from diffkv.integrations.transformers import DiffKVCache
from diffkv.profile import (
    Profile,
    ProfileError,
    ProfileNotFoundError,
    load_profile,
    model_identity,
    save_profile,
)

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()


METRICS = {"kl": 0.01, "kl_p95": 0.03, "top1": 0.95, "ppl_ratio": 1.01, "ppl_full": 20.0, "compression_physical": 4.2,
           "predicted_compression": 4.1, "tier_fractions": {"high": 0.2, "low": 0.5, "pruned": 0.3}}


def make(model, **config) -> Profile:
    """A complete profile (every section as ``diffkv calibrate`` writes it) for ``model``, named "tiny"."""
    cfg = DiffKVConfig(**{"alpha_high": 2.0, "alpha_low": 0.1, "recent_window": 4, "score_window": 4, **config})
    calibration = {"data": "pg-essays", "first_doc": 25, "texts": 2, "context_tokens": 64, "decode_steps": 8,
                   "budget": {"max_kl": 0.02, "max_ppl_increase": None}, "quick": True, "seconds": 1.5}
    search = {"global_best": {"alpha_high": 2.0, "alpha_low": 0.1, **METRICS}, "per_layer_gain": None,
              "per_layer_weight": None,
              "rows": [{"stage": "baseline", "alpha_high": 0.0, "alpha_low": 0.0, "per_layer": False, **METRICS}]}
    return Profile(model=model_identity(model, "tiny"), config=cfg, calibration=calibration, measured=METRICS,
                   search=search)


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
    assert d["schema_version"] == 3 and d["tool"]["name"] == "diffkv" and d["created"]
    assert d["model"]["num_layers"] == 2 and d["config"]["layer_alphas"] == [[1.0, 0.0], [3.0, 0.2]]
    assert len(d["model"]["weight_signs_sha256"]) == 64
    cache = DiffKVCache.from_profile(model, path)
    assert cache.config.alphas(1) == (3.0, 0.2) and cache.config.center_keys and d["config"]["center_keys"]
    with torch.no_grad():
        model.generate(torch.randint(3, 96, (1, 20)), max_new_tokens=3, past_key_values=cache, do_sample=False)
    assert cache.stats()["tokens_seen"] == 22
    cache.release()


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="diffkv calibrate") as err:
        load_profile(tmp_path / "nope.json")
    assert isinstance(err.value, ProfileNotFoundError) and isinstance(err.value, UsageError)


def test_save_refuses_an_incomplete_or_non_finite_profile(model, tmp_path):
    with pytest.raises(ProfileError, match="profile field calibration.data: missing"):
        save_profile(Profile(model=model_identity(model, "tiny"), config=DiffKVConfig()), tmp_path / "p.json")
    prof = make(model)
    prof.measured = {**prof.measured, "kl": float("nan")}
    with pytest.raises(ProfileError, match="profile field measured.kl: expected a finite number"):
        save_profile(prof, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("mutate, match", [
    (lambda d: "{not json", "not valid JSON"),
    (lambda d: [1, 2], "not a diffkv profile"),
    (lambda d: {**d, "schema": "other"}, "not a diffkv profile"),
    (lambda d: {**d, "schema_version": 99}, "schema_version 99"),
    (lambda d: {**d, "schema_version": 1}, "schema_version 1 .* upgrade"),
    (lambda d: {**d, "schema_version": True}, "field schema_version: expected the integer 2 or 3, got True"),
    (lambda d: {k: v for k, v in d.items() if k != "schema_version"}, "field schema_version: missing"),
    (lambda d: {**d, "model": "tiny"}, "profile field model: expected an object"),
    (lambda d: {**d, "config": None}, "profile field config: expected an object"),
    (lambda d: {**d, "model": {**d["model"], "num_layers": "2"}}, r"model.num_layers: expected an integer in \[1, "),
    (lambda d: {**d, "config": {**d["config"], "alpha_low": 5.0}}, r"config: expected alpha_low <= alpha_high and "
                                                                     r"alpha_low <= 1 \(mean importance\)"),
    (lambda d: {**d, "config": {**d["config"], "importance": "max"}}, r"config.importance: expected one of"),
    (lambda d: {**d, "config": {**d["config"], "high": "K9V9"}}, "config.high: tier 'K9V9': QuantSpec.bits must be"),
    (lambda d: {**d, "config": {**d["config"], "high": "K9"}}, "config.high: cannot parse tier 'K9'"),
    (lambda d: {**d, "config": {**d["config"], "high": "K8V4-g48/48"}}, "config.high: group size 48 must divide"),
    (lambda d: {**d, "config": {**d["config"], "bogus": 1}}, "profile field config: unknown field 'bogus'"),
    (lambda d: {**d, "config": {**d["config"], "layer_alphas": [[1.0, 0.0]]}},
     r"config.layer_alphas: expected one pair per layer \(model.num_layers = 2\), got '1 pairs'"),
    (lambda d: {**d, "config": {**d["config"], "alpha_high": 0.05}}, "config: expected alpha_low <= alpha_high"),
])
def test_load_errors(model, tmp_path, mutate, match):
    d = make(model).to_dict()
    with pytest.raises(ProfileError, match=match) as err:
        load_profile(write(tmp_path, mutate(d)))
    assert "diffkv" in str(err.value) and "\n" not in str(err.value)  # one line that says what to do


@pytest.mark.parametrize("change, field", [({"num_hidden_layers": 3}, "num_layers"),
                                           ({"num_key_value_heads": 1}, "num_kv_heads"),
                                           ({"hidden_size": 128}, "head_dim"),
                                           ({}, "weight_signs_sha256")])  # same shape, other weights (seed)
def test_profile_for_another_model(model, tmp_path, change, field):
    path = save_profile(make(model), tmp_path / "p.json")
    torch.manual_seed(1)
    other = LlamaForCausalLM(LlamaConfig(**{**SMALL, **change})).eval()
    with pytest.raises(ProfileError, match=f"another model .*model.{field}: profile"):
        load_profile(path, other)
    with pytest.raises(ProfileError, match=f"model.{field}"):
        DiffKVCache.from_profile(other, path)
    assert load_profile(path, model.config).config.alpha_high == 2.0  # a config object works too (no weights)
    assert load_profile(path, model.to(torch.bfloat16)).config.alpha_high == 2.0  # signs survive the cast
    model.float()


def test_shipped_profiles_are_found_by_name():
    from diffkv.profile import SHIPPED, resolve_profile, shipped_profiles

    assert {"smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b"} <= set(shipped_profiles())
    assert resolve_profile("smollm2-135m") == SHIPPED / "smollm2-135m.json"
    assert load_profile("qwen2.5-0.5b").model["name"] == "qwen2.5-0.5b"
    with pytest.raises(ProfileNotFoundError, match="no shipped profile of that name .shipped: .*smollm2-135m"):
        load_profile("smollm2-136m")
    with pytest.raises(ProfileNotFoundError, match="no profile at"):
        load_profile("smollm2-135m.json")  # a path (it has a suffix): never a shipped name
