"""The compression–quality frontier of recorded ``diffkv eval run`` results: every run is a point (physical
compression, accuracy or perplexity); the points of one method family (``h2o``, ``h2o@0.2``, … or ``diffkv``,
``diffkv@x4``, … within one results folder) are joined by a line, one panel per setting. Only reads JSON.

Each panel is lettered and tinted by task; its legend sits below its axes, with the family names shortened and
wrapped (:mod:`diffkv.viz.labels`), the abbreviations used spelled out in the figure's title."""

from __future__ import annotations

import json
from pathlib import Path

from diffkv.viz.cache_plots import TIER_COLORS, _figure
from diffkv.viz.labels import abbreviations, legend_labels, short_label

_MARKERS = ("s", "^", "D", "v", "P", "X", "<")
_PALETTE = ("#1f77b4", "#ff7f0e", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
            "#364fc7")  # no green: DiffKV as published is TIER_COLORS["high"]
_TINTS = {"ppl": "#f3f7fc", "gsm8k": "#fdfaee", "needle": "#f8f3fc", "ruler": "#f1faf7"}  # axes background per task
PANEL_W, AXES_H = 5.2, 3.7  # inches: one column's width; one row's height without its legend
LEGEND_GAP = 0.5  # inches from the bottom of the axes to the top of the legend (clears tick labels and x label)


def split_spec(method: str) -> tuple[str, str]:
    """(family, point) of a run's method spec: ``diffkv@x4+page_bytes=1472`` -> (``diffkv+page_bytes=1472``,
    ``x4``); ``h2o`` -> (``h2o``, "")."""
    base, plus, fields = method.partition("+")
    name, _, point = base.partition("@")
    return name + plus + fields, point


def load_runs(root: str | Path = "benchmarks/accuracy") -> list[dict]:
    """Every ``[<variant>/]<model>/<task>/<method>/metrics.json`` under ``root`` (``diffkv eval run`` output), as the
    rows of ``diffkv.eval.report.collect`` plus ``config`` (the run's config.json), ``variant`` (the sub-folder, ""
    at the top), ``label`` (method, "(profile)" when a calibrated profile was used) and ``family`` (the method
    without its operating point, ``[variant]`` appended: the points one line joins)."""
    root = Path(root)
    rows = []
    for f in sorted(root.glob("**/metrics.json")):
        rel = f.relative_to(root).parts
        if len(rel) < 4:
            continue
        cfg_path = f.with_name("config.json")
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        m = json.loads(f.read_text())
        variant = "/".join(rel[:-4])
        label = rel[-2] + (" (profile)" if cfg.get("profile") else "")
        family = split_spec(rel[-2])[0] + (f" [{variant}]" if variant else "")
        rows.append({**m, "model_tag": rel[-4], "task": rel[-3], "method": rel[-2], "variant": variant,
                     "config": cfg, "label": label, "family": family, "dir": str(f.parent)})
    return rows


def _setting(r: dict) -> tuple:
    """Runs comparable in one panel: model, task, generation length, task options, sample count and first sample
    (``--start``: another slice of the data is another panel)."""
    cfg = r.get("config") or {}
    return (r["model_tag"], r["task"], cfg.get("max_new_tokens"), json.dumps(cfg.get("task_options"), sort_keys=True),
            r.get("n"), cfg.get("start") or 0)


def _panel_title(r: dict, letter: str = "") -> str:
    """Two lines: ``(letter) model / task``, then the setting's details (length, protocol, first sample) and n."""
    cfg, opts = r.get("config") or {}, (r.get("config") or {}).get("task_options") or {}
    extra = ""
    if r["task"] == "needle" and opts.get("lengths"):
        extra = ", " + "/".join(f"{n // 1024}k" for n in opts["lengths"]) + " tokens"
    elif r["task"] == "gsm8k" and cfg.get("max_new_tokens"):
        extra = f", {cfg['max_new_tokens']} new tokens"
    if opts.get("protocol", "in-prompt") != "in-prompt" or opts.get("shots"):
        extra += ", " + ", ".join(f"{k} {v}" for k, v in sorted(opts.items()) if k in ("protocol", "shots"))
    if cfg.get("start"):
        extra += f", from sample {cfg['start']}"
    head = f"({letter}) " if letter else ""
    return f"{head}{r['model_tag']} / {r['task']}\n{extra.removeprefix(', ')}{', ' if extra else ''}n={r.get('n')}"


def pareto(points: list[tuple[float, float]], higher_is_better: bool = True) -> list[tuple[float, float]]:
    """The points no other point beats on both compression (x, higher better) and quality (y), sorted by x."""
    sign = 1 if higher_is_better else -1
    best = [p for p in points if not any(q != p and q[0] >= p[0] and sign * q[1] >= sign * p[1] for q in points)]
    return sorted(set(best))


def _styles(families: list[str]) -> dict[str, tuple[str, str]]:
    """(colour, marker) per method family of one panel, all distinct: full black, DiffKV as published green."""
    others = sorted({f for f in families if f != "diffkv" and f.partition(" [")[0] != "full"})
    styles = {}
    for f in families:
        if f.partition(" [")[0] == "full" or f == "diffkv":
            styles[f] = ("k" if f != "diffkv" else TIER_COLORS["high"], "o")
        else:
            i = others.index(f)
            styles[f] = (_PALETTE[i % len(_PALETTE)], _MARKERS[i % len(_MARKERS)])
    return styles


def _family(r: dict) -> str:
    return r.get("family") or split_spec(r["method"])[0]


def _draw_panel(ax, rs: list[dict], letter: str = "") -> None:
    """One setting's runs on ``ax``: a line per family, operating points labelled, Pareto front dashed, the legend
    below the axes (:func:`_legend_below`)."""
    ppl = "ppl" in rs[0]
    families: dict[str, list[dict]] = {}
    for r in sorted(rs, key=lambda r: r["compression_physical"]):
        families.setdefault(_family(r), []).append(r)
    styles = _styles(list(families))
    pts, names = [], {}
    for family, runs in families.items():
        xs = [r["compression_physical"] for r in runs]
        ys = [r["ppl"] if ppl else 100 * r["accuracy"] for r in runs]
        err = None if ppl else [100 * (r.get("stderr") or 0) for r in runs]
        color, marker = styles[family]
        ax.errorbar(xs, ys, yerr=err, fmt=marker + ("-" if len(runs) > 1 else ""), color=color, capsize=3, ms=5,
                    lw=1.2, label=family)
        for r, x, y in zip(runs, xs, ys, strict=True):
            point = split_spec(r["method"])[1]
            if point:
                ax.annotate(point, (x, y), xytext=(3, 3), textcoords="offset points", fontsize=7, color=color)
        pts += list(zip(xs, ys, strict=True))
        names.update({(x, y): family for x, y in zip(xs, ys, strict=True)})
    front = pareto(pts, higher_is_better=not ppl)
    ax.plot([p[0] for p in front], [p[1] for p in front], ls="--", color="#868e96", lw=1, zorder=0)
    ax.set(title=_panel_title(rs[0], letter), xlabel="physical compression (x vs fp16)",
           ylabel="perplexity (lower is better)" if ppl else "accuracy (%)", facecolor=_TINTS.get(rs[0]["task"], "w"))
    ax.title.set(fontsize=10, fontweight="bold")
    ax.set_xlim(0.8, max(p[0] for p in pts) * 1.15)
    full = [y for (x, y) in pts if x == 1.0]
    if ppl and full and max(y for _, y in pts) > 1.25 * full[0]:  # a method that breaks the model squashes the rest
        top = 1.25 * full[0]
        ax.set_ylim(min(y for _, y in pts) * 0.98, top)
        for i, (x, y) in enumerate(sorted(p for p in pts if p[1] > top)):
            ax.annotate(f"{short_label(names[x, y])} {y:.0f} ^", (x, top), xytext=(0, -10 - 9 * (i % 2)),
                        textcoords="offset points", fontsize=7, ha="center", color="#c92a2a")
    _legend_below(ax, list(families))


def _legend_below(ax, families: list[str]) -> None:
    """The panel's legend centred below its x label, one entry per family in drawing order (the errorbar containers
    keep the full family as their label), labelled by :func:`diffkv.viz.labels.legend_labels`; as many columns
    (up to 3) as fit within the panel's width, measured."""
    from matplotlib.transforms import ScaledTranslation

    fig = ax.get_figure()
    labels = legend_labels(families)
    handles = {c.get_label(): c for c in ax.containers}
    below = ax.transAxes + ScaledTranslation(0, -LEGEND_GAP, fig.dpi_scale_trans)
    for ncol in range(min(3, len(families)), 0, -1):
        legend = ax.legend([handles[f] for f in families], [labels[f] for f in families], loc="upper center",
                           bbox_to_anchor=(0.5, 0), bbox_transform=below, ncols=ncol, fontsize=7, framealpha=1,
                           borderaxespad=0, columnspacing=1.0, handlelength=1.5, handletextpad=0.5)
        if legend.get_window_extent().width <= (PANEL_W - 0.9) * fig.dpi:
            break


def _figure_title(families: list[str], width: int = 150) -> str:
    """The figure's title: what is drawn, then the legend abbreviations used (:func:`abbreviations`), broken into
    lines of about ``width`` characters between (never inside) the ``short = long`` pairs."""
    lines = ["Quality vs physical compression, one panel per setting; a line per method family, dashed: Pareto front"]
    used = abbreviations(families)
    for i, pair in enumerate(used):
        item = ("Legend abbreviations: " if i == 0 else "") + pair + (", " if i < len(used) - 1 else "")
        if i == 0 or len(lines[-1]) + len(item) > width:
            lines.append(item)
        else:
            lines[-1] += item
    return "\n".join(line.rstrip() for line in lines)


def plot_frontier(rows: list[dict], dpi: int = 80):
    """Quality vs physical compression, one panel per setting (:func:`_setting`): accuracy (%) with its standard
    error, or perplexity (lower is better; clipped at 1.25x the full cache's); each method family a line through its
    operating points (labelled ``x4``, ``0.2``), the Pareto frontier of the panel dashed. Panels are lettered, at
    most 3 a row, each with its legend below it; each row is as tall as its tallest legend needs. Returns the
    Figure, or None when no row has a quality and a compression."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("compression_physical") and ("ppl" in r or r.get("accuracy") is not None):
            groups.setdefault(_setting(r), []).append(r)
    if not groups:
        return None
    order = sorted(groups, key=lambda k: (k[1] != "ppl", k[1], k[0], k[2] or 0, k[3], -(k[4] or 0), k[5]))
    cols = min(3, len(groups))
    nrows = -(-len(groups) // cols)
    fig = _figure((PANEL_W * cols, AXES_H * nrows), dpi)
    axes = fig.subplots(nrows, cols, squeeze=False)
    for i, (ax, key) in enumerate(zip(axes.ravel(), order, strict=False)):
        _draw_panel(ax, groups[key], chr(ord("a") + i) if i < 26 else str(i + 1))
    for ax in axes.ravel()[len(groups):]:
        ax.set_visible(False)
    legend_h = [max((ax.get_legend().get_window_extent().height / dpi for ax in row if ax.get_legend()), default=0)
                for row in axes]
    fig.set_size_inches(PANEL_W * cols, sum(AXES_H + LEGEND_GAP + h for h in legend_h) + 0.4)
    fig.suptitle(_figure_title([_family(r) for k in order for r in groups[k]]), fontsize=9)
    return fig
