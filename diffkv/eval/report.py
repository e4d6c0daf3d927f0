"""``diffkv eval report``: a markdown table of the runs at the top of a results folder and (if matplotlib is
installed) the compression–quality frontier of every run under it, variant folders included."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_HEADER = ("| model | task | method | n | accuracy ± se / ppl | flips vs full | physical × | theoretical × "
           "| high / low / pruned |\n|---|---|---|---|---|---|---|---|---|")


def collect(out: str | Path, model: str | None = None, task: str | None = None) -> list[dict]:
    """Every ``<out>/<model>/<task>/<method>/metrics.json``, optionally filtered, sorted by model/task/method."""
    rows = []
    for f in sorted(Path(out).glob("*/*/*/metrics.json")):
        m = json.loads(f.read_text())
        if (model is None or f.parts[-4] == model) and (task is None or f.parts[-3] == task):
            rows.append({**m, "model_tag": f.parts[-4], "task": f.parts[-3], "method": f.parts[-2]})
    return rows


def frontier_rows(out: str | Path, model: str | None = None, task: str | None = None) -> list[dict]:
    """Every run under ``out``, variant folders included (:func:`diffkv.viz.frontier.load_runs`), filtered."""
    from diffkv.viz.frontier import load_runs

    return [r for r in load_runs(out)
            if (model is None or r["model_tag"] == model) and (task is None or r["task"] == task)]


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(rows: list[dict]) -> str:
    """One table row per run: accuracy in % ± stderr (or perplexity and its change vs full), flips, compression."""
    lines = [_HEADER]
    for r in rows:
        if "ppl" in r:
            inc = r.get("ppl_increase_vs_full")
            score = f"ppl {r['ppl']:.3f}" + (f" ({inc:+.2%})" if inc is not None else "")
        else:
            score = f"{100 * r['accuracy']:.1f} ± {100 * r['stderr']:.1f}" if r.get("n") else "–"
        fl = r.get("flips_vs_full")
        flips = f"{fl['flips']}/{fl['n_common']}" if fl else "–"
        fr = r.get("tier_fractions") or {}
        tiers = " / ".join(f"{100 * fr[t]:.0f}%" for t in ("high", "low", "pruned")) if fr else "–"
        lines.append(f"| {r['model_tag']} | {r['task']} | {r['method']} | {r.get('n', 0)} | {score} | {flips} | "
                     f"{_fmt(r.get('compression_physical'), '.2f')} | {_fmt(r.get('compression_theoretical'), '.2f')}"
                     f" | {tiers} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, dpi: int = 100) -> Path | None:
    """Quality vs physical compression of ``rows`` (accuracy or perplexity, one panel per setting, a line per method
    family through its operating points, the Pareto frontier dashed; :func:`diffkv.viz.plot_frontier`) saved to
    ``path``; None if matplotlib is not installed or no row has a quality and a compression."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from diffkv.viz.frontier import plot_frontier

    fig = plot_frontier(rows, dpi=dpi)
    if fig is None:
        return None
    fig.savefig(path)
    return Path(path)
