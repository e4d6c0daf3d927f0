"""Registry of KV-cache methods compared by the accuracy benchmarks: one name -> how to build its cache.

Every method is a transformers cache run by the same generation loop on the same model:

* ``full``: ``DynamicCache`` (reference); ``diffkv``: :class:`DiffKVCache` with the library's defaults
  (``DiffKVConfig()``) or a profile; ``diffkv-paper``: as published (K8V4 / K4V2, alpha 1.0 / 0.02, per-token
  keys: ``smooth_keys=False``) or a profile. Until 2026-12-05 ``diffkv`` meant ``diffkv-paper``: a run folder
  recorded before then resumes with the meaning it was made with (:func:`recorded_spec`);
* ``bf16``: the cache rounded to bfloat16 (the usual serving format, 1.0x): a control that shows how many
  answers any tiny perturbation of the cache flips on a fragile model;
* ``K8V8``, ``K4V4``, ``K8V4``: DiffKV's quantization only (one tier, alpha = 0: nothing pruned or demoted;
  per-token keys);
* ``diffkv-smooth``, ``K4V4-smooth``: the library's defaults (``smooth_keys``: keys centered and scaled per channel
  by the prompt's range before per-token quantization) / uniform K4V4 with ``smooth_keys``;
* ``diffkv-saw``: ``diffkv-paper`` (the published defaults or the profile) with ``score_after_window`` (decode scores
  count only the attention a token receives after it leaves the recent window); ``diffkv-compact``: with
  ``compact_meta`` and ``symmetric_keys`` (fp16 mean scores, 16-bit positions, scale-only keys: 6 bytes less per
  token and head); ``diffkv-compact-meta`` / ``diffkv-symmetric-keys``: with one of the two alone (4 / 2 bytes
  less);
* ``K16V16``: one 16-bit tier in the model's dtype, nothing pruned: the DiffKV cache that equals ``full`` token for
  token (a control of the paged path itself, on ``generate()`` and in the engine);
* ``kivi2`` / ``kivi2-r32``: KIVI 2-bit, group 32, residual 128 / 32 (:class:`~diffkv.baselines.KIVICache`);
* ``h2o``, ``snapkv``, ``streamingllm``: token eviction at a budget ``ratio`` (fraction of tokens kept).

**Operating points** (the compression–quality frontier): ``name@R`` runs an eviction method at keep ratio ``R``
(``h2o@0.25``), ``name@xS`` a DiffKV method with every threshold multiplied by ``S`` (``diffkv@x4``; α_low capped at
1; :func:`scale_thresholds`); ``+FIELD=VALUE`` sets a DiffKVConfig field of a DiffKV method
(``diffkv-compact-meta+page_bytes=1472``). The spec is the run's folder name, so points of one method sit side by
side.

**Storage.** A method whose cache is a DiffKV page layout (``full``, every DiffKV and uniform method) names it
in ``storage(model, profile) -> DiffKVConfig``: the serving engine can hold it, so ``diffkv eval run`` streams its
samples through continuous batching (:mod:`diffkv.eval.engine_runner`); the others (KIVI, eviction) have no
``storage`` and run through ``generate()`` in fixed batches.

**Equal memory.** A token kept by an eviction method costs fp16 bytes, so the budget that matches DiffKV's
memory is ``ratio = 1 / c`` where ``c`` is DiffKV's *measured physical* compression on the same model and task
(``benchmarks/accuracy/<model>/<task>/diffkv/metrics.json``; :func:`derive_budget`). Without such a record the
ratio falls back to :data:`DEFAULT_BUDGET` (1/4, the ≥4x target) and the run's config says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diffkv.core.config import DiffKVConfig, fp16_config
from diffkv.core.points import scale_thresholds

DEFAULT_BUDGET = 0.25
# the cache stats a result row keeps (``batch_stats``), on either runner
STAT_KEYS = ("compression_physical", "compression_theoretical", "fp16_bytes", "bytes_in_pages", "bytes_kept",
             "tokens_per_tier", "tokens_seen")


@dataclass(frozen=True, slots=True)
class Method:
    """A named cache configuration. ``build(model, budget, profile)`` returns a fresh cache for one batch.

    configure: for DiffKV methods, ``configure(model, profile) -> DiffKVConfig`` before an operating point
    (lets ``name@xS`` scale the thresholds). storage: ``storage(model, profile) -> DiffKVConfig``, the exact page
    layout and policy of the method's cache (None: not a paged cache, the engine cannot hold it).
    fixed_budget: the keep ratio a ``name@R`` spec fixes. engine: whether the serving engine can hold the cache
    (False for ``prompt_scores="repeat"``, whose scores come from a pass the engine does not run)."""

    name: str
    description: str
    build: Callable
    uses_budget: bool = False
    configure: Callable | None = None
    fixed_budget: float | None = None
    storage: Callable | None = None
    engine: bool = True


def _full(model, budget, profile):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _model_dtype(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _exact(model, profile) -> DiffKVConfig:
    """One 16-bit tier in the model's dtype, nothing pruned: stores K/V as ``DynamicCache`` does."""
    return fp16_config(_model_dtype(model))


def _published_or_profile(model, profile) -> DiffKVConfig:
    if profile is None:
        return DiffKVConfig(smooth_keys=False)
    from diffkv.profile import load_profile

    return load_profile(profile, model).config


def _library_or_profile(model, profile) -> DiffKVConfig:
    if profile is None:
        return DiffKVConfig()
    from diffkv.profile import load_profile

    return load_profile(profile, model).config


def _diffkv_with(**options):
    """diffkv-paper (published defaults or the profile) with some config fields replaced."""
    def configure(model, profile):
        return dataclasses.replace(_published_or_profile(model, profile), **options)
    return configure


def _at_point(configure: Callable, scale: float = 1.0, fields: dict | None = None) -> Callable:
    """The storage of ``configure`` at an operating point: ``fields`` replaced, then thresholds times ``scale`` (so
    a field such as ``importance`` decides how they scale)."""
    def storage(model, profile):
        config = configure(model, profile)
        return scale_thresholds(dataclasses.replace(config, **fields) if fields else config, scale)
    return storage


def _paged(storage: Callable) -> Callable:
    """``build`` of a method whose cache is a :class:`DiffKVCache` of ``storage(model, profile)``."""
    def build(model, budget, profile):
        from diffkv.integrations.transformers import DiffKVCache

        return DiffKVCache(model, storage(model, profile))
    return build


def _smooth_defaults(model, profile) -> DiffKVConfig:
    return DiffKVConfig(smooth_keys=True)


def _uniform(tier: str, smooth: bool = False):  # the methods' names fix their configs: never the library default
    def storage(model, profile):
        return DiffKVConfig(high=tier, low=tier, alpha_high=0.0, alpha_low=0.0, smooth_keys=smooth)
    return storage


def _bf16(model, profile) -> DiffKVConfig:
    return fp16_config("bfloat16")


def _paged_method(name: str, description: str, storage: Callable) -> Method:
    return Method(name, description, _paged(storage), storage=storage)


def _kivi(residual: int):
    def build(model, budget, profile):
        from diffkv.baselines import KIVICache
        from diffkv.hf.shape import kv_shape

        head_dim = kv_shape(model).head_dim
        return KIVICache(model, bits=2, group_size=min(32, head_dim), residual=residual)  # 32 (KIVI) if it fits
    return build


def _evict(policy_name: str):
    def build(model, budget, profile):
        from diffkv.baselines import EvictionCache, H2OPolicy, SnapKVPolicy, StreamingLLMPolicy

        policy = {"h2o": H2OPolicy, "snapkv": SnapKVPolicy, "streamingllm": StreamingLLMPolicy}[policy_name]
        return EvictionCache(model, policy(DEFAULT_BUDGET if budget is None else budget))
    return build


def _diffkv_method(name: str, description: str, configure: Callable) -> Method:
    return Method(name, description, _paged(configure), configure=configure, storage=configure)


# the lean-metadata options, together and each alone: name, DiffKVConfig fields set, metadata bytes per token and
# KV head at head_dim 64 with one group per tensor (the paper's fields: 16)
_LEAN_METADATA = (
    ("diffkv-compact", {"compact_meta": True, "symmetric_keys": True}, 10),
    ("diffkv-compact-meta", {"compact_meta": True}, 12),
    ("diffkv-symmetric-keys", {"symmetric_keys": True}, 14),
)

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("full", "DynamicCache, no compression", _full, storage=_exact),
    _diffkv_method("diffkv", "the library defaults DiffKVConfig() or --profile", _library_or_profile),
    _diffkv_method("diffkv-paper", "DiffKV as published (K8V4 / K4V2, alpha 1.0 / 0.02, per-token keys) or "
                   "--profile", _published_or_profile),
    _paged_method("bf16", "16-bit KV in bfloat16, nothing pruned: control for how far any rounding moves greedy "
                  "output", _bf16),
    _paged_method("K16V16", "one 16-bit tier in the model's dtype, nothing pruned: DiffKV's pages holding exactly "
                  "what full holds", _exact),
    _paged_method("K8V8", "uniform K8V8 (DiffKV quantization, alpha = 0)", _uniform("K8V8")),
    _paged_method("K4V4", "uniform K4V4 (DiffKV quantization, alpha = 0)", _uniform("K4V4")),
    _paged_method("K8V4", "uniform K8V4 (DiffKV quantization, alpha = 0)", _uniform("K8V4")),
    _diffkv_method("diffkv-smooth", "the library defaults: diffkv with smooth_keys (keys centered and scaled per "
                   "channel)", _smooth_defaults),
    _paged_method("K4V4-smooth", "uniform K4V4 with smooth_keys", _uniform("K4V4", smooth=True)),
    _diffkv_method("diffkv-saw", "diffkv-paper (published defaults or --profile) with score_after_window",
                   _diffkv_with(score_after_window=True)),
    *(_diffkv_method(name, f"diffkv-paper (published defaults or --profile) with {' and '.join(options)} "
                     f"({meta} B of metadata per token and head instead of 16)", _diffkv_with(**options))
      for name, options, meta in _LEAN_METADATA),
    Method("kivi2", "KIVI 2-bit, keys per channel, group 32, fp16 residual 128", _kivi(128)),
    Method("kivi2-r32", "KIVI 2-bit, keys per channel, group 32, fp16 residual 32", _kivi(32)),
    Method("h2o", "H2O heavy hitters + recent (half/half) at the budget", _evict("h2o"), True),
    Method("snapkv", "SnapKV observation-window vote (w 32, pool 7), prompt only", _evict("snapkv"), True),
    Method("streamingllm", "StreamingLLM 4 sinks + recent at the budget", _evict("streamingllm"), True),
)}


def _config_fields(spec: str, settings: list[str]) -> dict:
    """``["page_bytes=1472", "compact_meta=true"]`` as checked DiffKVConfig fields (values are JSON)."""
    fields = {}
    for item in settings:
        key, eq, text = item.partition("=")
        if not eq or key not in DiffKVConfig.__dataclass_fields__:
            raise ValueError(f"bad method spec {spec!r}: '+{item}' must be '+FIELD=VALUE' with a DiffKVConfig field "
                             f"({', '.join(DiffKVConfig.__dataclass_fields__)})")
        try:
            fields[key] = json.loads(text)
        except json.JSONDecodeError:
            fields[key] = text  # a tier name such as K8V4
    dataclasses.replace(DiffKVConfig(), **fields)  # a bad value raises ConfigError (a ValueError) naming the field
    return fields


def _point(spec: str, method: Method, point: str) -> tuple[float, float | None]:
    """(threshold scale, keep ratio) of ``@xS`` for a DiffKV method or ``@R`` for an eviction method."""
    scale = point.startswith("x")
    try:
        value = float(point[1:] if scale else point)
    except ValueError:
        value = math.nan
    if scale and method.configure is not None and math.isfinite(value) and value > 0:
        return value, None
    if not scale and method.uses_budget and 0 < value <= 1:
        return 1.0, value
    kinds = [m for m, x in METHODS.items() if x.configure is not None]
    raise ValueError(f"bad method spec {spec!r}: '@R' (0 < R <= 1) sets the keep ratio of an eviction method "
                     f"({', '.join(m for m, x in METHODS.items() if x.uses_budget)}), '@xS' (S > 0) scales the "
                     f"thresholds of a DiffKV method ({', '.join(kinds)})")


def get_method(spec: str) -> Method:
    """The method a spec names: ``NAME[@POINT][+FIELD=VALUE...]``. NAME is a registry name; ``@R`` an eviction
    method's keep ratio (0 < R <= 1), ``@xS`` a DiffKV method's thresholds times S > 0; ``+FIELD=VALUE`` sets a
    DiffKVConfig field of a DiffKV method (``diffkv-compact-meta+page_bytes=1472``; VALUE is JSON). ``ValueError``
    listing the known names, or saying what a suffix needs."""
    base, *settings = spec.split("+")
    name, at, point = base.partition("@")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    method = METHODS[name]
    if settings and method.configure is None:
        raise ValueError(f"bad method spec {spec!r}: '+FIELD=VALUE' sets DiffKVConfig fields of DiffKV methods only")
    fields = _config_fields(spec, settings)
    if not at and not fields:
        return method
    scale, budget = _point(spec, method, point) if at else (1.0, None)
    if budget is not None:
        return dataclasses.replace(method, name=spec, fixed_budget=budget,
                                   description=f"{method.description}; keep ratio {budget:g}")
    extra = (f"; thresholds x {scale:g}" if at else "") + (f"; {fields}" if fields else "")
    storage = _at_point(method.configure, scale, fields)
    return dataclasses.replace(method, name=spec, build=_paged(storage), storage=storage,
                               description=method.description + extra,
                               engine=fields.get("prompt_scores", "window") != "repeat")


# names whose meaning changed, with the name that now means what they meant then; a run folder whose config.json
# has no "method_names" key was recorded before the change (docstring above)
RENAMED = {"diffkv": "diffkv-paper"}
METHOD_NAMES = 2  # recorded in config.json of runs of a renamed method made since


def recorded_spec(spec: str, recorded: dict) -> str:
    """The spec that builds what ``spec`` meant when the run whose resolved config is ``recorded`` was made:
    ``diffkv@x4`` of a run without ``method_names`` is ``diffkv-paper@x4``; any other spec is itself."""
    head = next((i for i, c in enumerate(spec) if c in "@+"), len(spec))
    if spec[:head] in RENAMED and recorded.get("method_names") != METHOD_NAMES:
        return RENAMED[spec[:head]] + spec[head:]
    return spec


def derive_budget(results_dir: Path) -> tuple[float, str]:
    """Token budget ratio for eviction methods from DiffKV's recorded physical compression.

    results_dir: ``<out>/<model>/<task>``. Returns ``(ratio, source)``; ``source`` names the metrics file used or
    ``"default"`` (:data:`DEFAULT_BUDGET`) when DiffKV has no recorded compression there.
    """
    path = Path(results_dir) / "diffkv" / "metrics.json"
    if path.is_file():
        c = json.loads(path.read_text()).get("compression_physical")
        if isinstance(c, (int, float)) and math.isfinite(c) and c > 1:
            return round(1.0 / c, 4), str(path)
    return DEFAULT_BUDGET, "default"


def full_cache_stats(model, tokens_seen: int) -> dict:
    """Stats of an uncompressed cache in the shape of ``DiffKVCache.stats()`` (compression 1 vs fp16)."""
    from diffkv.hf.shape import kv_shape

    shape = kv_shape(model)
    cells = tokens_seen * shape.num_layers * shape.num_kv_heads
    d = shape.head_dim
    return {"tokens_seen": tokens_seen, "tokens_per_tier": {"high": cells, "low": 0, "pruned": 0},
            "tier_fractions": {"high": 1.0, "low": 0.0, "pruned": 0.0}, "fp16_bytes": cells * 4 * d,
            "bytes_in_pages": cells * 4 * d, "compression_physical": 1.0, "compression_theoretical": 1.0}


def method_stats(cache, model, tokens_seen: int) -> dict:
    """Unified stats of any registry cache after a batch. tokens_seen: valid tokens fed (prompt + decoded)."""
    if hasattr(cache, "stats"):
        from diffkv.baselines import KIVICache

        s = cache.stats(tokens_seen) if isinstance(cache, KIVICache) else cache.stats()
        if s.get("tokens_seen"):
            return s
    return full_cache_stats(model, tokens_seen)
