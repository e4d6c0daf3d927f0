"""The calibration Profile: a versioned JSON artefact holding the thresholds found for one model.

JSON only (never pickle). A profile records the model fingerprint (name, architecture, layers, KV heads, query
heads, head_dim), the full :class:`~diffkv.config.DiffKVConfig` (tiers, global and per-layer thresholds, windows),
the calibration data and budget, what was measured on it, the tool version and the date. :func:`load_profile`
validates all of it and checks the fingerprint against the model it is loaded for.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from diffkv.config import DiffKVConfig

SCHEMA = "diffkv.profile"
SCHEMA_VERSION = 1
SHAPE_KEYS = ("num_layers", "num_kv_heads", "num_attention_heads", "head_dim")
_CONFIG_KEYS = ("high", "low", "alpha_high", "alpha_low", "recent_window", "score_window", "meta_dtype", "raw_dtype",
                "layer_alphas", "center_keys")
_RECALIBRATE = "run `diffkv calibrate --model <model> --out <path>` to make a profile for it"


def _text_config(config):
    return getattr(config, "get_text_config", lambda: config)()


def model_fingerprint(model, name: str | None = None) -> dict:
    """Shape facts of a transformers model (or its config) that a profile must match."""
    cfg = _text_config(getattr(model, "config", model))
    heads = cfg.num_attention_heads
    archs = getattr(cfg, "architectures", None) or [type(model).__name__]
    return {
        "name": name or getattr(cfg, "_name_or_path", "") or archs[0],
        "architecture": archs[0],
        "num_layers": cfg.num_hidden_layers,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "num_attention_heads": heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    }


def config_to_dict(config: DiffKVConfig) -> dict:
    """JSON-ready dict of a DiffKVConfig (tiers by name, layer_alphas as lists)."""
    d = {k: getattr(config, k) for k in _CONFIG_KEYS}
    d["high"], d["low"] = config.high.name, config.low.name
    d["layer_alphas"] = None if config.layer_alphas is None else [list(p) for p in config.layer_alphas]
    return d


def config_from_dict(d: dict) -> DiffKVConfig:
    unknown = set(d) - set(_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; expected a subset of {list(_CONFIG_KEYS)}")
    kw = dict(d)
    if kw.get("layer_alphas") is not None:
        kw["layer_alphas"] = tuple(tuple(p) for p in kw["layer_alphas"])
    return DiffKVConfig(**kw)


@dataclass
class Profile:
    """A calibrated profile. ``config`` is what ``DiffKVCache(model, profile.config)`` uses."""

    model: dict
    config: DiffKVConfig
    calibration: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)
    tool: dict = field(default_factory=dict)
    created: str = ""

    def to_dict(self) -> dict:
        from diffkv import __version__

        return {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
            "tool": self.tool or {"name": "diffkv", "version": __version__},
            "created": self.created or time.strftime("%Y-%m-%dT%H:%M:%S"),
            "model": self.model, "config": config_to_dict(self.config), "calibration": self.calibration,
            "measured": self.measured, "search": self.search,
        }

    def check_model(self, model) -> None:
        """Raise ValueError if ``model`` (transformers model or config) has another shape than the profile's."""
        have = model_fingerprint(model)
        diff = [f"{k}: profile {self.model.get(k)} vs model {have[k]}" for k in SHAPE_KEYS
                if self.model.get(k) != have[k]]
        if diff:
            raise ValueError(f"profile was calibrated for {self.model.get('name')!r}, a model of another shape "
                             f"({'; '.join(diff)}); {_RECALIBRATE}")


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as JSON (atomically: temp file + rename). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def profile_from_dict(d: dict, where: str = "profile") -> Profile:
    """Validate a decoded profile dict and build the :class:`Profile` (ValueError says what is wrong)."""
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise ValueError(f"{where} is not a diffkv profile (missing \"schema\": \"{SCHEMA}\"); {_RECALIBRATE}")
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"{where} has schema_version {version!r}, this diffkv reads version {SCHEMA_VERSION}; "
                         f"use the diffkv release that wrote it, or {_RECALIBRATE}")
    for key, kind in (("model", dict), ("config", dict)):
        if not isinstance(d.get(key), kind):
            raise ValueError(f"{where}: field {key!r} is missing or not an object; {_RECALIBRATE}")
    missing = [k for k in SHAPE_KEYS if not isinstance(d["model"].get(k), int)]
    if missing:
        raise ValueError(f"{where}: model fingerprint lacks integer {missing}; {_RECALIBRATE}")
    try:
        config = config_from_dict(d["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: invalid config: {e}; {_RECALIBRATE}") from e
    if config.layer_alphas is not None and len(config.layer_alphas) != d["model"]["num_layers"]:
        raise ValueError(f"{where}: {len(config.layer_alphas)} per-layer thresholds for a model of "
                         f"{d['model']['num_layers']} layers; {_RECALIBRATE}")
    return Profile(model=d["model"], config=config, calibration=d.get("calibration") or {},
                   measured=d.get("measured") or {}, search=d.get("search") or {}, tool=d.get("tool") or {},
                   created=d.get("created") or "")


def load_profile(path: str | Path, model=None) -> Profile:
    """Read and validate a profile; if ``model`` is given, check that the profile was made for its shape.

    Raises
    ------
    FileNotFoundError: no file at ``path``.
    ValueError: malformed JSON, not a profile, unknown schema version, invalid config, or another model's shape.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no profile at {path}; {_RECALIBRATE}")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); restore the file or {_RECALIBRATE}") from e
    profile = profile_from_dict(d, where=str(path))
    if model is not None:
        profile.check_model(model)
    return profile
