"""Decode attention benchmark: the Triton paged kernel vs the torch reference vs SDPA over dense fp16 K/V.

    python benchmarks/gpu/bench_decode.py --out "$OUT"                     # H200 defaults (see gpu_check.sh)
    python benchmarks/gpu/bench_decode.py --device cpu --contexts 96 --batches 1 --shapes smollm2 --iters 1  # smoke

Per (shape, context, batch): every head retains ``context`` tokens, ``--high-frac`` of them in the high tier
(K8V4) and the rest in the low tier (K4V2), pages filled with random codes and valid fp16 scales/zeros. Reported:
median time, achieved GB/s of the bytes the kernel must read (compressed K/V codes + metadata of the retained
tokens; ``total_GBps`` adds queries, outputs, logits scratch and score read-modify-write), the same for SDPA over
dense fp16 K/V of the same tokens, and a device-to-device copy bandwidth measured in the same run
((read + write bytes) / time of ``dst.copy_(src)`` on 1 GiB). Writes ``decode_attention.json`` and ``.md``.
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

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHAPES = {"smollm2": (3, 3, 64), "llama3-8b": (8, 4, 128)}  # (H_kv, G, head_dim)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """Device-to-device copy bandwidth in GB/s, counting read + write bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src), device, iters) / 1e9


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
    kv_bytes = k * sum(n * (lay.key_row_bytes + lay.value_row_bytes + 2 * lay.meta_bytes * (lay.key_groups +
                                                                                            lay.value_groups))
                       for n, lay in ((n_hi, hi), (n_lo, lo)))
    return pool, tables, items, (hi, lo), (n_hi, n_lo), kv_bytes


def run_case(name: str, ctx: int, batch: int, args, device: torch.device, copy_gbps: float) -> dict:
    from diffkv.ops.paged_attention import paged_decode_attention

    h_kv, g, d = SHAPES[name]
    pool, tables, items, layouts, (n_hi, n_lo), kv_bytes = build(h_kv, d, ctx, batch, args.high_frac, device)
    k = items.numel()
    nh = torch.full((k,), n_hi, dtype=torch.int32, device=device)
    nl = torch.full((k,), n_lo, dtype=torch.int32, device=device)
    q = torch.randn(batch, h_kv * g, d, device=device, dtype=torch.float16)
    common = (q, pool, tables, items, nh, nl, layouts, d ** -0.5)
    row = {"shape": name, "H_kv": h_kv, "G": g, "head_dim": d, "context": ctx, "batch": batch,
           "n_high": n_hi, "n_low": n_lo, "kv_bytes": kv_bytes, "dense_fp16_bytes": 4 * k * ctx * d}
    scratch = k * (2 * g * 4 * ctx + 8 * ctx)  # logits written + read, score read + write
    w0 = args.num_warps[0]
    for label, kw in (("kernel", dict(return_gain=False)), ("kernel_scores", dict(update_scores=True,
                                                                                  return_gain=False))):
        t = bench(lambda kw=kw: paged_decode_attention(*common, backend="triton", num_warps=w0, **kw), device,
                  args.iters)
        row[f"{label}_ms"] = t * 1e3
        row[f"{label}_GBps"] = kv_bytes / t / 1e9
        row[f"{label}_total_GBps"] = (kv_bytes + (scratch if label == "kernel_scores" else 0)
                                      + 2 * q.numel() * 4) / t / 1e9
    row["kernel_pct_of_copy"] = 100 * row["kernel_GBps"] / copy_gbps
    for w in args.num_warps[1:]:  # the same kernel with other warps per program (register pressure what-if)
        t = bench(lambda w=w: paged_decode_attention(*common, backend="triton", num_warps=w, return_gain=False),
                  device, args.iters)
        row[f"kernel_w{w}_ms"], row[f"kernel_w{w}_GBps"] = t * 1e3, kv_bytes / t / 1e9
    ref_ok = k * ctx * d * 4 * 6 < args.ref_mem_gb * 1e9  # the reference dequantizes to dense fp32 (several copies)
    if ref_ok and not args.skip_ref:
        t = bench(lambda: paged_decode_attention(*common, backend="torch"), device, max(1, args.iters // 5), 1)
        row["torch_ref_ms"] = t * 1e3
    del pool
    kd = torch.randn(batch, h_kv, ctx, d, device=device, dtype=torch.float16)
    vd = torch.randn_like(kd)
    q4 = q.unsqueeze(2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t = bench(lambda: sdpa(q4, kd, vd, enable_gqa=True), device, args.iters)
    row["sdpa_fp16_ms"] = t * 1e3
    row["sdpa_fp16_GBps"] = row["dense_fp16_bytes"] / t / 1e9
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# Decode attention, {meta['device_name']} ({meta['date']})", "",
           f"Copy bandwidth (d2d, read+write): **{meta['copy_GBps']:.0f} GB/s**. Tokens per head = context "
           f"({meta['high_frac']:.0%} K8V4, rest K4V2). GB/s = compressed K/V bytes read / time.", "",
           "| shape | ctx | batch | kernel ms | GB/s | % copy | +scores ms | torch ref ms | SDPA fp16 ms | SDPA GB/s |"
           " speedup vs SDPA |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = f"{r['torch_ref_ms']:.3f}" if "torch_ref_ms" in r else "—"
        out.append(f"| {r['shape']} | {r['context']} | {r['batch']} | {r['kernel_ms']:.3f} | {r['kernel_GBps']:.0f} | "
                   f"{r['kernel_pct_of_copy']:.0f} % | {r['kernel_scores_ms']:.3f} | {ref} | {r['sdpa_fp16_ms']:.3f} "
                   f"| {r['sdpa_fp16_GBps']:.0f} | {r['sdpa_fp16_ms'] / r['kernel_ms']:.2f}x |")
    extra = sorted({k for r in rows for k in r if k.startswith("kernel_w") and k.endswith("_GBps")})
    for key in extra:
        out += ["", f"{key.removesuffix('_GBps').replace('kernel_', '')} (same kernel, other warps per program):",
                " ".join(f"{r['shape']}/{r['context']}/{r['batch']}: {r[key]:.0f} GB/s" for r in rows)]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for decode_attention.json / .md")
    p.add_argument("--device", default="cuda")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--high-frac", type=float, default=0.4, help="fraction of retained tokens in the high tier")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--ref-mem-gb", type=float, default=40.0, help="skip the torch reference above this estimate")
    p.add_argument("--skip-ref", action="store_true")
    p.add_argument("--num-warps", type=int, nargs="+", default=[4],
                   help="warps per program; the first fills the table, the others add kernel_w<N>_ms columns")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    copy_gbps = copy_bandwidth(device, args.copy_mib << 20, max(args.iters, 3))
    rows = []
    for name in args.shapes:
        for ctx in args.contexts:
            for batch in args.batches:
                rows.append(run_case(name, ctx, batch, args, device, copy_gbps))
                print(json.dumps(rows[-1]), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "torch": torch.__version__, "copy_GBps": copy_gbps, "high_frac": args.high_frac,
            "target": "kernel GB/s >= 60 % of copy GB/s at >= 8k context"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_attention.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "decode_attention.md"), "w") as f:
        f.write(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
