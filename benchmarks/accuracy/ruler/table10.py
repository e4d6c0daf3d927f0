"""Issue #46: the per-family RULER table of every run under ``ruler/`` (DiffKV eval runs and kvpress peers), on the
sample ids that every listed run has scored, so partial runs compare like with like.

    .venv/bin/python benchmarks/accuracy/ruler/table10.py                      # in-prompt-10 and peers-10, in-prompt
    .venv/bin/python benchmarks/accuracy/ruler/table10.py --protocol ask-after

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


def eval_runs(protocol: str) -> dict[str, dict[str, tuple[str, float, float]]]:
    """run name -> sample id -> (family, score, physical compression)."""
    folders = {"in-prompt-10": "in-prompt"} | ({f"{protocol}-10": protocol} if protocol != "in-prompt" else {})
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


def peer_runs(protocol: str) -> dict[str, dict[str, tuple[str, float, float]]]:
    runs = {}
    for path in sorted((HERE / "peers-10").glob(f"{protocol}-*.jsonl")):
        if path.name.endswith(".metrics.json"):
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        runs[f"kvpress {rows[0]['press']}" if rows else path.stem] = {
            r["id"]: (r["family"], string_match(r["output"], r["references"], r["metric"]),
                      1 / r["kept_fraction"] if r.get("kept_fraction") else 1.0) for r in rows}
    return runs


def table(runs: dict[str, dict[str, tuple[str, float, float]]]) -> str:
    common = set.intersection(*(set(r) for r in runs.values())) if runs else set()
    names = list(runs)
    fams = sorted({runs[names[0]][i][0] for i in common}) if common else []
    lines = [f"| family (n) | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
    for fam in fams:
        ids = [i for i in common if runs[names[0]][i][0] == fam]
        cells = [f"{sum(runs[n][i][1] for i in ids) / len(ids):.2f}" for n in names]
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
    args = ap.parse_args()
    print(table(eval_runs(args.protocol) | peer_runs(args.protocol)))


if __name__ == "__main__":
    main()
