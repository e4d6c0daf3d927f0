"""The profile JSON schema (version 3): every field required, typed, finite and in range; nothing else allowed.

The schema is built from the combinators of :mod:`diffkv.core.json_spec`. :func:`read_json` reads a file defensively
(size limit, nesting-depth limit checked on the raw text before ``json.loads`` recurses, duplicate keys refused)
and :func:`validate_profile` checks the decoded value against :data:`PROFILE`. Every problem raises
:class:`ProfileError`, a :class:`~diffkv.core.errors.UsageError`, whose message names the field path and the expected
value, e.g. ``profile field config.alpha_high: expected a finite number in [0, 1e+06], got inf``.

Version history: 3 added ``config.context_scale`` (the thresholds of the context point, a profile's second
operating point: ``diffkv.core.points``) and ``search.context_rows`` (its calibration), and the optional
``config.min_kept`` / ``min_high``; a version-2 file is read as it is (its context point has the default scale).
1 had no ``model.weight_signs_sha256`` and was checked loosely; a version-1 file is refused with a message pointing
to ``python -m diffkv.profile upgrade`` (validates it with this schema and adds the fingerprint of the model it is
for) or to re-running calibration.
"""

from __future__ import annotations

from pathlib import Path

from diffkv.core.checks import ConfigError, show_value
from diffkv.core.config import (
    ALPHA_MAX,
    IMPORTANCES,
    LAYERS_MAX,
    META_DTYPES,
    PROMPT_SCORES,
    RAW_DTYPES,
    SCORE_POOL_MAX,
    WINDOW_MAX,
)
from diffkv.core.errors import UsageError
from diffkv.core.json_spec import (
    MAX_STR,  # noqa: F401  (the longest profile string, importable from here too)
    Spec,
    SpecError,
    array,
    boolean,
    constant,
    fail,
    integer,
    loads,
    nesting_depth,
    nullable,
    number,
    obj,
    string,
)
from diffkv.core.tiers import TierSpec

SCHEMA = "diffkv.profile"
SCHEMA_VERSION = 3
READABLE = (2, 3)  # versions read with this schema (2: no context_scale, read as the default)
MAX_BYTES = 2 << 20  # a profile is ~15 KB; 2 MiB leaves room for thousands of layers and search rows
MAX_DEPTH = 16  # nesting of objects/arrays (a profile needs 4)
MAX_ROWS = 10_000
DIM_MAX = 1 << 16
METRIC_MAX = 1e9
RECALIBRATE = "run `diffkv calibrate --model <model> --out <path>` to make a profile for it"
UPGRADE = "python -m diffkv.profile upgrade <path> --model <model>"


class ProfileError(UsageError):
    """A profile file that cannot be used: unreadable, not JSON, not a profile, a bad field, another model."""


class ProfileNotFoundError(ProfileError, FileNotFoundError):
    """No profile file at the given path."""


def _fail(path: str, expected: str, value) -> ProfileError:
    return ProfileError(fail(path, expected, value).message("profile"))


def profile_spec(spec: Spec) -> Spec:
    """``spec`` raising :class:`ProfileError` (``profile field PATH: ...``) instead of :class:`SpecError`."""
    def check(v, path):
        try:
            return spec(v, path)
        except SpecError as err:
            raise ProfileError(err.message("profile")) from None
    return check


def tier(v, path):
    if not isinstance(v, str):
        raise fail(path, "a tier name such as 'K8V4' or 'K4V2-g64/32'", v)
    try:
        return TierSpec.parse(v).name
    except ConfigError as err:
        raise SpecError(path, str(err)) from None


# ---------------------------------------------------------------- the profile

ALPHA_HIGH = number(0.0, ALPHA_MAX)
ALPHA_LOW = number(0.0, ALPHA_MAX)  # <= 1 unless importance is "peak": DiffKVConfig checks it
KL = number(-1e-3, METRIC_MAX)  # a KL of 0 can come out a rounding error below 0
POSITIVE = number(0.0, METRIC_MAX, lo_open=True)
FRACTION = number(0.0, 1.0)
METRICS = {
    "kl": KL, "kl_p95": KL, "top1": FRACTION, "ppl_ratio": POSITIVE, "ppl_full": POSITIVE,
    "compression_physical": POSITIVE, "predicted_compression": POSITIVE,
    "tier_fractions": obj({"high": FRACTION, "low": FRACTION, "pruned": FRACTION}),
}
STAGES = ("baseline", "alpha_high", "alpha_low", "per_layer")

MODEL_FIELDS = {
    "name": string(),
    "architecture": string(),
    "num_layers": integer(1, LAYERS_MAX),
    "num_kv_heads": integer(1, DIM_MAX),
    "num_attention_heads": integer(1, DIM_MAX),
    "head_dim": integer(1, DIM_MAX),
    "weight_signs_sha256": string(pattern="[0-9a-f]{64}", what="64 lowercase hex digits (a sha256)"),
}
CONFIG = profile_spec(obj({
    "high": tier, "low": tier, "alpha_high": ALPHA_HIGH, "alpha_low": ALPHA_LOW,
    "recent_window": integer(1, WINDOW_MAX), "score_window": integer(1, WINDOW_MAX),
    "meta_dtype": string(META_DTYPES), "raw_dtype": string(RAW_DTYPES),
    "layer_alphas": nullable(array(array(number(0.0, ALPHA_MAX), 2, 2, "numbers (alpha_high, alpha_low)"),
                                   1, LAYERS_MAX, "[alpha_high, alpha_low] pairs")),
    "center_keys": boolean,
}, optional={"smooth_keys": (boolean, False), "score_after_window": (boolean, False),
             "compact_meta": (boolean, False), "symmetric_keys": (boolean, False),
             "page_bytes": (nullable(integer(1, 1 << 24)), None),
             "importance": (string(IMPORTANCES), "mean"),
             "prompt_scores": (string(PROMPT_SCORES), "window"),
             "score_pool": (integer(1, SCORE_POOL_MAX), 1), "score_spans": (boolean, False),
             "rotate_values": (boolean, False), "context_scale": (number(1e-6, ALPHA_MAX), 64.0),
             "min_kept": (number(0.0, 1.0), 0.0), "min_high": (number(0.0, 1.0), 0.0)}))
CALIBRATION = obj({
    "data": string(), "first_doc": integer(0, 1 << 30), "texts": integer(1, 1 << 20),
    "context_tokens": integer(1, WINDOW_MAX * 16), "decode_steps": integer(1, WINDOW_MAX),
    "budget": obj({"max_kl": nullable(number(0.0, METRIC_MAX)), "max_ppl_increase": nullable(number(0.0, METRIC_MAX))}),
    "quick": boolean, "seconds": number(0.0, METRIC_MAX),
})
SEARCH = obj({
    "global_best": obj({"alpha_high": ALPHA_HIGH, "alpha_low": ALPHA_LOW, **METRICS}),
    "per_layer_gain": nullable(POSITIVE),
    "per_layer_weight": nullable(POSITIVE),
    "rows": array(obj({"stage": string(STAGES), "alpha_high": ALPHA_HIGH, "alpha_low": ALPHA_LOW,
                       "per_layer": boolean, **METRICS}), 0, MAX_ROWS, "search rows"),
}, optional={"context_rows": (array(obj({"context_scale": number(1e-6, ALPHA_MAX),
                                         **{k: v for k, v in METRICS.items() if k != "predicted_compression"}}),
                                    0, MAX_ROWS, "context point rows"), [])})


def readable_version(v, path):
    if type(v) is not int or v not in READABLE:
        raise fail(path, " or ".join(map(str, READABLE)), v)
    return v


HEAD = {"schema": constant(SCHEMA), "schema_version": readable_version}
BODY = {
    "tool": obj({"name": string(), "version": string()}),
    "created": string(pattern=r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", what="a date like '2026-01-31T12:00:00'"),
    "model": obj(MODEL_FIELDS), "config": CONFIG, "calibration": CALIBRATION, "measured": obj(METRICS),
    "search": SEARCH,
}
PROFILE = profile_spec(obj({**HEAD, **BODY}))
PROFILE_V1 = profile_spec(obj({**HEAD, "schema_version": constant(1), **BODY,
                               "model": obj({k: v for k, v in MODEL_FIELDS.items() if k != "weight_signs_sha256"})}))


def check_head(d, version: int = SCHEMA_VERSION) -> None:
    """Refuse what is not a profile, or a profile of another schema version, before checking any field."""
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise ProfileError(f"not a diffkv profile (missing \"schema\": \"{SCHEMA}\"); {RECALIBRATE}")
    if "schema_version" not in d:
        raise ProfileError(f"profile field schema_version: missing (every field is required); {RECALIBRATE}")
    v = d["schema_version"]
    readable = READABLE if version == SCHEMA_VERSION else (version,)
    if type(v) is not int:
        raise ProfileError(f"{_fail('schema_version', 'the integer ' + ' or '.join(map(str, readable)), v)}; "
                       f"{RECALIBRATE}")
    if v in readable:
        return
    if v == 1:
        raise ProfileError(f"profile has schema_version 1 (no model weight fingerprint); upgrade it for the model it "
                           f"was calibrated for with `{UPGRADE}`, or {RECALIBRATE}")
    raise ProfileError(f"profile has schema_version {v}, this diffkv reads version "
                       f"{' or '.join(map(str, readable))}; use the diffkv release that wrote it, or {RECALIBRATE}")


def validate_profile(d, version: int = SCHEMA_VERSION) -> dict:
    """Check a decoded profile field by field plus the cross-field rules; returns it with floats normalized."""
    check_head(d, version)
    try:
        return _validate(d, version)
    except ProfileError as err:
        raise ProfileError(f"{err}; fix the field or {RECALIBRATE}") from None


def _validate(d: dict, version: int) -> dict:
    out = (PROFILE if version == SCHEMA_VERSION else PROFILE_V1)(d, "")
    model, config = out["model"], out["config"]
    if model["num_attention_heads"] % model["num_kv_heads"]:
        raise _fail("model.num_attention_heads", f"a multiple of model.num_kv_heads ({model['num_kv_heads']})",
                    model["num_attention_heads"])
    layers = config["layer_alphas"]
    if layers is not None and len(layers) != model["num_layers"]:
        raise _fail("config.layer_alphas", f"one pair per layer (model.num_layers = {model['num_layers']})",
                    f"{len(layers)} pairs")
    pairs = [("config", config["alpha_high"], config["alpha_low"])]
    pairs += [(f"config.layer_alphas[{i}]", h, lo) for i, (h, lo) in enumerate(layers or [])]
    cap, why = (ALPHA_MAX, "") if config["importance"] == "peak" else (1.0, " and alpha_low <= 1 (mean importance)")
    for path, high, low in pairs:
        if low > cap or low > high:
            raise ProfileError(f"profile field {path}: expected alpha_low <= alpha_high{why}, got "
                               f"alpha_high={high}, alpha_low={low}")
    high, low = TierSpec.parse(config["high"]), TierSpec.parse(config["low"])
    if high.key.bits < low.key.bits or high.value.bits < low.value.bits:
        raise ProfileError(f"profile field config.low: expected a tier with at most the bits of config.high "
                           f"({high}), got {low}")
    for key, t in (("high", high), ("low", low)):
        try:
            t.validate(model["head_dim"])
        except ConfigError as err:
            raise ProfileError(f"profile field config.{key}: {err} (model.head_dim = {model['head_dim']})") from None
    budget = out["calibration"]["budget"]
    if budget["max_kl"] is None and budget["max_ppl_increase"] is None:
        raise _fail("calibration.budget", "max_kl or max_ppl_increase (or both) to be a number", budget)
    return out


# ---------------------------------------------------------------- reading the file


def read_json(path: str | Path):
    """Decode the JSON of ``path``: ProfileError for a missing, unreadable, oversized, too deep or invalid file."""
    path = Path(path)
    if not path.is_file():
        raise ProfileNotFoundError(f"no profile at {path}; {RECALIBRATE}")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as err:
        raise ProfileError(f"cannot read profile {path} ({err.strerror or err}); {RECALIBRATE}") from None
    if len(raw) > MAX_BYTES:
        raise ProfileError(f"{path} is larger than {MAX_BYTES >> 20} MiB, too large for a profile; {RECALIBRATE}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ProfileError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); restore the file or "
                           f"{RECALIBRATE}") from None
    if nesting_depth(text, MAX_DEPTH) > MAX_DEPTH:
        raise ProfileError(f"{path} nests JSON deeper than {MAX_DEPTH} levels, a profile needs 4; restore the "
                           f"file or {RECALIBRATE}")
    try:
        return loads(text)
    except SpecError as err:
        raise ProfileError(f"{path}: {err.message('profile')}; restore the file or {RECALIBRATE}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, an int of too many digits; recursion: a guard
        raise ProfileError(f"{path} is not valid JSON ({show_value(str(err), 120)}); restore the file or "
                           f"{RECALIBRATE}") from None
