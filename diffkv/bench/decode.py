"""`diffkv bench decode`: decode speed and memory of DiffKVCache vs DynamicCache on one long prompt.

    diffkv bench decode --model qwen2.5-0.5b --context-tokens 4096 --max-new-tokens 128 --threads 1 --json

Speed: both caches are prefilled with the same prompt, then decoded **interleaved, one token each in turn** (the
order of the pair alternates every step), so both see the same machine load at the same time (the machines are shared
and noisy); ``speed_ratio`` = DiffKV tokens/s ÷ DynamicCache tokens/s over the same greedy steps.

Memory: each cache is measured in its own fresh process (``diffkv.bench.decode_memory``): the bytes of every tensor
reachable from the cache object after the decode (``diffkv.memory.owned``, an independent walk, not the cache's own
stats), and the process RSS after decoding and its peak, both minus the RSS after a 1-token run of the same model.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import torch

from diffkv.bench.common import add_alias, add_config_arguments, add_output_arguments, bench_config, progress


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context-tokens", type=int, default=2048, help="prompt tokens (PG essays)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded by each cache")
    for old in ("--context", "--prompt-tokens"):
        add_alias(p, old, "context_tokens")
    add_alias(p, "--new-tokens", "max_new_tokens")
    p.add_argument("--threads", type=int, default=None, help="decode threads, torch and kernel (default: torch's)")
    p.add_argument("--prefill-threads", type=int, default=None, help="threads for the prefills (default: --threads)")
    p.add_argument("--memory", choices=("both", "speed", "memory"), default="both",
                   help="measure speed, memory (one fresh process per cache) or both")
    add_config_arguments(p)
    add_output_arguments(p)


class Greedy:
    """Greedy decoding of one sequence through ``cache``, one timed step at a time (only the last logits).
    prefill_threads: torch threads for the prefill (then back to the current count for the decode)."""

    def __init__(self, model, ids: torch.Tensor, cache, prefill_threads: int | None = None):
        self.model, self.cache, self.seconds, self.tokens = model, cache, 0.0, []
        threads = torch.get_num_threads()
        torch.set_num_threads(prefill_threads or threads)
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.prefill_s = time.perf_counter() - t0
        torch.set_num_threads(threads)
        self.next = out.logits[:, -1:].argmax(-1)

    def step(self) -> None:
        t0 = time.perf_counter()
        out = self.model(self.next, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next = out.logits[:, -1:].argmax(-1)
        self.seconds += time.perf_counter() - t0
        self.tokens.append(int(self.next))


def make_cache(kind: str, model, cfg):
    from transformers import DynamicCache

    from diffkv.integrations.transformers import DiffKVCache

    return DynamicCache(config=model.config) if kind == "full" else DiffKVCache(model, cfg)


def _speed(args, model, ids, cfg) -> dict:
    full = Greedy(model, ids, make_cache("full", model, cfg), args.prefill_threads)
    dkv = Greedy(model, ids, make_cache("diffkv", model, cfg), args.prefill_threads)
    with progress(args, args.max_new_tokens - 1, "step", "decode (both caches)") as bar:
        for i in range(args.max_new_tokens - 1):
            for run_ in ((full, dkv) if i % 2 == 0 else (dkv, full)):
                run_.step()
            bar.update()
    steps = max(args.max_new_tokens - 1, 1)
    full_tps, dkv_tps = steps / max(full.seconds, 1e-9), steps / max(dkv.seconds, 1e-9)
    stats = dkv.cache.stats()
    same = next((i for i, (a, b) in enumerate(zip(full.tokens, dkv.tokens, strict=True)) if a != b), len(dkv.tokens))
    return {
        "method": "interleaved: one greedy decode step of each cache in turn, pair order alternating",
        "full_tokens_per_s": round(full_tps, 3),
        "diffkv_tokens_per_s": round(dkv_tps, 3),
        "speed_ratio": round(dkv_tps / full_tps, 3),
        "prefill_s": {"full": round(full.prefill_s, 3), "diffkv": round(dkv.prefill_s, 3)},
        "tokens_equal_to_full": same,
        "compression_physical": round(stats["compression_physical"], 3),
        "compression_held": round(stats["compression_held"], 3),
        "tier_fractions": {k: round(v, 4) for k, v in stats["tier_fractions"].items()},
        "attention_backend": dkv.cache.attention_backend,
    }


def _memory(args, kind: str) -> dict:
    """Run ``diffkv.bench.decode_memory`` for one cache in a fresh process; its JSON report."""
    cmd = [sys.executable, "-m", "diffkv.bench.decode_memory", "--cache", kind, "--model", args.model,
           "--context-tokens", str(args.context_tokens), "--max-new-tokens", str(args.max_new_tokens),
           "--alpha-high", str(args.alpha_high), "--alpha-low", str(args.alpha_low)]
    cmd += ["--profile", args.profile] if args.profile else []
    cmd += ["--threads", str(args.threads)] if args.threads else []
    cmd += ["--prefill-threads", str(args.prefill_threads)] if args.prefill_threads else []
    # NOTE: every allocation above 128 KiB is its own mapping, so freed prefill temporaries leave the RSS (the same
    # setting for both caches); otherwise glibc keeps freed heap blocks resident and RSS mixes in fragmentation.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"memory run of the {kind} cache failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def run(args) -> int:
    from diffkv.prompts import essay_tokens
    from diffkv.registry.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    cfg = bench_config(args, model)  # a profile of another model is refused here, before any run
    report = {"model": args.model, "context": args.context_tokens, "new_tokens": args.max_new_tokens,
              "config": {"high": cfg.high.name, "low": cfg.low.name, "alpha_high": cfg.alpha_high,
                         "alpha_low": cfg.alpha_low, "profile": args.profile}}
    if args.memory in ("both", "memory"):
        mem = {kind: _memory(args, kind) for kind in ("full", "diffkv")}
        full_b, dkv_b = mem["full"]["kv_bytes_owned"], mem["diffkv"]["kv_bytes_owned"]
        mem["diffkv_vs_full_bytes"] = round(dkv_b / full_b, 4)
        mem["diffkv_owned_vs_pages"] = round(dkv_b / mem["diffkv"]["bytes_in_pages"], 4)
        report["memory"] = mem
    if args.memory in ("both", "speed"):
        ids = torch.tensor([essay_tokens(tok, args.context_tokens)])
        with torch.no_grad():
            report["speed"] = _speed(args, model, ids, cfg)
    report["machine"] = f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"
    report["date"] = time.strftime("%Y-%m-%d %H:%M")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if "speed" in report:
        s = report["speed"]
        print(f"decode: full {s['full_tokens_per_s']:.2f} tok/s, DiffKV {s['diffkv_tokens_per_s']:.2f} tok/s "
              f"({s['attention_backend']}): speed_ratio {s['speed_ratio']:.2f}")
    if "memory" in report:
        m = report["memory"]
        for kind in ("full", "diffkv"):
            r = m[kind]
            print(f"{kind:>6}: cache owns {r['kv_bytes_owned'] / 2**20:8.1f} MiB; RSS after decode "
                  f"+{r['rss_after_mib']:.1f} MiB, peak +{r['rss_peak_mib']:.1f} MiB over a 1-token run")
        print(f"DiffKV owns {m['diffkv_vs_full_bytes']:.3f}x the full cache's bytes "
              f"({m['diffkv_owned_vs_pages']:.3f}x its page bytes)")
    return 0
