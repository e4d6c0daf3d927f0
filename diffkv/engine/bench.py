"""`diffkv bench serve`: serving throughput of the fp16 and diffkv KV backends at one KV byte budget.

    diffkv bench serve --model smollm2-135m --requests 32 --max-new-tokens 128 --kv-budget 24MiB --json

All requests (GSM8K questions, chat template, ``ignore_eos``) arrive at once; each backend serves them with the
same engine, model and budget, one after the other in one process. Throughput = generated tokens ÷ wall time
(prefills included). More compressed KV fits more concurrent requests in the budget; that is the gain measured.
"""

from __future__ import annotations

import json
import platform
import time

import torch


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--kv-budget", default="24MiB", help="KV pool size per backend, e.g. 24MiB, 2GiB")
    p.add_argument("--backends", default="fp16,diffkv")
    p.add_argument("--profile", default=None, help="calibrated profile for the diffkv backend (default: defaults)")
    p.add_argument("--max-running", type=int, default=64, help="most concurrent requests (table slots)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def gsm8k_prompts(tokenizer, n: int) -> list[list[int]]:
    """Token ids of the first ``n`` GSM8K test questions in the eval task's chat prompt."""
    from diffkv.data import load_dataset
    from diffkv.eval.tasks import GSM8K_PROMPT

    rows = load_dataset("gsm8k")[:n]
    out = []
    for r in rows:
        msg = [{"role": "user", "content": GSM8K_PROMPT.format(**r)}]
        out.append(tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
    return out


def serve_once(model, tokenizer, backend, prompts, max_new_tokens: int, max_running: int, progress: bool) -> dict:
    """Run every prompt to ``max_new_tokens`` through an engine over ``backend``; measure it."""
    from tqdm import tqdm

    from diffkv.engine import Engine, SamplingParams

    engine = Engine(model, tokenizer, backend, max_running=max_running)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    bar = tqdm(total=len(prompts) * max_new_tokens, desc=backend.name, unit="tok", disable=not progress)
    compression, start = [], time.perf_counter()
    while engine.has_work():
        events = engine.step()
        bar.update(sum(len(e.token_ids) for e in events))
        c = engine.metrics()["compression_physical"]
        if c:
            compression.append(c)
    wall = time.perf_counter() - start
    bar.close()
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"backend": backend.name, "tokens_per_s": round(tokens / wall, 3), "wall_s": round(wall, 2),
            "generated_tokens": tokens, "completed": sum(r.finish_reason == "length" for r in reqs),
            "peak_running": engine.peak_running, "preemptions": engine.preemptions, "steps": engine.steps,
            "pool_pages": backend.num_pages, "page_bytes": backend.plan.page_bytes,
            "mean_compression_physical": round(sum(compression) / len(compression), 3) if compression else None,
            "pool_full_again": backend.free_pages() == backend.num_pages}


def run(args) -> int:
    from diffkv.engine import make_backend
    from diffkv.models import load_model
    from diffkv.units import parse_bytes

    budget = parse_bytes(args.kv_budget)
    if args.requests < 1 or args.max_new_tokens < 1:
        raise ValueError("--requests and --max-new-tokens must be positive")
    model, tok = load_model(args.model)
    prompts = gsm8k_prompts(tok, args.requests)
    longest = max(map(len, prompts)) + args.max_new_tokens
    results = {}
    for kind in args.backends.split(","):
        backend = make_backend(kind, model, kv_budget_bytes=budget, profile=args.profile if kind == "diffkv"
                               else None, max_slots=args.max_running, max_model_len=longest)
        results[kind] = serve_once(model, tok, backend, prompts, args.max_new_tokens, args.max_running,
                                   not args.no_progress)
        del backend
    report = {"model": args.model, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
              "kv_budget_bytes": budget, "profile": args.profile,
              "prompt_tokens": {"mean": round(sum(map(len, prompts)) / len(prompts), 1), "max": max(map(len, prompts))},
              "backends": results,
              "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d")}
    if "fp16" in results and "diffkv" in results:
        f, d = results["fp16"], results["diffkv"]
        report["throughput_ratio"] = round(d["tokens_per_s"] / f["tokens_per_s"], 3)
        report["peak_running_ratio"] = round(d["peak_running"] / max(f["peak_running"], 1), 3)
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
