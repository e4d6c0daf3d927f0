"""`diffkv bench serve`: serving throughput of the fp16 and diffkv KV caches at one KV byte budget.

    diffkv bench serve --model smollm2-135m --requests 32 --max-new-tokens 128 --kv-budget 24MiB --json

All requests (GSM8K questions, chat template, ``ignore_eos``) arrive at once; each cache kind serves them with
its own engine over the same model and byte budget (every byte a cache holds counts: pages, ring, tables,
bookkeeping; ``peak_bytes_held`` reports the most it held). The engines step in turn in one process (so both see
the same machine load) and each one's time is the sum of its steps. Throughput = generated tokens ÷ that time (prefills
included). More compressed KV fits more concurrent requests in the budget; that is the gain measured.
``--prefill batched,single`` also serves every cache kind a second time with one prefill forward per request (its own
engine and pool, stepped in turn with the others), to measure batched prefill (``prefill_s``, ``prefill_speedup``);
``--prefill batched,separate`` with the admitted prompts in a forward of their own instead of in the decode forward
(``Engine(mixed_forward=False)``, the engine before issue #61's one forward per step).
"""

from __future__ import annotations

import json
import platform
import time

import torch

from diffkv.bench.common import add_alias
from diffkv.engine.prefill import DEFAULT_MAX_PREFILL_TOKENS, PREFILL_MODES
from diffkv.engine.scheduler import DEFAULT_RESERVE


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--kv-budget", default="24MiB",
                   help="KV bytes per cache, everything it holds (pages, tables, ...), e.g. 24MiB, 2GiB")
    p.add_argument("--caches", default="fp16,diffkv", help="KV cache kinds served side by side (default fp16,diffkv)")
    add_alias(p, "--backends", "caches", type=str)  # the old name (before issue #32), for recorded commands
    p.add_argument("--profile", default=None, help="calibrated profile for the diffkv cache (default: defaults)")
    p.add_argument("--max-running", type=int, default=64, help="most concurrent requests (table slots)")
    p.add_argument("--shots", type=int, default=0,
                   help="worked GSM8K examples before each question (chat turns; exemplars from the end of the "
                        "test split, never a served question). 0: zero-shot")
    p.add_argument("--no-decode-reserve", action="store_true",
                   help="admit without reserving room for future decode tokens (optimistic, vLLM-style)")
    p.add_argument("--prefill", default="batched",
                   help="how admitted requests are prefilled: batched (in the step's decode forward, or one forward "
                        "when nothing decodes), separate (batched in a forward of their own), single (one forward "
                        "each), or several comma-separated to run them side by side for every cache kind")
    p.add_argument("--max-prefill-tokens", type=int, default=DEFAULT_MAX_PREFILL_TOKENS,
                   help=f"most prompt tokens prefilled per engine step (default {DEFAULT_MAX_PREFILL_TOKENS}; a "
                        "longer prompt is prefilled alone)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def gsm8k_prompts(tokenizer, n: int, shots: int = 0) -> list[list[int]]:
    """Token ids of the first ``n`` GSM8K test questions in the eval task's chat prompt (its turns joined by blank
    lines for a tokenizer without a chat template, as the eval does).

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
    if getattr(tokenizer, "chat_template", "") is None:  # a base model (gemma3-270m): the eval's plain-text prompt
        return [tokenizer("\n\n".join(m["content"] for m in s["messages"])).input_ids for s in samples[:n]]
    return [tokenizer.apply_chat_template(s["messages"], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for s in samples[:n]]


def serve_side_by_side(model, tokenizer, caches, prompts, max_new_tokens: int, max_running: int,
                       progress: bool, reserve=DEFAULT_RESERVE, options: list[dict] | None = None,
                       labels: list[str] | None = None) -> dict:
    """Run every prompt to ``max_new_tokens`` through one engine per KV cache (``caches``), stepping the engines in
    turn so both see the same machine load; each engine's time is the sum of its own steps. options: more
    :class:`Engine` arguments per cache (e.g. ``prefill``); labels: the result keys (default: the caches' names)."""
    from tqdm import tqdm

    from diffkv.engine import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    labels = labels or [c.name for c in caches]
    if len(set(labels)) != len(caches):
        raise ValueError(f"one distinct label per cache needed, got {labels}")
    runs = []
    for c, label, opts in zip(caches, labels, options or [{}] * len(caches), strict=True):
        engine = Engine(model, tokenizer, c, max_running=max_running, reserve=reserve, **opts)
        runs.append({"engine": engine, "reqs": [engine.add_request(p, params) for p in prompts], "time": 0.0,
                     "compression": [], "peak_bytes": 0, "label": label})
    bar = tqdm(total=len(caches) * len(prompts) * max_new_tokens, unit="tok", disable=not progress)
    while any(r["engine"].has_work() for r in runs):
        for r in runs:
            if r["engine"].has_work():
                start = time.perf_counter()
                events = r["engine"].step()
                r["time"] += time.perf_counter() - start
                bar.update(sum(len(e.token_ids) for e in events))
                r["peak_bytes"] = max(r["peak_bytes"], r["engine"].cache.nbytes())
                c = r["engine"].metrics()["compression_physical"]
                if c:
                    r["compression"].append(c)
    bar.close()
    return {r["label"]: _summary(r) for r in runs}


def _summary(run: dict) -> dict:
    engine, reqs, comp = run["engine"], run["reqs"], run["compression"]
    cache, c = engine.cache, engine.counters
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"cache": cache.name, "tokens_per_s": round(tokens / run["time"], 3), "time_s": round(run["time"], 2),
            "generated_tokens": tokens, "completed": sum(r.finish_reason == "length" for r in reqs),
            "peak_running": engine.peak_running, "preemptions": c.preemptions, "steps": engine.steps,
            "mean_decode_batch": round(c.decoded_rows / max(c.decode_steps, 1), 2),
            "prefill": engine.prefiller.mode, "mixed_forward": engine.mixed_forward,
            "max_prefill_tokens": engine.planner.max_prefill_tokens, "mixed_prefills": c.mixed_prefills,
            "prefill_forwards": c.prefill_forwards, "prefill_fallbacks": c.prefill_fallbacks,
            "prefill_s": round(c.prefill_seconds, 2), "decode_s": round(c.decode_seconds, 2),
            "prefilled_tokens": c.prefilled_tokens, "recomputed_tokens": c.recomputed_tokens,
            "pool_pages": cache.num_pages, "page_bytes": cache.plan.page_bytes,
            "kv_budget_bytes": cache.kv_budget_bytes, "peak_bytes_held": run["peak_bytes"],
            "mean_compression_physical": round(sum(comp) / len(comp), 3) if comp else None,
            "pool_full_again": cache.free_pages() == cache.num_pages}


def _distinct(text: str, allowed, flag: str) -> list[str]:
    """``text`` split at commas: distinct names out of ``allowed``, else a ValueError naming ``flag``."""
    names = text.split(",")
    if any(n not in allowed for n in names) or len(set(names)) != len(names):
        raise ValueError(f"{flag} takes distinct names out of {','.join(allowed)}, got {text!r}")
    return names


def run(args) -> int:
    from diffkv.core.units import parse_bytes
    from diffkv.engine import CACHE_KINDS, make_cache
    from diffkv.registry.models import load_model

    budget = parse_bytes(args.kv_budget)
    if args.requests < 1 or args.max_new_tokens < 1 or args.max_prefill_tokens < 1:
        raise ValueError("--requests, --max-new-tokens and --max-prefill-tokens must be positive")
    kinds = _distinct(args.caches, CACHE_KINDS, "--caches")
    modes = _distinct(args.prefill, (*PREFILL_MODES, "separate"), "--prefill")
    model, tok = load_model(args.model)
    prompts = gsm8k_prompts(tok, args.requests, args.shots)
    longest = max(map(len, prompts)) + args.max_new_tokens
    runs = [(kind, mode) for kind in kinds for mode in modes]  # each run has its own pool
    caches = [make_cache(kind, model, kv_budget_bytes=budget, profile=args.profile if kind == "diffkv" else None,
                         max_slots=args.max_running, max_model_len=longest) for kind, _ in runs]
    labels = [kind if len(modes) == 1 else f"{kind}:{mode}" for kind, mode in runs]
    options = [{"prefill": "batched" if mode == "separate" else mode, "mixed_forward": mode != "separate",
                "max_prefill_tokens": args.max_prefill_tokens} for _, mode in runs]
    results = serve_side_by_side(model, tok, caches, prompts, args.max_new_tokens, args.max_running,
                                 not args.no_progress, None if args.no_decode_reserve else DEFAULT_RESERVE,
                                 options=options, labels=labels)
    report = {"model": args.model, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
              "shots": args.shots, "decode_reserve": not args.no_decode_reserve, "prefill": args.prefill,
              "max_prefill_tokens": args.max_prefill_tokens,
              "kv_budget_bytes": budget, "profile": args.profile,
              "prompt_tokens": {"mean": round(sum(map(len, prompts)) / len(prompts), 1), "max": max(map(len, prompts))},
              "caches": results,
              "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d")}
    if "single" in modes and "batched" in modes:  # one-forward-per-request prefill time over batched, per kind
        report["prefill_speedup"] = {kind: round(results[f"{kind}:single"]["prefill_s"] /
                                                 max(results[f"{kind}:batched"]["prefill_s"], 1e-9), 3)
                                     for kind in kinds}
    fp16, dkv = (f"fp16:{modes[0]}", f"diffkv:{modes[0]}") if len(modes) > 1 else ("fp16", "diffkv")
    if fp16 in results and dkv in results:
        f, d = results[fp16], results[dkv]
        report["throughput_ratio"] = round(d["tokens_per_s"] / f["tokens_per_s"], 3)
        report["peak_running_ratio"] = round(d["peak_running"] / max(f["peak_running"], 1), 3)
        report["mean_decode_batch_ratio"] = round(d["mean_decode_batch"] / max(f["mean_decode_batch"], 1e-9), 3)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for label, r in results.items():
            print(f"{label:>7}: {r['tokens_per_s']:.1f} tok/s, peak running {r['peak_running']}, "
                  f"preemptions {r['preemptions']}, completed {r['completed']}/{args.requests}, prefill "
                  f"{r['prefill_s']:.2f} s in {r['prefill_forwards']} forwards")
        if "prefill_speedup" in report:
            print("prefill_speedup (single / batched prefill time) " + ", ".join(
                f"{k} {v:.2f}x" for k, v in report["prefill_speedup"].items()))
        if "throughput_ratio" in report:
            print(f"throughput_ratio {report['throughput_ratio']:.2f}, peak_running_ratio "
                  f"{report['peak_running_ratio']:.2f}")
    return 0
