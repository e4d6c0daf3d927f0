"""Pairs the whole-prompt and chunk-512 needle runs of ``run.sh`` by sample id and prints a markdown summary:
cases done in both, correct in each, lost / gained by chunking, mean physical compression of each.

    python benchmarks/accuracy/chunked/compare.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
RUN = "qwen2.5-0.5b/needle/diffkv-compact-meta+page_bytes=1472/samples.jsonl"


def rows(name: str) -> dict[str, dict]:
    path = HERE / name / RUN
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())} if path.is_file() else {}


def main() -> None:
    whole, chunk = rows("whole"), rows("chunk512")
    both = sorted(set(whole) & set(chunk))
    lost = [i for i in both if whole[i]["correct"] and not chunk[i]["correct"]]
    gained = [i for i in both if chunk[i]["correct"] and not whole[i]["correct"]]

    def mean(rs, key="compression_physical"):
        vals = [r["batch_stats"][key] for r in rs if r["batch_stats"].get(key)]
        return sum(vals) / len(vals) if vals else float("nan")

    print(f"| | whole prompt | chunks of 512 (extend) |\n|---|---|---|\n"
          f"| cases run | {len(whole)} | {len(chunk)} |\n"
          f"| correct, cases run in both ({len(both)}) | {sum(whole[i]['correct'] for i in both)} | "
          f"{sum(chunk[i]['correct'] for i in both)} |\n"
          f"| physical compression (mean over batches, both) | {mean([whole[i] for i in both]):.2f}x | "
          f"{mean([chunk[i] for i in both]):.2f}x |\n")
    print(f"lost by chunking: {lost or 'none'}; gained: {gained or 'none'}")


if __name__ == "__main__":
    main()
