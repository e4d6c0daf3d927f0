"""Pairs the whole-prompt needle run of ``run.sh`` with each chunked run (chunk512: ``extend``; chunk512-deferred)
by sample id and prints a markdown summary: cases done in both, correct in each, lost / gained by chunking,
identical outputs, mean physical compression of each.

    python benchmarks/accuracy/chunked/compare.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
RUN = "qwen2.5-0.5b/needle/diffkv-compact-meta+page_bytes=1472/samples.jsonl"
CHUNKED = {"chunk512": "chunks of 512, extend", "chunk512-deferred": "chunks of 512, deferred"}


def rows(name: str) -> dict[str, dict]:
    path = HERE / name / RUN
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())} if path.is_file() else {}


def mean(rs: list[dict], key: str = "compression_physical") -> float:
    vals = [r["batch_stats"][key] for r in rs if r["batch_stats"].get(key)]
    return sum(vals) / len(vals) if vals else float("nan")


def main() -> None:
    whole = rows("whole")
    print("| | cases in both | correct, whole | correct, chunked | lost | gained | same output | compression, "
          "whole | compression, chunked |\n|---|---|---|---|---|---|---|---|---|")
    for name, label in CHUNKED.items():
        chunk = rows(name)
        both = sorted(set(whole) & set(chunk))
        lost = [i for i in both if whole[i]["correct"] and not chunk[i]["correct"]]
        gained = [i for i in both if chunk[i]["correct"] and not whole[i]["correct"]]
        same = sum(whole[i]["output"] == chunk[i]["output"] for i in both)
        print(f"| {label} | {len(both)} | {sum(whole[i]['correct'] for i in both)} | "
              f"{sum(chunk[i]['correct'] for i in both)} | {len(lost)} | {len(gained)} | {same} | "
              f"{mean([whole[i] for i in both]):.2f}x | {mean([chunk[i] for i in both]):.2f}x |")
    print(f"\nwhole prompt: {len(whole)} cases, {sum(r['correct'] for r in whole.values())} correct")


if __name__ == "__main__":
    main()
