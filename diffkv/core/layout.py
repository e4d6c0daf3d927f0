"""Unified paging: one page byte size for every tier, and the segment layout of a page per tier.

The page size is found by the search of docs/design.md §3.1: among sizes in ``[800, 8000] * head_dim / 128`` bytes
(step 32), take the smallest that minimizes the worst tier's waste ``1 - N * bytes_per_token / page_bytes``.
Page layout per tier (docs/design.md §3.2), token-major inside each segment; every segment starts on a 32-byte
boundary and the value codes on a 128-byte boundary (coalesced 128-bit loads):

    key codes   [N, key_row_bytes]            packed little-endian (quant.pack) or raw 16-bit
    key meta    [N, key_groups, 2]            (scale, zero) in meta dtype; absent for 16-bit keys; symmetric keys:
                                              [N, key_groups, 1], the scale only (zero = -scale * qmax / 2)
    value codes [N, value_row_bytes]
    value meta  [N, value_groups, 2]
    score       [N] float32                   accumulated attention (policy); compact: float16 mean attention
    position    [N] int32                     immediately after score; compact: int16, the position mod 2^16

``compact`` (``DiffKVConfig.compact_meta``, beyond the paper) stores the score as the fp16 *mean* attention and the
position modulo 2^16 (ages stay exact up to 65535 steps): 4 bytes instead of 8 per token and head.
``symmetric_keys`` (``DiffKVConfig.symmetric_keys``) drops the key zero: one meta value per key group.

With the published set of four tiers at head_dim 128 (``PUBLISHED_TIERS``) this reproduces the published plan:
6784-byte pages, 32 K8V4 tokens and 60 K4V2 tokens per page. A plan for only the two tiers in use may pick a
different, less wasteful size (see ``diffkv layout``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from diffkv.core.config import PAGE_ALIGN, DiffKVConfig, TierSpec

SEGMENT_ALIGN = PAGE_ALIGN  # segments and pages: multiples of 32 B
VALUE_ALIGN = 128
SCORE_BYTES = 4  # fp32 score sum (the paper); compact: 2 (fp16 mean)
POS_BYTES = 4  # int32 position; compact: 2 (position mod 2^16)
COMPACT_BYTES = 2
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
PUBLISHED_TIERS = ("K8V4-g128/64", "K8V4", "K4V2-g64/32", "K4V2")


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True, slots=True)
class TierLayout:
    """Byte layout of a page holding tokens of one tier. Offsets are from the page start."""

    name: str
    head_dim: int
    key_bits: int
    value_bits: int
    key_groups: int
    value_groups: int
    meta_bytes: int
    raw_bytes: int
    tokens_per_page: int
    key_row_bytes: int
    value_row_bytes: int
    key_offset: int
    key_meta_offset: int
    value_offset: int
    value_meta_offset: int
    score_offset: int
    pos_offset: int
    end: int
    bytes_per_token: int
    page_bytes: int
    score_bytes: int = SCORE_BYTES
    pos_bytes: int = POS_BYTES
    key_meta_fields: int = 2  # (scale, zero); symmetric keys: 1 (scale)

    @property
    def compact(self) -> bool:
        """Score stored as the fp16 mean, position as int16 mod 2^16 (``DiffKVConfig.compact_meta``)."""
        return self.score_bytes == COMPACT_BYTES

    @property
    def waste_fraction(self) -> float:
        return 1.0 - self.tokens_per_page * self.bytes_per_token / self.page_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["waste_fraction"] = round(self.waste_fraction, 6)
        return d


def _row_bytes(bits: int, head_dim: int, raw_bytes: int) -> int:
    return head_dim * raw_bytes if bits == 16 else head_dim * bits // 8


def _field_bytes(compact: bool) -> tuple[int, int]:
    return (COMPACT_BYTES, COMPACT_BYTES) if compact else (SCORE_BYTES, POS_BYTES)


def bytes_per_token(tier: TierSpec, head_dim: int, meta_bytes: int = 2, raw_bytes: int = 2,
                    compact: bool = False, symmetric_keys: bool = False) -> int:
    """Stored bytes of one token of one KV head: K and V codes, their (scale, zero) pairs (symmetric keys: scale
    only), score and position."""
    tier.validate(head_dim)
    k, v = tier.key, tier.value
    meta = meta_bytes * ((1 if symmetric_keys else 2) * k.num_groups(head_dim) + 2 * v.num_groups(head_dim))
    codes = _row_bytes(k.bits, head_dim, raw_bytes) + _row_bytes(v.bits, head_dim, raw_bytes)
    return codes + meta + sum(_field_bytes(compact))


def tier_layout(tier: TierSpec, head_dim: int, page_bytes: int, meta_bytes: int = 2, raw_bytes: int = 2,
                compact: bool = False, symmetric_keys: bool = False) -> TierLayout:
    """Layout of ``tier`` in a page of ``page_bytes``, holding as many tokens as fit (possibly 0)."""
    tier.validate(head_dim)
    k, v = tier.key, tier.value
    kg, vg = k.num_groups(head_dim), v.num_groups(head_dim)
    krow, vrow = _row_bytes(k.bits, head_dim, raw_bytes), _row_bytes(v.bits, head_dim, raw_bytes)
    bpt = bytes_per_token(tier, head_dim, meta_bytes, raw_bytes, compact, symmetric_keys)
    score_bytes, pos_bytes = _field_bytes(compact)
    kf = 1 if symmetric_keys else 2

    def offsets(n: int) -> tuple[int, ...]:
        key_meta = _align(n * krow, SEGMENT_ALIGN)
        value = _align(key_meta + n * kg * kf * meta_bytes, VALUE_ALIGN)
        value_meta = _align(value + n * vrow, SEGMENT_ALIGN)
        score = _align(value_meta + n * vg * 2 * meta_bytes, SEGMENT_ALIGN)
        pos = score + n * score_bytes
        return 0, key_meta, value, value_meta, score, pos, pos + n * pos_bytes

    n = page_bytes // bpt
    while n > 0 and offsets(n)[-1] > page_bytes:
        n -= 1
    return TierLayout(tier.name, head_dim, k.bits, v.bits, kg, vg, meta_bytes, raw_bytes, n, krow, vrow,
                      *offsets(n), bpt, page_bytes, score_bytes, pos_bytes, kf)


@dataclass(frozen=True, slots=True)
class PagePlan:
    """One page size and the layout of every tier in it."""

    page_bytes: int
    head_dim: int
    tiers: tuple[TierLayout, ...]

    @property
    def worst_waste(self) -> float:
        return max(t.waste_fraction for t in self.tiers)

    def layout(self, name: str | TierSpec) -> TierLayout:
        name = TierSpec.parse(name).name
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"tier {name} is not in this page plan ({[t.name for t in self.tiers]})")

    def to_dict(self) -> dict:
        return {
            "page_bytes": self.page_bytes,
            "head_dim": self.head_dim,
            "worst_waste_fraction": round(self.worst_waste, 6),
            "fp16_tokens_per_page": self.page_bytes // (4 * self.head_dim),
            "tiers": [t.to_dict() for t in self.tiers],
        }


def search_range(head_dim: int) -> range:
    """Candidate page sizes: the published 800..8000 B at head_dim 128, scaled with head_dim, step 32."""
    lo = max(_align(800 * head_dim // 128, SEGMENT_ALIGN), SEGMENT_ALIGN)
    return range(lo, 8000 * head_dim // 128 + 1, SEGMENT_ALIGN)


def plan_pages(
    head_dim: int,
    tiers: tuple[TierSpec | str, ...] | list,
    meta_dtype: str = "float16",
    raw_dtype: str = "float16",
    candidates: range | None = None,
    compact: bool = False,
    symmetric_keys: bool = False,
    expected_tokens: int | None = None,
) -> PagePlan:
    """Smallest page size minimizing the worst tier's waste; every tier must fit at least one token.
    ``compact``: 2-byte score and position fields; ``symmetric_keys``: scale-only key metadata (module docstring).
    ``expected_tokens``: the tokens a tier of one (sequence, layer, KV head) typically holds; the waste then also
    counts the half page each tier leaves empty at its end on average, ``page_bytes / 2`` over those tokens' bytes
    (:func:`tail_waste`), so short sequences get small pages."""
    if not tiers:
        raise ValueError("plan_pages needs at least one tier")
    if head_dim <= 0 or head_dim % 8:
        raise ValueError(f"head_dim must be a positive multiple of 8, got {head_dim}")
    specs = [TierSpec.parse(t) for t in dict.fromkeys(TierSpec.parse(t).name for t in tiers)]
    mb, rb = DTYPE_BYTES[meta_dtype], DTYPE_BYTES[raw_dtype]
    best: tuple[float, int] | None = None
    candidates = candidates or search_range(head_dim)
    for p in candidates:
        layouts = [tier_layout(t, head_dim, p, mb, rb, compact, symmetric_keys) for t in specs]
        if any(t.tokens_per_page == 0 for t in layouts):
            continue
        waste = max(t.waste_fraction + tail_waste(t, expected_tokens) for t in layouts)
        if best is None or waste < best[0] - 1e-12:
            best = (waste, p)
    if best is None:
        names = [t.name for t in specs]
        if len(candidates) == 1:  # a fixed page (DiffKVConfig.page_bytes)
            raise ValueError(f"a {candidates[0]}-byte page does not fit one token of every tier {names} at head_dim "
                             f"{head_dim}; use a larger page_bytes, or None for the planner's size")
        raise ValueError(f"no page size in {candidates[0]}..{candidates[-1]} B fits one token of every tier {names} "
                         f"at head_dim {head_dim}")
    p = best[1]
    return PagePlan(p, head_dim, tuple(tier_layout(t, head_dim, p, mb, rb, compact, symmetric_keys) for t in specs))


def tail_waste(layout: TierLayout, expected_tokens: int | None) -> float:
    """Expected share of a tier's bytes left empty in its last page: half a page over ``expected_tokens`` tokens'
    bytes (0 without an expectation)."""
    if not expected_tokens:
        return 0.0
    return layout.page_bytes / 2 / (expected_tokens * layout.bytes_per_token)


def plan_for_config(config: DiffKVConfig, head_dim: int) -> PagePlan:
    """Page plan for the tiers of a :class:`DiffKVConfig` (high first)."""
    config.validate(head_dim)
    p = config.page_bytes
    return plan_pages(head_dim, config.tiers, config.meta_dtype, config.raw_dtype,
                      candidates=None if p is None else range(p, p + 1), compact=config.compact_meta,
                      symmetric_keys=config.symmetric_keys)
