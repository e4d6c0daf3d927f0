"""`diffkv bench serve`: serving throughput of the fp16 and diffkv KV backends at one KV byte budget.

    diffkv bench serve --model smollm2-135m --requests 32 --max-new-tokens 128 --kv-budget 24MiB --json

All requests (GSM8K questions, chat template, ``ignore_eos``) arrive at once; each backend serves them with its
own engine over the same model and byte budget (every byte a backend holds counts: pages, ring, tables,
bookkeeping; ``peak_bytes_held`` reports the most it held). The engines step in turn in one process (so both see
the same machine load) and each one's time is the sum of its steps. Throughput = generated tokens ÷ that time (prefills
included). More compressed KV fits more concurrent requests in the budget; that is the gain measured.
"""

from __future__ import annotations

import json
import platform
import time

import torch

from diffkv.engine.scheduler import DEFAULT_RESERVE


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--kv-budget", default="24MiB",
                   help="KV bytes per backend, everything it holds (pages, tables, ...), e.g. 24MiB, 2GiB")
    p.add_argument("--backends", default="fp16,diffkv")
    p.add_argument("--profile", default=None, help="calibrated profile for the diffkv backend (default: defaults)")
    p.add_argument("--max-running", type=int, default=64, help="most concurrent requests (table slots)")
    p.add_argument("--shots", type=int, default=0,
                   help="worked GSM8K examples before each question (chat turns; exemplars from the end of the "
                        "test split, never a served question). 0: zero-shot")
    p.add_argument("--no-decode-reserve", action="store_true",
                   help="admit without reserving room for future decode tokens (optimistic, vLLM-style)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def gsm8k_prompts(tokenizer, n: int, shots: int = 0) -> list[list[int]]:
    """Token ids of the first ``n`` GSM8K test questions in the eval task's chat prompt.

    With ``shots`` > 0 each prompt starts with that many worked examples as user/assistant turns (the standard
    few-shot chain-of-thought protocol); they are the last ``shots`` test questions, so ``n + shots`` must not
    exceed the split (1319) and no served question is also an exemplar.
    """
    from diffkv.eval.tasks import GSM8K

    if shots < 0:
        raise ValueError(f"--shots must be >= 0, got {shots}")
    samples = GSM8K().samples(tokenizer, options={"shots": shots})
    if n > len(samples):
        raise ValueError(f"--requests + --shots must be at most {len(samples) + shots} (GSM8K test split)")
    return [tokenizer.apply_chat_template(s["messages"], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for s in samples[:n]]


def serve_side_by_side(model, tokenizer, backends, prompts, max_new_tokens: int, max_running: int,
                       progress: bool, reserve=DEFAULT_RESERVE) -> dict:
    """Run every prompt to ``max_new_tokens`` through one engine per backend, stepping the engines in turn so both
    see the same machine load; each engine's time is the sum of its own steps."""
    from tqdm import tqdm

    from diffkv.engine import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    runs = []
    for b in backends:
        engine = Engine(model, tokenizer, b, max_running=max_running, reserve=reserve)
        runs.append({"engine": engine, "reqs": [engine.add_request(p, params) for p in prompts], "time": 0.0,
                     "compression": [], "peak_bytes": 0})
    bar = tqdm(total=len(backends) * len(prompts) * max_new_tokens, unit="tok", disable=not progress)
    while any(r["engine"].has_work() for r in runs):
        for r in runs:
            if r["engine"].has_work():
                start = time.perf_counter()
                events = r["engine"].step()
                r["time"] += time.perf_counter() - start
                bar.update(sum(len(e.token_ids) for e in events))
                r["peak_bytes"] = max(r["peak_bytes"], r["engine"].backend.nbytes())
                c = r["engine"].metrics()["compression_physical"]
                if c:
                    r["compression"].append(c)
    bar.close()
    return {r["engine"].backend.name: _summary(r) for r in runs}


def _summary(run: dict) -> dict:
    engine, reqs, comp = run["engine"], run["reqs"], run["compression"]
    backend = engine.backend
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"backend": backend.name, "tokens_per_s": round(tokens / run["time"], 3), "time_s": round(run["time"], 2),
            "generated_tokens": tokens, "completed": sum(r.finish_reason == "length" for r in reqs),
            "peak_running": engine.peak_running, "preemptions": engine.preemptions, "steps": engine.steps,
            "mean_decode_batch": round(engine.decoded_rows / max(engine.decode_steps, 1), 2),
            "prefill_s": round(engine.prefill_seconds, 2), "decode_s": round(engine.decode_seconds, 2),
            "prefilled_tokens": engine.prefilled_tokens, "recomputed_tokens": engine.recomputed_tokens,
            "pool_pages": backend.num_pages, "page_bytes": backend.plan.page_bytes,
            "kv_budget_bytes": backend.kv_budget_bytes, "peak_bytes_held": run["peak_bytes"],
            "mean_compression_physical": round(sum(comp) / len(comp), 3) if comp else None,
            "pool_full_again": backend.free_pages() == backend.num_pages}


def run(args) -> int:
    from diffkv.engine import make_backend
    from diffkv.models import load_model
    from diffkv.units import parse_bytes

    budget = parse_bytes(args.kv_budget)
    if args.requests < 1 or args.max_new_tokens < 1:
        raise ValueError("--requests and --max-new-tokens must be positive")
    model, tok = load_model(args.model)
    prompts = gsm8k_prompts(tok, args.requests, args.shots)
    longest = max(map(len, prompts)) + args.max_new_tokens
    backends = [make_backend(kind, model, kv_budget_bytes=budget, profile=args.profile if kind == "diffkv" else None,
                             max_slots=args.max_running, max_model_len=longest) for kind in args.backends.split(",")]
    results = serve_side_by_side(model, tok, backends, prompts, args.max_new_tokens, args.max_running,
                                 not args.no_progress, None if args.no_decode_reserve else DEFAULT_RESERVE)
    report = {"model": args.model, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
              "shots": args.shots, "decode_reserve": not args.no_decode_reserve,
              "kv_budget_bytes": budget, "profile": args.profile,
              "prompt_tokens": {"mean": round(sum(map(len, prompts)) / len(prompts), 1), "max": max(map(len, prompts))},
              "backends": results,
              "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d")}
    if "fp16" in results and "diffkv" in results:
        f, d = results["fp16"], results["diffkv"]
        report["throughput_ratio"] = round(d["tokens_per_s"] / f["tokens_per_s"], 3)
        report["peak_running_ratio"] = round(d["peak_running"] / max(f["peak_running"], 1), 3)
        report["mean_decode_batch_ratio"] = round(d["mean_decode_batch"] / max(f["mean_decode_batch"], 1e-9), 3)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in results.values():
            print(f"{r['backend']:>7}: {r['tokens_per_s']:.1f} tok/s, peak running {r['peak_running']}, "
                  f"preemptions {r['preemptions']}, completed {r['completed']}/{args.requests}")
        if "throughput_ratio" in report:
            print(f"throughput_ratio {report['throughput_ratio']:.2f}, peak_running_ratio "
                  f"{report['peak_running_ratio']:.2f}")
    return 0
