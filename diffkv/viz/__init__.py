"""What DiffKV keeps, in figures (matplotlib, the ``notebooks`` or ``eval`` extra).

* which tokens sit in which tier: :func:`track_tiers` (per-token tier map of every layer and KV head),
  :func:`tier_fractions` (counts per layer and head), :func:`plot_tier_heatmap`, :func:`plot_tier_strip`,
  :func:`tokens_html`, :func:`cache_bytes` / :func:`plot_bytes`;
* calibration profiles: :func:`plot_sweep`, :func:`plot_layer_alphas`, :func:`prefill_stats` / :func:`plot_tier_mix`;
* recorded results under ``benchmarks/``: :func:`load_runs` / :func:`plot_frontier`, :func:`needle_results` /
  :func:`plot_needle_grid`, :func:`decode_results` / :func:`plot_decode`, :func:`serve_results` / :func:`plot_serve`.

Every ``plot_*`` returns a ``matplotlib.figure.Figure`` (no pyplot state): a notebook shows it as a cell's value, a
script saves it with ``fig.savefig(path)``. The notebooks in ``notebooks/`` use all of them.
"""

from diffkv.viz.cache_plots import (
    TIER_COLORS,
    cache_bytes,
    plot_bytes,
    plot_tier_heatmap,
    plot_tier_strip,
    tokens_html,
)
from diffkv.viz.calibration import plot_layer_alphas, plot_sweep, plot_tier_mix, prefill_stats, profile_dict
from diffkv.viz.frontier import load_runs, pareto, plot_frontier
from diffkv.viz.results import (
    decode_results,
    needle_results,
    plot_decode,
    plot_needle_grid,
    plot_serve,
    serve_results,
)
from diffkv.viz.tiers import HIGH, LOW, PRUNED, TierTracker, tier_fractions, track_tiers

__all__ = [
    "HIGH", "LOW", "PRUNED", "TIER_COLORS", "TierTracker", "cache_bytes", "decode_results", "load_runs",
    "needle_results", "pareto", "plot_bytes", "plot_decode", "plot_frontier", "plot_layer_alphas",
    "plot_needle_grid", "plot_serve", "plot_sweep", "plot_tier_heatmap", "plot_tier_mix", "plot_tier_strip",
    "prefill_stats", "profile_dict", "serve_results", "tier_fractions", "tokens_html", "track_tiers",
]
