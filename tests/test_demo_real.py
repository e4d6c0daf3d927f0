"""The README's main job on the real default model (fetched offline from PyPI on first use)."""

import json

import pytest

from diffkv.cli import main


@pytest.mark.real_model
def test_demo_json_on_smollm2(capsys):
    assert main(["demo", "--json", "--context-tokens", "400", "--max-new-tokens", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("compression_physical", "compression_theoretical", "tokens_per_tier", "diffkv_text", "full_text",
                "diffkv_tokens_per_s", "full_tokens_per_s"):
        assert key in out
    assert out["prompt_tokens"] > 400
    assert out["compression_physical"] > 1.5
    assert out["diffkv_text"].strip() and out["full_text"].strip()
    tiers = out["tokens_per_tier"]
    assert tiers["high"] > 0 and tiers["low"] > 0


@pytest.mark.real_model
def test_profile_of_another_model_is_refused_by_the_clis(capsys):
    args = ["--model", "smollm2-135m", "--profile", "profiles/qwen2.5-0.5b.json"]
    assert main(["bench", "ppl", *args, "--context-tokens", "64", "--continuation-tokens", "4"]) == 2
    assert main(["bench", "decode", *args, "--context-tokens", "64", "--max-new-tokens", "2"]) == 2
    assert main(["demo", *args, "--context-tokens", "64", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 3 and "qwen" in err.lower()
