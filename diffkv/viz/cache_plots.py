"""Figures of one cache: tier fractions per layer and KV head, the prompt coloured by tier, bytes held.

Figures are built with ``matplotlib.figure.Figure`` (no pyplot state, no backend needed); a notebook shows one as a
cell's value, a script calls ``fig.savefig(path)``.
"""

from __future__ import annotations

import html

import numpy as np
import torch

from diffkv.viz.tiers import HIGH, LOW, PRUNED, TIER_NAMES

TIER_ORDER = ("high", "low", "pruned")  # the order of tier_fractions' last axis
TIER_COLORS = {"high": "#2f9e44", "low": "#f08c00", "pruned": "#adb5bd"}
TIER_CMAPS = {"high": "Greens", "low": "Oranges", "pruned": "Greys"}
_BACKGROUND = {HIGH: "#b2f2bb", LOW: "#ffe8cc", PRUNED: "#f1f3f5"}
_TEXT = {HIGH: "#000", LOW: "#000", PRUNED: "#adb5bd"}


def _figure(figsize, dpi):
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, dpi=dpi, layout="constrained")


def plot_tier_heatmap(fractions, title: str | None = None, dpi: int = 80):
    """Layer x KV-head heatmaps of the high / low / pruned fractions (one panel each, shared 0-1 colour scale).

    fractions: [layers, kv_heads, 3] in the order (high, low, pruned), e.g. :func:`diffkv.viz.tier_fractions`
    (NaN rows, uncompressed layers, stay blank). Returns the Figure.
    """
    f = torch.as_tensor(fractions, dtype=torch.float32).numpy()
    layers, heads, _ = f.shape
    fig = _figure((2.0 + 1.6 * max(heads, 2), 1.5 + 0.16 * layers), dpi)
    axes = fig.subplots(1, 3, sharey=True)
    for i, (ax, name) in enumerate(zip(axes, TIER_ORDER, strict=True)):
        im = ax.imshow(f[:, :, i], cmap=TIER_CMAPS[name], vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_title(f"{name} ({100 * float(np.nanmean(f[:, :, i])):.0f} %)")
        ax.set_xlabel("KV head")
        ax.set_xticks(range(heads))
        fig.colorbar(im, ax=ax, shrink=0.8)
    axes[0].set_ylabel("layer")
    if title:
        fig.suptitle(title)
    return fig


def plot_tier_strip(tier_map, head: int = 0, dpi: int = 80, title: str | None = None):
    """The tier of every token (x) in every layer (y) for one KV head: green high, orange low, grey pruned, white
    for layers the cache does not compress. tier_map: [layers, kv_heads, seq] (``TierTracker.tier_map``)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    tm = torch.as_tensor(tier_map)[:, head].float().numpy()
    layers, seq = tm.shape
    fig = _figure((9, 1.2 + 0.12 * layers), dpi)
    ax = fig.subplots()
    cmap = ListedColormap(["#ffffff", TIER_COLORS["pruned"], TIER_COLORS["low"], TIER_COLORS["high"]])
    ax.imshow(tm, cmap=cmap, vmin=-1.5, vmax=2.5, aspect="auto", interpolation="nearest")
    ax.set(xlabel="token position", ylabel="layer", title=title or f"tier of every token, KV head {head}")
    fig.legend(handles=[Patch(color=TIER_COLORS[n], label=n) for n in TIER_ORDER], ncols=3, fontsize=8,
               loc="outside lower center")
    return fig


def tokens_html(tokenizer, ids, tiers, max_tokens: int | None = None) -> str:
    """The tokens ``ids`` as HTML spans coloured by tier (green high, orange low, grey pruned), with a legend.

    ids: [seq] token ids; tiers: [seq] tier per token (one (layer, head) row of ``TierTracker.tier_map``);
    max_tokens: show only the last ``max_tokens``. Each span's tooltip gives the position and tier.
    """
    ids = [int(x) for x in torch.as_tensor(ids).view(-1)]
    tiers = [int(x) for x in torch.as_tensor(tiers).view(-1)]
    if len(ids) != len(tiers):
        raise ValueError(f"{len(ids)} token ids but {len(tiers)} tiers")
    start = 0 if max_tokens is None else max(len(ids) - max_tokens, 0)
    counts = {t: tiers.count(t) for t in (HIGH, LOW, PRUNED)}
    legend = " ".join(f'<span style="background:{_BACKGROUND[t]};color:{_TEXT[t]};padding:0 4px">{name} '
                      f"{counts[t]}</span>" for t, name in ((HIGH, "high"), (LOW, "low"), (PRUNED, "pruned")))
    spans = []
    for pos in range(start, len(ids)):
        text = html.escape(tokenizer.decode([ids[pos]]))
        t = tiers[pos]
        style = f"background:{_BACKGROUND.get(t, '#fff')};color:{_TEXT.get(t, '#000')}"
        text = text.replace("\n", "&#8629;<br>")
        spans.append(f'<span title="{pos}: {TIER_NAMES.get(t, t)}" style="{style}">{text}</span>')
    skipped = f"<i>({start} earlier tokens not shown)</i> " if start else ""
    return (f'<div style="font-family:monospace;font-size:12px;line-height:1.5">{legend}<br>{skipped}'
            f'{"".join(spans)}</div>')



def cache_bytes(diffkv_cache, dynamic_cache=None) -> dict[str, int]:
    """Bytes of the same tokens held four ways: fp16 K/V, a transformers DynamicCache (as run, walked tensor by
    tensor), DiffKV's pages, and every byte the DiffKV cache owns (``stats()``'s fp16_bytes, bytes_in_pages,
    bytes_held). Call it before ``release()``."""
    s = diffkv_cache.stats()
    out = {"fp16 K/V": s["fp16_bytes"]}
    if dynamic_cache is not None:
        from diffkv.memory.owned import owned_bytes

        dtype = next((layer.keys.dtype for layer in dynamic_cache.layers if getattr(layer, "keys", None) is not None),
                     None)
        out[f"DynamicCache ({str(dtype).removeprefix('torch.')})"] = owned_bytes(dynamic_cache)
    out["DiffKV pages"] = s["bytes_in_pages"]
    out["DiffKV, all it holds"] = s["bytes_held"]
    return out


def plot_bytes(sizes: dict[str, int], title: str | None = None, dpi: int = 80):
    """Horizontal bars of bytes (MB), each labelled with its size and its ratio to the first entry."""
    names, values = list(sizes), [v / 1e6 for v in sizes.values()]
    fig = _figure((7, 0.6 + 0.5 * len(names)), dpi)
    ax = fig.subplots()
    colors = ["#868e96" if "DiffKV" not in n else TIER_COLORS["high"] for n in names]
    bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
    for bar, v in zip(bars, values[::-1], strict=True):
        ax.annotate(f"{v:.2f} MB ({v / values[0]:.2f}x)", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize=9)
    ax.set_xlabel("MB")
    ax.set_xlim(0, max(values) * 1.35)
    ax.set_title(title or "bytes held for the same tokens")
    return fig
