"""One RULER 4k ask-after sample (qwen2.5-0.5b, DiffKV with repeat scores, the setting of
``benchmarks/accuracy/ruler/run10.sh ask-after``) through the eval runner, two ways, side by side on one thread:
``one``: the re-read pass also stores the context (``repeat_prefill``, 2 L + bridge tokens of forward);
``two``: scores first, then the context's own prefill (3 L + bridge; the runner's path before 2026-12-06).
Each run is its own process (so its peak RSS is its own); rounds alternate. Prints a JSON line per run (seconds of
the sample, peak RSS, the cache's bytes, the answer) and the median ratio.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/repeat_scores/ask_after_speed.py [--rounds 2] [--family vt]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

METHOD = 'diffkv-compact-meta@x256+page_bytes=1472+importance="peak"+prompt_scores="repeat"'


def one_run(variant: str, family: str, out: str) -> None:
    import torch

    import diffkv.eval.runner as runner
    from diffkv.eval.runner import RunConfig, run_eval
    from diffkv.hf.repeat_scores import repeat_scores

    torch.set_num_threads(1)
    if variant == "two":
        def two_pass(model, cache, ids, bridge):  # the prefill then happens in feed_context
            cache.set_prompt_scores(repeat_scores(model, ids, torch.ones_like(ids), bridge))
        runner.repeat_prefill = two_pass
    cfg = RunConfig(model="qwen2.5-0.5b", task="ruler", method=METHOD, out=out, batch_size=1, runner="generate",
                    profile="profiles/qwen2.5-0.5b.json", limit=1,
                    task_options={"lengths": [4096], "samples": 1, "families": [family], "protocol": "ask-after"})
    run_eval(cfg, progress=False)
    row = json.loads(next(Path(out).rglob("samples.jsonl")).read_text())
    print(json.dumps({"variant": variant, "id": row["id"], "seconds": row["batch_seconds"],
                      "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                      "cache_bytes": row["batch_stats"]["bytes_in_pages"],
                      "compression_physical": round(row["batch_stats"]["compression_physical"], 3),
                      "output": row["output"]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--family", default="niah_multikey_2")
    ap.add_argument("--variant", choices=("one", "two"), help=argparse.SUPPRESS)  # a child run
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        one_run(args.variant, args.family, args.out)
        return
    seconds: dict[str, list[float]] = {"one": [], "two": []}
    for _ in range(args.rounds):
        for variant in ("two", "one"):
            with tempfile.TemporaryDirectory() as out:
                res = subprocess.run([sys.executable, __file__, "--variant", variant, "--family", args.family,
                                      "--out", out], capture_output=True, text=True, check=True)
            line = res.stdout.strip().splitlines()[-1]
            print(line, flush=True)
            seconds[variant].append(json.loads(line)["seconds"])
    ratio = statistics.median(t / o for t, o in zip(seconds["two"], seconds["one"], strict=True))
    print(f"median two-pass / one-pass time: {ratio:.2f}x over {args.rounds} rounds")


if __name__ == "__main__":
    main()
