"""Side-by-side table of the needle runs under ``in-prompt/`` and ``ask-after/`` (written by ``run.sh``).

    .venv/bin/python benchmarks/accuracy/ask-after/table.py > benchmarks/accuracy/ask-after/results.md
    .venv/bin/python benchmarks/accuracy/ask-after/table.py benchmarks/accuracy/ask-after/seed1   # another root

One row per method: correct / n, physical compression and high / low / pruned token shares per protocol, and the
samples each protocol got wrong.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOCOLS = ("in-prompt", "ask-after")
METHODS = ("full", "diffkv", "snapkv", "h2o")


def _run(root: Path, protocol: str, method: str) -> tuple[dict, list[dict]] | None:
    run = root / protocol / "qwen2.5-0.5b" / "needle" / method
    if not (run / "metrics.json").is_file():
        return None
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((run / "metrics.json").read_text()), rows


def _cell(run: tuple[dict, list[dict]] | None) -> list[str]:
    if run is None:
        return ["–", "–", "–", "–"]
    m, rows = run
    correct = sum(bool(r["correct"]) for r in rows)
    tiers = m.get("tier_fractions") or {}
    split = " / ".join(f"{100 * tiers.get(t, 0):.0f}" for t in ("high", "low", "pruned"))
    wrong = ", ".join(f"{r['id'].split('-')[2]}: {r['prediction']!r}" for r in rows if not r["correct"]) or "–"
    return [f"{correct}/{len(rows)}", f"{m['compression_physical']:.2f}×", split, wrong]


def main(root: Path = HERE) -> None:
    head = ["method"] + [f"{p} {c}" for p in PROTOCOLS for c in ("correct", "physical", "high/low/pruned %", "wrong")]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for method in METHODS:
        cells = [c for p in PROTOCOLS for c in _cell(_run(root, p, method))]
        print(f"| {method} | " + " | ".join(cells) + " |")
    configs = [root / p / "qwen2.5-0.5b" / "needle" / m / "config.json" for p in PROTOCOLS for m in ("snapkv", "h2o")]
    budgets = {json.loads(c.read_text())["budget"] for c in configs if c.is_file()}
    print(f"\nEviction budget (fraction of tokens kept): {', '.join(map(str, sorted(budgets))) or '–'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
