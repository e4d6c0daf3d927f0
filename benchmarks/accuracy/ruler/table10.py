"""Issue #46: the per-family RULER table of every run under ``ruler/`` (DiffKV eval runs and kvpress peers), on the
sample ids that every listed run has scored, so partial runs compare like with like.

    .venv/bin/python benchmarks/accuracy/ruler/table10.py                      # in-prompt-10 and peers-10, in-prompt
    .venv/bin/python benchmarks/accuracy/ruler/table10.py --protocol ask-after --ratios   # + per-family bytes
    .venv/bin/python benchmarks/accuracy/ruler/table10.py --plot benchmarks/accuracy/ruler/frontier-10-in-prompt.png
    .venv/bin/python benchmarks/accuracy/ruler/table10.py --folder in-prompt-5-1.5b    # only that folder's runs
    .venv/bin/python benchmarks/accuracy/ruler/table10.py --protocol ask-after --folder seed1/in-prompt,seed1/ask-after
    .venv/bin/python benchmarks/accuracy/ruler/table10.py --folder seed1/in-prompt --peers seed1/peers-10

Sources: ``<protocol>-10/<model>/ruler/<method>/samples.jsonl`` (``diffkv eval run``: ``score``, ``family``,
``batch_stats.compression_physical``) and ``peers-10/<protocol>-<press>-r<ratio>.jsonl`` (``run_kvpress.py``:
scored here with RULER's string match; its ratio is the bytes it was given, ``1 / kept_fraction``). The full cache
answers alike in both protocols (tests/test_ruler.py), so its in-prompt run is the reference for both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from diffkv.eval.ruler import string_match

HERE = Path(__file__).resolve().parent


def eval_runs(protocol: str, folder: str | None = None) -> dict[str, dict[str, tuple[str, float, float]]]:
    """run name -> sample id -> (family, score, physical compression); ``folder``: only the runs under these
    (comma-separated; a folder whose name has ``ask-after`` holds that protocol's runs, any other in-prompt ones)."""
    folders = {"in-prompt-10": "in-prompt"} | ({f"{protocol}-10": protocol} if protocol != "in-prompt" else {})
    if folder:
        folders = {f: "ask-after" if "ask-after" in f else "in-prompt" for f in folder.split(",")}
    runs = {}
    for folder, proto in folders.items():
        for path in sorted((HERE / folder).glob("*/ruler/*/samples.jsonl")):
            name = path.parent.name if proto == "in-prompt" else f"{path.parent.name} ({proto})"
            if proto != protocol and path.parent.name != "full":
                continue  # the other protocol's DiffKV runs
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            runs[name] = {r["id"]: (r["family"], float(r["score"]),
                                    (r.get("batch_stats") or {}).get("compression_physical") or 1.0) for r in rows}
    return runs


def peer_runs(protocol: str, folder: str = "peers-10") -> dict[str, dict[str, tuple[str, float, float]]]:
    runs = {}
    for path in sorted((HERE / folder).glob(f"{protocol}-*.jsonl")):
        if path.name.endswith(".metrics.json"):
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        runs[f"kvpress {rows[0]['press']}" if rows else path.stem] = {
            r["id"]: (r["family"], string_match(r["output"], r["references"], r["metric"]),
                      1 / r["kept_fraction"] if r.get("kept_fraction") else 1.0) for r in rows}
    return runs


def common_ids(runs: dict[str, dict[str, tuple[str, float, float]]]) -> set[str]:
    return set.intersection(*(set(r) for r in runs.values())) if runs else set()


def points(runs: dict[str, dict[str, tuple[str, float, float]]]) -> dict[str, tuple[float, float]]:
    """run name -> (bytes-weighted physical compression, RULER score) on the common sample ids."""
    common = common_ids(runs)
    return {n: (len(common) / sum(1 / r[i][2] for i in common), sum(r[i][1] for i in common) / len(common))
            for n, r in runs.items()} if common else {}


def plot(runs: dict[str, dict[str, tuple[str, float, float]]], path: Path, protocol: str,
         model: str = "qwen2.5-0.5b") -> None:
    """The frontier panel: RULER score vs physical compression, a point per run (on the common ids)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(runs)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for i, (name, (ratio, score)) in enumerate(sorted(pts.items(), key=lambda kv: kv[1][0])):
        style = ("o", "#2b8a3e") if name.startswith("diffkv") else ("s", "#1f77b4") if name.startswith("kvpress") \
            else ("*", "black")
        ax.scatter(ratio, score, marker=style[0], color=style[1], s=60, zorder=3)
        label = name.replace("diffkv-compact-meta", "diffkv").replace("+page_bytes=1472", "")
        for long, short in (("+score_spans=true", " spans"), ("+importance=peak+prompt_scores=repeat", " repeat"),
                            (" (ask-after)", "")):
            label = label.replace(long, short)
        ax.annotate(label, (ratio, score), textcoords="offset points",
                    xytext=(6, 4 if i % 2 else -11), fontsize=7)  # alternate sides: neighbours' labels overlap
    full = pts.get("full")
    if full:  # issue #46's targets: within 3 points of full in-prompt, 5 points ask-after
        gap = 5 if protocol == "ask-after" else 3
        ax.axhline(full[1] - gap / 100, color="grey", ls=":", lw=1, label=f"full - {gap} points (target)")
        ax.legend(loc="lower left", fontsize=7)
    ax.set_xscale("log", base=2)
    top = max(r for r, _ in pts.values()) if pts else 8
    ax.set_xlim(0.8, top * 2)
    ticks = [t for t in (1, 2, 4, 8, 16, 32) if t <= top * 2]
    ax.set_xticks(ticks, [f"{t}x" for t in ticks])
    ax.set_xlabel("physical compression (bytes-weighted, x)")
    ax.set_ylabel("RULER score (mean of samples)")
    n = len(common_ids(runs))
    ax.set_title(f"RULER-style 4k, {model}, {protocol}: {n} common samples", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def table(runs: dict[str, dict[str, tuple[str, float, float]]], ratios: bool = False) -> str:
    """Per-family RULER scores on the common ids; ``ratios`` adds each family's bytes-weighted compression."""
    common = common_ids(runs)
    names = list(runs)
    fams = sorted({runs[names[0]][i][0] for i in common}) if common else []
    lines = [f"| family (n) | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
    for fam in fams:
        ids = [i for i in common if runs[names[0]][i][0] == fam]
        cells = [f"{sum(runs[n][i][1] for i in ids) / len(ids):.2f}"
                 + (f" ({len(ids) / sum(1 / runs[n][i][2] for i in ids):.1f}×)" if ratios else "") for n in names]
        lines.append(f"| {fam} ({len(ids)}) | {' | '.join(cells)} |")
    if common:
        score = [f"**{sum(runs[n][i][1] for i in common) / len(common):.3f}**" for n in names]
        full = [f"{sum(runs[n][i][1] == 1.0 for i in common)}/{len(common)}" for n in names]
        ratio = [f"{len(common) / sum(1 / runs[n][i][2] for i in common):.2f}×" for n in names]
        lines += [f"| **RULER score** | {' | '.join(score)} |", f"| all-correct | {' | '.join(full)} |",
                  f"| physical (bytes-weighted) | {' | '.join(ratio)} |"]
    counts = ", ".join(f"{n}: {len(r)}" for n, r in runs.items())
    return "\n".join(lines) + f"\n\nOn the {len(common)} sample ids every run has scored (scored so far: {counts})."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", choices=("in-prompt", "ask-after"), default="in-prompt")
    ap.add_argument("--plot", type=Path, help="also draw the frontier panel into this PNG")
    ap.add_argument("--runs", help="comma-separated run names to keep (default: all)")
    ap.add_argument("--ratios", action="store_true", help="each family's bytes-weighted compression in its cells")
    ap.add_argument("--folder", help="only the eval runs under these comma-separated folders of ruler/ (e.g. "
                    "in-prompt-5-1.5b), no peers unless --peers")
    ap.add_argument("--peers", help="the kvpress runs of this folder of ruler/ (default: peers-10 without --folder)")
    args = ap.parse_args()
    for folder in (args.folder.split(",") if args.folder else []) + ([args.peers] if args.peers else []):
        if not (HERE / folder).is_dir():
            ap.error(f"no folder {HERE / folder}")
    peers = args.peers or (None if args.folder else "peers-10")
    runs = eval_runs(args.protocol, args.folder) | (peer_runs(args.protocol, peers) if peers else {})
    if args.runs:
        runs = {n: r for n, r in runs.items() if n in args.runs.split(",")}
    print(table(runs, args.ratios))
    if args.plot:
        found = (HERE / (args.folder or "in-prompt-10").split(",")[0]).glob("*/ruler/*/samples.jsonl")
        models = {p.parent.parent.parent.name for p in found}  # <folder>/<model>/ruler/<method>/samples.jsonl
        plot(runs, args.plot, args.protocol, ", ".join(sorted(models)) or "qwen2.5-0.5b")


if __name__ == "__main__":
    main()
