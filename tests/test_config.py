import pytest

from diffkv.config import PRESETS, DiffKVConfig, QuantSpec, TierSpec


def test_presets_parse_and_round_trip():
    for name, tier in PRESETS.items():
        assert tier.name == name
        assert TierSpec.parse(name) == tier
    assert TierSpec.parse("K4V2-g64/32") == TierSpec(QuantSpec(4, 64), QuantSpec(2, 32))


@pytest.mark.parametrize("bad", ["K8", "V4K8", "K3V2", "K8V4-g64", "k8v4", ""])
def test_bad_tier_names(bad):
    with pytest.raises(ValueError):
        TierSpec.parse(bad)


def test_keys_need_at_least_value_bits():
    with pytest.raises(ValueError, match="keys must have at least"):
        TierSpec.parse("K2V4")


def test_quant_spec_validation():
    with pytest.raises(ValueError, match="one of"):
        QuantSpec(3)
    with pytest.raises(ValueError, match="positive"):
        QuantSpec(4, 0)
    with pytest.raises(ValueError, match="stored as is"):
        QuantSpec(16, 32)
    with pytest.raises(ValueError, match="must divide head_dim"):
        QuantSpec(4, 48).group(64)
    assert QuantSpec(4, 32).num_groups(128) == 4
    assert QuantSpec(8).num_groups(64) == 1
    assert QuantSpec(16).num_groups(64) == 0


def test_diffkv_config_validation():
    cfg = DiffKVConfig()
    assert cfg.high.name == "K8V4" and cfg.low.name == "K4V2" and cfg.two_tier
    assert DiffKVConfig(high="K8V4", low="K8V4").tiers == (PRESETS["K8V4"],)
    with pytest.raises(ValueError, match="alpha_low <= alpha_high"):
        DiffKVConfig(alpha_high=0.1, alpha_low=0.2)
    with pytest.raises(ValueError, match="alpha_low <= alpha_high"):
        DiffKVConfig(alpha_low=-0.1)
    with pytest.raises(ValueError, match="at least the bits"):
        DiffKVConfig(high="K4V2", low="K8V4")
    with pytest.raises(ValueError, match="recent_window"):
        DiffKVConfig(recent_window=0)
    with pytest.raises(ValueError, match="meta_dtype"):
        DiffKVConfig(meta_dtype="int8")
    with pytest.raises(ValueError, match="center_keys must be True or False"):
        DiffKVConfig(center_keys="yes")
    with pytest.raises(ValueError, match="must divide head_dim"):
        DiffKVConfig(high="K8V4-g48/48", low="K4V2").validate(64)


def test_layer_alphas():
    cfg = DiffKVConfig(alpha_high=1.0, alpha_low=0.02, layer_alphas=[[2.0, 0.1], (0.5, 0.0)])
    assert cfg.alphas(0) == (2.0, 0.1) and cfg.alphas(1) == (0.5, 0.0)
    assert DiffKVConfig().alphas(7) == (1.0, 0.02)
    with pytest.raises(ValueError, match="layer 1"):
        DiffKVConfig(layer_alphas=[(1.0, 0.0), (0.1, 0.2)])
    with pytest.raises(ValueError, match="no thresholds for layer 2"):
        cfg.alphas(2)
