"""The report of ``bench_decode.py``: ``decode_attention.json`` (its rows and a ``meta`` block) and
``decode_attention.md`` (one table row per case, the targets of issue #59 with met / not met, the score-update
times, the warps sweep, and the errors of measurements that raised)."""

from __future__ import annotations

import datetime
import json
import os
import platform

import torch

TARGETS = ("llama3-8b 32k x 32: streams <= 0.47 ms and >= 2x SDPA (>= 1.5x first step); "
           "batch 1 at 32k: <= 40 us device time per layer call (issue #59)")


def verdicts(rows: list[dict]) -> list[str]:
    """One line per target case present in ``rows`` (streams kernel): the number, its target, met or not."""
    out = []
    for r in rows:
        if "streams_ms" not in r or "sdpa_fp16_ms" not in r or r["context"] != 32768:
            continue
        case = f"- {r['shape']} 32k x {r['batch']}:"
        if r["shape"] == "llama3-8b" and r["batch"] == 32:
            x = r["streams_x_sdpa"]
            out.append(f"{case} streams {r['streams_ms']:.3f} ms device time (target <= 0.47 ms: "
                       f"{'met' if r['streams_ms'] <= 0.47 else 'not met'}), {x:.2f}x SDPA (target >= 2x: "
                       f"{'met' if x >= 2 else 'not met'}; first step >= 1.5x: {'met' if x >= 1.5 else 'not met'})")
        if r["batch"] == 1:
            us = r["streams_ms"] * 1e3
            out.append(f"{case} batch-1 device time per layer call: streams {us:.1f} us (target <= 40 us: "
                       f"{'met' if us <= 40 else 'not met'}), SDPA {r['sdpa_fp16_ms'] * 1e3:.1f} us; host time "
                       f"per call: streams {_f(r, 'streams_host_us', '.0f')} us")
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    ks = meta["kernels"]
    out = [f"# Decode attention, {meta['device_name']} ({meta['date']}, commit {meta['commit']})", "",
           f"Copy bandwidth (device to device, read + write): **{meta['copy_GBps']:.0f} GB/s**. Tokens per head = "
           f"context ({meta['high_frac']:.0%} K8V4, rest K4V2). ms = device time per call ({meta['timing']}; "
           "per row: `timing` in the .json); GB/s = compressed K/V bytes read (codes + scale/zero) / device time; "
           "x SDPA = SDPA ms / kernel ms; host us = host time per call (Python + launches, device not awaited).", "",
           f"Targets: {TARGETS}.", *verdicts(rows), "",
           "| shape | ctx | batch | " + " | ".join(f"{k} ms | {k} GB/s | {k} % copy | {k} x SDPA" for k in ks)
           + " | SDPA fp16 ms | SDPA GB/s | host us: " + " / ".join([*ks, "SDPA"]) + " |",
           "|---|---|---|" + "---|" * (4 * len(ks) + 3)]
    for r in rows:
        cells = [f"{_f(r, f'{k}_ms', '.4f')} | {_f(r, f'{k}_GBps', '.0f')} | {_f(r, f'{k}_pct_of_copy', '.0f')} % "
                 f"| {_f(r, f'{k}_x_sdpa', '.2f')}x" for k in ks]
        host = " / ".join(_f(r, f"{k}_host_us", ".0f") for k in [*ks, "sdpa_fp16"])
        out.append(f"| {r['shape']} | {r['context']} | {r['batch']} | " + " | ".join(cells)
                   + f" | {_f(r, 'sdpa_fp16_ms', '.4f')} | {_f(r, 'sdpa_fp16_GBps', '.0f')} | {host} |")
    if any("streams_vs_split_rel_err" in r for r in rows):
        out += ["", "streams vs split kernel output, max |difference| / max |split| (fp16 probabilities: ~1e-3 "
                    "expected; O(1) is a wrong kernel): " + ", ".join(
                        f"{r['shape']}/{r['context']}/{r['batch']}: {r['streams_vs_split_rel_err']:.1e}" for r in rows
                        if "streams_vs_split_rel_err" in r)]
    if any("streams_scores_ms" in r for r in rows):
        out += ["", "streams + score update (`update_scores=True`), device ms: " + ", ".join(
            f"{r['shape']}/{r['context']}/{r['batch']}: {r['streams_scores_ms']:.4f}" for r in rows
            if "streams_scores_ms" in r)]
    for r in rows:
        sweep = sorted((int(key[9:-3]), v) for key, v in r.items() if key.startswith("streams_w") and
                       key.endswith("_ms"))
        if sweep:
            table = meta["streams_warps"]["16-bit"]  # fp16 queries; int keys, or str ones read back from JSON
            default = table.get(r["head_dim"], table.get(str(r["head_dim"]), 4))
            out += ["", f"streams kernel, warps per program, {r['shape']} {r['context']} x {r['batch']} (default "
                        f"{default} at head_dim {r['head_dim']}):", "",
                    "| warps | device ms | GB/s |", "|---|---|---|"]
            out += [f"| {w} | {ms:.4f} | {r[f'streams_w{w}_GBps']:.0f} |" for w, ms in sweep]
            if "streams_noptx_ms" in r:
                out += ["", f"the same case with the codes unpacked in Triton ops, not inline PTX "
                            f"(`DIFFKV_STREAMS_PTX=0`): {r['streams_noptx_ms']:.4f} ms against "
                            f"{_f(r, 'streams_ms', '.4f')}"]
    errors = [f"- {r['shape']} {r['context']} x {r['batch']} {key.removesuffix('_error')}: {v}" for r in rows
              for key, v in r.items() if key.endswith("_error")]
    return "\n".join(out + (["", "Errors (— in the table):", *errors] if errors else [])) + "\n"


def _f(row: dict, key: str, spec: str) -> str:
    """``row[key]`` formatted, or "—" where it was not measured (an error, or not asked for)."""
    return format(row[key], spec) if key in row else "—"


def write(out: str, rows: list[dict], device: torch.device, copy_gbps: float, args, streams_warps: dict):
    """Writes ``decode_attention.json`` and ``.md`` into ``out``; returns the markdown."""
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": os.environ.get("COMMIT", "unknown"),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
            "torch": torch.__version__, "copy_GBps": copy_gbps, "high_frac": args.high_frac,
            "kernels": args.kernels, "timing": ", ".join(sorted({m for r in rows for m in r["timing"].values()})),
            "reps": args.reps, "rounds": args.rounds, "streams_warps": {str(k): v for k, v in streams_warps.items()},
            "target": TARGETS}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "decode_attention.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "decode_attention.md"), "w") as f:
        f.write(markdown(rows, meta))
    return markdown(rows, meta)
