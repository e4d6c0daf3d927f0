import math
from fractions import Fraction

import numpy as np
import pytest

from diffkv.core.config import ALPHA_MAX, PRESETS, WINDOW_MAX, ConfigError, DiffKVConfig, QuantSpec, TierSpec
from diffkv.core.errors import UsageError


def test_presets_parse_and_round_trip():
    for name, tier in PRESETS.items():
        assert tier.name == name
        assert TierSpec.parse(name) == tier
    assert TierSpec.parse("K4V2-g64/32") == TierSpec(QuantSpec(4, 64), QuantSpec(2, 32))


@pytest.mark.parametrize("bad", ["K8", "V4K8", "K5V2", "K8V4-g64", "k8v4", "", "K8V4\n-g64/32", "K\u0668V4",
                                 "K8V4-g0/32", "K8V4-g99999999999999999999/32", "K8V4" * 20, None, 8, ["K8V4"]])
def test_bad_tier_names(bad):
    with pytest.raises(ConfigError):
        TierSpec.parse(bad)


def test_keys_may_have_fewer_bits_than_values_but_tiers_stay_ordered():
    assert TierSpec.parse("K3V4") == TierSpec(QuantSpec(3), QuantSpec(4))
    with pytest.raises(ValueError, match="at least the bits of the low tier"):
        DiffKVConfig(high="K3V4", low="K4V2")
    with pytest.raises(ValueError, match="multiple of 8"):  # a 3-bit row is a 2-bit and a 1-bit plane
        TierSpec.parse("K3V2-g4/64").validate(64)


def test_quant_spec_validation():
    with pytest.raises(ValueError, match="one of"):
        QuantSpec(5)
    with pytest.raises(ValueError, match="one of"):
        QuantSpec(True)  # True == 1, but a bool is not a bit count
    with pytest.raises(ValueError, match=r"group_size: expected an integer in \[1, 1024\]"):
        QuantSpec(4, 0)
    for bad in (True, 2048, 32.0, "32"):
        with pytest.raises(ConfigError, match="QuantSpec.group_size"):
            QuantSpec(4, bad)
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
    with pytest.raises(ValueError, match=r"alpha_low: expected a finite number in \[0, 1\]"):
        DiffKVConfig(alpha_low=-0.1)
    with pytest.raises(ValueError, match="at least the bits"):
        DiffKVConfig(high="K4V2", low="K8V4")
    with pytest.raises(ValueError, match="recent_window"):
        DiffKVConfig(recent_window=0)
    with pytest.raises(ValueError, match="meta_dtype"):
        DiffKVConfig(meta_dtype="int8")
    with pytest.raises(ValueError, match="center_keys: expected True or False"):
        DiffKVConfig(center_keys="yes")
    with pytest.raises(ValueError, match="smooth_keys: expected True or False"):
        DiffKVConfig(smooth_keys=1)
    with pytest.raises(ValueError, match="center_keys and smooth_keys exclude each other"):
        DiffKVConfig(center_keys=True, smooth_keys=True)
    assert DiffKVConfig().smooth_keys and not DiffKVConfig(center_keys=True).smooth_keys  # on unless centering
    assert not DiffKVConfig(smooth_keys=False).smooth_keys
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


@pytest.mark.parametrize("kw, match", [
    ({"alpha_high": math.inf}, r"DiffKVConfig.alpha_high: expected a finite number in \[0, 1e\+06\], got inf"),
    ({"alpha_high": math.nan}, "alpha_high: .* got nan"),
    ({"alpha_high": 1e308}, "alpha_high: .* got 1e\\+308"),
    ({"alpha_high": ALPHA_MAX * 2}, "alpha_high"),
    ({"alpha_high": True}, "alpha_high: .* got True"),
    ({"alpha_high": "1.0"}, "alpha_high: .* got '1.0'"),
    ({"alpha_high": None}, "alpha_high"),
    ({"alpha_high": 10 ** 5000}, "alpha_high: .* got an integer of"),
    ({"alpha_high": Fraction(10 ** 400, 3)}, "alpha_high"),
    ({"alpha_low": 1.5}, r"alpha_low: expected a finite number in \[0, 1\]"),
    ({"alpha_low": False}, "alpha_low"),
    ({"recent_window": 10 ** 30}, r"recent_window: expected an integer in \[1, 1048576\] tokens"),
    ({"recent_window": WINDOW_MAX + 1}, "recent_window"),
    ({"recent_window": True}, "recent_window: .* got True"),
    ({"score_window": 64.0}, "score_window: .* got 64.0"),
    ({"score_window": -1}, "score_window"),
    ({"raw_dtype": "int8"}, "raw_dtype: expected one of"),
    ({"meta_dtype": ["float16"]}, "meta_dtype"),
    ({"high": 8}, "DiffKVConfig.high: cannot parse tier 8"),
    ({"low": "K8V4-g64/0"}, "DiffKVConfig.low: tier 'K8V4-g64/0': QuantSpec.group_size"),
    ({"center_keys": 1}, "center_keys: expected True or False, got 1"),
    ({"layer_alphas": []}, "layer_alphas: expected None or a list of 1 to"),
    ({"layer_alphas": "12"}, "layer_alphas: expected None or a list"),
    ({"layer_alphas": [[math.inf, 0.1]]}, r"layer_alphas\[0\]\[0\] \(alpha_high of layer 0\): .* got inf"),
    ({"layer_alphas": [[1.0, True]]}, r"layer_alphas\[0\]\[1\] \(alpha_low of layer 0\)"),
    ({"layer_alphas": [[1.0, "0.1"]]}, r"layer_alphas\[0\]\[1\]"),
    ({"layer_alphas": [[1.0, 0.1, 0.0]]}, r"layer_alphas\[0\]: expected an \(alpha_high, alpha_low\) pair"),
    ({"layer_alphas": [1.0]}, r"layer_alphas\[0\]: expected an \(alpha_high, alpha_low\) pair"),
    ({"page_bytes": 1000}, "page_bytes: expected a multiple of 32, got 1000"),
    ({"page_bytes": 0}, r"page_bytes: expected an integer in \[32, "),
    ({"page_bytes": 1024.0}, "page_bytes: expected an integer"),
])
def test_config_fields_are_strict(kw, match):
    with pytest.raises(ConfigError, match=match) as err:
        DiffKVConfig(**kw)
    assert isinstance(err.value, UsageError) and isinstance(err.value, ValueError)
    assert len(str(err.value)) < 300 and "\n" not in str(err.value)


def test_config_normalizes_numbers():
    cfg = DiffKVConfig(alpha_high=np.float32(2.0), alpha_low=0, recent_window=np.int64(8),
                       layer_alphas=((np.float64(3.0), 1),))
    assert type(cfg.alpha_high) is float and type(cfg.alpha_low) is float and type(cfg.recent_window) is int
    assert cfg.layer_alphas == ((3.0, 1.0),) and type(cfg.layer_alphas[0][1]) is float
    assert DiffKVConfig(alpha_high=ALPHA_MAX, alpha_low=1, recent_window=WINDOW_MAX).alpha_high == ALPHA_MAX
