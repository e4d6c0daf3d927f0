"""Device-resident memory manager: exact small cases, atomicity, errors, sync counts, and a stateful property test
against the per-head Python manager of the benchmark (same ring order, page for page)."""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch.utils._python_dispatch import TorchDispatchMode

from diffkv.bench.memory import PerHeadManager
from diffkv.core.config import DiffKVConfig
from diffkv.core.layout import plan_for_config
from diffkv.memory import (
    HIGH_COL,
    LOW_COL,
    HeadTables,
    PagePool,
    PoolExhausted,
    alloc,
    allocate,
    release,
    release_slots,
    reserve,
    reserve_demand,
    ring_cpu,
    trim,
)

N_HI, N_LO, RECENT = 4, 8, 3
CPU_BACKENDS = ["torch", "cpu"]  # the compiled pass is required (conftest): no case vanishes without a compiler


def make(num_pages=64, slots=4, layers=2, heads=2, max_len=40, two_tier=True, recent=RECENT):
    pool = PagePool(32, num_pages)
    tables = HeadTables(slots, layers, heads, (N_HI, N_LO), max_len, two_tier=two_tier, recent_window=recent)
    return pool, tables


def state(pool, tables, scratch=True):
    """Every bookkeeping tensor; ``scratch=False`` leaves out the scratch entries masked writes may touch."""
    if scratch:
        return {**pool.snapshot(), "table": tables._table_buf.clone(), "counts": tables.counts.clone()}
    return {"ring": pool.ring.clone(), "refcount": pool.refcount.clone(), "state": pool.state.clone(),
            "table": tables.table.clone(), "counts": tables.counts.clone()}


def assert_same(a, b, skip=()):
    for key in a:
        if key not in skip:
            assert torch.equal(a[key], b[key]), key


def test_pool_from_budget_and_reads():
    pool = PagePool(100, budget_bytes=1050)
    assert pool.num_pages == 10 and tuple(pool.data.shape) == (10, 100)
    assert pool.free_pages() == 10 and pool.host_reads == 1
    assert pool.status() == {"start": 0, "free": 10, "refused": 0}
    with pytest.raises(ValueError, match="exactly one"):
        PagePool(100)
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(100, budget_bytes=99)


def test_for_config_takes_tokens_per_page_from_layout():
    cfg = DiffKVConfig()
    plan = plan_for_config(cfg, 64)
    t = HeadTables.for_config(cfg, plan, max_slots=2, num_layers=3, num_kv_heads=2, max_model_len=1000)
    n_hi, n_lo = plan.layout(cfg.high).tokens_per_page, plan.layout(cfg.low).tokens_per_page
    assert t.tokens_per_page_hl == (n_hi, n_lo) and t.recent_window == cfg.recent_window
    assert t.width == math.ceil(1000 / min(n_hi, n_lo)) + 2
    assert tuple(t.table.shape) == (2, 3, 2, t.width) and tuple(t.num_tokens.shape) == (2, 3, 2, 2)


def test_lifecycle_exact_pages():
    pool, tables = make(num_pages=12, slots=1, layers=1, heads=1)
    t = tables.width
    slot = tables.acquire_slot()
    heads = tables.select([slot])
    assert allocate(pool, tables, heads, 10).pages == 4  # ceil(10 / 4) + 1
    assert tables.table[0, 0, 0, :4].tolist() == [0, 1, 2, 3]
    assert trim(pool, tables, heads, torch.tensor([5]), torch.tensor([3])).pages == 1
    row = tables.table[0, 0, 0]
    assert row[:2].tolist() == [0, 1] and row[t - 1].item() == 2 and (row[2:t - 1] == -1).all()
    assert tables.num_pages[0, 0, 0].tolist() == [2, 1] and tables.num_tokens[0, 0, 0].tolist() == [5, 3]
    assert pool.status() == {"start": 4, "free": 9, "refused": 0} and pool.ring[3].item() == 3
    assert reserve(pool, tables, heads).pages == 0  # nothing is full
    tables.num_tokens[0, 0, 0] = torch.tensor([8, 8])
    assert reserve(pool, tables, heads).pages == 2  # high (col 2) then low (col T-2), item-major
    assert row[2].item() == 4 and row[t - 2].item() == 5
    pool.check_invariants(tables)
    assert release_slots(pool, tables, [slot]).pages == 5
    start, free = pool.status()["start"], pool.free_pages()
    tail_ids = [pool.ring[(start + free - 5 + i) % 12].item() for i in range(5)]
    assert tail_ids == [0, 1, 4, 5, 2]  # column order: high pages, then low pages from the last to the first
    assert free == 12 and (tables.table == -1).all() and (tables.counts == 0).all()
    pool.check_invariants(tables)


def test_token_address_before_and_after_trim_agree():
    pool, tables = make(slots=1, layers=1, heads=2)
    heads = tables.select([tables.acquire_slot()])
    allocate(pool, tables, heads, 30)
    n_high, n_low = torch.tensor([9, 13]), torch.tensor([17, 3])
    tables.tokens_flat[heads.items] = torch.stack([n_high, n_low], 1).int()
    items = heads.items.repeat_interleave(torch.stack([n_high, n_low]).amax(0) * 0 + 20)
    idx = torch.arange(20).repeat(2)
    lo_mask = idx < n_low.repeat_interleave(20)
    before = tables.token_address(items[lo_mask], LOW_COL, idx[lo_mask], before_trim=True)
    hi_before = tables.token_address(items, HIGH_COL, idx)
    trim(pool, tables, heads)
    after = tables.token_address(items[lo_mask], LOW_COL, idx[lo_mask])
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    hi_mask = idx < n_high.repeat_interleave(20)
    assert torch.equal(hi_before[0][hi_mask], tables.token_address(items, HIGH_COL, idx)[0][hi_mask])
    assert torch.equal(after[1], idx[lo_mask] % N_LO) and (after[0] >= 0).all()
    pool.check_invariants(tables)


def test_ops_over_any_set_of_heads():
    pool, tables = make(num_pages=100, slots=3, layers=2, heads=2)
    a, b = tables.acquire_slot(), tables.acquire_slot()
    some = tables.select_items(torch.tensor([b, a, b]), torch.tensor([1, 0, 0]), torch.tensor([0, 1, 1]))
    assert some.slots == (b, a) and some.slot_index.tolist() == [0, 1, 0]
    allocate(pool, tables, some, [6, 9])  # one length per slot, in the order of some.slots
    assert tables.num_tokens[b, 1, 0, 0] == 6 and tables.num_tokens[a, 0, 1, 0] == 9
    assert tables.num_pages.sum() == 2 * 3 + 4  # ceil(6/4) + 1 twice, ceil(9/4) + 1 once
    trim(pool, tables, some, torch.tensor([6, 4, 2]), torch.tensor([0, 5, 4]))
    layer0 = tables.select([a, b], layers=[0])  # overlaps `some` in two heads; the others are empty
    reserve(pool, tables, layer0)
    pool.check_invariants(tables)
    release(pool, tables, some)
    release(pool, tables, layer0)
    assert pool.free_pages() == pool.num_pages and (tables.counts == 0).all()
    pool.check_invariants(tables)


def test_reserve_low_page_only_where_demotion_is_possible():
    pool, tables = make(slots=1, layers=1, heads=3)
    heads = tables.select([tables.acquire_slot()])
    allocate(pool, tables, heads, 4)
    trim(pool, tables, heads, torch.tensor([2, 3, 4]), torch.tensor([0, 0, 0]))
    # n_high 2 < recent 3: no demotable token, so no low page; n_high 4 also fills its high page
    assert reserve_demand(tables, heads).tolist() == [[0, 0], [0, 1], [1, 1]]
    assert reserve_demand(tables, heads, torch.tensor([True, False, False])).tolist() == [[0, 1], [0, 0], [1, 0]]
    pool1, single = make(slots=1, layers=1, heads=1, two_tier=False)
    h1 = single.select([single.acquire_slot()])
    allocate(pool1, single, h1, 4)
    assert reserve_demand(single, h1).tolist() == [[1, 0]]
    with pytest.raises(ValueError, match="may_demote"):
        reserve(pool, tables, heads, torch.ones(2, dtype=torch.bool))


@pytest.mark.parametrize("op", ["allocate", "reserve", "reserve-cpu"])
def test_pool_exhausted_leaves_state_bit_identical(op):
    if op == "reserve-cpu" and "cpu" not in CPU_BACKENDS:
        pytest.skip("the C ring operations did not build here")
    pool, tables = make(num_pages=10, slots=2, layers=1, heads=2)
    first = tables.select([tables.acquire_slot()])
    allocate(pool, tables, first, 8)  # 2 heads x 3 pages
    second = tables.select([tables.acquire_slot()])
    if op.startswith("reserve"):
        allocate(pool, tables, second, 4)  # 2 x 2 pages: 0 left
        tables.num_tokens[..., 0] = tables.num_pages[..., 0] * N_HI  # every tier full: 4 high + 4 low pages
        call = lambda: reserve(pool, tables, tables.select([0, 1]), backend=op[8:] or "torch")  # noqa: E731
        needed = 8
    else:
        call = lambda: allocate(pool, tables, second, 9)  # noqa: E731
        needed = 8
    before = state(pool, tables)
    with pytest.raises(PoolExhausted) as err:
        call()
    assert (err.value.needed, err.value.free) == (needed, pool.num_pages - 6 - 4 * op.startswith("reserve"))
    assert "release or preempt" in str(err.value)
    assert_same(before, state(pool, tables))
    pool.check_invariants(tables)


def test_unsynced_refusal_changes_nothing_but_the_refused_count():
    pool, tables = make(num_pages=8, slots=1, layers=1, heads=4)
    heads = tables.select([tables.acquire_slot()])
    allocate(pool, tables, heads, 4)
    tables.num_tokens[:] = 8
    before, reads = state(pool, tables, scratch=False), pool.host_reads
    result = reserve(pool, tables, heads, sync=False)
    assert pool.host_reads == reads and int(result.pages) == 0
    assert_same(before, state(pool, tables, scratch=False), skip=("state",))
    assert pool.status() == {**dict(zip(("start", "free"), before["state"][:2].tolist(), strict=True)), "refused": 1}


def test_errors_are_clear():
    pool, tables = make()
    slot = tables.acquire_slot()
    heads = tables.select([slot])
    allocate(pool, tables, heads, 5)
    before = state(pool, tables)
    with pytest.raises(ValueError, match="already hold pages"):
        allocate(pool, tables, heads, 5)
    with pytest.raises(ValueError, match="trim only right after allocate"):
        trim(pool, tables, heads, torch.full((4,), 30), torch.zeros(4))
    assert_same(before, state(pool, tables))
    trim(pool, tables, heads, torch.full((4,), 3), torch.full((4,), 2))
    with pytest.raises(ValueError, match="already trimmed"):
        trim(pool, tables, heads)
    wide = tables.select([tables.acquire_slot()], layers=[0], heads=[0])
    allocate(pool, tables, wide, 40)  # max_model_len: 11 of the 12 columns
    trim(pool, tables, wide, torch.tensor([40]), torch.tensor([8]))  # 48 tokens: 10 high + 1 low page, both full
    before = state(pool, tables)
    for backend in CPU_BACKENDS:
        with pytest.raises(ValueError, match="max_model_len"):
            reserve(pool, tables, wide, backend=backend)
        assert_same(before, state(pool, tables))
    release(pool, tables, wide)
    tables.retire_slots(wide.slots)
    with pytest.raises(IndexError):
        tables.select([9])
    with pytest.raises(ValueError, match="not active"):
        tables.select([slot + 1])
    with pytest.raises(ValueError, match="twice"):
        tables.select_items(torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([0, 0]))
    with pytest.raises(IndexError, match="head index out of range"):
        tables.select_items(torch.tensor([0]), torch.tensor([0]), torch.tensor([-1]))
    with pytest.raises(TypeError, match="HeadSet"):
        release(pool, tables, heads.items)
    release_slots(pool, tables, [slot])
    with pytest.raises(ValueError, match="not active"):
        release_slots(pool, tables, [slot])
    with pytest.raises(ValueError, match="not active"):
        release(pool, tables, heads)  # a stale head set of a released slot
    assert pool.free_pages() == pool.num_pages
    pool.check_invariants(tables)


class _CountOps(TorchDispatchMode):
    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _op_counts(slots):
    pool, tables = make(num_pages=4096, slots=slots, layers=3, heads=2, max_len=64)
    heads = tables.select([tables.acquire_slot() for _ in range(slots)])
    counts, reads = [], []
    for fn in (lambda: allocate(pool, tables, heads, 20), lambda: trim(pool, tables, heads, 9, 5),
               lambda: reserve(pool, tables, heads, backend="torch"),
               lambda: reserve(pool, tables, heads, sync=False, backend="torch"),
               lambda: release(pool, tables, heads, backend="torch")):
        mode, before = _CountOps(), pool.host_reads
        with mode:
            fn()
        counts.append(mode.count)
        reads.append(pool.host_reads - before)
    return counts, reads


def test_work_is_vectorized_and_reads_are_bounded():
    small, reads = _op_counts(1)
    large, _ = _op_counts(16)  # 16x the heads: the same torch ops, no per-head Python loop
    assert small == large
    assert reads == [1, 1, 1, 0, 1]


def test_sync_and_unsynced_paths_agree():
    results = []
    for sync in (True, False):
        pool, tables = make(num_pages=200, slots=3)
        heads = tables.select([tables.acquire_slot() for _ in range(3)])
        allocate(pool, tables, heads, [7, 19, 30], sync=sync)
        g = torch.Generator().manual_seed(1)
        n_high = torch.randint(0, 8, (len(heads),), generator=g)
        trim(pool, tables, heads, n_high, torch.randint(0, 7, (len(heads),), generator=g), sync=sync)
        tables.num_tokens[..., 0] = tables.num_pages[..., 0] * N_HI
        reserve(pool, tables, heads, sync=sync)
        release(pool, tables, tables.select([1]), sync=sync)
        results.append(state(pool, tables, scratch=False))
        pool.check_invariants(tables)
    assert_same(*results)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_benchmark_runs_and_checks_itself(capsys, backend):
    from diffkv.bench import memory as bench

    threads = torch.get_num_threads()
    assert bench.main(["--sizes", "3x2x2", "2x1x3", "--quick", "--prompt-len", "80", "--ring-backend", backend,
                       "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert torch.get_num_threads() == threads and out["command"].endswith("--json")
    assert [r["heads"] for r in out["runs"]] == [12, 6] and set(out["speedup"]) == {"3x2x2", "2x1x3"}
    run = out["runs"][0]
    assert run["iters"] == 5 and run["ops"] == list(bench.OPS) and run["speedup"] > 0
    assert run["host_syncs_per_op"]["reserve_nosync"] == 0 and run["host_syncs_per_op"]["release"] == 1
    assert set(run["speedup_best"]) >= {"reserve+release", "reserve_nosync+release"}
    if backend == "cpu":  # one compiled call each: no torch op dispatched
        assert run["per_op"]["reserve"]["torch_ops"] == run["per_op"]["release"]["torch_ops"] == 0
    with pytest.raises(SystemExit):
        bench.main(["--slots", "3"])  # --layers and --kv-heads missing


needs_c = pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C ring operations did not build here")


@needs_c
@pytest.mark.parametrize("sync", [True, False])
def test_c_backend_matches_torch_on_many_heads(sync):
    """Thousands of heads with random splits and fills: the compiled pass leaves every tensor as torch does."""
    results = []
    for backend in ("torch", "cpu"):
        pool, tables = make(num_pages=6000, slots=16, layers=6, heads=8, max_len=40)
        g = torch.Generator().manual_seed(7)
        heads = tables.select([tables.acquire_slot() for _ in range(16)])
        allocate(pool, tables, heads, torch.randint(1, 30, (16,), generator=g).tolist())
        length = tables.tokens_flat[heads.items, 0]
        n_high = (torch.rand(len(heads), generator=g) * length).long()
        trim(pool, tables, heads, n_high, (length - n_high) // 2)
        for _ in range(3):
            cap = tables.pages_flat[heads.items] * tables.tokens_per_page
            fill = (torch.rand(len(heads), 1, generator=g) < 0.5).int()
            tables.tokens_flat[heads.items] = torch.maximum(tables.tokens_flat[heads.items], cap * fill)
            may = torch.rand(len(heads), generator=g) < 0.7
            reserve(pool, tables, heads, may, sync=sync, backend=backend)
        some = tables.select([3, 0, 11], layers=[5, 1], heads=[7, 2, 0])
        release(pool, tables, some, sync=sync, backend=backend)
        release(pool, tables, tables.select([1, 2]), sync=sync, backend=backend)
        pool.check_invariants(tables)
        results.append(state(pool, tables, scratch=False))
    assert_same(*results)


@needs_c
def test_c_backend_refuses_corrupt_tables_and_unknown_backends():
    pool, tables = make()
    heads = tables.select([tables.acquire_slot()])
    allocate(pool, tables, heads, 9)
    tables.table[0, 0, 1, 0] = pool.num_pages  # a page id past the pool: nothing may be written
    before = state(pool, tables)
    with pytest.raises(ValueError, match="invalid page id"):
        release(pool, tables, heads, backend="cpu")
    assert_same(before, state(pool, tables))
    with pytest.raises(ValueError, match="backend must be one of"):
        reserve(pool, tables, heads, backend="cuda")
    assert alloc.resolve_backend("auto", pool) == "cpu" == alloc.resolve_backend("c", pool)  # "c": the old name


def test_c_backend_build_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFKV_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with pytest.raises(ring_cpu.CompileError, match="failed"):
        ring_cpu.library.__wrapped__()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(ring_cpu.CompileError, match="cannot run the C compiler"):
        ring_cpu.library.__wrapped__()


class MemoryMachine(RuleBasedStateMachine):
    """Random allocate / trim / decode fills / reserve / release over many slots, mirrored on the Python baseline."""

    @initialize(two_tier=st.booleans(), num_pages=st.integers(10, 120))
    def setup(self, two_tier, num_pages):
        self.pool, self.tables = make(num_pages=num_pages, slots=4, layers=2, heads=2, max_len=40, two_tier=two_tier)
        self.base = PerHeadManager(num_pages, self.tables.num_items, (N_HI, N_LO), two_tier, RECENT, self.tables.width)
        self.phase = {}

    def _heads(self, data, phases, min_size=1):
        slots = sorted(s for s, p in self.phase.items() if p in phases)
        if len(slots) < min_size:
            return None
        pick = data.draw(st.lists(st.sampled_from(slots), min_size=min_size, unique=True)) if slots else []
        layers = data.draw(st.sampled_from([None, [0], [1]]))
        return self.tables.select(pick, layers=layers)

    def _atomic(self, call_ours, call_base, sync=True):
        """Run both; if the baseline refuses (out of pages, or a head past the tables' width: decode steps can
        fill a head beyond max_model_len here), ours must refuse alike and change nothing."""
        before = state(self.pool, self.tables, scratch=sync)
        try:
            expected = call_base()
        except (PoolExhausted, ValueError) as refusal:
            if sync:
                with pytest.raises(type(refusal)):
                    call_ours()
            else:
                assert int(call_ours().pages) == 0
                before["state"][2] += 1  # the refusal is counted
            assert_same(before, state(self.pool, self.tables, scratch=sync))
            return None
        result = call_ours()
        assert int(result.pages) == expected
        return result

    @rule(length=st.integers(0, 24), sync=st.booleans())
    def admit(self, length, sync):
        if len(self.phase) == self.tables.shape[0]:
            return
        slot = self.tables.acquire_slot()
        heads = self.tables.select([slot])
        items = heads.items.tolist()
        if self._atomic(lambda: allocate(self.pool, self.tables, heads, length, sync=sync),
                        lambda: self.base.allocate(items, [length] * len(items)), sync) is None:
            self.tables.retire_slots([slot])
        else:
            self.phase[slot] = "allocated"

    @rule(data=st.data())
    def prefill_split(self, data):
        heads = self._heads(data, {"allocated"})
        if heads is None:
            return
        length = self.tables.tokens_flat[heads.items, 0]
        n_high = (torch.tensor(data.draw(st.lists(st.floats(0, 1), min_size=len(heads), max_size=len(heads))))
                  * length).long()
        n_low = (length - n_high) // 2 if self.tables.two_tier else torch.zeros_like(n_high)
        sync = data.draw(st.booleans())
        self._atomic(lambda: trim(self.pool, self.tables, heads, n_high, n_low, sync=sync),
                     lambda: self.base.trim(heads.items.tolist(), n_high.tolist(), n_low.tolist()))
        for s in heads.slots:
            self.phase[s] = "trimmed"  # a one-layer trim leaves the other layer untrimmable: mark the slot done

    @rule(data=st.data())
    def decode_step(self, data):
        """Decoding filled some pages (counts only grow), then the next step reserves."""
        heads = self._heads(data, {"trimmed"})
        if heads is None:
            return
        cap = self.tables.pages_flat[heads.items] * self.tables.tokens_per_page
        tok = self.tables.tokens_flat[heads.items]
        new = torch.maximum(tok, (cap * data.draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))).int())
        self.tables.tokens_flat[heads.items] = new
        for k, (h, lo) in zip(heads.items.tolist(), new.tolist(), strict=True):
            self.base.n_hi[k], self.base.n_lo[k] = h, lo
        may = data.draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=len(heads), max_size=len(heads))))
        sync, backend = data.draw(st.booleans()), data.draw(st.sampled_from(CPU_BACKENDS))
        may_t = None if may is None else torch.tensor(may, dtype=torch.bool)
        self._atomic(lambda: reserve(self.pool, self.tables, heads, may_t, sync=sync, backend=backend),
                     lambda: self.base.reserve(heads.items.tolist(), may), sync)

    @rule(data=st.data())
    def finish(self, data):
        slots = sorted(self.phase)
        if not slots:
            return
        pick = data.draw(st.lists(st.sampled_from(slots), min_size=1, unique=True))
        items = self.tables.select(pick).items.tolist()
        result = release_slots(self.pool, self.tables, pick, sync=data.draw(st.booleans()),
                               backend=data.draw(st.sampled_from(CPU_BACKENDS)))
        assert int(result.pages) == self.base.release(items)
        for s in pick:
            del self.phase[s]

    @invariant()
    def conserved(self):
        if hasattr(self, "pool"):
            self.pool.check_invariants(self.tables)
            assert self.base.same_as(self.pool, self.tables)
            assert self.pool.free_pages() == len(self.base.free)

    def teardown(self):
        if hasattr(self, "pool") and self.phase:
            release_slots(self.pool, self.tables, sorted(self.phase))
            assert self.pool.free_pages() == self.pool.num_pages
            self.pool.check_invariants(self.tables)


MemoryMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestMemoryMachine = MemoryMachine.TestCase


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grow_keeps_owned_pages_and_frees_the_new_ones(backend):
    pool, tables = make(num_pages=12)
    heads = tables.select([tables.acquire_slot()])
    allocate(pool, tables, heads, 5)  # 8 heads x 1 page + low page each: some pages taken, the ring wrapped once
    release(pool, tables, heads, backend=backend)
    heads = tables.select([tables.acquire_slot()])
    allocate(pool, tables, heads, 3, pages=torch.ones(len(heads), dtype=torch.int64))  # exact: 3 tokens, 1 page
    pool.data.view(-1)[:] = torch.arange(pool.data.numel()).to(torch.uint8)
    before, owned = pool.data.clone(), tables.rows[heads.items, 0].tolist()
    free = pool.free_pages()
    pool.grow(20)
    assert pool.num_pages == 20 and pool.free_pages() == free + 8 and tuple(pool.data.shape) == (20, 32)
    assert torch.equal(pool.data[:12], before) and tables.rows[heads.items, 0].tolist() == owned
    pool.check_invariants(tables)
    reserve(pool, tables, heads, backend=backend)  # the ring still hands out pages in order, the new ones last
    release(pool, tables, heads, backend=backend)
    pool.check_invariants(tables)
    assert pool.free_pages() == 20
    with pytest.raises(ValueError, match="grow needs"):
        pool.grow(20)


def test_take_and_give_pages_for_an_owner_outside_the_tables():
    """take_pages / give_pages (the engine's sliding-window blocks): pages leave from ``start`` with refcount 1 and
    come back after the tail with refcount 0; a refused or malformed call changes nothing."""
    pool, tables = make(num_pages=10)
    heads = tables.select([tables.acquire_slot()], layers=[0])
    allocate(pool, tables, heads, 3)  # 2 heads x 2 pages: the ring's start moves to 4
    reads = pool.host_reads
    ids = pool.take_pages(3)
    assert ids.dtype == torch.int64 and ids.tolist() == [4, 5, 6] and pool.host_reads == reads + 1
    assert pool.refcount[ids].tolist() == [1, 1, 1] and pool.free_pages() == 3
    assert pool.take_pages(0).numel() == 0
    before = state(pool, tables)
    with pytest.raises(PoolExhausted, match="sliding"):
        pool.take_pages(4, op="allocate (sliding window)")
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="non-negative int"):
            pool.take_pages(bad)
    for bad in (ids.float(), ids.view(1, 3), torch.ones(11, dtype=torch.int64)):
        with pytest.raises(ValueError, match="give_pages"):
            pool.give_pages(bad)
    assert_same(before, state(pool, tables))
    pool.give_pages(ids[[2, 0]].int())  # any order, any integer dtype: written after the tail in that order
    assert pool.free_pages() == 5 and pool.refcount[ids].tolist() == [0, 1, 0]
    assert pool.ring[(pool.start + torch.arange(5)) % 10].tolist()[-2:] == [6, 4]
    pool.give_pages(ids[1:2])
    release(pool, tables, heads)
    pool.check_invariants(tables)
    assert pool.free_pages() == 10
