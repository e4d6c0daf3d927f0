"""``diffkv serve``: an OpenAI-compatible HTTP server over the serving engine (standard library only).

    diffkv serve --model smollm2-135m --backend diffkv --kv-budget 2GiB --port 8000

One background thread runs :meth:`Engine.serve_forever`; each HTTP connection gets a thread
(``ThreadingHTTPServer``) that validates the request (:mod:`diffkv.engine.openai_api`), tokenizes it, submits it
with :meth:`Engine.add_request` and waits on a per-request queue fed by the engine's listener. Endpoints:
``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``: Server-Sent Events), ``GET /health``,
``GET /metrics`` (the engine's metrics plus HTTP counters), ``GET /v1/models``. A streaming client that goes away
is noticed at the next write (or while its request waits) and its request is cancelled, so its pages are freed.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from diffkv.engine import openai_api as api
from diffkv.units import parse_bytes

log = logging.getLogger("diffkv.serve")
MAX_BODY_BYTES = 1 << 20
_POLL_S = 0.25  # how often a waiting handler checks its client and the engine thread
_ROUTES = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/health": "GET", "/metrics": "GET",
           "/v1/models": "GET"}


class _EngineDown(Exception):
    pass


class ServerHandle:
    """A running server: ``port``, ``url``, ``close()`` (also a context manager)."""

    def __init__(self, engine, model_name: str, host: str, port: int, max_body_bytes: int):
        self.engine, self.model_name, self.max_body_bytes = engine, model_name, max_body_bytes
        self.max_model_len = engine.backend.max_model_len
        emb = engine.model.get_input_embeddings() if hasattr(engine.model, "get_input_embeddings") else None
        self.vocab_size = getattr(emb, "num_embeddings", None) or engine.model.config.vocab_size
        self.tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to call from several threads at once
        self.counters = {"http_requests": 0, "http_4xx": 0, "http_5xx": 0, "client_disconnects": 0}
        self.active: set = set()
        self._lock = threading.Lock()
        self.engine_error: str | None = None
        self._stop = threading.Event()
        self.httpd = ThreadingHTTPServer((host, port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.state = self
        self.host, self.port = self.httpd.server_address[:2]
        self.url = f"http://{host}:{self.port}"
        self.engine_thread = threading.Thread(target=self._engine_loop, name="diffkv-engine", daemon=True)
        self.http_thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                            name="diffkv-http", daemon=True)
        self.engine_thread.start()
        self.http_thread.start()

    def _engine_loop(self) -> None:
        try:
            self.engine.serve_forever(self._stop)
        except BaseException as e:  # noqa: B036 - reported to every waiting handler and by /health
            self.engine_error = f"the engine thread failed: {type(e).__name__}: {e}"
            log.exception("engine thread failed")

    @property
    def engine_alive(self) -> bool:
        return self.engine_thread.is_alive() and self.engine_error is None

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def metrics(self) -> dict:
        with self._lock:
            return {**self.engine.metrics(), "model": self.model_name, **self.counters,
                    "http_active": len(self.active)}

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, stop the engine thread, close the socket (streams in flight end with an error)."""
        deadline = time.monotonic() + timeout
        self.httpd.shutdown()
        self._stop.set()
        self.engine_thread.join(timeout)
        while self.active and time.monotonic() < deadline:  # let waiting handlers answer "engine stopped"
            time.sleep(0.05)
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start_server(engine, model_name: str, host: str = "127.0.0.1", port: int = 0, *,
                 max_body_bytes: int = MAX_BODY_BYTES) -> ServerHandle:
    """Serve ``engine`` over HTTP from background threads; ``port`` 0 picks a free port (``handle.port``)."""
    return ServerHandle(engine, model_name, host, port, max_body_bytes)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "diffkv"
    timeout = 120  # seconds a connection may stall on a read or write

    @property
    def state(self) -> ServerHandle:
        return self.server.state

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        log.info("%s %s", self.address_string(), format % args)

    # ---- routing ----
    def _dispatch(self) -> None:
        method = self.command
        self.state.count("http_requests")
        self._body_read = self._gone = self._streaming = False
        path = self.path.split("?", 1)[0]
        try:
            if path not in _ROUTES:
                raise api.APIError(404, f"no route {path}", code="not_found")
            if method != _ROUTES[path]:
                raise api.APIError(405, f"{path} accepts {_ROUTES[path]}, not {method}", code="method_not_allowed")
            if path == "/health":
                ok = self.state.engine_alive
                body = {"status": "ok"} if ok else {"status": "error", "error": self.state.engine_error}
                self._send_json(200 if ok else 503, body)
            elif path == "/metrics":
                self._send_json(200, self.state.metrics())
            elif path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [{"id": self.state.model_name, "object": "model",
                                                                   "owned_by": "diffkv"}]})
            else:
                self._generate("completion" if path == "/v1/completions" else "chat")
        except api.APIError as e:
            if not self._body_read and self.headers.get("Content-Length", "0") != "0":
                self.close_connection = True  # the unread body would be taken for the next request
            self._send_json(e.status, e.body(), allow=_ROUTES.get(path) if e.status == 405 else None)
        except _EngineDown as e:
            self._send_json(503, api.error_body(str(e), "server_error", code="engine_unavailable"))
        except Exception as e:  # noqa: BLE001 - one bad request must not take the server down
            log.exception("unexpected error on %s %s", method, path)
            self.close_connection = True
            if not self._streaming:  # else the headers are out: closing the connection is all that is left
                self._send_json(500, api.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _dispatch

    def _send_json(self, status: int, body: dict, allow: str | None = None) -> None:
        if status >= 400:
            self.state.count("http_4xx" if status < 500 else "http_5xx")
        data = json.dumps(body, ensure_ascii=False).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if allow:
                self.send_header("Allow", allow)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except OSError:
            self.close_connection = True

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise api.APIError(411, "send the body with a Content-Length header, not chunked")
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise api.APIError(411, "a Content-Length header is required")
        if not length.isdigit():
            self.close_connection = True
            raise api.APIError(400, f"bad Content-Length {length[:40]!r}")
        if int(length) > self.state.max_body_bytes:
            self.close_connection = True
            raise api.APIError(413, f"the body has {length} bytes; the limit is {self.state.max_body_bytes}",
                               code="request_too_large")
        raw = self.rfile.read(int(length))
        if len(raw) < int(length):
            self.close_connection = True
            raise api.APIError(400, "the body ended before Content-Length bytes")
        self._body_read = True
        return raw

    # ---- generation ----
    def _encode(self, req: api.ParsedRequest) -> list[int]:
        tok = self.state.engine.tokenizer
        with self.state.tokenizer_lock:
            if req.kind == "chat":
                if not hasattr(tok, "apply_chat_template") or getattr(tok, "chat_template", "") is None:
                    raise api.APIError(400, "this model has no chat template; use /v1/completions",
                                       param="messages")
                try:
                    text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
                except Exception as e:  # noqa: BLE001 - e.g. a template that wants alternating roles
                    raise api.APIError(400, f"the chat template rejected the messages: {e}",
                                       param="messages") from None
                ids = tok(text, add_special_tokens=False).input_ids
            elif isinstance(req.prompt, str):
                ids = tok(req.prompt).input_ids
            else:
                ids = req.prompt
        if not ids:
            raise api.APIError(400, "the prompt is empty after tokenization", param="prompt")
        bad = next((t for t in ids if not 0 <= t < self.state.vocab_size), None)
        if bad is not None:
            raise api.APIError(400, f"token id {bad} is outside the vocabulary [0, {self.state.vocab_size})",
                               param="prompt")
        return list(ids)

    def _generate(self, kind: str) -> None:
        state = self.state
        req = api.parse_request(kind, api.parse_json(self._read_body()))
        if not state.engine_alive:
            raise _EngineDown(state.engine_error or "the server is shutting down")
        ids = self._encode(req)
        params = api.sampling_params(req, len(ids), state.max_model_len)
        events: queue.Queue = queue.Queue()
        try:
            request = state.engine.add_request(ids, params, listener=events.put)
        except ValueError as e:
            raise api.APIError(400, str(e), param="prompt" if kind == "completion" else "messages") from None
        out = api.ResponseBuilder(kind, state.model_name)
        with state._lock:
            state.active.add(request)
        try:
            if req.stream:
                self._stream(request, events, out, len(ids), req.include_usage)
            else:
                self._whole(request, events, out, len(ids))
        finally:
            with state._lock:
                state.active.discard(request)

    def _events(self, request, events: queue.Queue):
        """Yield ``request``'s events until it finished; cancel it if the client goes away while it waits."""
        while True:
            try:
                ev = events.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.state.engine_alive:
                    request.cancel()
                    raise _EngineDown(self.state.engine_error or "the server is shutting down") from None
                if self._client_gone():
                    self._disconnected(request)
                    return
                continue
            yield ev
            if ev.finished:
                return

    def _client_gone(self) -> bool:
        """True when the peer closed its side (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _disconnected(self, request) -> None:
        request.cancel()
        self._gone = self.close_connection = True
        self.state.count("client_disconnects")
        log.info("client %s went away: cancelled %s", self.address_string(), request.id)

    def _whole(self, request, events: queue.Queue, out: api.ResponseBuilder, prompt_tokens: int) -> None:
        text, last = [], None
        for ev in self._events(request, events):
            text.append(ev.delta)
            last = ev
        if last is None or not last.finished:
            return  # the client went away
        if last.finish_reason == "error":
            raise api.APIError(500, last.error or "the engine failed on this request", type="server_error",
                               code="engine_error")
        if last.finish_reason == "cancelled":
            raise _EngineDown("the request was cancelled by the server")
        self._send_json(200, out.body("".join(text), last.finish_reason, prompt_tokens, len(request.output_ids)))

    def _stream(self, request, events: queue.Queue, out: api.ResponseBuilder, prompt_tokens: int,
                include_usage: bool) -> None:
        self._streaming = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if out.kind == "chat":
                self._chunk(api.sse(out.chunk("", role=True)))
            try:
                for ev in self._events(request, events):
                    if ev.delta:
                        self._chunk(api.sse(out.chunk(ev.delta)))
                    if ev.finish_reason in ("error", "cancelled"):
                        msg = ev.error if ev.finish_reason == "error" else "the request was cancelled by the server"
                        self._chunk(api.sse(api.error_body(msg or "engine error", "server_error",
                                                           code="engine_error")))
                    elif ev.finished:
                        self._chunk(api.sse(out.chunk(None, ev.finish_reason)))
                        if include_usage:
                            self._chunk(api.sse(out.usage_chunk(prompt_tokens, len(request.output_ids))))
            except _EngineDown as e:
                self._chunk(api.sse(api.error_body(str(e), "server_error", code="engine_unavailable")))
            if self._gone:  # the client went away while waiting
                return
            self._chunk(api.sse("[DONE]"))
            self._chunk(b"")
        except OSError:  # BrokenPipeError, ConnectionResetError, a stalled client's timeout
            if not request.finished:
                self._disconnected(request)
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        """One HTTP/1.1 chunk (``b""`` ends the body)."""
        self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))


# ---- CLI ----
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
