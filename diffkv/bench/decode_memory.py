"""Memory of one cache over a long-prompt greedy decode, measured alone in this process (``diffkv bench decode``
runs it once per cache in a fresh process and reads the JSON it prints).

    python -m diffkv.bench.decode_memory --cache diffkv --model qwen2.5-0.5b --context-tokens 4096 --max-new-tokens 128

Baseline: the RSS after a 1-token run of the same model (weights paged in, allocator warm). Then the peak RSS is
reset (Linux ``/proc/self/clear_refs``), the prompt is prefilled and ``new_tokens`` tokens decoded. Reports the bytes
of every tensor reachable from the cache (``diffkv.memory.owned``), the RSS after decoding and the peak RSS, both
minus the baseline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from diffkv.bench.common import add_config_arguments, bench_config
from diffkv.memory.owned import owned_bytes

MIB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def main(argv=None) -> int:
    from diffkv.bench.decode import Greedy, make_cache
    from diffkv.prompts import essay_tokens
    from diffkv.registry.models import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", choices=("full", "diffkv"), required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prefill-threads", type=int, default=None)
    add_config_arguments(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    cfg = bench_config(args, model)
    ids = torch.tensor([essay_tokens(tok, args.context_tokens)])
    with torch.no_grad():
        warm = Greedy(model, ids[:, :1], make_cache(args.cache, model, cfg))
        del warm
        base = _status_kib("VmRSS")
        peak_reset = _reset_peak()
        run = Greedy(model, ids, make_cache(args.cache, model, cfg), args.prefill_threads)
        for _ in range(args.max_new_tokens - 1):
            run.step()
    after, peak = _status_kib("VmRSS"), _status_kib("VmHWM")
    report = {
        "cache": args.cache,
        "kv_bytes_owned": owned_bytes(run.cache),
        "rss_baseline_mib": round(base / 1024, 1),
        "rss_after_mib": round((after - base) / 1024, 1),
        "rss_peak_mib": round((peak - base) / 1024, 1) if peak_reset else None,
        "prefill_s": round(run.prefill_s, 2),
    }
    if args.cache == "diffkv":
        stats = run.cache.stats()
        report.update(bytes_held=stats["bytes_held"], bytes_in_pages=stats["bytes_in_pages"],
                      compression_physical=round(stats["compression_physical"], 3),
                      compression_held=round(stats["compression_held"], 3),
                      attention_backend=run.cache.attention_backend)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
