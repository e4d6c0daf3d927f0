"""DiffKV's configuration (docs/algorithm.md §2-4): the two tiers, the thresholds, the windows and the key options.

Every field is checked when the object is made (``diffkv.core.checks``): a bad value raises :class:`ConfigError`
naming the field, the expected value and what was given. Tiers are ``diffkv.core.tiers.TierSpec`` (``"K8V4"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from diffkv.core.checks import ConfigError, bad_value, check_int, check_real, show_value
from diffkv.core.tiers import PRESETS, QuantSpec, TierSpec, as_tier

__all__ = ["ALPHA_MAX", "IMPORTANCES", "LAYERS_MAX", "META_DTYPES", "PRESETS", "PROMPT_SCORES", "RAW_DTYPES",
           "SCORE_POOL_MAX", "WINDOW_MAX", "ConfigError", "DiffKVConfig", "QuantSpec", "TierSpec", "show_value"]
META_DTYPES = ("float16", "bfloat16", "float32")
RAW_DTYPES = ("float16", "bfloat16", "float32")
IMPORTANCES = ("mean", "peak")
PROMPT_SCORES = ("window", "repeat")
ALPHA_MAX = 1e6  # thresholds compare with n * score <= n (tokens): 1e6 already means "never high" up to 1M tokens
WINDOW_MAX = 1 << 20  # recent_window / score_window, in tokens
LAYERS_MAX = 4096  # entries of layer_alphas
PAGE_ALIGN = 32  # page sizes and page segments are multiples of this (diffkv.core.layout.SEGMENT_ALIGN)
PAGE_BYTES_MAX = 1 << 24
SCORE_POOL_MAX = 255  # tokens in the prefill score pooling window


def _check_alphas(alpha_high, alpha_low, names: tuple[str, str], peak: bool = False) -> tuple[float, float]:
    """Validated ``(alpha_high, alpha_low)`` as floats; ``names`` are their field names in messages. A mean score
    above uniform attention is never pruned (alpha_low <= 1); peaks run higher, so with ``peak`` it is free."""
    high = check_real(names[0], alpha_high, 0.0, ALPHA_MAX)
    low = check_real(names[1], alpha_low, 0.0, ALPHA_MAX if peak else 1.0,
                     "" if peak else " (above 1 it would prune tokens receiving more than uniform attention; "
                     "importance='peak' allows more)")
    if low > high:
        raise ConfigError(f"{names[1]}: need 0 <= alpha_low <= alpha_high, got alpha_low={low}, alpha_high={high}")
    return high, low


def _layer_alphas(pairs, peak: bool) -> tuple[tuple[float, float], ...]:
    field = "DiffKVConfig.layer_alphas"
    if not isinstance(pairs, (list, tuple)) or not 1 <= len(pairs) <= LAYERS_MAX:
        raise bad_value(field, f"None or a list of 1 to {LAYERS_MAX} (alpha_high, alpha_low) pairs", pairs)
    out = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise bad_value(f"{field}[{i}]", "an (alpha_high, alpha_low) pair", pair)
        out.append(_check_alphas(pair[0], pair[1], (f"{field}[{i}][0] (alpha_high of layer {i})",
                                                     f"{field}[{i}][1] (alpha_low of layer {i})"), peak))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DiffKVConfig:
    """DiffKV compression settings (docs/algorithm.md §2-4).

    A token whose normalized importance ``n * score`` is below ``alpha_low`` is pruned, below ``alpha_high`` kept
    in the ``low`` tier, otherwise in the ``high`` tier. The ``recent_window`` newest tokens are always high; the
    prefill importance uses the last ``score_window`` prompt queries. If ``high == low`` there is one tier and
    ``alpha_high`` plays no role (tokens below ``alpha_low`` are pruned, the rest kept).

    meta_dtype: dtype of stored scales/zeros ("float16" as published; "bfloat16" keeps the range of bf16
        models at 8 mantissa bits; "float32" is exact but costs 2x metadata bytes).
    raw_dtype: storage dtype of 16-bit ("K16V16") tensors; "float32" only for exactness tests on fp32 models.
    layer_alphas: optional per-layer ``(alpha_high, alpha_low)`` pairs (e.g. from calibration), one per layer;
        they replace the global pair for that layer.
    center_keys: subtract one constant vector per (sequence, layer, KV head), the per-channel median of its
        prompt keys, from every key before it is quantized (beyond the paper). Attention is unchanged: softmax over
        tokens ignores the common term ``q . c``. Keys with a large per-channel offset (qwen2.5's) quantize much
        better at 4 bits (benchmarks/studies/2026-11-29-center-keys.md). Costs ``head_dim`` fp32 per head and
        sequence, counted in the stats.
    smooth_keys: per (sequence, layer, KV head) and channel, the prompt keys' mid-range ``c`` and half-range ``s``
        (beyond the paper): every key is stored as ``(k - c) / s`` and each decode query is multiplied by ``s``, so
        attention sees ``q . k - q . c`` (the common term cancels in the softmax). Evens out outlier channels
        (qwen2.5's ``k_proj`` bias) before per-token quantization (measured: benchmarks/accuracy/key_quant_study.md).
        Costs ``2 * head_dim`` fp32 per head
        and sequence, counted in the stats. Excludes ``center_keys``. Default (None): on unless ``center_keys``;
        ``False`` is the published per-token key quantization.
    score_after_window: decode importance counts only the attention a token receives after it leaves the
        ``recent_window`` (beyond the paper, whose mean also counts the protected window steps, where a token is
        usually attended far above its later level, so decode-time pruning hardly fires within a few hundred
        tokens). A token's score restarts when it leaves the window and it becomes a victim candidate one step
        later; prompt tokens that are already past the window keep their prefill scores. See docs/algorithm.md
        §4.4-4.5 and ``diffkv.core.policy`` (``lag``).
    compact_meta: 4 bytes of per-token bookkeeping instead of 8 (beyond the paper): the score is kept as the fp16
        *mean* attention (updated ``m += (p - m) / count``) instead of the fp32 sum, the position as int16 modulo
        2^16. Same decisions up to fp16 rounding of the means; sequences are limited to 65536 tokens (ages stay
        exact). ``diffkv.core.layout``.
    page_bytes: bytes per page (a multiple of 32), or None (default): the planner's size, the smallest in the
        published range (800-8000 B at head_dim 128, scaled with head_dim) that wastes least inside a page
        (``diffkv.core.layout.plan_pages``). Beyond the paper. Each (sequence, layer, KV head) leaves about half a
        page empty per tier at its end, which on short sequences is a large share: smaller pages give that back
        (``diffkv layout --page-bytes``).
    importance: what a token's score measures (docs/algorithm.md §4.1, §4.5). "mean" (the paper): the average
        attention it has received per query, ``score / age``. "peak" (beyond the paper): the largest attention it
        has received from any one query (prefill: of the scoring window; decode: of one step), so a token that a
        reasoning step needed once, sharply, stays above the thresholds however rarely it is read afterwards,
        while a token that was never needed falls below them as ``1/n`` shrinks. Meant with
        ``score_after_window`` (otherwise the recent window's local attention sets every peak). Thresholds are on
        the same ``alpha / n`` scale but peaks run higher than means: calibrate, or scale a mean profile's
        thresholds (measured: benchmarks/studies/2026-12-02-peak-importance.md).
    prompt_scores: where the prompt's scores come from. "window" (the paper): the attention of the last
        ``score_window`` prompt queries. "repeat" (beyond the paper, after KVzip): also the attention each prompt
        token receives from the queries of a copy of the prompt that the model reads again after it
        (``diffkv.hf.repeat_scores``; the host supplies them, ``DiffKVCache.set_prompt_scores``), a score that does
        not depend on a question, for contexts compressed before the question arrives. A token keeps the larger of
        its two peaks, so it needs ``importance="peak"``. Costs one forward over twice the prompt.
    score_pool: max-pool each prompt token's prefill score over its ``score_pool`` neighbours (an odd window centred
        on the token; 1, the default, is the paper's per-token score; beyond the paper, after SnapKV's pooling).
        The question of a prompt reads a fact through a few of its tokens, yet the fact is all of them (the seven
        digit tokens of a number, a uuid's pieces): pooled, the tokens next to an important one score as high, so a
        span is kept or pruned whole instead of losing single digits. Prefill only (decode scores are not pooled);
        costs one 1-D max-pool over ``[B, H_kv, L]`` per layer. Pooled scores are higher, so a profile's thresholds
        keep more tokens: compare at equal bytes. ``diffkv.core.policy.pool_scores`` (measured:
        benchmarks/accuracy/ruler.md).
    score_spans: max-pool each prompt token's prefill score over its word, the run of tokens between whitespace
        (``diffkv.core.spans``; at most ``SPAN_MAX`` tokens; beyond the paper): a number or a uuid, one word of many
        tokens, is kept or pruned whole, where ``score_pool``'s fixed window covers a 7-digit number but not a
        uuid. Needs the prompt's token ids: the serving engine passes them (``KVStore.set_word_starts``), the
        transformers cache reads them with the tokenizer (``diffkv.hf.auto_words``); the vLLM plug-in does not yet
        (a ValueError says so). Prefill only; compare at equal bytes (pooled scores keep more tokens). Not with
        ``score_pool`` > 1.
    rotate_values: store every value vector rotated by a fixed randomized Hadamard transform and rotate each
        attention output back (``diffkv.core.rotation``, beyond the paper; QuaRot's idea applied to the cache only):
        outlier channels no longer set each token's quantization range. Same bytes; costs two [D, D] matmuls per new
        token and head (measured: benchmarks/studies/2026-12-03-rotate-values.md).
    context_scale: the second operating point, for a context compressed before its question is known (a shared
        system prompt or document, ``DiffKVCache.for_context``, an engine or vLLM shared prefix): repeat scores
        with peak importance and every threshold times ``context_scale`` (``diffkv.core.points.context_point``;
        hosts pick it themselves, docs/design.md §6.5). ``diffkv calibrate`` measures it per profile under the
        profile's budget (benchmarks/calibration/README.md); the default 64 is RULER's ask-after setting
        (benchmarks/accuracy/ruler.md). Ignored by a config that is itself a repeat point.
    min_kept: a floor on the tokens each (sequence, KV head) keeps of its prompt, as a fraction (beyond the paper;
        issue #60): where the thresholds would prune more, the best-scored pruned tokens are kept in the low tier
        (``diffkv.core.policy.split_prefill``), so a prompt whose attention is spread thin (a list whose every word
        matters a little: RULER's cwe, fwe, vt) is not compressed far harder than the rest. Prefill only; 0 (the
        default): no floor (measured: benchmarks/accuracy/ruler.md, "cwe on seed 1").
    min_high: the same floor on the high tier: each (sequence, KV head) keeps at least this fraction of its prompt
        at the high tier's precision, its best-scored tokens moved up (beyond the paper; issue #60). Prefill only.
    symmetric_keys: keys quantized with a scale only, on a grid symmetric about 0 (``diffkv.core.quant``, beyond
        the paper): 2 bytes less per key group. Meant with ``smooth_keys``, whose keys are centered per channel
        (measured: benchmarks/studies/2026-12-01-leaner-metadata.md).
    """

    high: TierSpec | str = "K8V4"
    low: TierSpec | str = "K4V2"
    alpha_high: float = 1.0
    alpha_low: float = 0.02
    recent_window: int = 64
    score_window: int = 64
    meta_dtype: str = "float16"
    raw_dtype: str = "float16"
    layer_alphas: tuple[tuple[float, float], ...] | None = None
    center_keys: bool = False
    smooth_keys: bool | None = None
    score_after_window: bool = False
    compact_meta: bool = False
    symmetric_keys: bool = False
    page_bytes: int | None = None
    importance: str = "mean"
    prompt_scores: str = "window"
    score_pool: int = 1
    score_spans: bool = False
    rotate_values: bool = False
    context_scale: float = 64.0
    min_kept: float = 0.0
    min_high: float = 0.0

    def __post_init__(self):
        put = object.__setattr__
        put(self, "high", as_tier("DiffKVConfig.high", self.high))
        put(self, "low", as_tier("DiffKVConfig.low", self.low))
        hi, lo = self.high, self.low
        if hi.key.bits < lo.key.bits or hi.value.bits < lo.value.bits:
            raise ConfigError(f"DiffKVConfig.low: the high tier ({hi}) must have at least the bits of the low tier "
                              f"({lo}) for keys and values")
        if not isinstance(self.importance, str) or self.importance not in IMPORTANCES:
            raise bad_value("DiffKVConfig.importance", f"one of {IMPORTANCES}", self.importance)
        if not isinstance(self.prompt_scores, str) or self.prompt_scores not in PROMPT_SCORES:
            raise bad_value("DiffKVConfig.prompt_scores", f"one of {PROMPT_SCORES}", self.prompt_scores)
        if self.prompt_scores == "repeat" and not self.peak:
            raise ConfigError("DiffKVConfig.prompt_scores='repeat' keeps each token's larger peak attention: it needs "
                              "importance='peak'")
        put(self, "score_pool", check_int("DiffKVConfig.score_pool", self.score_pool, 1, SCORE_POOL_MAX, " tokens"))
        if self.score_pool % 2 == 0:
            raise bad_value("DiffKVConfig.score_pool", "an odd number of tokens (a window centred on each token)",
                            self.score_pool)
        if not isinstance(self.score_spans, bool):
            raise bad_value("DiffKVConfig.score_spans", "a bool", self.score_spans)
        if self.score_spans and self.score_pool > 1:
            raise ConfigError("DiffKVConfig: score_spans pools over words, score_pool over a fixed window; set one "
                              f"(score_pool={self.score_pool}, score_spans=True)")
        high, low = _check_alphas(self.alpha_high, self.alpha_low,
                                  ("DiffKVConfig.alpha_high", "DiffKVConfig.alpha_low"), self.peak)
        put(self, "alpha_high", high)
        put(self, "alpha_low", low)
        if self.layer_alphas is not None:
            put(self, "layer_alphas", _layer_alphas(self.layer_alphas, self.peak))
        for name in ("recent_window", "score_window"):
            put(self, name, check_int(f"DiffKVConfig.{name}", getattr(self, name), 1, WINDOW_MAX, " tokens"))
        for name, choices in (("meta_dtype", META_DTYPES), ("raw_dtype", RAW_DTYPES)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
                raise bad_value(f"DiffKVConfig.{name}", f"one of {choices}", getattr(self, name))
        if self.smooth_keys is None:
            put(self, "smooth_keys", self.center_keys is False)
        for name in ("center_keys", "smooth_keys", "score_after_window", "compact_meta", "symmetric_keys",
                     "rotate_values"):
            if not isinstance(getattr(self, name), bool):
                raise bad_value(f"DiffKVConfig.{name}", "True or False", getattr(self, name))
        if self.page_bytes is not None:
            put(self, "page_bytes", check_int("DiffKVConfig.page_bytes", self.page_bytes, PAGE_ALIGN, PAGE_BYTES_MAX,
                                              " bytes, or None for the planner's size"))
            if self.page_bytes % PAGE_ALIGN:
                raise bad_value("DiffKVConfig.page_bytes", f"a multiple of {PAGE_ALIGN}", self.page_bytes)
        put(self, "context_scale", check_real("DiffKVConfig.context_scale", self.context_scale, 1e-6, ALPHA_MAX, ""))
        for name in ("min_kept", "min_high"):
            put(self, name, check_real(f"DiffKVConfig.{name}", getattr(self, name), 0.0, 1.0, " (of a prompt)"))
        if self.center_keys and self.smooth_keys:
            raise ConfigError("DiffKVConfig: center_keys and smooth_keys exclude each other (smooth_keys centers the "
                              "keys too); set one")

    @property
    def key_vectors(self) -> int:
        """Vectors of ``head_dim`` fp32 kept per (sequence, layer, KV head): key center and scale."""
        return 2 if self.smooth_keys else int(self.center_keys)

    @property
    def peak(self) -> bool:
        """Scores hold each token's peak attention instead of a sum or mean (``importance == "peak"``)."""
        return self.importance == "peak"

    @property
    def score_lag(self) -> int:
        """Age from which decode attention counts in a token's score: 0 (the paper) or ``recent_window``."""
        return self.recent_window if self.score_after_window else 0

    def alphas(self, layer_idx: int) -> tuple[float, float]:
        """(alpha_high, alpha_low) of a layer: its entry in ``layer_alphas`` if given, else the global pair."""
        if self.layer_alphas is None:
            return self.alpha_high, self.alpha_low
        if not 0 <= layer_idx < len(self.layer_alphas):
            raise ConfigError(f"layer_alphas has {len(self.layer_alphas)} entries; no thresholds for layer {layer_idx}")
        return self.layer_alphas[layer_idx]

    @property
    def two_tier(self) -> bool:
        return self.high != self.low

    @property
    def tiers(self) -> tuple[TierSpec, ...]:
        return (self.high, self.low) if self.two_tier else (self.high,)

    def validate(self, head_dim: int) -> None:
        for t in self.tiers:
            t.validate(head_dim)


def fp16_config(raw_dtype: str = "float16") -> DiffKVConfig:
    """One 16-bit tier in ``raw_dtype``, nothing pruned (``alpha`` 0), no key smoothing: K/V stored as they are (a
    plain paged cache; the exact baseline of the tests, the engine's ``fp16`` kind and vLLM's ``exact`` setting)."""
    return DiffKVConfig(high="K16V16", low="K16V16", alpha_high=0.0, alpha_low=0.0, raw_dtype=raw_dtype,
                        smooth_keys=False)
