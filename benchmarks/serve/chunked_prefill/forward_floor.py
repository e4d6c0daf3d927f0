"""Issue #61's ITL target on this CPU, bounded from below without any engine: the bare model forward over R rows.

A step that decodes the running requests and carries a prompt chunk of C tokens runs at least the model's linear
layers over R = B + C rows; the decode-only step runs them over B. This times the transformers model alone (one
sequence of R tokens, no cache, so no attention over a long prefix: that only adds to the chunked step) for
R = B, B + 32 and B + 256, interleaved, one thread as ``itl.py``. If ``forward(B + C) / forward(B)`` is over 2, no
scheduler can bring the chunked step's gap within 2x the decode-only one on this machine.

    python benchmarks/serve/chunked_prefill/forward_floor.py --out benchmarks/serve/chunked_prefill/forward_floor.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from diffkv.registry.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=8, help="decode rows B (itl.py runs 8 requests)")
    ap.add_argument("--chunks", default="32,256")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model(args.model)
    sizes = [args.batch] + [args.batch + int(c) for c in args.chunks.split(",")]
    times: dict[int, list[float]] = {r: [] for r in sizes}
    with torch.inference_mode():
        for r in sizes:  # warm-up
            model(torch.randint(100, 1000, (1, r)), use_cache=False)
        for _ in range(args.reps):
            for r in sizes:
                ids = torch.randint(100, 1000, (1, r))
                start = time.perf_counter()
                model(ids, use_cache=False)
                times[r].append(time.perf_counter() - start)
    base = statistics.median(times[args.batch])
    rows = [{"rows": r, "median_s": round(statistics.median(t), 4), "min_s": round(min(t), 4),
             "vs_decode_rows": round(statistics.median(t) / base, 2)} for r, t in times.items()]
    out = {"command": "python benchmarks/serve/chunked_prefill/forward_floor.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "model": args.model, "dtype": str(next(model.parameters()).dtype), "threads": 1, "rows": rows,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
