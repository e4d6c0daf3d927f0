"""`diffkv` command line: layout | models | data | demo | bench | calibrate | eval | serve.

Subcommands import their modules lazily so `diffkv layout` does not pay for torch/transformers start-up twice.
"""

from __future__ import annotations

import argparse
import json
import sys


def _add_layout(sub) -> None:
    p = sub.add_parser("layout", help="page size and per-tier page layout for a head_dim and tier pair")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--high", default="K8V4", help="high tier, e.g. K8V4 or K8V4-g128/64")
    p.add_argument("--low", default="K4V2", help="low tier, e.g. K4V2 or K4V2-g64/32")
    p.add_argument("--meta-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--published", action="store_true", help="size pages for the four published tiers (6784 B at 128)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_layout)


def _layout(args) -> int:
    from diffkv.config import DiffKVConfig
    from diffkv.layout import PUBLISHED_TIERS, plan_pages

    cfg = DiffKVConfig(high=args.high, low=args.low, meta_dtype=args.meta_dtype)
    tiers = tuple(dict.fromkeys([*cfg.tiers, *PUBLISHED_TIERS])) if args.published else cfg.tiers
    plan = plan_pages(args.head_dim, tiers, meta_dtype=args.meta_dtype)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    fp16_bpt = 4 * args.head_dim
    print(f"page: {plan.page_bytes} B (head_dim {args.head_dim}, {plan.page_bytes // fp16_bpt} fp16 tokens/page)")
    print(f"{'tier':<14}{'tokens/page':>12}{'B/token':>9}{'waste':>8}{'vs fp16':>9}")
    for t in plan.tiers:
        ratio = fp16_bpt * t.tokens_per_page / plan.page_bytes
        print(f"{t.name:<14}{t.tokens_per_page:>12}{t.bytes_per_token:>9}{t.waste_fraction:>8.2%}{ratio:>8.2f}x")
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="answer a long-context question with the full cache and with DiffKV, side by side")
    p.add_argument("--model", default="smollm2-135m", help="registry name, local folder or HF id")
    p.add_argument("--context-tokens", type=int, default=1500, help="PG-essay tokens before the question")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--profile", default=None, help="calibrated profile JSON (default: the published defaults)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_demo)


def _demo(args) -> int:
    from diffkv.demo import run_demo

    return run_demo(args)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: memory manager, decode speed, perplexity, serving")
    bsub = p.add_subparsers(dest="bench", required=True)
    from diffkv.bench import decode as decode_bench
    from diffkv.bench import ppl as ppl_bench
    from diffkv.engine import bench as serve_bench
    from diffkv.memory import bench as memory_bench

    for name, mod, text in (("memory", memory_bench, "parallel memory manager vs per-head free lists"),
                            ("decode", decode_bench, "decode speed: DiffKVCache vs DynamicCache, side by side"),
                            ("ppl", ppl_bench, "perplexity of a continuation decoded through the compressed cache"),
                            ("serve", serve_bench, "serving throughput: fp16 vs diffkv KV backend at one budget")):
        mod.add_arguments(bsub.add_parser(name, help=text))
        bsub.choices[name].set_defaults(func=mod.run)


def _add_module(sub, name: str, module: str, text: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    mod.add_arguments(sub.add_parser(name, help=text))
    sub.choices[name].set_defaults(func=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_layout(sub)
    from diffkv.registry_cli import add_data_parser, add_models_parser

    add_models_parser(sub)
    add_data_parser(sub)
    _add_demo(sub)
    _add_bench(sub)
    _add_module(sub, "calibrate", "diffkv.calibration.cli", "find thresholds that keep quality within a budget")
    _add_module(sub, "eval", "diffkv.eval.cli", "accuracy benchmarks: DiffKV vs full cache and baselines")
    _add_module(sub, "serve", "diffkv.engine.serve_cli", "OpenAI-compatible HTTP server over the serving engine")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"diffkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
