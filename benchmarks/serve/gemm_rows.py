"""Which row counts of an fp32 ``linear`` give a row other bits than the same row inside a large product, and what
computing every product in blocks of ``ROW_BLOCK`` rows (``diffkv.engine.invariance``) costs, for the weight shapes
of qwen2.5-0.5b.

    .venv/bin/python benchmarks/serve/gemm_rows.py > benchmarks/serve/batch_invariance/gemm_rows_<cpu>.txt

Timings: median of 15 calls each (5 at 256 rows), plain then blocked, in one process (shared machine).
"""

from __future__ import annotations

import statistics
import time

import torch

from diffkv.engine.invariance import ROW_BLOCK, blocked_linear

SHAPES = {"k_proj/v_proj": (128, 896), "q_proj/o_proj": (896, 896), "gate/up": (4864, 896), "down": (896, 4864),
          "lm_head": (151936, 896)}


def timed(fn, reps: int = 15) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {torch.backends.cpu.get_cpu_capability()}")
    for name, (n, k) in SHAPES.items():
        w, x = torch.randn(n, k), torch.randn(256, k)
        ref = torch.nn.functional.linear(x, w)
        differ = [m for m in range(1, 65) if not torch.equal(torch.nn.functional.linear(x[:m], w), ref[:m])]
        blocked_ref = blocked_linear(x, w, None)
        blocked_ok = all(torch.equal(blocked_linear(x[s:s + m], w, None), blocked_ref[s:s + m])
                         for s in (0, 3) for m in range(1, 65))
        print(f"{name} [{n} x {k}]: rows differing from a 256-row product: {differ}; "
              f"blocked ({ROW_BLOCK} rows) all equal at offsets 0 and 3: {blocked_ok}")
        for m in (1, 2, 3, 256):
            plain = timed(lambda a=x[:m], b=w: torch.nn.functional.linear(a, b), 5 if m > 3 else 15)
            blocked = timed(lambda a=x[:m], b=w: blocked_linear(a, b, None), 5 if m > 3 else 15)
            print(f"  {m} row(s): plain {plain:.2f} ms, blocked {blocked:.2f} ms ({blocked / plain:.2f}x)")


if __name__ == "__main__":
    main()
