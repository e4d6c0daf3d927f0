"""``diffkv serve``: an OpenAI-compatible HTTP server over the serving engine (standard library only).

    diffkv serve --model smollm2-135m --cache diffkv --kv-budget 2GiB --port 8000

One background thread runs :meth:`Engine.serve_forever`; each HTTP connection gets a thread
(``ThreadingHTTPServer``) that validates the request (:mod:`diffkv.serve.openai_api`), tokenizes it, submits it
with :meth:`Engine.add_request` and waits on a per-request queue fed by the engine's listener. Endpoints:
``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``: Server-Sent Events), ``GET /health``,
``GET /metrics`` (the engine's metrics plus HTTP counters), ``GET /v1/models``. A streaming client that goes away
is noticed at the next write (or while its request waits) and its request is cancelled, so its pages are freed.

What a request must pass first (``Host``, ``Origin``, API key, JSON body, sizes, timeouts, the pending limit) is
listed in :mod:`diffkv.serve.http_handler` and implemented in :mod:`diffkv.serve.http_guard` and
:mod:`diffkv.serve.http_conn`.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from diffkv.core.errors import UsageError
from diffkv.serve.http_guard import Guard
from diffkv.serve.http_handler import MAX_BODY_BYTES, Handler

log = logging.getLogger("diffkv.serve")
REQUEST_TIMEOUT_S = 30.0
MAX_PENDING = 256


class _HTTPServer(ThreadingHTTPServer):
    """One thread per connection; never shares its port (a busy port is an error); disconnects are logged quietly."""

    daemon_threads = True
    allow_reuse_port = False
    request_queue_size = 1024  # listen backlog (socketserver's default, 5, resets clients that connect at once)

    def __init__(self, address: tuple[str, int], handler):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("client %s: %s", client_address[0], exc)
        else:
            log.error("unexpected error serving %s", client_address[0], exc_info=exc)


def bind_error(host: str, port: int, e: OSError) -> Exception:
    """A :class:`UsageError` saying why ``host``:``port`` cannot be listened on, or ``e`` when it is not the user's."""
    if e.errno == errno.EADDRINUSE:
        return UsageError(f"port {port} is in use: pick another with --port, or --port 0 for a free one")
    if e.errno == errno.EACCES:
        return UsageError(f"no permission to listen on port {port} (ports below 1024 need privileges): pick "
                          "another with --port")
    if e.errno == errno.EADDRNOTAVAIL or isinstance(e, socket.gaierror):
        return UsageError(f"cannot listen on {host!r}: not an address of this machine (127.0.0.1 for this "
                          "machine only, 0.0.0.0 for every interface)")
    return e


def listen(host: str, port: int, handler=Handler) -> _HTTPServer:
    """A listening HTTP server on ``host``:``port`` (0: a free port); :class:`UsageError` if that is impossible."""
    try:
        return _HTTPServer((host.strip("[]"), port), handler)
    except OSError as e:
        raise bind_error(host, port, e) from e


class ServerHandle:
    """A running server: ``port``, ``url``, ``close()`` (also a context manager). Options: see :func:`start_server`."""

    def __init__(self, engine, model_name: str, host: str, port: int, *, max_body_bytes: int = MAX_BODY_BYTES,
                 allowed_hosts=(), cors_origins=(), api_key: str | None = None, model_aliases=(),
                 max_pending: int = MAX_PENDING, request_timeout: float | None = REQUEST_TIMEOUT_S):
        if max_body_bytes < 1 or max_pending < 1 or request_timeout is not None and not 0 < request_timeout < 1e9:
            raise UsageError(f"max_body_bytes ({max_body_bytes}), max_pending ({max_pending}) and request_timeout "
                             f"({request_timeout}) must be positive")
        self.engine, self.model_name, self.max_body_bytes = engine, model_name, max_body_bytes
        self.model_names = {model_name, *model_aliases}
        self.max_pending, self.request_timeout = max_pending, request_timeout
        self.pending = threading.BoundedSemaphore(max_pending)
        self.max_model_len = engine.cache.max_model_len
        emb = engine.model.get_input_embeddings() if hasattr(engine.model, "get_input_embeddings") else None
        self.vocab_size = getattr(emb, "num_embeddings", None) or engine.model.config.vocab_size
        self.tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to call from several threads at once
        self.counters = {"http_requests": 0, "http_4xx": 0, "http_5xx": 0, "http_429": 0, "client_disconnects": 0}
        self.active: set = set()
        self._lock = threading.Lock()
        self.engine_error: str | None = None
        self._stop = threading.Event()
        self.httpd = listen(host, port)
        self.httpd.state = self
        self.host, self.port = self.httpd.server_address[:2]
        try:
            self.guard = Guard(host, self.port, allowed_hosts, cors_origins, api_key)
        except UsageError:
            self.httpd.server_close()
            raise
        self.url = f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{host}:{self.port}"
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
                 max_body_bytes: int = MAX_BODY_BYTES, allowed_hosts=(), cors_origins=(), api_key: str | None = None,
                 model_aliases=(), max_pending: int = MAX_PENDING,
                 request_timeout: float | None = REQUEST_TIMEOUT_S) -> ServerHandle:
    """Serve ``engine`` over HTTP from background threads; ``port`` 0 picks a free port (``handle.port``).

    ``allowed_hosts``: ``Host`` names answered besides 127.0.0.1 / localhost / [::1] (and the bound address) on the
    bound port: ``name``, ``name:port`` or ``*``. ``cors_origins``: browser origins allowed (``*`` any; none by
    default, so a web page cannot call the server). ``api_key``: required as ``Authorization: Bearer`` on all but
    ``/health``. ``model_aliases``: ``model`` values accepted besides ``model_name`` (a request without ``model``
    is accepted too). ``max_body_bytes`` (413), ``max_pending`` generation requests at once (429 beyond),
    ``request_timeout``: seconds a request may take to arrive and a read or write may stall (None: no limit).
    A port in use raises :class:`~diffkv.core.errors.UsageError`."""
    return ServerHandle(engine, model_name, host, port, max_body_bytes=max_body_bytes, allowed_hosts=allowed_hosts,
                        cors_origins=cors_origins, api_key=api_key, model_aliases=model_aliases,
                        max_pending=max_pending, request_timeout=request_timeout)
