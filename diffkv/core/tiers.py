"""Precision of the stored tokens: the quantization of one tensor and the (key, value) pair of a tier.

Keys may have fewer bits than values (``K3V4``): the published system keeps keys at least as precise, but with
smoothed keys the data may say otherwise (benchmarks/accuracy/key_quant_study.md).

A tier is written ``K<kbits>V<vbits>`` with an optional ``-g<key group>/<value group>`` suffix, e.g. ``K8V4``
(one group per token and head, as the published default) or ``K4V2-g64/32`` (docs/algorithm.md §3.1). ``16`` bits
means "stored as is" (no quantization) in the configured raw dtype.

The tier a token is in is labelled by :class:`Tier` (``PAD``, ``PRUNED``, ``LOW``, ``HIGH``): the values of the
policy's tier maps (``diffkv.core.policy``). The two stored tiers, in the order of the tier axis of every page table
and per-tier array, are ``diffkv.memory.STORED_TIERS``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from diffkv.core.checks import ConfigError, bad_value, check_int, show_value

QUANT_BITS = (16, 8, 4, 3, 2, 1)
GROUP_MAX = 1024  # channels per quantization group (it must also divide head_dim)
_TIER_RE = re.compile(r"K(\d+)V(\d+)(?:-g(\d+)/(\d+))?", re.ASCII)


class Tier(enum.IntEnum):
    """Which tier a token is in: the label of each position of a tier map (``PrefillSplit.tier``, int8).

    PAD (-1): not a token: a left-padding position of a batch (or a layer the cache does not compress).
    PRUNED (0): dropped: the token is stored nowhere.
    LOW (1): stored in the low tier (``DiffKVConfig.low``, the coarser precision).
    HIGH (2): stored in the high tier (``DiffKVConfig.high``).

    Ordered by how much of the token is kept, so ``tier >= Tier.LOW`` means "stored". These are labels, not indices:
    the tier axis of the page tables and per-tier arrays is indexed by ``diffkv.memory.HIGH_COL`` / ``LOW_COL``.
    """

    PAD = -1
    PRUNED = 0
    LOW = 1
    HIGH = 2


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """Quantization of one tensor (keys or values) of one tier.

    bits: 16 (stored as is), 8, 4, 3 (packed as a 2-bit and a 1-bit plane, ``diffkv.core.quant``), 2 or 1.
    group_size: channels per (scale, zero) group; ``None`` means one group over the whole head_dim.
    """

    bits: int
    group_size: int | None = None

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in QUANT_BITS:
            raise ConfigError(f"QuantSpec.bits must be one of {QUANT_BITS}, got {show_value(self.bits)}")
        if self.group_size is not None:
            check_int("QuantSpec.group_size", self.group_size, 1, GROUP_MAX)
        if self.bits == 16 and self.group_size is not None:
            raise ConfigError("QuantSpec.group_size: 16-bit tensors are stored as is and take no group_size; "
                              "leave it None")

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def group(self, head_dim: int) -> int:
        """Group size resolved for ``head_dim`` (validated)."""
        size = head_dim if self.group_size is None else self.group_size
        if head_dim % size:
            raise ConfigError(f"group size {size} must divide head_dim {head_dim} (use a divisor of {head_dim})")
        if self.bits == 3 and size % 8:
            raise ConfigError(f"3-bit codes need groups of a multiple of 8 channels (each row is a 2-bit and a "
                              f"1-bit plane), got {size}")
        if self.quantized and (size * self.bits) % 8:
            raise ConfigError(f"group of {size} channels at {self.bits} bits is not a whole number of bytes")
        return size

    def num_groups(self, head_dim: int) -> int:
        return 0 if not self.quantized else head_dim // self.group(head_dim)


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Precision of one storage tier: how keys and values of a token are kept."""

    key: QuantSpec
    value: QuantSpec

    def __post_init__(self):
        for name in ("key", "value"):
            if not isinstance(getattr(self, name), QuantSpec):
                raise bad_value(f"TierSpec.{name}", "a QuantSpec", getattr(self, name))

    @classmethod
    def parse(cls, name: str) -> TierSpec:
        """Parse ``K8V4`` or ``K4V2-g64/32`` (key group 64 channels, value group 32 channels)."""
        if isinstance(name, TierSpec):
            return name
        m = _TIER_RE.fullmatch(name.strip()) if isinstance(name, str) and len(name) <= 64 else None
        if not m:
            raise ConfigError(f"cannot parse tier {show_value(name)}: expected e.g. 'K8V4' or 'K4V2-g64/32'; "
                              f"presets: {list(PRESETS)}")
        kb, vb, kg, vg = (int(g) if g is not None else None for g in m.groups())
        try:
            return cls(QuantSpec(kb, kg), QuantSpec(vb, vg))
        except ConfigError as err:
            raise ConfigError(f"tier {name.strip()!r}: {err}") from None

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


def as_tier(field: str, t) -> TierSpec:
    """``t`` (a TierSpec or its name) as a TierSpec; ConfigError naming ``field`` otherwise."""
    if isinstance(t, TierSpec):
        return t
    try:
        return TierSpec.parse(t)
    except ConfigError as err:
        raise ConfigError(f"{field}: {err}") from None
