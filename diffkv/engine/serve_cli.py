"""``diffkv serve`` command line: load the model, build the backend and engine, serve until SIGTERM / Ctrl-C.

    diffkv serve --model smollm2-135m --backend diffkv --kv-budget 2GiB --port 8000
"""

from __future__ import annotations

import logging
import threading

from diffkv.engine.server import start_server
from diffkv.units import parse_bytes

log = logging.getLogger("diffkv.serve")


def _size_arg(text: str) -> int:
    import argparse

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="registry name (diffkv models), local folder or HF id")
    p.add_argument("--backend", default="diffkv", choices=["diffkv", "fp16"], help="KV storage")
    p.add_argument("--kv-budget", type=_size_arg, default=parse_bytes("2GiB"),
                   help="KV pool memory: 2GiB, 512MiB, 1e9 (default 2GiB)")
    p.add_argument("--profile", default=None, help="calibrated profile JSON for --backend diffkv")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default localhost only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--max-running", type=int, default=None, help="most requests decoding at once")
    p.add_argument("--max-model-len", type=int, default=4096, help="most tokens per request (prompt + output)")
    p.add_argument("--served-model-name", default=None, help="name reported in responses (default --model)")
    p.add_argument("--device", default=None, help="cpu, cuda ... (default cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="model weights (default float16 on GPU, float32 on CPU)")


def run(args) -> int:
    import torch

    from diffkv.engine import Engine, make_backend
    from diffkv.models import load_model

    if args.max_running is not None and args.max_running < 1:
        raise ValueError(f"--max-running must be >= 1, got {args.max_running}")
    if args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("float32" if device == "cpu" else "float16"))
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    backend = make_backend(args.backend, model, kv_budget_bytes=args.kv_budget, profile=args.profile,
                           max_slots=max(64, args.max_running or 0), max_model_len=args.max_model_len)
    engine = Engine(model, tokenizer, backend, max_running=args.max_running)
    handle = start_server(engine, args.served_model_name or args.model, args.host, args.port)
    print(f"diffkv serve: {args.model} on {device} ({backend.name} backend, {backend.num_pages} pages of "
          f"{backend.plan.page_bytes} B, max {backend.max_model_len} tokens per request)", flush=True)
    print(f"listening on {handle.url}", flush=True)
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
