"""Does a greedy answer depend on what else the engine runs? N GSM8K prompts sent alone (one engine run each)
against the same N sent together (one engine, up to N running), per KV cache kind; token ids compared.

    .venv/bin/python benchmarks/serve/batch_invariance.py --model qwen2.5-0.5b --n 8 --tokens 128 \
        --caches fp16,diffkv --modes default,invariant \
        --profile benchmarks/calibration/qwen2.5-0.5b-full-smooth.json [--server] [--out F]

One engine per cache kind serves both: first each prompt alone (the next sent when the previous ended), then all at
once. Writes one JSON record (per cache kind: answers that differ, the first differing token, or character with
``--server``, and the wall times) to ``--out`` (default: stdout only).
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


def through_engine(eng: Engine, prompts: list[list[int]], tokens: int, together: bool) -> list[list[int]]:
    """Greedy token ids of every prompt: all queued at once, or each run to its end before the next."""
    params = SamplingParams(max_new_tokens=tokens)
    if together:
        return [r.output_ids for r in eng.generate(prompts, params)]
    return [eng.generate([p], params)[0].output_ids for p in prompts]


def through_server(eng: Engine, samples: list[dict], tokens: int, together: bool) -> list[str]:
    """Greedy answers (text) of ``diffkv serve``'s /v1/chat/completions: concurrent clients or one at a time."""
    from diffkv.serve.server import start_server

    handle = start_server(eng, "m", port=0)

    def ask(sample):
        body = json.dumps({"messages": sample["messages"], "max_tokens": tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"{handle.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.load(r)["choices"][0]["message"]["content"]

    try:
        if together:
            with ThreadPoolExecutor(len(samples)) as pool:
                return list(pool.map(ask, samples))
        return [ask(s) for s in samples]
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
    for kind in args.caches.split(","):
        for mode in args.modes.split(","):
            if mode not in ("default", "invariant"):
                raise SystemExit(f"unknown mode {mode!r}")
            eng = make_engine(model, tok, kind, args.profile, args.n, max_len, mode == "invariant")
            times, outs, made = {}, {}, {}
            for together in (False, True):
                start, before = time.perf_counter(), eng.tokens_generated
                outs[together] = (through_server(eng, samples, args.tokens, together) if args.server
                                  else through_engine(eng, prompts, args.tokens, together))
                times[together], made[together] = time.perf_counter() - start, eng.tokens_generated - before
            diffs = {samples[i]["id"]: first_difference(a, b)
                     for i, (a, b) in enumerate(zip(outs[False], outs[True], strict=True))}
            diffs = {k: v for k, v in diffs.items() if v is not None}
            record["runs"].append({
                "cache": kind, "mode": mode, "differ": len(diffs), "first_difference": diffs,
                "seconds_alone": round(times[False], 1), "seconds_together": round(times[True], 1),
                "tokens_per_s_alone": round(made[False] / times[False], 2),
                "tokens_per_s_together": round(made[True] / times[True], 2),
                "kv_pool_bytes": eng.cache.plan.page_bytes * eng.cache.num_pages,
                "peak_rss_mib_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                "answers_alone": outs[False]})
            print(json.dumps({k: v for k, v in record["runs"][-1].items() if k != "answers_alone"}), flush=True)
            if args.out:  # after every run: a stopped benchmark keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
