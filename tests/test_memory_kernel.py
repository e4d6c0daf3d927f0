"""The fused ring kernels (reserve / release) against the torch ops: bit-identical bookkeeping. Triton, and the
compiled C pass of ``diffkv.memory.ring_cpu`` (CPU only).

On CPU they run under TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay tiny; odd shapes on purpose: one head,
a head count past one block (carry between blocks), rows wider than a column tile, a ring that wraps, refusals.
"""

import copy

import pytest
import torch

pytest.importorskip("triton")

from diffkv.memory import HeadTables, PagePool, allocate, release, reserve, trim  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED = ["triton"] + (["cpu"] if DEVICE == "cpu" else [])  # the compiled pass is required on CPU (conftest)
# triton 3.6's interpreter converts 1-element arrays to loop bounds with a numpy DeprecationWarning
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def build(slots, layers, heads, per_page, max_len, num_pages, two_tier=True, rotate=0, seed=0):
    """A pool and tables after allocate + trim + some decode fills, with the ring start moved by ``rotate``."""
    g = torch.Generator().manual_seed(seed)
    pool = PagePool(16, num_pages, device=DEVICE, allocate_data=False)
    tables = HeadTables(slots, layers, heads, per_page, max_len, two_tier=two_tier, recent_window=2, device=DEVICE)
    if rotate:  # take and give back pages so that the free region wraps around the ring's end
        spin = tables.select([tables.acquire_slot()])
        allocate(pool, tables, spin, rotate * per_page[0])
        release(pool, tables, spin)
        tables.retire_slots(spin.slots)
    hs = tables.select([tables.acquire_slot() for _ in range(slots)])
    lengths = torch.randint(0, max_len // 2, (slots,), generator=g)
    allocate(pool, tables, hs, lengths.tolist())
    length = lengths[hs.slot_index.cpu()]
    n_high = (torch.rand(len(hs), generator=g) * (length + 1)).long().clamp(max=length)
    n_low = (length - n_high) if two_tier else torch.zeros_like(n_high)
    trim(pool, tables, hs, n_high.to(DEVICE), n_low.to(DEVICE))
    full = torch.rand(len(hs), generator=g) < 0.6  # decode filled the last page of some heads
    tok = tables.tokens_flat[hs.items]
    cap = tables.pages_flat[hs.items] * tables.tokens_per_page
    tables.tokens_flat[hs.items] = torch.where(full[:, None].to(DEVICE), cap, tok)
    return pool, tables, hs


def public(pool, tables):
    return {"ring": pool.ring.cpu().clone(), "refcount": pool.refcount.cpu().clone(), "state": pool.state.cpu().clone(),
            "table": tables.table.cpu().clone(), "counts": tables.counts.cpu().clone()}


def assert_identical(a, b):
    for key in a:
        if not torch.equal(a[key], b[key]):
            diff = (a[key] != b[key]).nonzero()[:5].tolist()
            raise AssertionError(f"{key} differs at {diff}: torch {a[key].flatten()[:12].tolist()} "
                                 f"triton {b[key].flatten()[:12].tolist()}")


def run_both(objs, op, fused, **kw):
    """Run ``op`` with the torch and the ``fused`` backend on two copies; return both results and states."""
    out = []
    for backend in ("torch", fused):
        pool, tables, hs = copy.deepcopy(objs)
        result = op(pool, tables, hs, backend=backend, **kw)
        pool.check_invariants(tables)
        out.append((int(result.pages), public(pool, tables)))
    assert out[0][0] == out[1][0]
    assert_identical(out[0][1], out[1][1])
    return out[0][0]


CASES = {  # slots, layers, heads, (N_hi, N_lo), max_len, num_pages, two_tier, rotate
    "one head": (1, 1, 1, (4, 8), 40, 64, True, 0),
    "two blocks": (3, 2, 3, (4, 8), 40, 400, True, 0),
    "wrapping ring": (2, 2, 3, (4, 8), 40, 160, True, 9),
    "single tier": (2, 3, 2, (3, 3), 30, 200, False, 5),
    "wide rows": (1, 2, 2, (1, 2), 40, 200, True, 0),
}


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("sync", [True, False])
def test_reserve_kernel_matches_torch(case, sync, fused):
    objs = build(*CASES[case])
    taken = run_both(objs, reserve, fused, sync=sync)
    assert taken > 0


@pytest.mark.parametrize("fused", FUSED)
def test_reserve_kernel_with_may_demote_and_refusal(fused):
    objs = build(*CASES["two blocks"], seed=3)
    may = torch.arange(len(objs[2])) % 3 == 0
    run_both(objs, reserve, fused, may_demote=may.to(DEVICE), sync=False)
    pool, tables, hs = objs
    tight = (pool, tables, hs)
    need = int(reserve(*copy.deepcopy(tight)).pages)
    pool.state[1] = need - 1  # one page short: both must refuse and change nothing but the refused count
    for backend in ("torch", fused):
        p, t, h = copy.deepcopy(tight)
        before = public(p, t)
        assert int(reserve(p, t, h, sync=False, backend=backend).pages) == 0
        after = public(p, t)
        assert after["state"][2] == before["state"][2] + 1
        after["state"][2] -= 1
        assert_identical(before, after)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("sync", [True, False])
def test_release_kernel_matches_torch(case, sync, fused):
    objs = build(*CASES[case], seed=1)
    freed = run_both(objs, release, fused, sync=sync)
    assert freed > 0
