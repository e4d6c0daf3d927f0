"""The calibration Profile: a versioned JSON artefact holding the thresholds found for one model.

JSON only (never pickle). A profile records the model's identity (name, architecture, layers, KV heads, query
heads, head_dim and a fingerprint of its weights), the full :class:`~diffkv.core.config.DiffKVConfig` (tiers, global
and per-layer thresholds, windows), the calibration data and budget, what was measured on it, the tool version and
the date. :func:`load_profile` validates every field (:mod:`diffkv.profile_schema`) and checks the identity
against the model it is loaded for; every problem is a :class:`~diffkv.profile_schema.ProfileError`.

Weight fingerprint (``model.weight_signs_sha256``): sha256 of the *sign bits* of three small fixed slices of the
weights, read in float32: 16 evenly spaced rows of the input embedding, 16 evenly spaced rows of the first
``k_proj.weight`` (else the first other 2-D weight) and the first 1-D ``*norm.weight``. Rounding never changes a
sign bit, so the fingerprint is the same whether the model is loaded in float32, bfloat16 or float16 (where
hashing the values would differ), yet two differently trained models share it with probability ~2^-(thousands).

Upgrading a schema-version-1 profile (which has no fingerprint)::

    python -m diffkv.profile upgrade profiles/old.json --model smollm2-135m [--out new.json]
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from diffkv import profile_schema as schema
from diffkv.core.config import ConfigError, DiffKVConfig, show_value
from diffkv.hf.shape import kv_shape, text_config
from diffkv.profile_schema import SCHEMA, SCHEMA_VERSION, ProfileError, ProfileNotFoundError, read_json

__all__ = ["Profile", "ProfileError", "ProfileNotFoundError", "load_profile", "save_profile", "model_fingerprint",
           "model_identity", "weight_signs_sha256", "config_to_dict", "config_from_dict", "upgrade_profile"]
SHAPE_KEYS = ("num_layers", "num_kv_heads", "num_attention_heads", "head_dim")
_CONFIG_KEYS = ("high", "low", "alpha_high", "alpha_low", "recent_window", "score_window", "meta_dtype", "raw_dtype",
                "layer_alphas", "center_keys", "smooth_keys", "score_after_window", "compact_meta",
                "symmetric_keys", "page_bytes", "importance")
_LATER_KEYS = {"prompt_scores": "window", "score_pool": 1, "score_spans": False,
               "rotate_values": False, "context_scale": 64.0, "min_kept": 0.0,
               "min_high": 0.0}  # written only when set
FINGERPRINT_ROWS = 16


def model_fingerprint(model, name: str | None = None) -> dict:
    """Shape facts of a transformers model (or its config) that a profile must match."""
    cfg = text_config(getattr(model, "config", model))
    shape = kv_shape(cfg)
    archs = getattr(cfg, "architectures", None) or [type(model).__name__]
    return {
        "name": name or getattr(cfg, "_name_or_path", "") or archs[0],
        "architecture": archs[0],
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "num_attention_heads": shape.num_heads,
        "head_dim": shape.head_dim,
    }


def _rows(w):
    return w[:: max(1, w.shape[0] // FINGERPRINT_ROWS)][:FINGERPRINT_ROWS]


def weight_signs_sha256(model) -> str | None:
    """sha256 of the sign bits of fixed weight slices (module doc), or None without weights (a config, meta)."""
    import numpy as np
    import torch

    if not isinstance(model, torch.nn.Module):
        return None
    params = list(model.named_parameters())
    emb = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    mats = [(n, p) for n, p in params if p.dim() == 2 and p is not emb]
    k_proj = next((p for n, p in mats if n.endswith("k_proj.weight")), mats[0][1] if mats else None)
    norm = next((p for n, p in params if p.dim() == 1 and n.endswith("norm.weight")), None)
    parts = [("embed", emb, True), ("k_proj", k_proj, True), ("norm", norm, False)]
    h = hashlib.sha256(b"diffkv weight signs v1")
    for tag, w, rows in parts:
        if w is None:
            continue
        if w.is_meta:
            return None
        part = (_rows(w) if rows else w).detach().float().cpu().contiguous()
        h.update(f"{tag}{tuple(part.shape)}".encode())
        h.update(np.packbits(torch.signbit(part).flatten().numpy()).tobytes())
    return h.hexdigest()


def model_identity(model, name: str | None = None) -> dict:
    """What a profile records of its model: :func:`model_fingerprint` plus ``weight_signs_sha256``."""
    return {**model_fingerprint(model, name), "weight_signs_sha256": weight_signs_sha256(model)}


def _model_name(model) -> str:
    """Last path part of the model's ``_name_or_path`` (a registry model's cache folder is its registry name)."""
    path = getattr(getattr(model, "config", model), "_name_or_path", "") or ""
    return Path(str(path)).name if isinstance(path, (str, Path)) else ""


def config_to_dict(config: DiffKVConfig) -> dict:
    """JSON-ready dict of a DiffKVConfig (tiers by name, layer_alphas as lists). The fields added after the first
    profiles (``_LATER_KEYS``: ``prompt_scores``, ``score_pool``, ``score_spans``, ``rotate_values``,
    ``context_scale``, ``min_kept``, ``min_high``) appear only when they differ from their defaults, so the dicts
    (profiles, calibration cache keys) of configs without them are what they were before those options existed."""
    d = {k: getattr(config, k) for k in _CONFIG_KEYS}
    d.update({k: getattr(config, k) for k, default in _LATER_KEYS.items() if getattr(config, k) != default})
    d["high"], d["low"] = config.high.name, config.low.name
    d["layer_alphas"] = None if config.layer_alphas is None else [list(p) for p in config.layer_alphas]
    return d


def config_from_dict(d) -> DiffKVConfig:
    """A DiffKVConfig from its profile dict: all fields required and checked (ProfileError naming the field)."""
    kw = schema.CONFIG(d, "config")
    if kw["layer_alphas"] is not None:
        kw["layer_alphas"] = tuple(tuple(p) for p in kw["layer_alphas"])
    try:
        return DiffKVConfig(**kw)
    except ConfigError as err:
        raise ProfileError(f"profile field config: {err}; fix the field or {schema.RECALIBRATE}") from None


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

    def check_model(self, model, weights: bool = True) -> None:
        """ProfileError naming each field where ``model`` (transformers model or config) is not the profile's.

        Compared: the architecture (when known), the shape and, for a model with weights, the weight fingerprint
        (module doc). The name (the last part of ``config._name_or_path``) counts when the weights cannot be
        compared or both names are registry names: the same weights in another folder or under a hub id are the
        profile's model.
        """
        have = model_fingerprint(model)
        mine = self.model
        cfg = getattr(model, "config", model)
        arch = (getattr(cfg, "architectures", None) or [type(model).__name__ if hasattr(model, "config") else None])[0]
        diff = [("architecture", mine.get("architecture"), arch)] if arch not in (None, mine.get("architecture")) \
            else []
        diff += [(k, mine.get(k), have[k]) for k in SHAPE_KEYS if mine.get(k) != have[k]]
        signs = weight_signs_sha256(model) if weights and not diff else None
        if signs is not None and signs != mine.get("weight_signs_sha256"):
            diff.append(("weight_signs_sha256", mine.get("weight_signs_sha256"), signs))
        from diffkv.registry.models import MODELS

        name, theirs = _model_name(model), str(mine.get("name", ""))
        both_registry = name in MODELS and theirs in MODELS
        if (signs is None or both_registry) and name and name.lower() != theirs.lower():
            diff.insert(0, ("name", mine.get("name"), name))
        if diff:
            fields = "; ".join(f"model.{k}: profile {show_value(a, 80)} vs model {show_value(b, 80)}"
                               for k, a, b in diff)
            raise ProfileError(f"profile was calibrated for {show_value(mine.get('name'))}, another model than this "
                               f"one ({fields}); {schema.RECALIBRATE}")


def profile_from_dict(d, where: str = "profile", version: int = SCHEMA_VERSION) -> Profile:
    """Validate a decoded profile (:mod:`~diffkv.profile_schema`) and build the :class:`Profile`."""
    try:
        v = schema.validate_profile(d, version)
        config = config_from_dict(v["config"])
    except ProfileError as err:
        raise ProfileError(f"{where}: {err}") from None
    return Profile(model=v["model"], config=config, calibration=v["calibration"], measured=v["measured"],
                   search=v["search"], tool=v["tool"], created=v["created"])


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Validate and write ``profile`` as JSON (atomically: temp file + rename). Returns the path."""
    path = Path(path)
    d = profile.to_dict()
    profile_from_dict(json.loads(json.dumps(d)), where=f"profile to write to {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(d, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


SHIPPED = Path(__file__).parent / "profiles"  # calibrated profiles installed with the package


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped with diffkv (``load_profile(name)`` finds them)."""
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def resolve_profile(path_or_name: str | Path) -> Path:
    """A profile file: ``path_or_name`` itself when it exists, else the shipped profile of that name
    (``"smollm2-135m"`` -> ``diffkv/profiles/smollm2-135m.json``); ProfileNotFoundError naming both otherwise."""
    path = Path(path_or_name).expanduser()
    if path.is_file() or path.suffix == ".json" or len(path.parts) > 1:
        return path
    shipped = SHIPPED / f"{path_or_name}.json"
    if shipped.is_file():
        return shipped
    raise ProfileNotFoundError(f"no profile file {str(path_or_name)!r} and no shipped profile of that name "
                               f"(shipped: {', '.join(shipped_profiles())}); {schema.RECALIBRATE}")


def load_profile(path: str | Path, model=None) -> Profile:
    """Read and validate a profile (a path, or the name of a shipped profile: :func:`resolve_profile`); if ``model``
    is given, check that the profile was made for it.

    Raises
    ------
    ProfileNotFoundError (a FileNotFoundError too): no file at ``path``.
    ProfileError (a UsageError, so a ValueError): unreadable, too large or too deep, not JSON, not a profile, an
    unknown schema version, a field missing, unknown, of the wrong type or out of range, or another model.
    """
    path = resolve_profile(path)
    profile = profile_from_dict(read_json(path), where=str(path))
    if model is not None:
        try:
            profile.check_model(model)
        except ProfileError as err:
            raise ProfileError(f"{path}: {err}") from None
    return profile


def upgrade_profile(path: str | Path, model, out: str | Path | None = None) -> Path:
    """Rewrite a schema-version-1 profile as version 2 for ``model`` (the one it was calibrated for).

    Every field is validated as in version 2 (a missing ``config.center_keys``, from before that field existed, is
    ``false``); name, architecture and shape must match ``model``; its weight fingerprint is added. A version-2
    file is only checked against ``model`` (and copied to ``out`` if given). Writes ``out`` (default: in place)
    and returns the path.
    """
    d = read_json(path)
    if isinstance(d, dict) and d.get("schema_version") == SCHEMA_VERSION and type(d["schema_version"]) is int:
        profile = profile_from_dict(d, where=str(path))
        profile.check_model(model)
        return save_profile(profile, out) if out else Path(path)
    if isinstance(d, dict) and isinstance(d.get("config"), dict):
        d["config"].setdefault("center_keys", False)  # version-1 files from before center_keys existed
    profile = profile_from_dict(d, where=str(path), version=1)
    profile.check_model(model, weights=False)
    profile.model = {**profile.model, "weight_signs_sha256": weight_signs_sha256(model)}
    return save_profile(profile, out or path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m diffkv.profile", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upgrade", help="rewrite a schema-version-1 profile as version 2 for its model")
    up.add_argument("path")
    up.add_argument("--model", required=True, help="registry name, local folder or HF id of the profile's model")
    up.add_argument("--out", default=None, help="where to write (default: in place)")
    args = p.parse_args(argv)
    from diffkv.core.errors import UsageError
    from diffkv.registry.models import load_model

    try:
        model, _ = load_model(args.model)
        print(f"wrote {upgrade_profile(args.path, model, args.out)}")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
