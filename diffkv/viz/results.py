"""Figures of recorded results (``benchmarks/``): the needle grid, decode speed vs context, serving runs (quality vs
compression: :mod:`diffkv.viz.frontier`). Only reads JSON; recomputes nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

from diffkv.viz.cache_plots import TIER_COLORS, _figure
from diffkv.viz.frontier import load_runs

_NEEDLE_ID = re.compile(r"needle-(\d+)-([0-9.]+)-\d+")


def needle_results(root: str | Path = "benchmarks/accuracy") -> dict[str, dict[tuple[int, float], bool]]:
    """{method label: {(context length, depth): passed}} from every needle run's samples.jsonl under ``root``
    (repeats of one cell pass only if all pass)."""
    out: dict[str, dict[tuple[int, float], bool]] = {}
    for r in load_runs(root):
        samples = Path(r["dir"]) / "samples.jsonl"
        if r["task"] != "needle" or not samples.is_file():
            continue
        cells = out.setdefault(f"{r['model_tag']}: {r['label']}", {})
        for line in samples.read_text().splitlines():
            s = json.loads(line)
            m = _NEEDLE_ID.fullmatch(s["id"])
            if m:
                key = (int(m.group(1)), float(m.group(2)))
                cells[key] = cells.get(key, True) and bool(s["correct"])
    return out


def plot_needle_grid(results: dict[str, dict[tuple[int, float], bool]], dpi: int = 80):
    """One panel per method: context length x needle depth, green pass, red fail, blank not run."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    lengths = sorted({k[0] for cells in results.values() for k in cells})
    depths = sorted({k[1] for cells in results.values() for k in cells})
    fig = _figure((1.2 + 2.0 * len(results), 0.9 + 0.45 * len(lengths)), dpi)
    axes = fig.subplots(1, len(results), sharey=True, squeeze=False)[0]
    cmap = ListedColormap(["#ffa8a8", "#b2f2bb"])
    for ax, (name, cells) in zip(axes, results.items(), strict=True):
        grid = np.full((len(lengths), len(depths)), np.nan)
        for (n, d), ok in cells.items():
            grid[lengths.index(n), depths.index(d)] = float(ok)
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, "pass" if v else "fail", ha="center", va="center", fontsize=8)
        ax.set_title(f"{name}\n{sum(cells.values())}/{len(cells)}", fontsize=9)
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("depth")
    axes[0].set_yticks(range(len(lengths)), [str(n) for n in lengths])
    axes[0].set_ylabel("context tokens")
    return fig


def decode_results(root: str | Path = "benchmarks/results/decode") -> list[dict]:
    """Rows (model, context, tokens/s of both caches, speed ratio, KV bytes owned) of every ``diffkv bench decode
    --json`` output in ``root`` that has the memory section, sorted by model and context."""
    rows = []
    for f in sorted(Path(root).glob("*.json")):
        d = json.loads(f.read_text())
        if "speed" not in d or "memory" not in d:
            continue
        rows.append({"file": f.name, "model": d["model"], "context": d["context"],
                     "full_tokens_per_s": d["speed"]["full_tokens_per_s"],
                     "diffkv_tokens_per_s": d["speed"]["diffkv_tokens_per_s"], "speed_ratio": d["speed"]["speed_ratio"],
                     "full_bytes": d["memory"]["full"]["kv_bytes_owned"],
                     "diffkv_bytes": d["memory"]["diffkv"]["kv_bytes_owned"], "machine": d.get("machine", "")})
    return sorted(rows, key=lambda r: (r["model"], r["context"]))


def plot_decode(rows: list[dict], dpi: int = 80):
    """Decode tokens/s (left) and KV bytes owned (right, MB) vs context length, DynamicCache vs DiffKV."""
    fig = _figure((9, 3.6), dpi)
    speed, mem = fig.subplots(1, 2)
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        ctx = [r["context"] for r in rs]
        for key, name, color in (("full", "DynamicCache", "k"), ("diffkv", "DiffKV", TIER_COLORS["high"])):
            speed.plot(ctx, [r[f"{key}_tokens_per_s"] for r in rs], "o-", color=color, label=f"{model} {name}")
            mem.plot(ctx, [r[f"{key}_bytes"] / 1e6 for r in rs], "o-", color=color, label=f"{model} {name}")
        for r in rs:
            speed.annotate(f"{r['speed_ratio']:.2f}x", (r["context"], r["diffkv_tokens_per_s"]), xytext=(4, -10),
                           textcoords="offset points", fontsize=8)
            mem.annotate(f"{r['diffkv_bytes'] / r['full_bytes']:.3f}x", (r["context"], r["diffkv_bytes"] / 1e6),
                         xytext=(4, 4), textcoords="offset points", fontsize=8)
    contexts = sorted({r["context"] for r in rows})
    for ax in (speed, mem):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context tokens")
        ax.legend(fontsize=8)
    speed.set(ylabel="decode tokens/s (1 thread)", title="decode speed")
    mem.set(ylabel="KV bytes owned (MB)", title="KV cache memory after decoding")
    return fig


def serve_results(root: str | Path = "benchmarks/serve") -> list[dict]:
    """One row per ``diffkv bench serve`` JSON in ``root`` that compares the fp16 and diffkv KV caches: its settings
    and each cache's numbers under ``"caches"`` (files recorded before issue #32 name that key ``"backends"``;
    ``--prefill batched,single`` runs name their engines ``fp16:batched`` ...: skipped)."""
    rows = []
    for f in sorted(Path(root).glob("*.json")):
        d = json.loads(f.read_text())
        caches = d.get("caches", d.get("backends", {}))
        if {"fp16", "diffkv"} <= set(caches):
            rows.append({"run": f.stem, **{k: v for k, v in d.items() if k not in ("caches", "backends")},
                         "caches": caches})
    return rows


def plot_serve(rows: list[dict], dpi: int = 80):
    """Per serving run: throughput (tokens/s) and peak concurrent requests, fp16 vs DiffKV KV cache."""
    import numpy as np

    fig = _figure((10, 0.9 + 0.5 * len(rows)), dpi)
    axes = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(rows))
    names = [r["run"].removeprefix(f"{r['model']}_") for r in rows]
    for ax, key, title in ((axes[0], "tokens_per_s", "throughput (tokens/s)"),
                           (axes[1], "peak_running", "peak running requests")):
        for off, kind, color in ((-0.2, "fp16", "#868e96"), (0.2, "diffkv", TIER_COLORS["high"])):
            vals = [r["caches"][kind][key] for r in rows]
            ax.barh(y + off, vals, height=0.4, color=color, label=kind)
        for i, r in enumerate(rows):
            b = r["caches"]
            ax.annotate(f"{b['diffkv'][key] / b['fp16'][key]:.2f}x", (b["diffkv"][key], i + 0.2), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_yticks(y, names, fontsize=8)
    axes[0].invert_yaxis()
    return fig
