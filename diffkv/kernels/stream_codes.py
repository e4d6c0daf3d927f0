"""Integer codes to fp16 for the streams decode kernel (``diffkv.kernels.paged_decode_streams``), on the tensor
cores' terms: a code becomes the fp16 number ``1024 + code`` by OR-ing it into the mantissa of 1024 (the magic-number
trick of LMDeploy's ``cvt_f16x4_u8``), on CUDA by inline PTX four bytes at a time (:func:`_unpack_asm`; the Triton
interpreter cannot run PTX, so there the same function runs in Triton ops); and bf16 queries brought into fp16 by an
exact power of two (:func:`pow2_scale`)."""

from __future__ import annotations

import triton
import triton.language as tl

STREAM_BITS = (2, 4, 8)


def _unpack_asm(bits: int, j: int, in_place: bool = False) -> str:
    """PTX of ``stream``'s fp16 path for four bytes at once (``tl.inline_asm_elementwise`` with ``pack=4``): one
    shift of the 32-bit word, two byte permutes to fp16 lanes, two LOP3 (mask, then ``| 0x6400``): ``1024 + code``.
    in_place: no shift, the field masked where it lies: ``1024 + code * 2^(j * bits)`` (exact: at most 2^8 - 1)."""
    shift = f"shr.b32 w, $2, {j * bits};" if j and not in_place else "mov.b32 w, $2;"
    mask = (((1 << bits) - 1) << (j * bits if in_place else 0)) * 0x10001
    return ("{ .reg .b32 w, a, b; " + shift + " prmt.b32 a, w, 0, 0x4140; prmt.b32 b, w, 0, 0x4342; "
            f"lop3.b32 $0, a, {mask:#x}, 0x64006400, 0xea; lop3.b32 $1, b, {mask:#x}, 0x64006400, 0xea; }}")


_A8_0 = tl.constexpr(_unpack_asm(8, 0))
_A4_0 = tl.constexpr(_unpack_asm(4, 0))
_A4_1 = tl.constexpr(_unpack_asm(4, 1))
_A2_0 = tl.constexpr(_unpack_asm(2, 0))
_A2_1 = tl.constexpr(_unpack_asm(2, 1))
_A2_2 = tl.constexpr(_unpack_asm(2, 2))
_A2_3 = tl.constexpr(_unpack_asm(2, 3))
_P4_1 = tl.constexpr(_unpack_asm(4, 1, in_place=True))
_P2_1 = tl.constexpr(_unpack_asm(2, 1, in_place=True))
_P2_2 = tl.constexpr(_unpack_asm(2, 2, in_place=True))
_P2_3 = tl.constexpr(_unpack_asm(2, 3, in_place=True))


@triton.jit
def _magic_fp16(byt, J: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, IN_PLACE: tl.constexpr):
    """``1024 + code`` in fp16 for bit field J of every byte of ``byt`` (uint8): ``code | 0x6400`` is that fp16
    number (the magic-number trick of LMDeploy's ``cvt_f16x4_u8``); IN_PLACE: ``1024 + code * 2^(J * BITS)`` (the
    field not shifted down: one SHF per four bytes fewer). ASM (CUDA only: the interpreter cannot run PTX): as inline
    PTX on four bytes a 32-bit word (:func:`_unpack_asm`), ~1.1 instructions a code where the compiler's own
    lowering of the same integer ops takes ~2.5 (byte extracts and a pack per pair)."""
    if ASM:
        if BITS == 8:
            asm: tl.constexpr = _A8_0
        elif BITS == 4:
            asm: tl.constexpr = _A4_0 if J == 0 else (_P4_1 if IN_PLACE else _A4_1)
        elif IN_PLACE:
            asm: tl.constexpr = _A2_0 if J == 0 else (_P2_1 if J == 1 else (_P2_2 if J == 2 else _P2_3))
        else:
            asm: tl.constexpr = _A2_0 if J == 0 else (_A2_1 if J == 1 else (_A2_2 if J == 2 else _A2_3))
        x = tl.inline_asm_elementwise(asm, "=r,=r,r", [byt], dtype=tl.float16, is_pure=True, pack=4)
    else:
        mask: tl.constexpr = (1 << BITS) - 1
        if IN_PLACE:
            code = byt.to(tl.int32) & (mask << (J * BITS))
        else:
            code = (byt.to(tl.int32) >> (J * BITS)) & mask
        x = (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return x


@triton.jit
def stream(byt, J: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, OFFSET: tl.constexpr,
           IN_PLACE: tl.constexpr = False):
    """Bit field J of every byte of ``byt`` (uint8 [BN, NB]) as fp16: the codes of channels ``c * PER + J``
    (IN_PLACE: times ``2^(J * BITS)``, for a caller that scales the dot's result back), plus 1024 when OFFSET (the
    caller takes the 1024 off after the dot, one HSUB2 a code pair fewer).

    OFFSET is for 16-bit queries: with the 1024 in the dots their fp32 sums grow 1024-fold and lose ~10 bits, which
    the fp16 rounding of the probabilities already costs those queries but fp32 queries (1e-5) cannot afford."""
    x = _magic_fp16(byt, J, BITS, ASM, IN_PLACE)
    if not OFFSET:
        x -= 1024.0
    return x


@triton.jit
def pow2_scale(amax):
    """(2^k, 2^-k) with ``amax * 2^k`` in [2^13, 2^14): bf16 queries times 2^k are exact in fp16 (8
    significant bits of 11; below 2^-24 of the largest they turn subnormal). Built from the exponent bits, so that
    both are powers of two on a GPU too (its exp2 and log2 are approximate)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of amax (0 when every query is 0)
    biased = tl.minimum(tl.maximum(127 + 13 - (e - 127), 1), 253)
    scale = (biased << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - biased) << 23).to(tl.float32, bitcast=True)
    return scale, inverse
