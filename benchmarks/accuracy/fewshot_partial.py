"""Summary of the stopped 4-shot GSM8K runs in ``benchmarks/accuracy/fewshot/`` (30 of the first 100 questions
each; the runner writes ``metrics.json`` only at the end, so these folders have samples only).

    .venv/bin/python benchmarks/accuracy/fewshot_partial.py > benchmarks/accuracy/fewshot/summary.json

Per method: questions done, correct answers, physical compression over the recorded batches (fp16 bytes ÷ bytes in
pages); and the zero-shot full cache's correct answers on the same questions (``qwen2.5-0.5b/gsm8k/full``).
"""

import json
from pathlib import Path

ROOT = Path("benchmarks/accuracy")


def load(folder: Path) -> dict[str, dict]:
    return {s["id"]: s for s in map(json.loads, (folder / "samples.jsonl").read_text().splitlines())}


def main() -> None:
    zero_shot = load(ROOT / "qwen2.5-0.5b/gsm8k/full")
    out = {}
    for method in ("full", "diffkv"):
        runs = load(ROOT / "fewshot/qwen2.5-0.5b/gsm8k" / method)
        batches = {s["batch"]: s["batch_stats"] for s in runs.values()}
        fp16, held = (sum(b[k] for b in batches.values()) for k in ("fp16_bytes", "bytes_in_pages"))
        out[method] = {"shots": 4, "questions": sorted(runs, key=lambda i: int(i.split("-")[1])),
                       "correct": sum(s["correct"] for s in runs.values()),
                       "zero_shot_full_correct_on_same": sum(zero_shot[i]["correct"] for i in runs),
                       "compression_physical": round(fp16 / held, 3)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
