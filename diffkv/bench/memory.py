"""``diffkv bench memory``: allocate / trim / reserve / release over S*L*H heads, diffkv.memory vs a per-head
Python free-list manager doing the same work (same pages per head, same ring order, checked page for page).

    diffkv bench memory --json                 # 64x30x3 and 256x32x8 heads, default backend (auto)
    diffkv bench memory --ring-backend torch --json   # the torch ops (the reference; --backend is an old alias)
    diffkv bench memory --quick                # 5 timed rounds per mode: a smoke run

Each round runs one request lifetime for all S slots on both managers, op by op (diffkv first, then the
baseline), so every op starts with caches the other manager left cold, as it would after a model step.
Reported: best of N (uncontended cost; these shared CPUs are noisy) and the median, torch ops dispatched and
device->host reads per operation (counted in a separate round), and pages moved, checked equal on both sides.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections import deque

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffkv.bench.common import add_alias, add_output_arguments, progress
from diffkv.core.config import DiffKVConfig
from diffkv.core.layout import plan_for_config
from diffkv.memory import HeadTables, PagePool, PoolExhausted, allocate, release, reserve, trim
from diffkv.memory.alloc import resolve_backend

OPS = ("allocate", "trim", "reserve", "reserve_nosync", "release")


class PerHeadManager:
    """Baseline: a Python deque of free page ids, Python lists of page ids per (slot, layer, head) and tier, Python
    int counts, and a loop over heads in every operation: a vLLM-v0-style free list multiplied by L*H, kept lean
    (ints, not block objects). Each operation is all or nothing, as in diffkv.memory."""

    def __init__(self, num_pages: int, num_items: int, tokens_per_page: tuple[int, int], two_tier: bool,
                 recent_window: int | None, width: int):
        self.free = deque(range(num_pages))
        self.ref = [0] * num_pages
        self.hi: list[list[int]] = [[] for _ in range(num_items)]
        self.lo: list[list[int]] = [[] for _ in range(num_items)]
        self.n_hi, self.n_lo = [0] * num_items, [0] * num_items
        self.per_page, self.two_tier, self.recent, self.width = tokens_per_page, two_tier, recent_window or 0, width

    def allocate(self, items: list[int], lengths: list[int]) -> int:
        n_min, extra = min(self.per_page), int(self.two_tier)
        demand = [-(-length // n_min) + extra for length in lengths]
        if sum(demand) > len(self.free):
            raise PoolExhausted("allocate", sum(demand), len(self.free))
        free, ref = self.free, self.ref
        for k, length, d in zip(items, lengths, demand, strict=True):
            pages = [free.popleft() for _ in range(d)]
            for p in pages:
                ref[p] = 1
            self.hi[k], self.n_hi[k], self.n_lo[k] = pages, length, 0
        return sum(demand)

    def trim(self, items: list[int], n_high: list[int], n_low: list[int]) -> int:
        n_hi, n_lo = self.per_page
        freed = 0
        for k, h, lo in zip(items, n_high, n_low, strict=True):
            kh, kl, pages = -(-h // n_hi), -(-lo // n_lo), self.hi[k]
            for p in pages[kh + kl:]:
                self.free.append(p)
                self.ref[p] = 0
            freed += len(pages) - kh - kl
            self.hi[k], self.lo[k], self.n_hi[k], self.n_lo[k] = pages[:kh], pages[kh:kh + kl], h, lo
        return freed

    def reserve(self, items: list[int], may_demote: list[bool] | None = None) -> int:
        n_hi, n_lo = self.per_page
        grow_hi, grow_lo = [], []  # page lists that get one page; all high ones first, as diffkv.memory
        for idx, k in enumerate(items):
            hi, lo = self.hi[k], self.lo[k]
            grow = len(hi) + len(lo)
            if self.n_hi[k] >= len(hi) * n_hi:
                grow_hi.append(hi)
                grow += 1
            if self.two_tier and (may_demote[idx] if may_demote is not None else self.n_hi[k] >= self.recent):
                if self.n_lo[k] >= len(lo) * n_lo:
                    grow_lo.append(lo)
                    grow += 1
            if grow > self.width:
                raise ValueError(f"reserve: a head would need {grow} pages but tables are {self.width} wide")
        need = len(grow_hi) + len(grow_lo)
        if need > len(self.free):  # all or nothing, as diffkv.memory
            raise PoolExhausted("reserve", need, len(self.free))
        free, ref = self.free, self.ref
        for pages in grow_hi + grow_lo:
            p = free.popleft()
            ref[p] = 1
            pages.append(p)
        return need

    def release(self, items: list[int]) -> int:
        free, ref, freed = self.free, self.ref, 0
        for k in items:
            hi, lo = self.hi[k], self.lo[k]
            free.extend(hi)
            free.extend(reversed(lo))  # column order: low page j sits in column T-1-j
            for p in hi:
                ref[p] = 0
            for p in lo:
                ref[p] = 0
            freed += len(hi) + len(lo)
            self.hi[k], self.lo[k], self.n_hi[k], self.n_lo[k] = [], [], 0, 0
        return freed

    def same_as(self, pool: PagePool, tables: HeadTables) -> bool:
        """Page-for-page equality with a diffkv pool and tables (slow; for checks)."""
        start, free, _ = pool.state.tolist()
        ring = pool.ring.tolist()
        if [ring[(start + i) % pool.num_pages] for i in range(free)] != list(self.free):
            return False
        rows, t = tables.rows.tolist(), tables.width
        for k, row in enumerate(rows):
            lo = self.lo[k]
            if row[:len(self.hi[k])] != self.hi[k] or [row[t - 1 - j] for j in range(len(lo))] != lo:
                return False
        if tables.pages_flat.tolist() != [[len(h), len(lo)] for h, lo in zip(self.hi, self.lo, strict=True)]:
            return False
        tokens = [[h, lo] for h, lo in zip(self.n_hi, self.n_lo, strict=True)]
        return tables.tokens_flat.tolist() == tokens and pool.refcount.tolist() == self.ref


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _timed(fn, device: torch.device):
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


SIZES = ((64, 30, 3), (256, 32, 8))  # S x L x H: smollm2-135m's 30 x 3 heads, Llama-3-8B's 32 x 8


def _size(text: str) -> tuple[int, int, int]:
    try:
        s, ly, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is SxLxH, e.g. 64x30x3, got {text!r}") from None
    if min(s, ly, h) < 1:
        raise argparse.ArgumentTypeError(f"S, L and H must be >= 1, got {text!r}")
    return s, ly, h


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=_size, nargs="+", default=list(SIZES), metavar="SxLxH",
                        help="requests x layers x KV heads, one run each (default: 64x30x3 256x32x8)")
    parser.add_argument("--slots", type=int, help="one size only: requests (S), with --layers and --kv-heads")
    parser.add_argument("--layers", type=int, help="one size only: layers (L)")
    parser.add_argument("--kv-heads", type=int, help="one size only: KV heads per layer (H)")
    parser.add_argument("--quick", action="store_true", help="5 timed rounds per mode instead of --iters (smoke run)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512, help="longest prompt; prompts are drawn in [P/2, P]")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=30,
                        help="timed rounds per reserve mode (synced / unsynced), each after one warm-up round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ring-backend", default="auto", choices=("auto", "torch", "cpu", "triton", "c"),
                        help="cpu: the compiled CPU pass (diffkv/memory/ring_cpu.c; c: its old name); auto: triton on "
                             "CUDA, cpu on CPU")
    add_alias(parser, "--backend", "ring_backend", type=str, choices=("auto", "torch", "cpu", "triton", "c"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: on a shared 2-core machine OpenMP barriers stall under load)")
    parser.add_argument("--seed", type=int, default=0)
    add_output_arguments(parser)


def _round(base, tables, pool, rng, lengths_max, sync_reserve, backend, times, counts=None, check=False):
    """One request lifetime for S slots on both managers: allocate, trim, (decode fills pages), reserve, release."""
    s, dev = tables.shape[0], pool.device
    slots = [tables.acquire_slot() for _ in range(s)]
    heads = tables.select(slots)
    items, k = heads.items.tolist(), len(heads)
    per_slot = torch.randint(lengths_max // 2, lengths_max + 1, (s,), generator=rng)
    lengths = per_slot[heads.slot_index.cpu()]
    rw = tables.recent_window or 0
    n_high = lengths.clamp(max=rw) + (torch.rand(k, generator=rng) * (lengths - rw).clamp(min=0)).long()
    n_low = (torch.rand(k, generator=rng) * (lengths - n_high)).long()
    fill = torch.rand(k, generator=rng) < 0.5  # half of the heads filled their last high page while decoding
    steps = [
        ("allocate", lambda: allocate(pool, tables, heads, per_slot.tolist()),
         lambda: base.allocate(items, lengths.tolist())),
        ("trim", lambda: trim(pool, tables, heads, n_high.to(dev), n_low.to(dev)),
         lambda: base.trim(items, n_high.tolist(), n_low.tolist())),
        ("reserve" if sync_reserve else "reserve_nosync",
         lambda: reserve(pool, tables, heads, sync=sync_reserve, backend=backend), lambda: base.reserve(items)),
        # both sides get their head lists ready-made (an engine keeps a request's HeadSet), as for reserve
        ("release", lambda: release(pool, tables, heads, backend=backend), lambda: base.release(items)),
    ]
    for name, fn_ours, fn_base in steps:
        if name.startswith("reserve"):  # decode filled some high pages: the same token counts on both sides
            tok = tables.tokens_flat[heads.items]
            full = tables.pages_flat[heads.items][:, 0] * tables.tokens_per_page[0]
            tok[:, 0] = torch.where(fill.to(dev), full, tok[:, 0])
            tables.tokens_flat[heads.items] = tok
            for kk, v in zip(items, tok[:, 0].tolist(), strict=True):
                base.n_hi[kk] = v
        reads, counter = pool.host_reads, _CountOps()
        if counts is None:
            res, dt = _timed(fn_ours, dev)
            times["diffkv"][name].append(dt)
        else:
            with counter:
                res = fn_ours()
        res_base, dt = _timed(fn_base, torch.device("cpu"))
        times["python"][name].append(dt)
        pages = res.pages if isinstance(res.pages, int) else int(res.pages)
        if pages != res_base:
            raise RuntimeError(f"{name}: diffkv moved {pages} pages, the baseline {res_base}")
        if check and not base.same_as(pool, tables):
            raise RuntimeError(f"{name}: diffkv and the baseline disagree page for page")
        if counts is not None:
            counts[name] = {"torch_ops": counter.count, "host_reads": pool.host_reads - reads, "pages": pages}
    tables.retire_slots(slots)


def _speedups(ms: dict) -> dict:
    out = {op: ms["python"][op] / ms["diffkv"][op] for op in OPS}
    for tag, r in (("reserve+release", "reserve"), ("reserve_nosync+release", "reserve_nosync")):
        out[tag] = (ms["python"][r] + ms["python"]["release"]) / (ms["diffkv"][r] + ms["diffkv"]["release"])
    return {k: float(f"{v:.3g}") for k, v in out.items()}  # 3 significant digits: a slow run is not "0.0x"


def run(args) -> int:
    """Run the benchmark for parsed ``args`` (see :func:`add_arguments`); prints a table or JSON, returns 0.

    JSON: ``{"benchmark", "command", "backend", "device", "machine", "date", "speedup": {size: x}, "runs": [...]}``,
    one run per size with ``speedup`` (median reserve + release, baseline / ours), ``heads``, ``ops`` and
    ``host_syncs_per_op`` among its keys.
    """
    one = (args.slots, args.layers, args.kv_heads)
    if any(v is not None for v in one):
        if any(v is None or v < 1 for v in one):
            raise SystemExit("--slots, --layers and --kv-heads go together (all >= 1); or use --sizes")
        args.sizes = [one]
    if args.quick:
        args.iters = 5
    threads = torch.get_num_threads()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        runs = [_measure(args, *size) for size in args.sizes]
    finally:
        torch.set_num_threads(threads)
    result = {
        "benchmark": "memory", "command": getattr(args, "cmdline", None) or " ".join(["diffkv", *sys.argv[1:]]),
        "backend": args.ring_backend, "device": args.device,
        "speedup": {f"{r['slots']}x{r['layers']}x{r['kv_heads']}": r["speedup"] for r in runs},
        "runs": runs,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": args.threads or threads, "torch": torch.__version__,
                    "python": platform.python_version(), "load_avg_1m": round(os.getloadavg()[0], 2)},
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    print(json.dumps(result, indent=2) if args.json else "\n\n".join(_table(r) for r in runs))
    return 0


def _measure(args, slots: int, layers: int, kv_heads: int) -> dict:
    config, dev = DiffKVConfig(), torch.device(args.device)
    plan = plan_for_config(config, args.head_dim)
    tables = HeadTables.for_config(config, plan, slots, layers, kv_heads, args.max_model_len, dev)
    per_head = tables.worst_pages(args.prompt_len) + 2  # and room for the decode steps' pages
    pool = PagePool(plan.page_bytes, num_pages=tables.num_items * per_head, device=dev, allocate_data=False)
    base = PerHeadManager(pool.num_pages, tables.num_items, tables.tokens_per_page_hl, config.two_tier,
                          config.recent_window, tables.width)
    rng = torch.Generator().manual_seed(args.seed)
    times = {m: {op: [] for op in OPS} for m in ("diffkv", "python")}
    counts: dict = {}
    for sync_reserve in (True, False):  # counting rounds, checked page for page against the baseline
        _round(base, tables, pool, rng, args.prompt_len, sync_reserve, args.ring_backend, times, counts, check=True)
    times = {m: {op: [] for op in OPS} for m in ("diffkv", "python")}
    with progress(args, 2 * (args.iters + 1), "round", "timed rounds") as bar:
        for it in range(2 * (args.iters + 1)):  # rounds alternate a synced and an unsynced reserve; 1 warm-up each
            _round(base, tables, pool, rng, args.prompt_len, it % 2 == 0, args.ring_backend, times)
            bar.update()
    if pool.free_pages() != pool.num_pages or len(base.free) != pool.num_pages:
        raise RuntimeError("a manager did not end with every page free")
    best = {m: {op: 1e3 * min(v[1:]) for op, v in d.items()} for m, d in times.items()}
    median = {m: {op: 1e3 * statistics.median(v[1:]) for op, v in d.items()} for m, d in times.items()}
    pages_per_head = round(counts["release"]["pages"] / tables.num_items, 2)
    speedup_median = _speedups(median)
    return {
        "speedup": speedup_median["reserve+release"], "heads": tables.num_items, "ops": list(OPS),
        "host_syncs_per_op": {op: c["host_reads"] for op, c in counts.items()},
        "slots": slots, "layers": layers, "kv_heads": kv_heads,
        "prompt_len": args.prompt_len, "max_model_len": args.max_model_len, "table_width": tables.width,
        "num_pages": pool.num_pages, "page_bytes": plan.page_bytes, "tokens_per_page": list(tables.tokens_per_page_hl),
        "pages_per_head_at_release": pages_per_head, "iters": args.iters, "device": str(dev),
        "backend": args.ring_backend,
        "implementation": resolve_backend(args.ring_backend, pool),  # what "auto" chose
        "speedup_best": _speedups(best), "speedup_median": speedup_median,
        "best_ms": _rounded(best), "median_ms": _rounded(median), "per_op": counts,
    }


def _rounded(d: dict) -> dict:
    return {m: {op: round(v, 3) for op, v in ops.items()} for m, ops in d.items()}


def _table(r: dict) -> str:
    lines = [f"{r['heads']} heads ({r['slots']} x {r['layers']} x {r['kv_heads']}), {r['pages_per_head_at_release']} "
             f"pages per head at release, device {r['device']}, backend {r['implementation']}; "
             f"best of {r['iters']} (median)",
             f"{'op':<16}{'diffkv ms':>18}{'python ms':>18}{'speedup':>16}{'torch ops':>11}{'host reads':>12}"]
    for op in OPS:
        b, m, c = r["best_ms"], r["median_ms"], r["per_op"][op]
        lines.append(f"{op:<16}{b['diffkv'][op]:>9.3f} ({m['diffkv'][op]:>6.3f}){b['python'][op]:>9.3f} "
                     f"({m['python'][op]:>6.3f}){r['speedup_best'][op]:>8.1f}x ({r['speedup_median'][op]:>4.1f}x)"
                     f"{c['torch_ops']:>11}{c['host_reads']:>12}")
    for tag in ("reserve+release", "reserve_nosync+release"):
        lines.append(f"{tag}: {r['speedup_best'][tag]}x best of {r['iters']}, {r['speedup_median'][tag]}x median")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diffkv.bench.memory", description=__doc__.splitlines()[0])
    add_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.cmdline = " ".join(["python -m diffkv.bench.memory", *argv])
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
