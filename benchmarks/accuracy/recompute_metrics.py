"""Recompute metrics.json of the recorded eval runs from their samples.jsonl (after a change to the metrics) and
print what changed; ``--write`` saves them. Run from the checkout:

    .venv/bin/python benchmarks/accuracy/recompute_metrics.py [--write]
"""
import json
import sys
from pathlib import Path

from diffkv.eval.metrics import compute_metrics, read_samples

for mfile in sorted(Path("benchmarks/accuracy").rglob("metrics.json")):
    run = mfile.parent
    cfg_file = run / "config.json"
    if not cfg_file.is_file():
        continue
    old = json.loads(mfile.read_text())
    ids = list(read_samples(run))
    new = compute_metrics(run, ids, json.loads(cfg_file.read_text()))
    new["n_requested"] = old.get("n_requested", new["n_requested"])
    diff = {k: (old.get(k), new.get(k)) for k in set(old) | set(new) if old.get(k) != new.get(k)}
    if diff:
        print(run, {k: v for k, v in diff.items() if k != "flips_vs_full"}, "flips" if "flips_vs_full" in diff else "")
        if "--write" in sys.argv:
            mfile.write_text(json.dumps({**old, **new}, indent=2) + "\n")
