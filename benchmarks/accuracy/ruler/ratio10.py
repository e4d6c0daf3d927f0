"""Print the physical compression a DiffKV run measured, rounded to 2 decimals: the kvpress presses of
``peers10.sh`` get those bytes. From the run's ``metrics.json`` when it finished, else the bytes-weighted ratio of
its samples so far (at least 24, as the in-prompt presses were set from the first 24 in-prompt samples).

    python3 benchmarks/accuracy/ruler/ratio10.py RUN_DIR
"""

import json
import sys
from pathlib import Path

MIN_SAMPLES = 24


def main(run: Path) -> int:
    metrics = run / "metrics.json"
    if metrics.is_file():
        print(round(json.loads(metrics.read_text())["compression_physical"], 2))
        return 0
    rows = []
    if (run / "samples.jsonl").is_file():
        for line in (run / "samples.jsonl").read_text().splitlines():
            if line.strip().endswith("}"):  # a line cut by a stopped run is skipped
                rows.append(json.loads(line)["batch_stats"])
    if len(rows) < MIN_SAMPLES:
        print(f"{run} has {len(rows)} samples and no metrics.json: its bytes set the presses' ratio, so it needs "
              f">= {MIN_SAMPLES}; run its step of queue10.sh diffkv further first", file=sys.stderr)
        return 1
    fp16 = sum(r["fp16_bytes"] for r in rows)
    kept = sum(r["bytes_kept"] for r in rows)
    print(round(fp16 / kept, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
