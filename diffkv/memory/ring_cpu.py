"""The compiled CPU ring operations (``ring_cpu.c``): reserve and release as one call each, no torch op.

The C file is compiled on first use with the system C compiler (``$CC``, else ``cc``; ``diffkv.kernels.cbuild``)
into ``cache_home()/build/ring_cpu-<hash>.so`` and loaded with ctypes. :func:`available` says whether that worked;
``backend="auto"`` uses it on CPU when it did and falls back to the torch ops (the reference) when it did not.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from diffkv.kernels.cbuild import CompileError, build, loads
from diffkv.memory.pool import PagePool
from diffkv.memory.ring_launch import _check as _check_buffers
from diffkv.memory.tables import HeadTables

SOURCE = Path(__file__).with_name("ring_cpu.c")
ERRORS = {-3: "an item is not a head of these tables", -4: "the tables or the ring hold an invalid page id"}
__all__ = ["CompileError", "available", "library", "release_cpu", "reserve_cpu"]


@cache
def library() -> ctypes.CDLL:
    """Build (once per source version) and load the shared library; raises :class:`CompileError`."""
    lib = build("ring_cpu", {SOURCE: []})
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.diffkv_ring_reserve.argtypes = [ptr] * 8 + [i64] * 9
    lib.diffkv_ring_release.argtypes = [ptr] * 7 + [i64] * 4
    lib.diffkv_ring_reserve.restype = lib.diffkv_ring_release.restype = i64
    return lib


@cache
def available() -> bool:
    """Whether the compiled operations can be used (compiles them on the first call)."""
    return loads(library)


def _check(pool: PagePool, tables: HeadTables, items: torch.Tensor) -> None:
    if pool.device.type != "cpu":  # raw pointers: never hand device memory to the C code
        raise ValueError(f"the compiled ring ops run on CPU tensors, the pool is on {pool.device}")
    _check_buffers(pool, tables, items)  # every buffer on the pool's device, contiguous, of the right dtype


def _raise_on_error(code: int, op: str) -> None:
    if code in ERRORS:
        raise ValueError(f"{op}: {ERRORS[code]} (nothing was changed)")


def reserve_cpu(pool: PagePool, tables: HeadTables, items: torch.Tensor, may_demote: torch.Tensor | None,
                count_refusal: bool) -> tuple[int, list[int]]:
    """``reserve`` in one call (no torch op unless ``may_demote`` needs a dtype change). items: int64 [K] distinct
    flat head ids; may_demote: bool [K] or None.

    Returns (code, [taken, needed, widest, free before]): code 0 done, -1 pool short, -2 a row would outgrow the
    table (refused: nothing changed but ``pool.state[2] += count_refusal``). Invalid ids raise ValueError, also
    before any change.
    """
    _check(pool, tables, items)
    demote = None if may_demote is None else may_demote.to(torch.int8).contiguous()
    out = (ctypes.c_int64 * 4)()
    n_hi, n_lo = tables.tokens_per_page_hl
    code = library().diffkv_ring_reserve(
        pool._ring_buf.data_ptr(), pool._ref_buf.data_ptr(), tables._table_buf.data_ptr(), tables.counts.data_ptr(),
        items.data_ptr(), None if demote is None else demote.data_ptr(), pool.state.data_ptr(), ctypes.addressof(out),
        items.numel(), tables.num_items, pool.num_pages, tables.width, n_hi, n_lo, tables.recent_window or 0,
        int(tables.two_tier), int(count_refusal))
    _raise_on_error(code, "reserve")
    return code, list(out)


def release_cpu(pool: PagePool, tables: HeadTables, items: torch.Tensor) -> int:
    """``release`` in one call, no torch op. items: int64 [K] distinct flat head ids. Returns the pages freed."""
    _check(pool, tables, items)
    out = ctypes.c_int64(0)
    code = library().diffkv_ring_release(
        pool._ring_buf.data_ptr(), pool._ref_buf.data_ptr(), tables._table_buf.data_ptr(), tables.counts.data_ptr(),
        items.data_ptr(), pool.state.data_ptr(), ctypes.addressof(out), items.numel(), tables.num_items,
        pool.num_pages, tables.width)
    _raise_on_error(code, "release")
    return out.value
