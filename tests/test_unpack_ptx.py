"""The streams kernel's inline PTX unpack (``_unpack_asm``), which no CPU can run: each string is executed by a small
emulator of the four PTX instructions it uses (mov, shr, prmt, lop3; semantics of the PTX ISA) on every byte value,
and must give what the interpreter's Triton-ops path gives: ``1024 + field j`` as fp16, element i from byte i (the
packing ``tl.inline_asm_elementwise(pack=4)`` uses: byte 0 of ``$2`` is element 0, ``$0`` holds elements 0 and 1
low half first). A typo in a shift, a mask or a byte selector fails here; the GPU tests check the hardware."""

import re

import numpy as np
import pytest

from diffkv.kernels.stream_codes import STREAM_BITS, _unpack_asm


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 default mode: byte k of the result is byte (sel nibble k & 7) of {b, a} (a = bytes 0-3), sign-
    replicated when the nibble's bit 3 is set."""
    pool = a | (b << 32)
    out = 0
    for k in range(4):
        nib = (sel >> (4 * k)) & 0xF
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """lop3.b32: bit k of the result is bit (a_k * 4 + b_k * 2 + c_k) of lut (a = 0xF0, b = 0xCC, c = 0xAA)."""
    out = 0
    for k in range(32):
        idx = ((a >> k) & 1) << 2 | ((b >> k) & 1) << 1 | ((c >> k) & 1)
        out |= ((lut >> idx) & 1) << k
    return out


def _run(asm: str, word: int) -> tuple[int, int]:
    """($0, $1) of the asm block with $2 = word."""
    regs = {"$2": word}

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    body = asm.strip().removeprefix("{").removesuffix("}")
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        op, args = stmt.split(None, 1)
        ops = [x.strip() for x in args.split(",")]
        if op == ".reg":
            continue
        if op == "mov.b32":
            regs[ops[0]] = val(ops[1])
        elif op == "shr.b32":
            regs[ops[0]] = val(ops[1]) >> val(ops[2])
        elif op == "prmt.b32":
            regs[ops[0]] = _prmt(val(ops[1]), val(ops[2]), val(ops[3]))
        elif op == "lop3.b32":
            regs[ops[0]] = _lop3(val(ops[1]), val(ops[2]), val(ops[3]), val(ops[4]))
        else:
            raise AssertionError(f"the emulator does not know {op!r}: extend it with the PTX ISA's semantics")
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("bits", STREAM_BITS)
def test_each_unpack_string_gives_1024_plus_the_field_of_each_byte(bits, in_place):
    """``1024 + field j`` of each byte; in place (the values' streams): ``1024 + field j * 2^(j * bits)``."""
    rng = np.random.default_rng(bits)
    words = np.concatenate([np.arange(256, dtype=np.uint32) * 0x01010101, rng.integers(0, 2**32, 300, np.uint32)])
    for j in range(8 // bits):
        asm = _unpack_asm(bits, j, in_place)
        assert re.search(r"\$2", asm) and "$0" in asm and "$1" in asm
        scale = 1 << (j * bits) if in_place else 1
        for word in words.tolist():
            lo, hi = _run(asm, word)
            halves = np.array([lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16], np.uint16).view(np.float16)
            fields = [((word >> (8 * i)) >> (j * bits)) & ((1 << bits) - 1) for i in range(4)]
            assert halves.astype(np.float32).tolist() == [1024.0 + f * scale for f in fields], (bits, j, hex(word))
