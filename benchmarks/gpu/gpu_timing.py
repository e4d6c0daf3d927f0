"""Timers of the GPU benchmarks: device time (CUDA graph replay, or CUDA events around back-to-back calls), host
time per call (the Python and launch cost, without waiting for the device), and device-to-device copy bandwidth.

On CPU (the smoke test under ``TRITON_INTERPRET=1``) device time is wall time per call."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _events_ms(run, rounds: int) -> list[float]:
    """Milliseconds of ``run()`` per round, from CUDA events."""
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def device_time(fn, device: torch.device, reps: int = 20, rounds: int = 5) -> tuple[float, str]:
    """(seconds of device time per call of ``fn``, method): the median over ``rounds`` of one CUDA graph holding
    ``reps`` calls ("graph": no host work between the kernels), else CUDA events around ``reps`` back-to-back calls
    ("events": launch gaps included where the host is slower than the device); on CPU wall time ("wall").
    ``fn`` must not sync the host (pass ``widths`` and ``workspace`` to ``paged_decode_attention``)."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t) / reps)
        return statistics.median(times), "wall"
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up (compile, allocate the workspace) off the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    sync(device)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        sync(device)
        return statistics.median(_events_ms(graph.replay, rounds)) / 1e3 / reps, "graph"
    except Exception as err:  # noqa: BLE001 - a call that cannot be captured is still timed
        print(f"note: CUDA graph capture failed ({type(err).__name__}: {str(err)[:200]}); timing with CUDA events")
        sync(device)

        def run():
            for _ in range(reps):
                fn()
        return statistics.median(_events_ms(run, rounds)) / 1e3 / reps, "events"


def host_time(fn, device: torch.device, calls: int = 20) -> float:
    """Median seconds of host time per call of ``fn``, each call timed alone without waiting for the device (few
    enough calls that the launch queue never fills); the device is synchronized before and after."""
    fn()
    sync(device)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    sync(device)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """Device-to-device copy bandwidth in GB/s, counting read + write bytes (median of ``iters`` copies)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    if device.type == "cuda":
        t = statistics.median(_events_ms(lambda: dst.copy_(src), iters)) / 1e3
    else:
        times = []
        for _ in range(iters):
            s = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - s)
        t = statistics.median(times)
    return 2 * nbytes / t / 1e9
