"""Metrics of runs stopped before their end (the runner writes ``metrics.json`` only when every sample is done),
over the samples they hold, with the ``full`` run's accuracy on the same questions (``flips_vs_full``).

    .venv/bin/python benchmarks/accuracy/partial_metrics.py benchmarks/accuracy/gen512/qwen2.5-0.5b/gsm8k/diffkv-saw

Prints one JSON object per run folder; writes nothing. The runner batches samples by prompt length, so a stopped
run holds the shortest prompts of its ``--limit``, not its first questions.
"""

import json
import sys
from pathlib import Path

from diffkv.eval.metrics import compute_metrics, read_samples


def main(folders: list[str]) -> None:
    for folder in map(Path, folders):
        config = json.loads((folder / "config.json").read_text())
        done = sorted(read_samples(folder), key=lambda i: int(i.rsplit("-", 1)[1]))
        metrics = compute_metrics(folder, done, config)
        print(json.dumps({"run": str(folder), "limit": config.get("limit"), "ids": done, **metrics}))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
