"""Issue #46, why cwe differs: RULER scores cwe by the recall of the 10 most common words anywhere in the answer, so
a longer list scores higher whether or not the model counted. Per in-prompt-10 run: the RULER score, the recall of
the answer's first 10 distinct words (what the question asks for), and the mean number of distinct words listed.

    .venv/bin/python benchmarks/accuracy/ruler/cwe_lists.py [RUN ...]   # default: full, shipped, score_spans x4

A RUN is a folder name under in-prompt-10/qwen2.5-0.5b/ruler/, or a path from ruler/ for the other protocol
(ask-after-10/qwen2.5-0.5b/ruler/<method>).
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent / "in-prompt-10" / "qwen2.5-0.5b" / "ruler"
DEFAULT = ["full", "diffkv-compact-meta+page_bytes=1472", "diffkv-compact-meta@x4+page_bytes=1472+score_spans=true"]


def distinct_words(output: str) -> list[str]:
    out: list[str] = []
    for word in (w.strip(" .,\n").lower() for w in output.split(",")):
        if word and word not in out:
            out.append(word)
    return out


def main(runs: list[str]) -> None:
    print("| run | RULER score (cwe) | recall of the first 10 distinct words | distinct words listed |")
    print("|---|---|---|---|")
    for run in runs:
        folder = Path(__file__).parent / run if "/" in run else HERE / run
        rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["family"] == "cwe"]
        if not rows:
            raise SystemExit(f"{run}: no cwe samples")
        score = sum(r["score"] for r in rows) / len(rows)
        first = [distinct_words(r["output"]) for r in rows]
        recall = sum(len(set(r["reference"]) & set(w[:10])) / len(r["reference"])
                     for r, w in zip(rows, first, strict=True))
        print(f"| {run} (n={len(rows)}) | {score:.2f} | {recall / len(rows):.2f} | "
              f"{sum(map(len, first)) / len(rows):.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
