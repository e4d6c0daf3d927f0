"""``diffkv serve`` command line: load the model, build the KV cache and engine, serve until SIGTERM / Ctrl-C.

    diffkv serve --model smollm2-135m --cache diffkv --kv-budget 2GiB --port 8000
    diffkv serve --model smollm2-135m --host 0.0.0.0 --allowed-hosts llm.example.com --api-key "$KEY"

The port is claimed before the model loads, so a busy port is reported at once (a one-line error).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import threading

from diffkv.core.errors import UsageError
from diffkv.core.points import keeps_everything
from diffkv.core.units import parse_bytes
from diffkv.engine.cache import CACHE_KINDS
from diffkv.engine.prefill import DEFAULT_MAX_PREFILL_TOKENS
from diffkv.serve.http_guard import Guard
from diffkv.serve.http_handler import MAX_BODY_BYTES
from diffkv.serve.server import MAX_PENDING, REQUEST_TIMEOUT_S, listen, start_server

log = logging.getLogger("diffkv.serve")


def _size_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _list_arg(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def serve_profile(value: str, model: str) -> str | None:
    """The profile ``--profile value`` names for ``--model model``: ``auto`` is the model's shipped profile when
    one has its name (calibrated for that model; why it is the default: benchmarks/serve/prefix/README.md), else
    None (``DiffKVConfig()``); ``none`` is None; anything else is a path or shipped name."""
    if value == "none":
        return None
    if value == "auto":
        from diffkv.profile import shipped_profiles

        return model if model in shipped_profiles() else None
    return value


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="registry name (diffkv models), local folder or HF id")
    p.add_argument("--cache", default="diffkv", choices=CACHE_KINDS,
                   help="KV cache kind: diffkv (compressed tiers) or fp16 (a paged 16-bit cache); default diffkv")
    # --backend: the old name (before issue #32), hidden, kept for recorded commands; what
    # diffkv.bench.common.add_alias does, which the engine cannot import (the apps' layer sits above it)
    p.add_argument("--backend", dest="cache", choices=CACHE_KINDS, help=argparse.SUPPRESS,
                   default=argparse.SUPPRESS)
    p.add_argument("--kv-budget", type=_size_arg, default=parse_bytes("2GiB"),
                   help="KV pool memory: 2GiB, 512MiB, 1e9 (default 2GiB)")
    p.add_argument("--profile", default="auto",
                   help="calibrated profile (JSON path or shipped name) for --cache diffkv; default auto: the "
                        "model's shipped profile when --model names one, else DiffKVConfig(); none: DiffKVConfig()")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default localhost only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--max-running", type=int, default=None, help="most requests decoding at once")
    p.add_argument("--max-model-len", type=int, default=4096, help="most tokens per request (prompt + output)")
    p.add_argument("--max-prefill-tokens", type=int, default=DEFAULT_MAX_PREFILL_TOKENS,
                   help=f"most prompt tokens prefilled together in one engine step (default "
                        f"{DEFAULT_MAX_PREFILL_TOKENS}; a longer prompt is prefilled alone)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill a prompt longer than this over several steps, one chunk per step, while the running "
                        "requests decode (full-attention models; default: whole)")
    p.add_argument("--chunked-prefill", choices=("extend", "deferred"), default="deferred",
                   help="with --prefill-chunk: deferred (default: chunks staged at full precision in the KV budget and "
                        "stored as one prompt: the whole prompt's tiers, cheaper chunks) or extend (each chunk "
                        "appended to the pages: bounded memory)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="chats that begin alike (a system prompt, a document, earlier turns) share the compressed "
                        "pages of their common messages, prefilled once (full-attention models), scored by "
                        "--prefix-scores")
    p.add_argument("--prefix-scores", choices=("context", "window"), default="context",
                   help="what places a shared prefix's tokens: context (default: repeat scores at the config's "
                        "context point, for questions that come after it) or window (the prefix's own last "
                        "queries at the config's thresholds)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a greedy request gets the same answer whatever else runs (linear layers over padded rows, "
                        "each prompt scored alone; costs decode speed at small batches, see "
                        "benchmarks/serve/batch_invariance.md)")
    p.add_argument("--served-model-name", default=None, help="name reported in responses (default --model)")
    p.add_argument("--device", default=None, help="cpu, cuda ... (default cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="model weights (default float16 on GPU, float32 on CPU)")
    g = p.add_argument_group("access (see README, Security)")
    g.add_argument("--allowed-hosts", type=_list_arg, default=(), metavar="NAMES",
                   help="Host header names answered besides 127.0.0.1 / localhost / [::1] on the bound port (and "
                        "any IP address on it with --host 0.0.0.0): name or name:port, comma-separated; * for any "
                        "(default: none)")
    g.add_argument("--cors-origin", type=_list_arg, default=(), metavar="ORIGINS",
                   help="browser origins allowed to call, e.g. http://localhost:3000, comma-separated; * for any "
                        "(default: none, requests with another Origin header get a 403)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on all but /health (default: $DIFFKV_API_KEY, "
                        "which keeps the key out of the process list; else none)")
    g.add_argument("--max-body-bytes", type=_size_arg, default=MAX_BODY_BYTES,
                   help="largest request body, e.g. 1MiB (default 1MiB; larger: 413)")
    g.add_argument("--max-pending", type=int, default=MAX_PENDING,
                   help=f"most generation requests in flight or queued (default {MAX_PENDING}; more: 429)")
    g.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S, metavar="SECONDS",
                   help=f"seconds a request may take to arrive, and a read or write may stall "
                        f"(default {REQUEST_TIMEOUT_S:g})")


def run(args) -> int:
    import torch

    from diffkv.engine import Engine, make_cache
    from diffkv.registry.models import load_model

    if args.max_running is not None and args.max_running < 1:
        raise ValueError(f"--max-running must be >= 1, got {args.max_running}")
    if args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if args.max_prefill_tokens < 1:
        raise ValueError(f"--max-prefill-tokens must be >= 1, got {args.max_prefill_tokens}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_pending < 1 or not 0 < args.request_timeout < math.inf:
        raise UsageError(f"--max-pending ({args.max_pending}) and --request-timeout ({args.request_timeout}) must "
                         "be positive")
    api_key = args.api_key if args.api_key is not None else os.environ.get("DIFFKV_API_KEY") or None
    Guard(args.host, args.port, args.allowed_hosts, args.cors_origin, api_key)  # bad values fail before the load
    if args.port:
        listen(args.host, args.port).server_close()  # a busy port fails now, not after the model loaded
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("float32" if device == "cpu" else "float16"))
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    profile = serve_profile(args.profile, args.model) if args.cache == "diffkv" else None
    cache = make_cache(args.cache, model, kv_budget_bytes=args.kv_budget, profile=profile,
                       max_slots=max(64, args.max_running or 0), max_model_len=args.max_model_len)
    engine = Engine(model, tokenizer, cache, max_running=args.max_running, max_prefill_tokens=args.max_prefill_tokens,
                    batch_invariant=args.batch_invariant, prefill_chunk=args.prefill_chunk,
                    chunked_prefill=args.chunked_prefill,
                    prefix_cache=args.prefix_cache, prefix_scores=args.prefix_scores)
    name = args.served_model_name or args.model
    handle = start_server(engine, name, args.host, args.port, max_body_bytes=args.max_body_bytes,
                          allowed_hosts=args.allowed_hosts, cors_origins=args.cors_origin, api_key=api_key,
                          model_aliases=(args.model,), max_pending=args.max_pending,
                          request_timeout=args.request_timeout)
    print(f"diffkv serve: {args.model} on {device} ({cache.name} KV cache"
          f"{'' if args.cache != 'diffkv' else ', profile ' + (profile or 'none: DiffKVConfig()')}, "
          f"{cache.num_pages} pages of {cache.plan.page_bytes} B, max {cache.max_model_len} tokens per request)",
          flush=True)
    print(scores_line(engine), flush=True)
    print(f"listening on {handle.url}", flush=True)
    if args.host.strip("[]") not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("listening on %s without --api-key: anyone who can reach port %d can use the model",
                    args.host, handle.port)
    stop = threading.Event()
    try:
        import signal

        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    except ValueError:  # not the main thread
        pass
    try:
        while not stop.wait(0.5):
            if not handle.engine_thread.is_alive():
                print(f"diffkv serve: {handle.engine_error or 'the engine stopped'}", flush=True)
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        log.info("shutting down")
        handle.close()
        log.info("stopped")
    return 0


def scores_line(engine) -> str:
    """Which scores each path of ``engine`` uses (printed at start-up: nothing chosen for the user is hidden)."""
    config = getattr(engine.cache, "config", None)
    if config is None or keeps_everything(config):
        return "scores: none (every token kept)"
    line = f"scores: prompts by {config.prompt_scores} scores ({config.importance} importance)"
    if engine.prefix is None:
        return line + "; shared prefixes off (--prefix-cache)"
    point = engine.prefix.point
    scale = "the same thresholds" if point is config else f"thresholds x {config.context_scale:g}"
    return line + f"; shared prefixes by {point.prompt_scores} scores ({point.importance} importance, {scale})"

