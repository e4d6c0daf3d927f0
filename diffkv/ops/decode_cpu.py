"""The compiled CPU decode step (``diffkv/kernels/decode_cpu.c``): placement, stores, attention and the score update
of one layer's items in one call, reading the pages directly (no dense copy of the cache is ever made).

Built on first use with the system C compiler (``diffkv.kernels.cbuild``; OpenMP across items when the compiler has
it) and loaded with ctypes. :func:`available` says whether that worked.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from diffkv.core.page_io import resolve_dtypes
from diffkv.kernels.cbuild import CompileError, build, loads
from diffkv.memory import HIGH_COL, LOW_COL

_DIR = Path(__file__).resolve().parent.parent / "kernels"
STRICT_FLAGS = ["-ffp-contract=off"]  # placement and stores: bit-exact with the torch reference
ATTEND_FLAGS = ["-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
                "-ffp-contract=fast"]  # attention: reassociation lets the dot products vectorize
LAYOUT_FIELDS = ("tokens_per_page", "key_bits", "value_bits", "key_groups", "value_groups", "key_offset",
                 "key_meta_offset", "value_offset", "value_meta_offset", "score_offset", "pos_offset",
                 "score_bytes", "key_meta_fields")
_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
ERRORS = {
    -3: "an item is not a head of these tables",
    -4: "the tables hold an invalid page id or a token count their pages cannot hold",
    -5: "a head has no room for this step's token: call reserve() before the decode step",
    -6: "the new token's keys/values contain NaN or Inf (not finite) or overflow the tier's scale/zero dtype "
        "(use meta_dtype='bfloat16' or 'float32')",
    -7: "out of memory for the attention scratch",
}
__all__ = ["CompileError", "available", "decode_step_cpu", "library"]


@cache
def library() -> ctypes.CDLL:
    """Build (once per source version and CPU) and load the library; raises :class:`CompileError`."""
    lib = build("decode_cpu", {_DIR / "decode_cpu.c": STRICT_FLAGS, _DIR / "decode_cpu_attend.c": ATTEND_FLAGS},
                headers=(_DIR / "decode_cpu.h",), link=["-lm"], optional=["-march=native", "-fopenmp"])
    ptr, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    lib.diffkv_decode_step.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr,
                                       ptr, ptr, ptr, i64, i64, f64, f64, f64, i64, i64, i64, i64, ptr, ptr]
    lib.diffkv_decode_step.restype = i64
    return lib


@cache
def available() -> bool:
    """Whether the compiled decode step can be used (builds it on the first call)."""
    return loads(library)


@cache
def _layout(lay, peak: bool) -> torch.Tensor:
    """int64 [LAYOUT_FIELDS + 1] of a TierLayout and the score kind (1: peaks; cached: layouts are frozen)."""
    fields = [max(getattr(lay, f), 1) if f.endswith("groups") else getattr(lay, f) for f in LAYOUT_FIELDS]
    return torch.tensor(fields + [int(peak)], dtype=torch.int64)


def _f32(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return x.reshape(shape).to(torch.float32).contiguous()


def decode_step_cpu(kv, items: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    position: torch.Tensor, alpha_high: float, alpha_low: float, scaling: float, *,
                    threads: int | None = None) -> torch.Tensor:
    """One decode step of K distinct items of one layer; the same effects as the torch reference,
    ``diffkv.ops.decode_step.decode_step(..., backend="torch")``.

    kv: the ``PagedKV`` (on CPU); items: int64 [K] flat head ids (a ``HeadSet``'s, this step's pages reserved);
    query: [B, H_q, D]; key, value: [K, D] the new token (any float dtype, finite); position: int [K] its index.
    threads: OpenMP threads across items (default ``torch.get_num_threads()``). Returns out [B, H_q, D] fp32.
    Raises ValueError (nothing changed) for inconsistent tables, a head without a reserved page or values the tier
    cannot store.
    """
    data, tables, cfg = kv.pool.data, kv.tables, kv.config
    if data.device.type != "cpu":  # raw pointers: never hand device memory to the C code
        raise ValueError(f"the compiled decode step runs on CPU tensors, the pool is on {data.device}")
    b, hq, d = query.shape
    k = items.numel()
    if k == 0 or k % b or hq % (k // b) or key.shape != (k, d) or value.shape != (k, d):
        raise ValueError(f"items [{k}] must be B * H_kv for query {tuple(query.shape)}, and key/value [K, D]; got "
                         f"{tuple(key.shape)} / {tuple(value.shape)}")
    hi, lo = kv.layouts[HIGH_COL], kv.layouts[LOW_COL]
    if hi.head_dim != d:
        raise ValueError(f"head_dim {d} does not match the page layout's {hi.head_dim}")
    assert data.is_contiguous() and tables.rows.is_contiguous() and tables.counts.is_contiguous()
    md, rd = resolve_dtypes(hi, kv.meta_dtype, kv.raw_dtype)
    g = hq // (k // b)
    items = items.to(torch.int64).contiguous()
    q, kk, vv = _f32(query, (k * g, d)), _f32(key, (k, d)), _f32(value, (k, d))
    pos = position.to(torch.int64).contiguous()
    out = torch.empty(b, hq, d, dtype=torch.float32)
    plan = torch.empty(k, 4, dtype=torch.int64)
    failed = (ctypes.c_int64 * 1)(0)
    hl, ll = _layout(hi, cfg.peak), _layout(lo, cfg.peak)
    alpha_quant = alpha_high if cfg.two_tier else alpha_low
    code = library().diffkv_decode_step(
        data.data_ptr(), kv.pool.num_pages, hi.page_bytes, tables.rows.data_ptr(), tables.width,
        tables.counts.data_ptr(), tables.num_items, items.data_ptr(), k, g, d, q.data_ptr(), kk.data_ptr(),
        vv.data_ptr(), pos.data_ptr(), out.data_ptr(), hl.data_ptr(), ll.data_ptr(), _KIND[md], _KIND[rd],
        float(scaling), float(alpha_low), float(alpha_quant), cfg.recent_window, cfg.score_lag, int(cfg.two_tier),
        threads or torch.get_num_threads(), plan.data_ptr(), ctypes.addressof(failed))
    if code:
        item = int(items[failed[0]])
        raise ValueError(f"decode step: {ERRORS.get(code, f'error {code}')} (head {item}; nothing was changed)")
    return out
