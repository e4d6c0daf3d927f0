"""``diffkv eval run | report`` (also ``python -m diffkv.eval ...``).

    python -m diffkv.eval run --model qwen2.5-0.5b --task gsm8k --methods full,diffkv,K4V4,kivi2,h2o,snapkv \\
        --limit 10 --max-batch 64 --max-new-tokens 256
    python -m diffkv.eval run --model qwen2.5-0.5b --task ruler --ruler-lengths 4096,8192 --ruler-protocol ask-after
    python -m diffkv.eval report --out benchmarks/accuracy

Without --out, results go to the user results folder (:func:`diffkv.core.paths.results_home`), never into the checkout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_TASK_OPTIONS = {"needle_lengths": ("lengths", int), "needle_depths": ("depths", float),
                 "needle_repeats": ("repeats", int), "ppl_context": ("context", int),
                 "ppl_continuation": ("continuation", int), "ppl_essays": ("essays", int),
                 "gsm8k_shots": ("shots", int), "needle_protocol": ("protocol", str),
                 "ruler_lengths": ("lengths", int), "ruler_families": ("families", str),
                 "ruler_samples": ("samples", int), "ruler_protocol": ("protocol", str)}
_LISTS = ("lengths", "depths", "families")  # options that take a comma-separated list

_PROTOCOL_HELP = ("in-prompt (default: the question is part of the compressed prompt) | ask-after (the context is "
                  "prefilled and compressed first, then the question is fed token by token)")
_HELP = {"needle_protocol": _PROTOCOL_HELP, "ruler_protocol": _PROTOCOL_HELP,
         "ruler_lengths": "comma-separated prompt lengths in tokens, chat template included (default 4096)",
         "ruler_families": "comma-separated RULER families (default all: niah_single_1..3, niah_multikey_1..3, "
                           "niah_multivalue, niah_multiquery, vt, cwe, fwe, qa)",
         "ruler_samples": "samples per family and length (default 50)"}

_DEFAULT_OUT = "$DIFFKV_RESULTS/accuracy, ~/.local/share/diffkv/results/accuracy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``run`` and ``report`` subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="eval_command", required=True)
    r = sub.add_parser("run", help="evaluate methods on a task (resumable; results under --out)")
    r.add_argument("--model", default="qwen2.5-0.5b", help="registry name or local folder")
    r.add_argument("--task", required=True, help="gsm8k | aime2025 | gpqa-diamond | needle | ruler | ppl")
    r.add_argument("--methods", default="full,diffkv", help="comma-separated method names (see `diffkv eval list`)")
    r.add_argument("--limit", type=int, default=None, help="N samples of the task (from --start)")
    r.add_argument("--start", type=int, default=0, help="first sample (e.g. --start 500 --limit 100: questions "
                   "500-599)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--batch-size", type=int, default=4, help="samples per fixed batch of the generate runner")
    r.add_argument("--runner", default="auto", choices=["auto", "engine", "generate"],
                   help="engine: samples stream through the continuous-batching engine (paged methods, generation "
                        "tasks, question in the prompt); generate: model.generate over fixed left-padded batches "
                        "(every method; the reference path); auto (default): the engine where it can run, and a "
                        "resumed run keeps its runner")
    r.add_argument("--max-batch", type=int, default=64,
                   help="most samples decoding at once on the engine runner (default 64; lowered to what a 4 GiB "
                        "pool holds at the worst case)")
    r.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's")
    r.add_argument("--budget", type=float, default=None,
                   help="token budget ratio of eviction methods; default 1 / DiffKV's recorded physical compression")
    r.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill each prompt in chunks of this many tokens (generate(prefill_chunk_size=N); the "
                        "generate runner): later chunks are appended to the compressed cache by extend")
    r.add_argument("--chunked-prefill", choices=("extend", "deferred"), default=None,
                   help="with --prefill-chunk: how a DiffKV cache stores the chunks (DiffKVCache(chunked_prefill=); "
                        "default extend)")
    r.add_argument("--profile", default=None,
                   help="calibrated profile (JSON path or shipped name) for the diffkv method")
    r.add_argument("--out", default=None, help=f"results folder (default {_DEFAULT_OUT})")
    r.add_argument("--overwrite", action="store_true", help="restart runs whose recorded settings differ")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--json", action="store_true", help="print the metrics of every method as one JSON object")
    for flag, (key, kind) in _TASK_OPTIONS.items():
        many = key in _LISTS
        r.add_argument("--" + flag.replace("_", "-"), default=None,
                       help=_HELP.get(flag, f"{'comma-separated ' if many else ''}{kind.__name__}{'s' if many else ''} "
                                            f"({key} option)"))
    p = sub.add_parser("report", help="markdown table of recorded results and a plot of their compression-quality "
                                      "frontier")
    p.add_argument("--out", default=None, help=f"results folder (default {_DEFAULT_OUT}; the recorded results: "
                   "benchmarks/accuracy)")
    p.add_argument("--model", default=None)
    p.add_argument("--task", default=None)
    p.add_argument("--plot", default=None, help="PNG path of the frontier of every run under --out, variant folders "
                   "included (default <out>/accuracy_vs_compression.png)")
    p.add_argument("--json", action="store_true")
    sub.add_parser("list", help="known tasks and methods")


def _task_options(args) -> dict:
    opts = {}
    for flag, (key, kind) in _TASK_OPTIONS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        try:
            parsed = [kind(x) for x in str(value).split(",") if x.strip()]
        except ValueError as err:
            raise ValueError(f"--{flag.replace('_', '-')}: cannot parse {value!r} as {kind.__name__}s") from err
        value = parsed if key in _LISTS else parsed[0]
        if opts.get(key, value) != value:
            raise ValueError(f"--{flag.replace('_', '-')} contradicts another flag setting the {key} option")
        opts[key] = value
    return opts


def _out(args) -> str:
    from diffkv.core.paths import results_home

    return str(args.out or results_home() / "accuracy")


def _run(args) -> int:
    from diffkv.eval.methods import get_method
    from diffkv.eval.protocol import task_protocol
    from diffkv.eval.runner import RunConfig, run_eval
    from diffkv.eval.tasks import get_task

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        get_method(m)
    task = get_task(args.task)
    task_protocol(task, _task_options(args))  # bad options fail before the model loads
    if hasattr(task, "check_options"):
        task.check_options(_task_options(args))
    model = tokenizer = None
    results = {}
    for name in methods:
        cfg = RunConfig(model=args.model, task=args.task, method=name, out=_out(args), limit=args.limit,
                        start=args.start, seed=args.seed, batch_size=args.batch_size,
                        max_new_tokens=args.max_new_tokens, budget=args.budget, profile=args.profile,
                        task_options=_task_options(args), runner=args.runner, max_batch=args.max_batch,
                        prefill_chunk=args.prefill_chunk, chunked_prefill=args.chunked_prefill)
        if model is None:
            from diffkv.registry.models import load_model

            model, tokenizer = load_model(args.model)
        m = run_eval(cfg, model, tokenizer, overwrite=args.overwrite, progress=not args.no_progress)
        results[name] = {**m, "run_dir": str(cfg.run_dir())}
        if args.json:
            continue
        score = f"ppl {m['ppl']:.3f}" if "ppl" in m else f"accuracy {m['accuracy']:.3f} ± {m['stderr']:.3f}"
        print(f"{args.task}/{name}: n={m['n']} {score}, physical compression "
              f"{m['compression_physical'] or float('nan'):.2f}x -> {cfg.run_dir()}", flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def _report(args) -> int:
    from diffkv.eval.report import collect, frontier_rows, markdown, plot

    rows = collect(_out(args), args.model, args.task)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(markdown(rows))
    png = plot(frontier_rows(_out(args), args.model, args.task),
               Path(args.plot or Path(_out(args)) / "accuracy_vs_compression.png"))
    print(f"\nplot: {png}" if png else "\n(no plot: matplotlib is not installed or no accuracy results)")
    return 0


def _list(args) -> int:
    from diffkv.eval.methods import METHODS
    from diffkv.eval.tasks import TASKS

    print("tasks:   " + ", ".join(TASKS))
    for m in METHODS.values():
        print(f"  {m.name:<14}{m.description}")
    return 0


def run(args) -> int:
    """Dispatch a parsed ``diffkv eval`` command line; returns the exit status."""
    return {"run": _run, "report": _report, "list": _list}[args.eval_command](args)
