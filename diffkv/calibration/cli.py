"""``diffkv calibrate``: profile a model, search thresholds under a quality budget, write a Profile JSON.

    diffkv calibrate --model smollm2-135m --out profiles/smollm2-135m.json --max-kl 0.02 --per-layer --quick
    python -m diffkv.calibration --model smollm2-135m --quick      # same, before the main CLI wires it

Resumable: the profiling statistics (safetensors) and every measured candidate (JSONL) are cached under
``--stats-dir`` (default ``$DIFFKV_HOME/calibration``); a rerun with the same data settings reuses them.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from diffkv.calibration import search

QUICK = {"texts": 2, "context_tokens": 512, "decode_steps": 32, "layer_evals": 4}
FULL = {"texts": 4, "context_tokens": 1024, "decode_steps": 64, "layer_evals": 6}


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="registry name (diffkv models), local folder or HF id")
    p.add_argument("--out", default=None, help="profile path (default: the user results folder, "
                   "$DIFFKV_RESULTS/profiles/<model>.json or ~/.local/share/diffkv/results/profiles/<model>.json)")
    p.add_argument("--data", default="pg-essays", choices=["pg-essays", "champ"], help="calibration text")
    p.add_argument("--first-doc", type=int, default=None, help="first document used (default 25 for pg-essays, "
                   "leaving the first essays to evaluation; 0 for champ)")
    p.add_argument("--max-kl", type=float, default=None, help="budget: mean KL(full||DiffKV) per token, nats "
                   "(default 0.02 if no budget is given)")
    p.add_argument("--max-ppl-increase", type=float, default=None, help="budget: perplexity increase, 0.03 = +3%%")
    p.add_argument("--per-layer", action="store_true", help="also search per-layer thresholds")
    p.add_argument("--quick", action="store_true", help=f"small run: {QUICK}, coarse grids")
    for name in ("texts", "context_tokens", "decode_steps"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"default {FULL[name]} "
                       f"(quick {QUICK[name]})")
    p.add_argument("--high", default="K8V4")
    p.add_argument("--low", default="K4V2")
    p.add_argument("--recent-window", type=int, default=64)
    p.add_argument("--score-window", type=int, default=64)
    p.add_argument("--center-keys", action="store_true",
                   help="subtract each head's median prompt key before quantizing (DiffKVConfig.center_keys)")
    p.add_argument("--smooth-keys", action=argparse.BooleanOptionalAction, default=None,
                   help="store keys per channel centered and scaled by each head's prompt range "
                        "(DiffKVConfig.smooth_keys; default: on unless --center-keys)")
    p.add_argument("--score-after-window", action="store_true",
                   help="decode scores count only the attention after a token leaves the recent window "
                        "(DiffKVConfig.score_after_window, beyond the paper)")
    p.add_argument("--compact-meta", action="store_true",
                   help="fp16 mean scores and 16-bit positions: 4 B less per token (DiffKVConfig.compact_meta)")
    p.add_argument("--symmetric-keys", action="store_true",
                   help="scale-only key groups: 2 B less per group (DiffKVConfig.symmetric_keys)")
    p.add_argument("--rotate-values", action="store_true",
                   help="store values under a fixed randomized Hadamard rotation (DiffKVConfig.rotate_values)")
    p.add_argument("--no-context", action="store_true",
                   help="skip the context point (repeat scores for a context compressed before its question; "
                        "diffkv.core.points): the profile keeps the default context_scale")
    p.add_argument("--context-of", default=None, metavar="PROFILE",
                   help="calibrate only the context point of this profile (same model) and write it to --out")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on shared 2-core boxes)")
    p.add_argument("--stats-dir", default=None, help="cache of statistics and measurements")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the written profile as JSON (the table goes to stderr)")


def _fmt_row(r: dict, budget: search.Budget) -> str:
    alphas = "per-layer" if r.get("per_layer") else f"{r['alpha_high']:>6g} {r['alpha_low']:>6g}"
    return (f"{r['stage']:<11}{alphas:>14}{r['predicted_compression']:>8.2f}x{r['compression_physical']:>8.2f}x"
            f"{r['kl']:>9.4f}{r['top1']:>7.3f}{r['ppl_ratio']:>8.4f}  {'ok' if budget.ok(r) else 'over':<5}"
            f"{r.get('seconds', 0):>6.0f}s{' (cached)' if r.get('cached') else ''}")


def run(args) -> int:
    import torch

    from diffkv.calibration.profiler import ImportanceStats, calibration_texts, profile_model
    from diffkv.core.config import DiffKVConfig
    from diffkv.core.paths import cache_home, results_home
    from diffkv.profile import Profile, model_identity, save_profile
    from diffkv.registry.models import load_model

    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    preset = QUICK if args.quick else FULL
    n, ctx, steps = (getattr(args, k) or preset[k] for k in ("texts", "context_tokens", "decode_steps"))
    first = args.first_doc if args.first_doc is not None else (25 if args.data == "pg-essays" else 0)
    budget = search.Budget(args.max_kl if args.max_kl is not None or args.max_ppl_increase is not None else 0.02,
                           args.max_ppl_increase)
    base = DiffKVConfig(high=args.high, low=args.low, recent_window=args.recent_window,
                        score_window=args.score_window, center_keys=args.center_keys,
                        smooth_keys=args.smooth_keys, score_after_window=args.score_after_window,
                        compact_meta=args.compact_meta, symmetric_keys=args.symmetric_keys,
                        rotate_values=args.rotate_values)
    slug = Path(str(args.model)).name
    out = Path(args.out or results_home() / "profiles" / f"{slug}.json")
    say = functools.partial(print, file=sys.stderr if args.json else sys.stdout)
    stats_dir = Path(args.stats_dir) if args.stats_dir else cache_home() / "calibration"
    stem = f"{slug}-{args.data}-d{first}-n{n}-c{ctx}-s{steps}-w{args.score_window}"
    model, tok = load_model(args.model)
    stats_path = stats_dir / f"{stem}.safetensors"
    if stats_path.is_file():
        stats = ImportanceStats.load(stats_path)
        say(f"reusing profiling statistics {stats_path}")
    else:
        ids = calibration_texts(tok, args.data, n, ctx + steps + 1, first)
        stats = profile_model(model, ids, ctx, args.score_window, {"name": slug, "data": args.data,
                                                                   "first_doc": first}, progress=not args.no_progress)
        stats.save(stats_path)
    evaluate = search.CachedEvaluator(model, stats, stats_dir / f"{stem}.evals.jsonl", progress=not args.no_progress,
                                      tokenizer=tok)
    if args.context_of:
        return _context_only(args, evaluate, budget, model, out, say)
    highs, lows = (search.QUICK_HIGH, search.QUICK_LOW) if args.quick else (search.FULL_HIGH, search.FULL_LOW)
    rows = search.global_sweep(evaluate, base, budget, highs, lows)
    best = search.best_row(rows, budget)
    layer = None
    if args.per_layer and best is not None:
        layer = search.per_layer_search(evaluate, stats, base, budget, rows, max_evals=preset["layer_evals"])
        rows += layer["rows"]
    say(f"\n{'stage':<11}{'a_high a_low':>14}{'pred':>9}{'meas':>9}{'KL':>9}{'top1':>7}{'ppl x':>8}  budget")
    for r in rows:
        say(_fmt_row(r, budget))
    if best is None:
        say(f"no configuration meets the budget {budget} (even alpha = 0/0, all {base.high}); raise the budget")
        return 1
    chosen, config = best, replace(base, alpha_high=best["alpha_high"], alpha_low=best["alpha_low"])
    if layer and layer["best"] and layer["best"]["compression_physical"] > best["compression_physical"]:
        chosen = layer["best"]
        config = replace(config, layer_alphas=tuple(tuple(p) for p in chosen["layer_alphas"]))
    gain = (layer["best"]["compression_physical"] / best["compression_physical"]) if layer and layer["best"] else None
    config, context_rows = (config, []) if args.no_context else _context_point(evaluate, config, budget, args, say)
    elapsed = time.perf_counter() - start
    keep = ("kl", "kl_p95", "top1", "ppl_ratio", "ppl_full", "compression_physical", "predicted_compression",
            "tier_fractions")
    profile = Profile(
        model=model_identity(model, slug),
        config=config,
        calibration={"data": args.data, "first_doc": first, "texts": n, "context_tokens": ctx, "decode_steps": steps,
                     "budget": {"max_kl": budget.max_kl, "max_ppl_increase": budget.max_ppl_increase},
                     "quick": bool(args.quick), "seconds": round(elapsed, 1)},
        measured={k: chosen[k] for k in keep},
        search={"global_best": {k: best[k] for k in ("alpha_high", "alpha_low", *keep)},
                "per_layer_gain": gain, "per_layer_weight": layer and layer["weight"],
                "rows": [{k: r.get(k) for k in ("stage", "alpha_high", "alpha_low", "per_layer", *keep)}
                         for r in rows], "context_rows": context_rows},
    )
    save_profile(profile, out)
    say(f"\nchosen: {'per-layer' if config.layer_alphas else 'global'} alpha_high={config.alpha_high} "
          f"alpha_low={config.alpha_low}: {chosen['compression_physical']:.2f}x physical, KL {chosen['kl']:.4f}, "
          f"top-1 {chosen['top1']:.3f}, ppl x{chosen['ppl_ratio']:.4f}"
          + (f"; per-layer gain over global x{gain:.3f}" if gain else ""))
    say(f"wrote {out} ({evaluate.measured} candidates measured, {elapsed / 60:.1f} min)")
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2))
    return 0


CONTEXT_KEEP = ("context_scale", "kl", "kl_p95", "top1", "ppl_ratio", "ppl_full", "compression_physical",
                "tier_fractions")


def _context_point(evaluate, config, budget: search.Budget, args, say) -> tuple:
    """``config`` with the context scale the budget allows (the most compressive context point within it; none
    within it: the smallest scale tried, said so) and the profile's ``context_rows``."""
    rows = search.context_sweep(evaluate, config, budget, search.QUICK_CONTEXT if args.quick else
                                search.CONTEXT_SCALES)
    say(f"\n{'context x':<11}{'meas':>9}{'KL':>9}{'top1':>7}{'ppl x':>8}  budget")
    for r in rows:
        say(f"{r['context_scale']:<11g}{r['compression_physical']:>8.2f}x{r['kl']:>9.4f}{r['top1']:>7.3f}"
            f"{r['ppl_ratio']:>8.4f}  {'ok' if budget.ok(r) else 'over'}")
    best = search.best_row(rows, budget)
    if best is None:
        say(f"no context point meets the budget {budget}; keeping the smallest scale tried, {rows[0]['context_scale']}")
    scale = (best or rows[0])["context_scale"]
    say(f"context point: repeat scores, peak importance, thresholds x {scale:g}")
    return replace(config, context_scale=scale), [{k: r[k] for k in CONTEXT_KEEP} for r in rows]


def _context_only(args, evaluate, budget: search.Budget, model, out: Path, say) -> int:
    """``--context-of``: the profile at that path with its context point calibrated, written to ``out``."""
    from diffkv.profile import load_profile, save_profile

    profile = load_profile(args.context_of, model)
    profile.config, rows = _context_point(evaluate, profile.config, budget, args, say)
    profile.search = {**profile.search, "context_rows": rows}
    profile.created = ""  # stamped now: the file changed
    save_profile(profile, out)
    say(f"wrote {out} ({evaluate.measured} candidates measured)")
    return 0

