"""`diffkv` command line: layout | models | data | demo | bench | calibrate | eval | serve.

Only the chosen subcommand's module is imported, so `diffkv layout` and `--help` do not load torch.
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
    p.add_argument("--compact", action="store_true",
                   help="compact metadata (DiffKVConfig.compact_meta): fp16 mean score + 16-bit position, 4 B less")
    p.add_argument("--symmetric-keys", action="store_true",
                   help="scale-only key groups (DiffKVConfig.symmetric_keys): 2 B less per key group")
    p.add_argument("--page-bytes", type=int, default=None,
                   help="a fixed page size (DiffKVConfig.page_bytes, a multiple of 32; default: the planner's)")
    p.add_argument("--expected-tokens", type=int, default=None,
                   help="tokens a tier of one sequence, layer and KV head typically holds: the search also weighs the "
                   "half page each tier leaves empty at its end (short sequences get smaller pages; use the size "
                   "as --page-bytes / DiffKVConfig.page_bytes)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_layout)


def _layout(args) -> int:
    from diffkv.core.config import DiffKVConfig
    from diffkv.core.layout import PUBLISHED_TIERS, plan_pages, tail_waste

    cfg = DiffKVConfig(high=args.high, low=args.low, meta_dtype=args.meta_dtype, page_bytes=args.page_bytes)
    tiers = tuple(dict.fromkeys([*cfg.tiers, *PUBLISHED_TIERS])) if args.published else cfg.tiers
    fixed = None if cfg.page_bytes is None else range(cfg.page_bytes, cfg.page_bytes + 1)
    if args.expected_tokens is not None and args.expected_tokens < 1:
        raise ValueError(f"--expected-tokens must be a positive number of tokens, got {args.expected_tokens}")
    plan = plan_pages(args.head_dim, tiers, meta_dtype=args.meta_dtype, candidates=fixed, compact=args.compact,
                      symmetric_keys=args.symmetric_keys, expected_tokens=args.expected_tokens)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    fp16_bpt = 4 * args.head_dim
    print(f"page: {plan.page_bytes} B (head_dim {args.head_dim}, {plan.page_bytes // fp16_bpt} fp16 tokens/page)")
    tail = args.expected_tokens is not None
    head = f"{'tier':<14}{'tokens/page':>12}{'B/token':>9}{'waste':>8}{'vs fp16':>9}"
    print(head + ("   tail waste" if tail else ""))
    for t in plan.tiers:
        ratio = fp16_bpt * t.tokens_per_page / plan.page_bytes
        extra = f"{tail_waste(t, args.expected_tokens):>13.2%}" if tail else ""
        print(f"{t.name:<14}{t.tokens_per_page:>12}{t.bytes_per_token:>9}{t.waste_fraction:>8.2%}{ratio:>8.2f}x"
              + extra)
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="answer a long-context question with the full cache and with DiffKV, side by side")
    p.add_argument("--model", default="smollm2-135m", help="registry name, local folder or HF id")
    p.add_argument("--context-tokens", type=int, default=1500, help="PG-essay tokens before the question")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--profile", default=None,
                   help="calibrated profile: JSON path or shipped name, e.g. smollm2-135m (default: the defaults)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="also write the layer x KV-head heatmap of tier fractions to PATH (.png/.svg/.pdf; matplotlib)")
    from diffkv.bench.common import add_output_arguments

    add_output_arguments(p)
    p.set_defaults(func=_demo)


def _demo(args) -> int:
    from diffkv.demo import run_demo

    return run_demo(args)


# name -> (module with add_arguments(parser) and run(args), help). Imported only when that command runs, so
# `diffkv layout` and every `--help` stay fast (torch and transformers take seconds to import).
_BENCH = {
    "memory": ("diffkv.bench.memory", "parallel memory manager vs per-head free lists"),
    "decode": ("diffkv.bench.decode", "decode speed: DiffKVCache vs DynamicCache, side by side"),
    "ppl": ("diffkv.bench.ppl", "perplexity of a continuation decoded through the compressed cache"),
    "serve": ("diffkv.bench.serve", "serving throughput: fp16 vs diffkv KV cache at one budget"),
}
_MODULES = {
    "calibrate": ("diffkv.calibration.cli", "find thresholds that keep quality within a budget"),
    "eval": ("diffkv.eval.cli", "accuracy benchmarks: DiffKV vs full cache and baselines"),
    "serve": ("diffkv.serve.serve_cli", "OpenAI-compatible HTTP server over the serving engine"),
}


def _add_lazy(sub, table: dict, wanted) -> None:
    """One sub-parser per entry of ``table``; only the modules named in ``wanted`` are imported and given their
    arguments."""
    import importlib

    for name, (module, text) in table.items():
        p = sub.add_parser(name, help=text, description=text)
        if name in wanted:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.run)


def _first_word(argv: list[str], after: str | None = None) -> str | None:
    """The first non-option word of ``argv`` (after the word ``after`` when given): the chosen subcommand."""
    words = [a for a in argv if not a.startswith("-")]
    if after is not None:
        words = words[words.index(after) + 1:] if after in words else []
    return words[0] if words else None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``diffkv`` parser: complete without ``argv``; with it, only the chosen subcommand's module is imported."""
    parser = argparse.ArgumentParser(prog="diffkv", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="print tracebacks of expected errors too")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_layout(sub)
    from diffkv.registry.cli import add_data_parser, add_models_parser

    add_models_parser(sub)
    add_data_parser(sub)
    _add_demo(sub)
    bench = sub.add_parser("bench", help="benchmarks: memory manager, decode speed, perplexity, serving")
    _add_lazy(bench.add_subparsers(dest="bench", required=True), _BENCH,
              _BENCH if argv is None else {_first_word(argv, "bench")})
    _add_lazy(sub, _MODULES, _MODULES if argv is None else {_first_word(argv)})
    return parser


def _expected(err: BaseException) -> bool:
    """Errors whose message is the whole story: bad input, a missing or unreadable file, a busy port."""
    from diffkv.core.errors import UsageError

    if isinstance(err, (UsageError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                        PermissionError)):
        return True
    return type(err).__name__ in ("PoolExhausted", "CompileError")


def main(argv: list[str] | None = None) -> int:
    """Run one command line; expected errors print one line and return 2, ``--debug`` adds the traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"diffkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if not _expected(err) or args.debug:
            raise
        lines = str(err).strip().splitlines() or [type(err).__name__]
        more = " (more with --debug)" if len(lines) > 1 else ""
        print(f"diffkv {args.command}: error: {lines[0]}{more}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
