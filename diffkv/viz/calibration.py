"""Figures of a calibrated profile (``diffkv calibrate``): the threshold sweep, per-layer alphas, and how the tier
mix of one prompt moves with the thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffkv.viz.cache_plots import TIER_COLORS, TIER_ORDER, _figure

STAGE_STYLE = {"baseline": ("#495057", "s"), "alpha_high": ("#1971c2", "o"), "alpha_low": ("#f08c00", "o"),
               "per_layer": ("#2f9e44", "D")}


def profile_dict(profile) -> dict:
    """A profile as its JSON dict: from a path, a :class:`~diffkv.profile.Profile` or a dict."""
    if isinstance(profile, (str, Path)):
        return json.loads(Path(profile).read_text())
    if hasattr(profile, "to_dict"):
        return profile.to_dict()
    return dict(profile)


def plot_sweep(profile, dpi: int = 80):
    """Mean KL per token vs physical compression of every candidate the calibration measured, by search stage
    (``search.rows``), with the KL budget, the chosen global pair and the per-layer result. Returns the Figure."""
    p = profile_dict(profile)
    search, measured = p.get("search") or {}, p.get("measured") or {}
    rows = search.get("rows") or []
    fig = _figure((7.5, 4.5), dpi)
    ax = fig.subplots()
    for stage in dict.fromkeys(r["stage"] for r in rows):
        rs = [r for r in rows if r["stage"] == stage]
        color, marker = STAGE_STYLE.get(stage, ("#868e96", "o"))
        xs, ys = [r["compression_physical"] for r in rs], [r["kl"] for r in rs]
        ax.plot(xs, ys, marker=marker, color=color, label=f"{stage} ({len(rs)})", lw=0.8, ms=5, alpha=0.85)
        for r in rs:
            text = f"{r[stage]:g}" if stage in ("alpha_high", "alpha_low") else (
                f"λ {r['lam']:.3g}" if r.get("lam") is not None else None)
            if text:
                ax.annotate(text, (r["compression_physical"], r["kl"]), xytext=(2, 3), textcoords="offset points",
                            fontsize=7, color=color)
    best = search.get("global_best")
    if best:
        ax.plot(best["compression_physical"], best["kl"], "*", ms=16, color="#1971c2", mec="k",
                label=f"global best (α {best['alpha_high']:g} / {best['alpha_low']:g})")
    if measured.get("compression_physical"):
        label = "chosen: per layer" if (p.get("config") or {}).get("layer_alphas") else "chosen"
        ax.plot(measured["compression_physical"], measured["kl"], "P", ms=14, color="#2f9e44", mec="k",
                label=f"{label} ({measured['compression_physical']:.2f}x, KL {measured['kl']:.3f})")
    budget = ((p.get("calibration") or {}).get("budget") or {}).get("max_kl")
    if budget is not None:
        ax.axhline(budget, ls="--", color="#c92a2a", lw=1, label=f"budget: mean KL {budget:g}")
    ax.set(xlabel="physical compression (x vs fp16)", ylabel="mean KL vs full cache (nats/token)",
           title=f"calibration sweep: {(p.get('model') or {}).get('name', '?')}, "
                 f"{p['config']['high']} / {p['config']['low']}")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def plot_layer_alphas(profile, dpi: int = 80):
    """Per-layer alpha_high and alpha_low (bars) against the global pair (dashed lines)."""
    cfg = profile_dict(profile)["config"]
    pairs = cfg.get("layer_alphas")
    if not pairs:
        raise ValueError("this profile has no per-layer alphas (calibrated without --per-layer)")
    fig = _figure((8, 4.5), dpi)
    axes = fig.subplots(2, 1, sharex=True)
    layers = range(len(pairs))
    for ax, i, name, color in ((axes[0], 0, "alpha_high", TIER_COLORS["high"]),
                               (axes[1], 1, "alpha_low", TIER_COLORS["low"])):
        ax.bar(layers, [p[i] for p in pairs], color=color)
        ax.axhline(cfg[name], ls="--", color="k", lw=1, label=f"global {cfg[name]:g}")
        ax.set_ylabel(name)
        ax.legend(fontsize=8)
    axes[1].set_xlabel("layer")
    axes[0].set_title("per-layer thresholds: high if mean attention ≥ α_high / n, pruned if < α_low / n")
    return fig


def prefill_stats(model, ids: torch.Tensor, config) -> dict:
    """``stats()`` of a DiffKVCache with ``config`` after the prefill of ``ids`` ([1, L]) alone (no decoding)."""
    from diffkv.integrations.transformers import DiffKVCache

    cache = DiffKVCache(model, config)
    try:
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        return cache.stats()
    finally:
        cache.release()


def plot_tier_mix(results: dict[str, dict], dpi: int = 80, title: str | None = None):
    """Stacked bars of the high / low / pruned fractions per setting, annotated with the physical compression.

    results: {label: stats dict} (``prefill_stats`` / ``cache.stats()``: ``tier_fractions``,
    ``compression_physical``)."""
    labels = list(results)
    fig = _figure((7.5, 0.8 + 0.45 * len(labels)), dpi)
    ax = fig.subplots()
    left = [0.0] * len(labels)
    for name in TIER_ORDER:
        vals = [results[k]["tier_fractions"][name] for k in labels]
        ax.barh(labels, vals, left=left, color=TIER_COLORS[name], label=name)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    for i, k in enumerate(labels):
        ax.annotate(f"{results[k]['compression_physical']:.2f}x", (1.0, i), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=9)
    ax.set_xlim(0, 1.15)
    ax.invert_yaxis()
    ax.set_xlabel("fraction of (token, layer, KV head) cells")
    fig.legend(*ax.get_legend_handles_labels(), ncols=3, fontsize=8, loc="outside lower center")
    ax.set_title(title or "tier mix vs thresholds (α_high / α_low), physical compression on the right")
    return fig
