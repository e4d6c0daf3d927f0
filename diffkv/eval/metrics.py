"""Metrics of a run folder: accuracy ± stderr (or perplexity), flips vs ``full``, compression, tokens per tier, and
accuracy per task family when the rows name one (``per_family``; ruler).

Compression is aggregated over the batches of the run (each row carries its batch's cache stats): physical =
sum of fp16 bytes of the tokens seen / sum of bytes the cache kept; theoretical likewise from stored bits.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from diffkv.eval.answers import mean_stderr


def read_samples(path: Path, ids: list[str] | None = None) -> dict[str, dict]:
    """``{id: row}`` of ``path/samples.jsonl`` (the last row of an id wins), restricted to ``ids`` if given."""
    rows: dict[str, dict] = {}
    file = Path(path) / "samples.jsonl"
    if file.is_file():
        for line in file.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[row["id"]] = row
    if ids is not None:
        keep = set(ids)
        rows = {k: v for k, v in rows.items() if k in keep}
    return rows


def _compression(rows: dict[str, dict]) -> dict:
    batches = {r["batch"]: r["batch_stats"] for r in rows.values() if r.get("batch_stats")}
    fp16 = sum(s.get("fp16_bytes") or 0 for s in batches.values())
    kept = sum(s.get("bytes_kept") or s.get("bytes_in_pages") or 0 for s in batches.values())
    tiers = {t: sum((s.get("tokens_per_tier") or {}).get(t, 0) for s in batches.values())
             for t in ("high", "low", "pruned")}
    cells = sum(tiers.values())
    theo = [(s["compression_theoretical"], s.get("fp16_bytes") or 0) for s in batches.values()
            if s.get("compression_theoretical")]
    weight = sum(w for _, w in theo)
    return {
        "compression_physical": fp16 / kept if kept else None,
        "compression_theoretical": weight / sum(w / c for c, w in theo) if weight else None,  # bytes-weighted
        "tokens_per_tier": tiers,
        "tier_fractions": {t: n / cells for t, n in tiers.items()} if cells else None,
    }


def full_run_dir(path: Path) -> Path | None:
    """The ``full`` run to compare ``path`` (``<out>/<model>/<task>/<method>``) with: its sibling, else the one in
    the results tree one level up (``<out>/..``), where a run recorded under its own ``--out`` finds it."""
    path = Path(path)
    if path.name == "full":
        return None
    model, task = path.parent.parent.name, path.parent.name
    for cand in (path.parent / "full", path.parent.parent.parent.parent / model / task / "full"):
        if (cand / "samples.jsonl").is_file():
            return cand
    return None


def _flips(rows: dict[str, dict], path: Path) -> dict | None:
    """Samples whose correctness / prediction differs from the ``full`` run of the same model and task."""
    full_dir = full_run_dir(path)
    if full_dir is None:
        return None
    full = read_samples(full_dir, list(rows))
    common = [i for i in rows if i in full]
    if not common:
        return None
    if "nll" in rows[common[0]]:
        return None
    flips = [i for i in common if bool(rows[i]["correct"]) != bool(full[i]["correct"])]
    return {"n_common": len(common), "flips": len(flips),
            "correct_to_wrong": sum(1 for i in flips if full[i]["correct"]),
            "wrong_to_correct": sum(1 for i in flips if rows[i]["correct"]),
            "answers_changed": sum(1 for i in common if rows[i].get("prediction") != full[i].get("prediction")),
            "full_accuracy_on_common": sum(bool(full[i]["correct"]) for i in common) / len(common),
            "full_run": os.path.relpath(full_dir, path)}


def _groups(rows: dict[str, dict]) -> dict:
    """Accuracy (and mean ``score``, RULER's number) per ``family`` of the rows, and per ``length`` within a
    family when the rows hold several lengths; empty when the rows carry no family."""
    if not any("family" in r for r in rows.values()):
        return {}

    def summary(group: list[dict]) -> dict:
        out = {"n": len(group), "accuracy": sum(bool(r["correct"]) for r in group) / len(group)}
        if all("score" in r for r in group):
            out["score"] = sum(r["score"] for r in group) / len(group)
        return out

    families: dict[str, list[dict]] = {}
    for r in rows.values():
        families.setdefault(r.get("family", "?"), []).append(r)
    per_family = {}
    for name, group in families.items():
        per_family[name] = summary(group)
        lengths = sorted({r.get("length") for r in group}, key=str)
        if len(lengths) > 1:
            per_family[name]["per_length"] = {str(n): summary([r for r in group if r.get("length") == n])
                                              for n in lengths}
    out = {"per_family": per_family}
    if all("score" in f for f in per_family.values()):
        out["score_mean_of_families"] = sum(f["score"] for f in per_family.values()) / len(per_family)
    return out


def compute_metrics(path: Path, ids: list[str], config: dict) -> dict:
    """Metrics of the rows of ``path/samples.jsonl`` whose ids are in ``ids`` (the run's sample list)."""
    rows = read_samples(path, ids)
    out = {"model": config["model"], "task": config["task"], "method": config["method"], "n": len(rows),
           "n_requested": len(ids), "budget": config.get("budget")}
    if rows and "nll" in next(iter(rows.values())):
        nll, se = mean_stderr([r["nll"] for r in rows.values()])
        out.update({"ppl": math.exp(nll), "nll": nll, "nll_stderr": se})
        full_dir = full_run_dir(path)
        full = read_samples(full_dir, list(rows)) if full_dir is not None else {}
        if full and set(full) == set(rows):
            full_nll = sum(r["nll"] for r in full.values()) / len(full)
            out["ppl_increase_vs_full"] = math.exp(nll - full_nll) - 1
    else:
        acc, se = mean_stderr([float(bool(r["correct"])) for r in rows.values()])
        out.update({"accuracy": acc, "stderr": se, "flips_vs_full": _flips(rows, path),
                    "mean_new_tokens": (sum(r.get("new_tokens", 0) for r in rows.values()) / len(rows)
                                        if rows else None)})
        out.update(_groups(rows))
    out.update(_compression(rows))
    return out
