"""How much of the ``ring_backend="c"`` reserve / release time is the compiled call itself, inside the memory benchmark.

    python benchmarks/memory_c_call_time.py [bench options, e.g. --sizes 64x30x3]

Runs ``diffkv bench memory --ring-backend c`` with the two C entry points wrapped in a timer, then prints the best and
median time of each call next to the benchmark's own table (the whole operation: Python checks and the call).
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from diffkv.bench import memory as bench
from diffkv.memory import ring_cpu  # noqa: E402


class TimedLibrary:
    """Stands in for the ctypes library: same entry points, each call timed."""

    def __init__(self, lib):
        self.times = {"diffkv_ring_reserve": [], "diffkv_ring_release": []}
        for name in self.times:
            setattr(self, name, self._timed(getattr(lib, name), self.times[name]))

    @staticmethod
    def _timed(fn, times):
        def call(*args):
            start = time.perf_counter()
            out = fn(*args)
            times.append(time.perf_counter() - start)
            return out
        return call


def main(argv: list[str]) -> int:
    timed = TimedLibrary(ring_cpu.library())
    ring_cpu.library = lambda: timed  # this process only
    bench.main(["--ring-backend", "c", *argv])
    for name, times in timed.times.items():
        print(f"{name}: {len(times)} calls, best {1e3 * min(times):.3f} ms, median "
              f"{1e3 * statistics.median(times):.3f} ms (all sizes together)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
