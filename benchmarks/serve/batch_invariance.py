"""Does a greedy answer depend on what else the engine runs? N GSM8K prompts sent alone (one engine run each)
against the same N sent together (one engine, up to N running), per KV cache kind; token ids compared.

    .venv/bin/python benchmarks/serve/batch_invariance.py --model qwen2.5-0.5b --n 8 --tokens 128 \
        --caches fp16,diffkv --modes default,invariant \
        --profile benchmarks/calibration/qwen2.5-0.5b-full-smooth.json [--server] [--out F]

One engine per cache kind serves both: first each prompt alone (the next sent when the previous ended), then all at
once (``--batches 4,8``: in groups of 4, then of 8). Writes one JSON record (per cache kind: answers that differ,
the first differing token, or character with ``--server``, and the wall times) to ``--out`` (default: stdout
only).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from diffkv.bench.common import add_alias
from diffkv.engine import CACHE_KINDS, Engine, SamplingParams, make_cache
from diffkv.eval.runner import encode_prompt
from diffkv.eval.tasks import get_task
from diffkv.registry.models import load_model


def make_engine(model, tok, kind: str, profile: str | None, n: int, max_len: int, invariant: bool) -> Engine:
    cache = make_cache(kind, model, kv_budget_bytes=1 << 30, profile=profile, max_slots=n, max_model_len=max_len)
    return Engine(model, tok, cache, max_running=n, batch_invariant=invariant)


def through_engine(eng: Engine, prompts: list[list[int]], tokens: int, batch: int) -> list[list[int]]:
    """Greedy token ids of every prompt, ``batch`` queued at once (the next group when one has ended; 1: alone)."""
    params = SamplingParams(max_new_tokens=tokens)
    return [r.output_ids for i in range(0, len(prompts), batch) for r in eng.generate(prompts[i:i + batch], params)]


def through_server(eng: Engine, samples: list[dict], tokens: int, batch: int) -> list[str]:
    """Greedy answers (text) of ``diffkv serve``'s /v1/chat/completions: ``batch`` concurrent clients at a time."""
    from diffkv.serve.server import start_server

    handle = start_server(eng, "m", port=0)

    def ask(sample):
        body = json.dumps({"messages": sample["messages"], "max_tokens": tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"{handle.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.load(r)["choices"][0]["message"]["content"]

    try:
        with ThreadPoolExecutor(batch) as pool:
            return [a for i in range(0, len(samples), batch) for a in pool.map(ask, samples[i:i + batch])]
    finally:
        handle.close()


def first_difference(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--n", type=int, default=8, help="prompts (GSM8K questions 0..n-1)")
    p.add_argument("--start", type=int, default=0, help="first GSM8K question")
    p.add_argument("--tokens", type=int, default=128, help="greedy new tokens per prompt")
    p.add_argument("--caches", default="fp16,diffkv", help="KV cache kinds, one after the other (fp16, diffkv)")
    add_alias(p, "--backends", "caches", type=str)  # the old name (before issue #32), for recorded commands
    p.add_argument("--profile", default=None, help="profile for the diffkv cache (default: DiffKVConfig())")
    p.add_argument("--modes", default="default,invariant",
                   help="engine modes, run one after the other per cache: default, invariant (batch_invariant=True)")
    p.add_argument("--batches", default=None, help="prompts sent at once, comma-separated (default: all n)")
    p.add_argument("--server", action="store_true", help="through diffkv serve's HTTP API (chat completions)")
    p.add_argument("--out", default=None, help="write the JSON record here")
    args = p.parse_args(argv)
    if any(kind not in CACHE_KINDS for kind in args.caches.split(",")):
        raise SystemExit(f"--caches takes kinds out of {','.join(CACHE_KINDS)}, got {args.caches!r}")
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    samples = get_task("gsm8k").samples(tok)[args.start:args.start + args.n]
    prompts = [encode_prompt(tok, s) for s in samples]
    record = {"command": " ".join(["python", *sys.argv]), "model": args.model, "n": args.n, "start": args.start,
              "tokens": args.tokens, "profile": args.profile,
              "threads": torch.get_num_threads(), "server": args.server, "runs": []}
    max_len = max(map(len, prompts)) + args.tokens
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.n]
    if any(not 1 <= b <= args.n for b in batches):
        raise SystemExit(f"--batches takes sizes in [1, --n], got {args.batches!r}")
    for kind in args.caches.split(","):
        for mode in args.modes.split(","):
            if mode not in ("default", "invariant"):
                raise SystemExit(f"unknown mode {mode!r}")
            eng = make_engine(model, tok, kind, args.profile, args.n, max_len, mode == "invariant")
            times, outs, made = {}, {}, {}
            for batch in (1, *batches):
                start, before = time.perf_counter(), eng.counters.tokens_generated
                outs[batch] = (through_server(eng, samples, args.tokens, batch) if args.server
                               else through_engine(eng, prompts, args.tokens, batch))
                times[batch], made[batch] = time.perf_counter() - start, eng.counters.tokens_generated - before
            by_batch = {}
            for batch in batches:
                diffs = {samples[i]["id"]: first_difference(a, b)
                         for i, (a, b) in enumerate(zip(outs[1], outs[batch], strict=True))}
                by_batch[batch] = {k: v for k, v in diffs.items() if v is not None}
            diffs = by_batch[batches[-1]]
            record["runs"].append({
                "cache": kind, "mode": mode, "differ": len(diffs), "first_difference": diffs,
                "differ_by_batch": {b: len(d) for b, d in by_batch.items()},
                "first_difference_by_batch": by_batch,
                "seconds_alone": round(times[1], 1), "seconds_together": round(times[batches[-1]], 1),
                "tokens_per_s_alone": round(made[1] / times[1], 2),
                "tokens_per_s_together": round(made[batches[-1]] / times[batches[-1]], 2),
                "tokens_per_s_by_batch": {b: round(made[b] / times[b], 2) for b in batches},
                "kv_pool_bytes": eng.cache.plan.page_bytes * eng.cache.num_pages,
                "peak_rss_mib_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                "answers_alone": outs[1]})
            print(json.dumps({k: v for k, v in record["runs"][-1].items() if k != "answers_alone"}), flush=True)
            if args.out:  # after every run: a stopped benchmark keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
