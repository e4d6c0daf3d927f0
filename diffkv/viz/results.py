"""Figures of recorded results (``benchmarks/``): quality vs compression per method, the needle grid, decode speed
vs context, serving runs. Only reads JSON; recomputes nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

from diffkv.viz.cache_plots import TIER_COLORS, _figure

_NEEDLE_ID = re.compile(r"needle-(\d+)-([0-9.]+)-\d+")


def load_runs(root: str | Path = "benchmarks/accuracy") -> list[dict]:
    """Every ``[<variant>/]<model>/<task>/<method>/metrics.json`` under ``root`` (``diffkv eval run`` output), as the
    rows of ``diffkv.eval.report.collect`` plus ``config`` (the run's config.json), ``variant`` (the sub-folder, ""
    at the top) and ``label`` (method, "(profile)" when a calibrated profile was used)."""
    root = Path(root)
    rows = []
    for f in sorted(root.glob("**/metrics.json")):
        rel = f.relative_to(root).parts
        if len(rel) < 4:
            continue
        cfg_path = f.with_name("config.json")
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        m = json.loads(f.read_text())
        label = rel[-2] + (" (profile)" if cfg.get("profile") else "")
        rows.append({**m, "model_tag": rel[-4], "task": rel[-3], "method": rel[-2], "variant": "/".join(rel[:-4]),
                     "config": cfg, "label": label, "dir": str(f.parent)})
    return rows


def _setting(r: dict) -> tuple:
    cfg = r.get("config") or {}
    return (r["model_tag"], r["task"], cfg.get("max_new_tokens"), json.dumps(cfg.get("task_options"), sort_keys=True))


def _panel_title(r: dict) -> str:
    cfg, opts = r.get("config") or {}, (r.get("config") or {}).get("task_options") or {}
    extra = ""
    if r["task"] == "needle" and opts.get("lengths"):
        extra = ", " + "/".join(f"{n // 1024}k" for n in opts["lengths"]) + " tokens"
    elif r["task"] == "gsm8k" and cfg.get("max_new_tokens"):
        extra = f", {cfg['max_new_tokens']} new tokens"
    return f"{r['model_tag']} / {r['task']}{extra}"


def pareto(points: list[tuple[float, float]], higher_is_better: bool = True) -> list[tuple[float, float]]:
    """The points no other point beats on both compression (x, higher better) and quality (y), sorted by x."""
    sign = 1 if higher_is_better else -1
    best = [p for p in points if not any(q != p and q[0] >= p[0] and sign * q[1] >= sign * p[1] for q in points)]
    return sorted(set(best))


def plot_frontier(rows: list[dict], dpi: int = 80):
    """Quality vs physical compression, one panel per (model, task, generation setting): accuracy (%) with its
    standard error, or perplexity (lower is better); the Pareto frontier as a dashed line. Returns the Figure, or
    None when no row has a quality and a compression."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("compression_physical") and ("ppl" in r or r.get("accuracy") is not None):
            groups.setdefault(_setting(r), []).append(r)
    if not groups:
        return None
    order = sorted(groups, key=lambda k: (k[1] != "ppl", k[1], k[0], k[2] or 0, k[3]))  # ppl first, then by task
    groups = {k: groups[k] for k in order}
    cols = min(3, len(groups))
    nrows = -(-len(groups) // cols)
    fig = _figure((4.6 * cols, 3.6 * nrows), dpi)
    axes = fig.subplots(nrows, cols, squeeze=False).ravel()
    for ax, rs in zip(axes, groups.values(), strict=False):
        ppl = "ppl" in rs[0]
        n_max = max(r.get("n", 0) for r in rs)
        pts = []
        for i, r in enumerate(sorted(rs, key=lambda r: r["compression_physical"])):
            x = r["compression_physical"]
            y = r["ppl"] if ppl else 100 * r["accuracy"]
            err = None if ppl else 100 * (r.get("stderr") or 0)
            color = TIER_COLORS["high"] if r["method"] == "diffkv" else ("k" if r["method"] == "full" else "#1971c2")
            ax.errorbar(x, y, yerr=err, fmt="o", color=color, capsize=3, ms=6)
            label = r.get("label", r["method"]) + (f" n={r['n']}" if r.get("n", n_max) != n_max else "")
            ax.annotate(label, (x, y), xytext=(4, 4 if i % 2 == 0 else -11), textcoords="offset points", fontsize=8)
            pts.append((x, y))
        front = pareto(pts, higher_is_better=not ppl)
        ax.plot([p[0] for p in front], [p[1] for p in front], ls="--", color="#868e96", lw=1, zorder=0)
        ax.set(title=_panel_title(rs[0]), xlabel="physical compression (x vs fp16)",
               ylabel="perplexity (lower is better)" if ppl else "accuracy (%)")
        ax.set_xlim(0.8, max(p[0] for p in pts) * 1.25)
    for ax in axes[len(groups):]:
        ax.set_visible(False)
    return fig


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
    """One row per ``diffkv bench serve`` JSON in ``root`` that compares the fp16 and diffkv backends: its settings
    and each backend's numbers (``--prefill batched,single`` runs name their engines ``fp16:batched`` ...: skipped)."""
    rows = []
    for f in sorted(Path(root).glob("*.json")):
        d = json.loads(f.read_text())
        if {"fp16", "diffkv"} <= set(d.get("backends", ())):
            rows.append({"run": f.stem, **{k: v for k, v in d.items() if k != "backends"}, "backends": d["backends"]})
    return rows


def plot_serve(rows: list[dict], dpi: int = 80):
    """Per serving run: throughput (tokens/s) and peak concurrent requests, fp16 vs DiffKV backend."""
    import numpy as np

    fig = _figure((10, 0.9 + 0.5 * len(rows)), dpi)
    axes = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(rows))
    names = [r["run"].removeprefix(f"{r['model']}_") for r in rows]
    for ax, key, title in ((axes[0], "tokens_per_s", "throughput (tokens/s)"),
                           (axes[1], "peak_running", "peak running requests")):
        for off, backend, color in ((-0.2, "fp16", "#868e96"), (0.2, "diffkv", TIER_COLORS["high"])):
            vals = [r["backends"][backend][key] for r in rows]
            ax.barh(y + off, vals, height=0.4, color=color, label=backend)
        for i, r in enumerate(rows):
            b = r["backends"]
            ax.annotate(f"{b['diffkv'][key] / b['fp16'][key]:.2f}x", (b["diffkv"][key], i + 0.2), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_yticks(y, names, fontsize=8)
    axes[0].invert_yaxis()
    return fig
