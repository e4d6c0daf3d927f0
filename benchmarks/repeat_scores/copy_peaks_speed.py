"""copy_peaks (the repeat-score pass's per-layer peaks, ``diffkv.hf.repeat_scores``) against its earlier version,
side by side, at qwen2.5-0.5b's shapes (14 query heads, 2 KV heads, head_dim 64) on one thread: one layer of a
4,000-token prompt read twice (T = 2 n + bridge). Rounds alternate; prints each round and the median ratio, and
the largest difference between the two results. Extra memory: the chunk's logits, [H_q, chunk, T] fp32 before,
[H_q, chunk, <= T] after.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/repeat_scores/copy_peaks_speed.py [--n 4000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from copy_peaks_before import copy_peaks as before  # noqa: E402

from diffkv.hf.repeat_scores import copy_peaks as after  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--bridge", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    t = 2 * args.n + args.bridge
    q, k = torch.randn(14, t, 64, generator=g), torch.randn(2, t, 64, generator=g)
    scale = 64 ** -0.5
    ratios = []
    for r in range(args.rounds):
        times = {}
        for name, fn in (("before", before), ("after", after)):
            t0 = time.perf_counter()
            out = fn(q, k, args.n, args.n + args.bridge, scale)
            times[name], _ = time.perf_counter() - t0, out
            if name == "before":
                ref = out
        diff = (out - ref).abs().max().item()
        ratios.append(times["before"] / times["after"])
        print(f"round {r}: before {times['before']:.2f} s, after {times['after']:.2f} s, "
              f"speed-up {ratios[-1]:.2f}x, max |diff| {diff:.1e}")
    print(f"median speed-up {statistics.median(ratios):.2f}x over {args.rounds} rounds (n={args.n}, T={t})")


if __name__ == "__main__":
    main()
