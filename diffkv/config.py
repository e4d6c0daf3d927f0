"""Configuration dataclasses: quantization of one tensor, the (key, value) pair of a tier, and DiffKV itself.

A tier is written ``K<kbits>V<vbits>`` with an optional ``-g<key group>/<value group>`` suffix, e.g. ``K8V4``
(one group per token and head, as the published default) or ``K4V2-g64/32`` (ALGORITHM.md §3.1). ``16`` bits
means "stored as is" (no quantization) in the configured raw dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

QUANT_BITS = (16, 8, 4, 2, 1)
META_DTYPES = ("float16", "bfloat16", "float32")
RAW_DTYPES = ("float16", "bfloat16", "float32")
_TIER_RE = re.compile(r"^K(\d+)V(\d+)(?:-g(\d+)/(\d+))?$")


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """Quantization of one tensor (keys or values) of one tier.

    bits: 16 (stored as is), 8, 4, 2 or 1.
    group_size: channels per (scale, zero) group; ``None`` means one group over the whole head_dim.
    """

    bits: int
    group_size: int | None = None

    def __post_init__(self):
        if self.bits not in QUANT_BITS:
            raise ValueError(f"QuantSpec.bits must be one of {QUANT_BITS}, got {self.bits!r}")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise ValueError(f"QuantSpec.group_size must be a positive int or None (whole head), "
                             f"got {self.group_size!r}")
        if self.bits == 16 and self.group_size is not None:
            raise ValueError("16-bit tensors are stored as is and take no group_size; leave it None")

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def group(self, head_dim: int) -> int:
        """Group size resolved for ``head_dim`` (validated)."""
        size = head_dim if self.group_size is None else self.group_size
        if head_dim % size:
            raise ValueError(f"group size {size} must divide head_dim {head_dim} (use a divisor of {head_dim})")
        if self.quantized and (size * self.bits) % 8:
            raise ValueError(f"group of {size} channels at {self.bits} bits is not a whole number of bytes")
        return size

    def num_groups(self, head_dim: int) -> int:
        return 0 if not self.quantized else head_dim // self.group(head_dim)


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Precision of one storage tier: how keys and values of a token are kept."""

    key: QuantSpec
    value: QuantSpec

    def __post_init__(self):
        if self.key.bits < self.value.bits:
            raise ValueError(
                f"keys must have at least as many bits as values (got K{self.key.bits}V{self.value.bits}); "
                "keys matter more than values"
            )

    @classmethod
    def parse(cls, name: str) -> TierSpec:
        """Parse ``K8V4`` or ``K4V2-g64/32`` (key group 64 channels, value group 32 channels)."""
        if isinstance(name, TierSpec):
            return name
        m = _TIER_RE.match(str(name).strip())
        if not m:
            raise ValueError(f"cannot parse tier {name!r}: expected e.g. 'K8V4' or 'K4V2-g64/32'; "
                             f"presets: {list(PRESETS)}")
        kb, vb, kg, vg = (int(g) if g is not None else None for g in m.groups())
        return cls(QuantSpec(kb, kg), QuantSpec(vb, vg))

    @property
    def name(self) -> str:
        base = f"K{self.key.bits}V{self.value.bits}"
        if self.key.group_size is None and self.value.group_size is None:
            return base
        kg = self.key.group_size if self.key.group_size is not None else "all"
        vg = self.value.group_size if self.value.group_size is not None else "all"
        return f"{base}-g{kg}/{vg}"

    def validate(self, head_dim: int) -> None:
        self.key.group(head_dim)
        self.value.group(head_dim)

    def __str__(self) -> str:
        return self.name


PRESETS: dict[str, TierSpec] = {
    n: TierSpec.parse(n)
    for n in ("K16V16", "K8V8", "K8V4", "K8V2", "K4V4", "K4V2", "K4V1", "K8V4-g128/64", "K4V2-g64/32")
}


def _check_alphas(alpha_high: float, alpha_low: float, where: str) -> None:
    if not (0.0 <= alpha_low <= alpha_high):
        raise ValueError(f"need 0 <= alpha_low <= alpha_high{where}, got alpha_low={alpha_low}, "
                         f"alpha_high={alpha_high}")
    if alpha_low > 1.0:
        raise ValueError(f"alpha_low={alpha_low}{where} > 1 would prune tokens receiving more than uniform attention")


def _as_tier(t: TierSpec | str) -> TierSpec:
    return t if isinstance(t, TierSpec) else TierSpec.parse(t)


@dataclass(frozen=True, slots=True)
class DiffKVConfig:
    """DiffKV compression settings (ALGORITHM.md §4).

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
        better at 4 bits (benchmarks/accuracy/README.md, "center_keys"). Costs ``head_dim`` fp32 per head and
        sequence, counted in the stats.
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

    def __post_init__(self):
        object.__setattr__(self, "high", _as_tier(self.high))
        object.__setattr__(self, "low", _as_tier(self.low))
        hi, lo = self.high, self.low
        if hi.key.bits < lo.key.bits or hi.value.bits < lo.value.bits:
            raise ValueError(f"the high tier ({hi}) must have at least the bits of the low tier ({lo}) "
                             "for keys and values")
        _check_alphas(self.alpha_high, self.alpha_low, "")
        if self.layer_alphas is not None:
            pairs = tuple((float(a), float(b)) for a, b in self.layer_alphas)
            for i, (a, b) in enumerate(pairs):
                _check_alphas(a, b, f" (layer {i})")
            object.__setattr__(self, "layer_alphas", pairs)
        for name in ("recent_window", "score_window"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.meta_dtype not in META_DTYPES:
            raise ValueError(f"meta_dtype must be one of {META_DTYPES}, got {self.meta_dtype!r}")
        if not isinstance(self.center_keys, bool):
            raise ValueError(f"center_keys must be True or False, got {self.center_keys!r}")
        if self.raw_dtype not in RAW_DTYPES:
            raise ValueError(f"raw_dtype must be one of {RAW_DTYPES}, got {self.raw_dtype!r}")

    def alphas(self, layer_idx: int) -> tuple[float, float]:
        """(alpha_high, alpha_low) of a layer: its entry in ``layer_alphas`` if given, else the global pair."""
        if self.layer_alphas is None:
            return self.alpha_high, self.alpha_low
        if not 0 <= layer_idx < len(self.layer_alphas):
            raise ValueError(f"layer_alphas has {len(self.layer_alphas)} entries; no thresholds for layer {layer_idx}")
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
