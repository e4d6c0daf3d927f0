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

import logging
import threading
import time
from http.server import ThreadingHTTPServer

from diffkv.engine.http_handler import MAX_BODY_BYTES, Handler

log = logging.getLogger("diffkv.serve")


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
        self.httpd = ThreadingHTTPServer((host, port), Handler)
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
