"""Decode attention benchmark: the paged Triton kernels ("streams", the new one, and "split", the old one) vs SDPA
over a dense fp16 K/V cache of the same tokens.

    python benchmarks/gpu/bench_decode.py --out "$OUT"                  # the H200 session (benchmarks/gpu/session.sh)
    python benchmarks/gpu/bench_decode.py --device cpu --shapes smollm2 --contexts 96 --batches 1 --reps 1 \
        --rounds 1 --copy-mib 4 --sweep smollm2/96/1 --warps 1 2     # CPU smoke (TRITON_INTERPRET=1)

Per (shape, context, batch): every head retains ``context`` tokens, ``--high-frac`` of them in the high tier
(K8V4) and the rest in the low tier (K4V2), pages filled with random codes and valid fp16 scales/zeros. Per kernel:

* ``<kernel>_ms``: device time per call, from the replay of a CUDA graph holding ``--reps`` calls (``timing`` says
  "graph", or "events" where capture failed: CUDA events around back-to-back calls). The call gets ``widths`` and
  a preallocated ``workspace`` (``diffkv.ops.decode_plan``), so it makes no host sync and no allocation;
* ``<kernel>_host_us``: host time per call (Python + launches), each call timed alone without waiting for the
  device. Device-bound when ``_ms * 1000`` exceeds it, else host-bound (eager decode pays the larger of the two);
* ``<kernel>_GBps``: the bytes the kernel must read (compressed K/V codes + scale/zero of the retained tokens,
  ``kv_bytes``) / device time; ``_pct_of_copy`` against the device-to-device copy bandwidth measured in the same
  run ((read + write bytes) / time of ``dst.copy_(src)``); ``_x_sdpa``: SDPA's device time / the kernel's.

``streams_scores_ms`` adds the score update (``update_scores=True``); ``--sweep`` cases add ``streams_w<N>_ms`` for
the warps of ``--warps``. SDPA (``sdpa_fp16_ms``, ``_host_us``, ``_GBps``) reads dense fp16 K/V
(``dense_fp16_bytes``). Writes ``decode_attention.json`` (rows keep the form of the 2026-12-04 runs: ``shape``,
``context``, ``batch``, ``sdpa_fp16_ms``, one ``*_ms`` per kernel) and ``decode_attention.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from decode_report import write  # noqa: E402 (beside this file)
from gpu_timing import copy_bandwidth, device_time, host_time  # noqa: E402

# (H_kv, G, head_dim); qwen2.5-0.5b is also the engine step's model (session.sh)
SHAPES = {"smollm2": (3, 3, 64), "llama3-8b": (8, 4, 128), "qwen2.5-0.5b": (2, 7, 64)}
KERNELS = ("streams", "split")


def build(h_kv: int, d: int, ctx: int, batch: int, high_frac: float, device: torch.device, seed: int = 0):
    """Pages, tables and layouts of ``batch * h_kv`` heads holding ``ctx`` tokens each (random but valid)."""
    from diffkv.core.config import DiffKVConfig
    from diffkv.core.layout import plan_for_config
    from diffkv.memory import HeadTables

    gen = torch.Generator(device=device).manual_seed(seed)
    cfg = DiffKVConfig(high="K8V4", low="K4V2")
    plan = plan_for_config(cfg, d)
    hi, lo = plan.layout(cfg.high), plan.layout(cfg.low)
    n_hi = round(ctx * high_frac)
    n_lo = ctx - n_hi
    p_hi, p_lo = -(-n_hi // hi.tokens_per_page), -(-n_lo // lo.tokens_per_page)
    k = batch * h_kv
    tables = HeadTables(batch, 1, h_kv, (hi.tokens_per_page, lo.tokens_per_page), ctx + 1, device=device)
    pool = torch.randint(0, 256, (k * (p_hi + p_lo), plan.page_bytes), dtype=torch.uint8, device=device,
                         generator=gen)
    for lay in (hi, lo):  # valid metadata: scale in [0.01, 0.03), zero in [-1, 0); fp32 scores 0
        for off, groups in ((lay.key_meta_offset, lay.key_groups), (lay.value_meta_offset, lay.value_groups)):
            meta = pool[:, off:off + lay.tokens_per_page * groups * 4].view(torch.float16).view(len(pool), -1, 2)
            meta[..., 0] = (torch.rand(meta.shape[:2], generator=gen, device=device) * 0.02 + 0.01).half()
            meta[..., 1] = (-torch.rand(meta.shape[:2], generator=gen, device=device)).half()
        pool[:, lay.score_offset:lay.score_offset + 4 * lay.tokens_per_page] = 0
    ids = torch.randperm(len(pool), device=device, generator=gen).int().view(k, p_hi + p_lo)
    rows = tables.rows
    rows[:k, :p_hi] = ids[:, :p_hi]
    if p_lo:
        rows[:k, tables.width - p_lo:] = ids[:, p_hi:].flip(1)
    tables.tokens_flat[:k] = torch.tensor([n_hi, n_lo], dtype=torch.int32, device=device)
    items = torch.arange(k, device=device)
    # bytes read per token and tier: K and V codes + (scale, zero) per metadata group
    kv_bytes = k * sum(n * (lay.key_row_bytes + lay.value_row_bytes + 2 * lay.meta_bytes * (lay.key_groups +
                                                                                            lay.value_groups))
                       for n, lay in ((n_hi, hi), (n_lo, lo)))
    widths = (p_hi * hi.tokens_per_page, p_lo * lo.tokens_per_page)  # host-known, as a decode plan's bounds
    return pool, tables, items, (hi, lo), (n_hi, n_lo), kv_bytes, widths


def _time(row: dict, label: str, fn, device, args, nbytes: int | None = None, host: bool = True) -> None:
    """Adds ``<label>_ms`` (device), ``_host_us`` and, with ``nbytes``, ``_GBps`` to ``row``; a call that raises
    adds ``<label>_error`` instead (the other measurements go on)."""
    try:
        t, row["timing"][label] = device_time(fn, device, args.reps, args.rounds)
        row[f"{label}_ms"] = t * 1e3
        if nbytes is not None:
            row[f"{label}_GBps"] = nbytes / t / 1e9
        if host:
            row[f"{label}_host_us"] = host_time(fn, device, args.host_calls) * 1e6
    except Exception as err:  # noqa: BLE001 - recorded in the row and printed
        row[f"{label}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(f"error: {row['shape']} {row['context']} x {row['batch']} {label}: {row[f'{label}_error']}", flush=True)


def run_case(name: str, ctx: int, batch: int, args, device: torch.device, copy_gbps: float) -> dict:
    from diffkv.ops.decode_plan import DecodeWorkspace
    from diffkv.ops.paged_attention import paged_decode_attention

    h_kv, g, d = SHAPES[name]
    pool, tables, items, layouts, (n_hi, n_lo), kv_bytes, widths = build(h_kv, d, ctx, batch, args.high_frac,
                                                                         device)
    k = items.numel()
    nh = torch.full((k,), n_hi, dtype=torch.int32, device=device)
    nl = torch.full((k,), n_lo, dtype=torch.int32, device=device)
    q = torch.randn(batch, h_kv * g, d, device=device, dtype=torch.float16)
    row = {"shape": name, "H_kv": h_kv, "G": g, "head_dim": d, "context": ctx, "batch": batch,
           "n_high": n_hi, "n_low": n_lo, "kv_bytes": kv_bytes, "dense_fp16_bytes": 4 * k * ctx * d, "timing": {}}

    def call(kernel: str, warps=None, **kw):
        ws = DecodeWorkspace(device)  # one per timed call: a graph keeps the buffers it captured
        return lambda: paged_decode_attention(q, pool, tables, items, nh, nl, layouts, d ** -0.5, backend="triton",
                                              kernel=kernel, num_warps=warps, widths=widths, workspace=ws,
                                              return_gain=False, **kw)

    for kernel in args.kernels:
        _time(row, kernel, call(kernel), device, args, kv_bytes)
    if {"streams", "split"} <= set(args.kernels):  # the kernels agree (streams: inline PTX, fp16 probabilities)
        try:
            a, b = call("streams")()[0].float(), call("split")()[0].float()
            row["streams_vs_split_rel_err"] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        except Exception as err:  # noqa: BLE001 - recorded in the row
            row["streams_vs_split_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    if "streams" in args.kernels and not args.no_scores:
        _time(row, "streams_scores", call("streams", update_scores=True), device, args, kv_bytes, host=False)
    if f"{name}/{ctx}/{batch}" in args.sweep:
        for w in args.warps:
            _time(row, f"streams_w{w}", call("streams", w), device, args, kv_bytes, host=False)
        os.environ["DIFFKV_STREAMS_PTX"] = "0"  # the same kernel with the codes unpacked in Triton ops
        try:
            _time(row, "streams_noptx", call("streams"), device, args, kv_bytes, host=False)
        finally:
            del os.environ["DIFFKV_STREAMS_PTX"]
    if args.ref:  # the torch reference (dequantizes to dense fp32: slow, large)
        _time(row, "torch_ref", lambda: paged_decode_attention(q, pool, tables, items, nh, nl, layouts, d ** -0.5,
                                                               backend="torch"), device, args, host=False)
    pool = None  # noqa: F841 (frees the pages before the dense cache is made)
    kd = torch.randn(batch, h_kv, ctx, d, device=device, dtype=torch.float16)
    vd = torch.randn_like(kd)
    q4 = q.unsqueeze(2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    _time(row, "sdpa_fp16", lambda: sdpa(q4, kd, vd, enable_gqa=True), device, args, row["dense_fp16_bytes"])
    for kernel in args.kernels:
        if f"{kernel}_ms" in row:
            row[f"{kernel}_pct_of_copy"] = 100 * row[f"{kernel}_GBps"] / copy_gbps
            if "sdpa_fp16_ms" in row:
                row[f"{kernel}_x_sdpa"] = row["sdpa_fp16_ms"] / row[f"{kernel}_ms"]
    return row


def print_env(device: torch.device) -> None:
    import importlib.util

    import triton

    print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}")
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        print(f"device: {prop.name}, {prop.multi_processor_count} SMs, {prop.total_memory >> 20} MiB")
    print("importable: " + ", ".join(f"{m} {importlib.util.find_spec(m) is not None}"
                                     for m in ("pytest", "pytest_timeout", "xdist", "transformers")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for decode_attention.json / .md")
    p.add_argument("--device", default="cuda")
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 8192])  # the targets' cases first
    p.add_argument("--batches", type=int, nargs="+", default=[32, 1])
    p.add_argument("--shapes", nargs="+", default=["llama3-8b", "qwen2.5-0.5b"], choices=list(SHAPES))
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--high-frac", type=float, default=0.4, help="fraction of retained tokens in the high tier")
    p.add_argument("--reps", type=int, default=20, help="calls per CUDA graph (device time)")
    p.add_argument("--rounds", type=int, default=5, help="timed graph replays; the median is reported")
    p.add_argument("--host-calls", type=int, default=20, help="calls timed alone for the host time per call")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--env", action="store_true", help="print versions, the device and the copy bandwidth; exit")
    p.add_argument("--sweep", nargs="*", default=["llama3-8b/32768/32"], help="shape/context/batch cases that "
                   "also time the streams kernel at each of --warps")
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--no-scores", action="store_true", help="skip streams_scores_ms (score update)")
    p.add_argument("--ref", action="store_true", help="also time the torch reference (torch_ref_ms)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.env:
        print_env(device)
    copy_gbps = copy_bandwidth(device, args.copy_mib << 20, 10)
    print(f"copy bandwidth (device to device, read + write bytes, {args.copy_mib} MiB): {copy_gbps:.0f} GB/s",
          flush=True)
    if args.env:
        return 0
    from diffkv.ops.paged_attention_streams import STREAMS_WARPS

    rows = []
    for name in args.shapes:
        for ctx in args.contexts:
            for batch in args.batches:
                rows.append(run_case(name, ctx, batch, args, device, copy_gbps))
                print(json.dumps(rows[-1]), flush=True)
                write(args.out, rows, device, copy_gbps, args, STREAMS_WARPS)  # each case: a cut run keeps the rest
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print(write(args.out, rows, device, copy_gbps, args, STREAMS_WARPS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
