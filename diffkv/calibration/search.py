"""Threshold search under a quality budget: the published coordinate sweep, then per-layer thresholds.

1. Global sweep (docs/algorithm.md §6): alpha_high over a grid with alpha_low = 0 (ascending, stop at the first
   candidate over budget), then alpha_low over a grid at the chosen alpha_high. Every candidate is measured
   (:func:`~diffkv.calibration.quality.measure_quality`); the most compressive one within budget wins.
2. Per-layer (beyond the paper): the profiling statistics predict, for every layer and every pair of a grid, the
   page bytes and the share of decode attention that lands on pruned / low tokens. A KL proxy
   ``pruned_mass + w * low_mass`` (``w`` fitted on the measured global candidates) ranks layer sensitivity; for
   a Lagrange weight ``lam`` each layer takes the pair minimizing ``bytes / fp16_bytes + lam * proxy``. The
   frontier of such assignments is bisected with real measurements for the most compressive one within budget.
3. Context point (issue #62): the thresholds of the point a context compressed before its question is placed by
   (repeat scores, peak importance: ``diffkv.core.points``) as the window point's times a scale, ascending over
   :data:`CONTEXT_SCALES` until a scale is over budget (:func:`context_sweep`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from diffkv.calibration.predict import config_alphas, predict
from diffkv.calibration.quality import measure_quality
from diffkv.core.config import DiffKVConfig
from diffkv.core.points import context_point
from diffkv.profile import config_to_dict

QUICK_HIGH = (0.5, 1.0, 2.0, 4.0, 8.0)
QUICK_LOW = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
FULL_HIGH = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)
FULL_LOW = (0.01, 0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0)
LAYER_HIGH = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
LAYER_LOW = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
CONTEXT_SCALES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)  # context point thresholds / window point's
QUICK_CONTEXT = (4.0, 16.0, 64.0)


@dataclass(frozen=True)
class Budget:
    """Quality budget: mean KL(full || DiffKV) per token (nats) and/or perplexity increase (0.03 = +3 %)."""

    max_kl: float | None = None
    max_ppl_increase: float | None = None

    def __post_init__(self):
        if self.max_kl is None and self.max_ppl_increase is None:
            raise ValueError("give a quality budget: --max-kl and/or --max-ppl-increase")
        for name in ("max_kl", "max_ppl_increase"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ValueError(f"{name} must be >= 0, got {v}")

    def ok(self, m: dict) -> bool:
        return ((self.max_kl is None or m["kl"] <= self.max_kl)
                and (self.max_ppl_increase is None or m["ppl_ratio"] - 1 <= self.max_ppl_increase))


def best_row(rows: list[dict], budget: Budget) -> dict | None:
    """The most compressive row within budget (ties: the lower KL)."""
    ok = [r for r in rows if budget.ok(r)]
    return max(ok, key=lambda r: (r["compression_physical"], -r["kl"])) if ok else None


def global_sweep(evaluate, base: DiffKVConfig, budget: Budget, highs=QUICK_HIGH, lows=QUICK_LOW) -> list[dict]:
    """Measured rows of the coordinate sweep (``evaluate(config) -> dict``); each row has ``stage`` and alphas."""
    rows = [{"stage": "baseline", **evaluate(replace(base, alpha_high=0.0, alpha_low=0.0, layer_alphas=None))}]
    for ah in sorted(highs):
        rows.append({"stage": "alpha_high", **evaluate(replace(base, alpha_high=ah, alpha_low=0.0, layer_alphas=None))})
        if not budget.ok(rows[-1]):
            break
    chosen = best_row([r for r in rows if r["stage"] == "alpha_high"], budget)
    if chosen is None:
        return rows
    ah = chosen["alpha_high"]  # the most compressive alpha_high within budget (ties: the lower KL)
    for al in sorted(x for x in lows if x <= min(ah, 1.0)):
        rows.append({"stage": "alpha_low", **evaluate(replace(base, alpha_high=ah, alpha_low=al, layer_alphas=None))})
        if not budget.ok(rows[-1]):
            break
    return rows


def context_sweep(evaluate, config: DiffKVConfig, budget: Budget, scales=CONTEXT_SCALES) -> list[dict]:
    """Measured rows of the context point (``diffkv.core.points.context_point``: repeat scores, peak importance,
    ``config``'s thresholds x scale) over ascending ``scales``, stopping at the first over budget. Each row has
    ``stage`` "context" and its ``context_scale``. The protocol is the window point's (a context compressed, then
    its continuation teacher-forced): the two points answer the same budget."""
    rows = []
    for s in sorted(scales):
        rows.append({"stage": "context", "context_scale": s,
                     **evaluate(context_point(replace(config, context_scale=s)))})
        if not budget.ok(rows[-1]):
            break
    return rows


def _fit_weight(stats, base: DiffKVConfig, rows: list[dict]) -> float:
    """w of the proxy ``pruned_mass + w * low_mass`` from measured (KL, predicted masses) of global rows."""
    alphas = torch.cat([config_alphas(replace(base, alpha_high=r["alpha_high"], alpha_low=r["alpha_low"]),
                                      stats.layers) for r in rows])
    pred = predict(stats, base, alphas)
    ones = torch.ones(len(rows), dtype=torch.float64)  # intercept: the quantization error of the high tier
    x = torch.stack([pred.pruned_mass.sum(1), pred.low_mass.sum(1), ones], 1)  # [R, 3]
    y = torch.tensor([r["kl"] for r in rows], dtype=torch.float64)[:, None]
    if len(rows) < 3:
        return 0.1
    coef = torch.linalg.lstsq(x, y).solution[:, 0]
    if coef[0] > 0 and coef[1] > 0:
        return float(coef[1] / coef[0])
    return 0.1 if coef[1] <= 0 else 10.0


def layer_frontier(stats, base: DiffKVConfig, weight: float, highs=LAYER_HIGH, lows=LAYER_LOW) -> list[dict]:
    """Per-layer assignments along the Lagrange weight, most compressive first (predicted, no model run).

    Each entry: ``layer_alphas`` (one pair per recorded layer), ``predicted_compression``, ``proxy`` (sum over
    layers of pruned_mass + weight * low_mass) and ``lam``.
    """
    pairs = [(ah, al) for ah in highs for al in lows if al <= min(ah, 1.0)]
    grid = torch.tensor(pairs, dtype=torch.float64)[:, None, :].expand(-1, len(stats.layers), -1).contiguous()
    pred = predict(stats, base, grid)
    cost = pred.layer_bytes() / (pred.pages[0, 0].numel() * pred.fp16_bytes_per_head)  # [G, layers]
    proxy = pred.pruned_mass + weight * pred.low_mass
    fp16 = pred.pages[0].numel() * pred.fp16_bytes_per_head
    seen, out = set(), []
    for lam in torch.logspace(-3, 4, 57).tolist():
        pick = (cost + lam * proxy).argmin(0)  # [layers]
        key = tuple(pick.tolist())
        if key in seen:
            continue
        seen.add(key)
        cols = torch.arange(len(stats.layers))
        out.append({"layer_alphas": [list(pairs[i]) for i in key], "lam": lam,
                    "predicted_compression": float(fp16 / pred.layer_bytes()[pick, cols].sum()),
                    "proxy": float(proxy[pick, cols].sum())})
    return sorted(out, key=lambda r: -r["predicted_compression"])


def per_layer_search(evaluate, stats, base: DiffKVConfig, budget: Budget, global_rows: list[dict],
                     max_evals: int = 5, highs=LAYER_HIGH, lows=LAYER_LOW) -> dict:
    """Bisect the per-layer frontier with measurements. Returns ``{"weight", "frontier_size", "rows", "best"}``."""
    best_global = best_row(global_rows, budget)
    if best_global is not None:
        base = replace(base, alpha_high=best_global["alpha_high"], alpha_low=best_global["alpha_low"])
    weight = _fit_weight(stats, base, global_rows)
    frontier = layer_frontier(stats, base, weight, highs, lows)
    floor = best_global["predicted_compression"] if best_global else 0.0
    frontier = [f for f in frontier if f["predicted_compression"] > floor]  # only what could beat the global one
    rows: list[dict] = []
    lo, hi = 0, len(frontier) - 1  # frontier[lo] most compressive; find the first index within budget
    while lo <= hi and len(rows) < max_evals:
        mid = (lo + hi) // 2
        cand = frontier[mid]
        layer_alphas = _expand(cand["layer_alphas"], stats.layers, stats.meta["num_layers"], base)
        m = evaluate(replace(base, layer_alphas=layer_alphas))
        rows.append({"stage": "per_layer", "lam": cand["lam"], "proxy": cand["proxy"], **m,
                     "layer_alphas": [list(p) for p in layer_alphas]})
        if budget.ok(m):
            hi = mid - 1
        else:
            lo = mid + 1
    return {"weight": weight, "frontier_size": len(frontier), "rows": rows, "best": best_row(rows, budget)}


def _expand(pairs: list[list[float]], layers: list[int], num_layers: int, base: DiffKVConfig) -> tuple:
    """Per recorded layer pairs -> one pair per model layer (unrecorded layers, e.g. sliding, get the global)."""
    full = [(base.alpha_high, base.alpha_low)] * num_layers
    for i, p in zip(layers, pairs, strict=False):
        full[i] = tuple(p)
    return tuple(full)


class CachedEvaluator:
    """``evaluate(config) -> row``: measured quality + predicted compression (None for peak importance, which the
    predictor does not replay), memoized in a JSONL file (resume). tokenizer: for repeat-score configs."""

    def __init__(self, model, stats, path: str | Path | None = None, batch_size: int | None = None,
                 progress: bool = False, tokenizer=None):
        self.model, self.stats, self.batch_size, self.progress = model, stats, batch_size, progress
        self.tokenizer = tokenizer
        self.path = Path(path) if path else None
        self.done: dict[str, dict] = {}
        if self.path and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    entry = json.loads(line)
                    self.done[entry["key"]] = entry["row"]
        self.measured = 0

    def __call__(self, config: DiffKVConfig) -> dict:
        key = json.dumps(config_to_dict(config), sort_keys=True)
        if key in self.done:
            return dict(self.done[key], cached=True)
        start = time.perf_counter()
        row = measure_quality(self.model, self.stats, config, self.batch_size, self.progress, self.tokenizer)
        pred = None if config.peak else predict(self.stats, config, config_alphas(config, self.stats.layers))
        row.update(alpha_high=config.alpha_high, alpha_low=config.alpha_low,
                   per_layer=config.layer_alphas is not None,
                   predicted_compression=None if pred is None else float(pred.compression()[0]),
                   predicted_tier_fractions=None if pred is None else pred.tier_fractions(),
                   seconds=round(time.perf_counter() - start, 1))
        self.done[key] = row
        self.measured += 1
        if self.progress:
            from tqdm.auto import tqdm

            pred = row["predicted_compression"]
            tqdm.write(f"measured {'per-layer' if row['per_layer'] else (config.alpha_high, config.alpha_low)}: "
                       f"{row['compression_physical']:.2f}x (predicted "
                       f"{'-' if pred is None else f'{pred:.2f}x'}), "
                       f"KL {row['kl']:.4f}, top-1 {row['top1']:.3f}, ppl x{row['ppl_ratio']:.4f}, {row['seconds']}s")
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "row": row}) + "\n")
        return dict(row)
