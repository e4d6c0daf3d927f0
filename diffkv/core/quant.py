"""Quantization codec, torch reference (the bit-exact oracle for the Triton kernels).

Asymmetric min-max quantization per token per contiguous channel group (docs/algorithm.md §3.2), fp32 math,
round-half-to-even, clamp to [0, 2^b - 1]. Two deliberate deviations from the published CUDA code:

* ``zero`` is ``min`` rounded *down* to the metadata dtype and ``scale`` is ``(max - zero) / (2^b - 1)`` rounded
  *up*, and the codes are computed with these stored values. The quantization grid therefore always covers the
  group, so ``|x - x_hat| <= scale / 2`` holds for every element even though scale and zero are stored in fp16,
  up to fp32 rounding of ``max - zero`` (about one fp32 ulp of the group's magnitude). Rounding to nearest, as the
  original does, can shift the grid by half an fp16 ulp of ``min``.
* ``scale`` has a floor of 2^-24 so a constant group is exact (the original divides by zero there).

``symmetric=True`` (``DiffKVConfig.symmetric_keys``, beyond the paper) stores the scale only: ``scale = max|x| /
(qmax / 2)`` rounded up and ``zero = -scale * qmax / 2`` computed in fp32 (exact for 16-bit scales), so the grid
``(q - qmax / 2) * scale`` is symmetric about 0 with no zero level. Codes follow the same
``round((x - zero) / scale)``; a constant-zero group decodes to ``scale_floor / 2``, not 0.

3-bit codes (beyond the paper) are packed as two bit planes per row: the low 2 bits of every code as 2-bit codes
(``D / 4`` bytes), then the high bit as 1-bit codes (``D / 8`` bytes), so every reader and writer reuses the
2- and 1-bit byte arithmetic (no code straddles a byte); ``D`` must be a multiple of 8.

Metadata is fp16 by default, as published. Caveat for bf16 models: fp16 overflows above 65504, so a group with
|values| beyond that fails validation; use ``meta_dtype=torch.bfloat16`` (same range as the model, 8 mantissa
bits, so a coarser grid) or ``torch.float32`` for such models.
"""

from __future__ import annotations

import torch

SCALE_FLOOR = 2.0**-24
CODE_BITS = (8, 4, 3, 2, 1)


def max_code(bits: int) -> int:
    return (1 << bits) - 1


def round_to(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Round fp32 ``x`` to ``dtype`` towards +inf (``up``) or -inf: the result never lies below / above ``x``.

    Round to nearest even, then one ulp step (``nextafter``) where that landed on the wrong side.
    """
    h = x.to(dtype)
    if dtype == torch.float32:
        return h
    off = h.float() < x if up else h.float() > x
    return torch.where(off, torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf"))), h)


def _grouped(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    d = x.shape[-1]
    g = d if group_size is None else group_size
    if g <= 0 or d % g:
        raise ValueError(f"group size {g} must divide the last dimension {d}")
    return x.reshape(*x.shape[:-1], d // g, g)


def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    meta_dtype: torch.dtype = torch.float16,
    validate: bool = True,
    symmetric: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` per token and channel group.

    x: [..., D] float16 / bfloat16 / float32.
    Returns ``codes`` [..., D] uint8 in [0, 2^bits - 1] (unpacked), ``scale`` and ``zero`` [..., D // group] in
    ``meta_dtype`` (symmetric: ``zero`` fp32, :func:`symmetric_zero`, not stored). Raises ``ValueError`` on NaN/Inf
    input or when a group cannot be represented in ``meta_dtype``.
    """
    if bits not in CODE_BITS:
        raise ValueError(f"quantize takes bits in {CODE_BITS}, got {bits}; 16-bit tensors are stored as is")
    if not x.is_floating_point():
        raise ValueError(f"quantize expects a floating tensor, got {x.dtype}")
    xf = x.float()
    if validate and not torch.isfinite(xf).all():
        raise ValueError("cannot quantize a tensor that contains NaN or Inf")
    xg = _grouped(xf, group_size)
    qmax = max_code(bits)
    if symmetric:
        amax = xg.abs().amax(-1)
        scale = round_to((amax / torch.full_like(amax, qmax / 2)).clamp_min(SCALE_FLOOR), meta_dtype, up=True)
        zero = symmetric_zero(scale, bits)
        zf = zero
    else:
        zero = round_to(xg.amin(-1) + 0.0, meta_dtype, up=False)  # + 0.0 makes a -0 minimum +0 (canonical bytes)
        zf = zero.float()
        span = xg.amax(-1) - zf
        # NOTE: divide by a tensor, not a Python scalar: CUDA turns scalar division into a multiply by a rounded
        # reciprocal, which is not bit-exact with the CPU and the Triton kernel (IEEE div_rn).
        scale = round_to((span / torch.full_like(span, qmax)).clamp_min(SCALE_FLOOR), meta_dtype, up=True)
    sf = scale.float()
    if validate and not (torch.isfinite(sf).all() and torch.isfinite(zf).all()):
        raise ValueError(
            f"values up to {xf.abs().max().item():.4g} do not fit {meta_dtype} scales/zeros; "
            "use meta_dtype=torch.bfloat16 or torch.float32"
        )
    q = torch.round((xg - zf.unsqueeze(-1)) / sf.unsqueeze(-1)).clamp_(0, qmax).to(torch.uint8)
    return q.reshape(x.shape), scale, zero


def symmetric_zero(scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The zero of a scale-only group: ``-scale * qmax / 2`` in fp32 (exact). scale: [...] any float dtype."""
    return scale.float() * -(max_code(bits) / 2)


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``codes * scale + zero`` in fp32, cast to ``dtype``.

    codes: [..., D] uint8 (unpacked); scale, zero: [..., G] with G dividing D. Returns [..., D].
    """
    d, g = codes.shape[-1], scale.shape[-1]
    if g == 0 or d % g:
        raise ValueError(f"{g} groups do not divide the last dimension {d}")
    q = codes.float().reshape(*codes.shape[:-1], g, d // g)
    x = q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return x.reshape(codes.shape).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack b-bit codes little-endian into bytes: element i of a byte occupies bits [i*b, (i+1)*b); 3 bits: the
    2-bit plane of the low bits, then the 1-bit plane of the high bit (module docstring).

    codes: [..., D] uint8 with values < 2^bits. Returns [..., D * bits // 8] uint8.
    """
    if bits not in CODE_BITS:
        raise ValueError(f"pack takes bits in {CODE_BITS}, got {bits}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack expects uint8 codes, got {codes.dtype}")
    if bits == 3:
        if codes.shape[-1] % 8:
            raise ValueError(f"last dimension {codes.shape[-1]} is not a multiple of 8 (3-bit rows are 2 + 1 planes)")
        return torch.cat([pack(codes & 3, 2), pack((codes >> 2) & 1, 1)], -1)
    per = 8 // bits
    d = codes.shape[-1]
    if d % per:
        raise ValueError(f"last dimension {d} is not a multiple of {per} (codes per byte at {bits} bits)")
    if bits == 8:
        return codes.clone()
    c = codes.reshape(*codes.shape[:-1], d // per, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return ((c & max_code(bits)) << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`. packed: [..., B] uint8. Returns codes [..., B * 8 // bits] uint8."""
    if bits not in CODE_BITS:
        raise ValueError(f"unpack takes bits in {CODE_BITS}, got {bits}")
    if bits == 3:
        low, high = _planes(packed)
        return unpack(low, 2) | (unpack(high, 1) << 2)
    if bits == 8:
        return packed.clone()
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & max_code(bits)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def _planes(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-bit and 1-bit planes of 3-bit rows [..., 3 D / 8]: ([..., D / 4], [..., D / 8])."""
    if packed.shape[-1] % 3:
        raise ValueError(f"3-bit rows take a multiple of 3 bytes, got {packed.shape[-1]}")
    quarter = packed.shape[-1] // 3 * 2
    return packed[..., :quarter], packed[..., quarter:]


def _unpacked_float(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of packed rows as fp32 [..., D] with byte-wide bit operations."""
    if bits == 8:
        return packed.float()
    if bits == 3:
        low, high = _planes(packed)
        return _unpacked_float(low, 2) + _unpacked_float(high, 1) * 4
    per, mask = 8 // bits, max_code(bits)
    q = torch.stack([(packed >> (i * bits)) & mask for i in range(per)], -1)
    return q.view(*packed.shape[:-1], packed.shape[-1] * per).float()


def dequantize_packed(packed: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``dequantize(unpack(packed, bits), scale, zero)`` in fp32 with byte-wide bit operations (the fast path).

    packed: [..., D * bits // 8] uint8; scale, zero: [..., G]. Returns [..., D] float32, bit-identical to the
    unfused composition (same fp32 multiply, then add).
    """
    q = _unpacked_float(packed, bits)
    d = q.shape[-1]
    g = scale.shape[-1]
    q = q.view(*packed.shape[:-1], g, d // g)
    q.mul_(scale.float().unsqueeze(-1)).add_(zero.float().unsqueeze(-1))
    return q.view(*packed.shape[:-1], d)
