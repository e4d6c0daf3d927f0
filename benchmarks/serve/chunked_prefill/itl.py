"""Issue #44 item 5: inter-token latency of running requests while a long prompt arrives, with and without chunked
prefill (``Engine(prefill_chunk=N)``), side by side in one process on one model.

8 requests with short prompts decode; once they run (``--steady-steps`` steps: their steady-state gaps), a
~4k-token prompt (an essay) is added. For each engine we record, for the 8, the gaps between consecutive tokens
from the long prompt's arrival until its first token (max, mean, p99 and p99 over the steady-state median), the
long prompt's time to first token, the bytes of the pages in use at that moment and the process's peak RSS.
``--chunk`` takes several sizes (``512,32``) and ``--modes`` both designs (``extend,deferred``): one engine each
after the whole-prompt one. ``--rounds N`` repeats all of it N times; each chunked run's p99 is divided by the
steady-state median of the *unchunked* engine of its round (``p99_itl_vs_unchunked_steady``, issue #61), and the
median over rounds is reported per engine.

    python benchmarks/serve/chunked_prefill/itl.py --modes extend,deferred --out run.json
    python benchmarks/serve/chunked_prefill/itl.py --chunk 32,256 --modes deferred --rounds 3 --new-tokens 200 \
        --separate --out benchmarks/serve/chunked_prefill/results_mixed_forward.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from diffkv.engine import Engine, SamplingParams, make_cache
from diffkv.prompts import essay_tokens
from diffkv.registry.models import load_model


def run(model, tok, args, chunk: int | None, mode: str = "extend", mixed: bool = True) -> dict:
    cache = make_cache("diffkv", model, kv_budget_bytes=args.kv_budget, profile=args.profile,
                       max_slots=16, max_model_len=args.long_tokens + args.new_tokens + 64)
    eng = Engine(model, tok, cache, prefill_chunk=chunk, chunked_prefill=mode, mixed_forward=mixed)
    stamps: dict[str, list[float]] = {}

    def listener(ev):
        if ev.token_ids:
            stamps.setdefault(ev.request.id, []).append(time.perf_counter())

    short = [essay_tokens(tok, 64, start_essay=i) for i in range(8)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    running = [eng.add_request(p, params, listener) for p in short]
    for _ in range(args.steady_steps + 1):  # the first step prefills them
        eng.step()
    steady = [b - a for r in running for a, b in zip(stamps.get(r.id, []), stamps.get(r.id, [])[1:], strict=False)]
    arrival = time.perf_counter()
    long = eng.add_request(essay_tokens(tok, args.long_tokens, start_essay=20),
                           SamplingParams(max_new_tokens=4, ignore_eos=True), listener)
    while not long.output_ids and not long.finished:
        eng.step()
    first = time.perf_counter()
    gaps = []  # between consecutive tokens of the requests already decoding when it arrived (from their last one)
    for r in running:
        before = [x for x in stamps.get(r.id, []) if x < arrival]
        t = before[-1:] + [x for x in stamps.get(r.id, []) if x >= arrival and x <= first]
        gaps += [b - a for a, b in zip(t, t[1:], strict=False)] if before else []
    held = eng.metrics()["pages_used"] * cache.plan.page_bytes  # pages in use when the long prompt's token came
    for r in [*running, long]:  # measured: end them now rather than decode the rest
        r.cancel()
    eng.run()
    p99 = sorted(gaps)[min(len(gaps) - 1, int(0.99 * len(gaps)))]
    return {"prefill_chunk": chunk, "chunked_prefill": mode if chunk else None, "mixed_forward": mixed,
            "long_prompt_tokens": len(long.prompt_ids), "gaps_s": [round(g, 3) for g in gaps],
            "ttft_long_s": round(first - arrival, 2), "itl_max_s": round(max(gaps), 3),
            "itl_mean_s": round(statistics.mean(gaps), 3), "itl_p99_s": round(p99, 3),
            "itl_steady_median_s": round(statistics.median(steady), 3),
            "itl_p99_vs_steady": round(p99 / statistics.median(steady), 2), "tokens_of_the_8_meanwhile": len(gaps),
            "chunk_forwards": eng.counters.prefill_chunks, "page_bytes_in_use": held,
            "rss_max_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--profile", default="qwen2.5-0.5b")
    ap.add_argument("--long-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=400)
    ap.add_argument("--chunk", default="512", help="chunk sizes, comma-separated (one engine each)")
    ap.add_argument("--steady-steps", type=int, default=6)
    ap.add_argument("--modes", default="extend", help="chunked_prefill designs, comma-separated (extend, deferred)")
    ap.add_argument("--kv-budget", type=int, default=256 << 20)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every engine this many times (median reported)")
    ap.add_argument("--separate", action="store_true", help="also each chunked engine with its chunks in forwards "
                    "of their own (Engine(mixed_forward=False), the design before issue #61)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    rows = []
    for r in range(args.rounds):
        whole = run(model, tok, args, None)
        designs = [True, False] if args.separate else [True]
        round_rows = [whole] + [run(model, tok, args, int(c), m, mixed) for m in args.modes.split(",")
                                for c in args.chunk.split(",") for mixed in designs]
        for row in round_rows:
            row["round"] = r
            row["p99_itl_vs_unchunked_steady"] = round(row["itl_p99_s"] / whole["itl_steady_median_s"], 2)
        rows += round_rows
        print(json.dumps([{k: v for k, v in row.items() if k != "gaps_s"} for row in round_rows]), flush=True)
    whole, chunked = rows[0], rows[1]
    medians = {}
    for row in rows:
        if row["prefill_chunk"]:
            name = f"{row['chunked_prefill']}-{row['prefill_chunk']}" + ("" if row["mixed_forward"] else "-separate")
            medians.setdefault(name, []).append(row)
    summary = {name: {"p99_itl_vs_unchunked_steady": statistics.median(r["p99_itl_vs_unchunked_steady"] for r in rs),
                      "ttft_long_s": statistics.median(r["ttft_long_s"] for r in rs), "rounds": len(rs)}
               for name, rs in medians.items()}
    out = {"command": "python benchmarks/serve/chunked_prefill/itl.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "model": args.model, "profile": args.profile, "runs": rows, "median_over_rounds": summary,
        "ttft_long_whole_s": statistics.median(r["ttft_long_s"] for r in rows if not r["prefill_chunk"]),
        "itl_max_whole_vs_chunked": round(whole["itl_max_s"] / chunked["itl_max_s"], 2),
        "ttft_long_chunked_vs_whole": round(chunked["ttft_long_s"] / whole["ttft_long_s"], 2),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
