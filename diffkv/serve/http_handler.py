"""The HTTP request handler of ``diffkv serve``: checks, routing, body limits, OpenAI requests in, events out.

One instance per connection, on its own thread (``ThreadingHTTPServer``), answering its requests in turn; it reaches
the engine through the :class:`~diffkv.serve.server.ServerHandle` stored on the HTTP server (``self.server.state``).
Before any work a request passes, in order: ``Host`` and ``Origin`` (:class:`~diffkv.serve.http_guard.Guard`),
route and method, API key, then for a generation ``Content-Type`` and body size
(:class:`~diffkv.serve.http_conn.GuardedHandler`), the model name, a free pending slot.
"""

from __future__ import annotations

import logging
import queue
import select
import socket

from diffkv.serve import openai_api as api
from diffkv.serve.http_conn import ClientGone, GuardedHandler

log = logging.getLogger("diffkv.serve")
MAX_BODY_BYTES = 1 << 20
_POLL_S = 0.25  # how often a waiting handler checks its client and the engine thread
_ROUTES = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/health": "GET", "/metrics": "GET",
           "/v1/models": "GET"}
_OPEN = ("/health",)  # routes answered without the API key



def chat_prefix(tok, messages: list[dict], ids: list[int]) -> int | None:
    """How many of ``ids`` (the whole chat, rendered) the messages before the last one render to, when those
    tokens start ``ids`` and leave at least one after them: the prefix a server with prefix caching shares
    (a system prompt, a document, the earlier turns). None otherwise."""
    if len(messages) < 2:
        return None
    try:
        head = tok(tok.apply_chat_template(messages[:-1], tokenize=False), add_special_tokens=False).input_ids
    except Exception:  # noqa: BLE001 - a template that rejects a partial chat: no shared prefix
        return None
    return len(head) if 0 < len(head) < len(ids) and ids[:len(head)] == head else None

class EngineDown(Exception):
    """The engine thread is not running: requests get a 503."""


class Handler(GuardedHandler):
    """Routes and generation; the connection handling and checks come from :class:`GuardedHandler`."""

    # ---- routing ----
    def _dispatch(self) -> None:
        method, state = self.command, self.state
        state.count("http_requests")
        self._body_read = self._gone = self._streaming = False
        path = self.path.split("?", 1)[0]
        try:
            state.guard.check_host(self.headers)
            self._cors = state.guard.check_origin(self.headers)
            if path not in _ROUTES:
                raise api.APIError(404, f"no route {path}", code="not_found")
            allow = f"{_ROUTES[path]}, OPTIONS"
            if method == "OPTIONS":  # a CORS preflight (or a plain question): no key needed
                self._send_json(204, None, {"Allow": allow})
                return
            if method != _ROUTES[path]:
                raise api.APIError(405, f"{path} accepts {_ROUTES[path]}, not {method}", code="method_not_allowed",
                                   headers={"Allow": allow})
            if path not in _OPEN:
                state.guard.check_api_key(self.headers)
            if path == "/health":
                ok = state.engine_alive
                body = {"status": "ok"} if ok else {"status": "error", "error": state.engine_error}
                self._send_json(200 if ok else 503, body)
            elif path == "/metrics":
                self._send_json(200, state.metrics())
            elif path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                                                   "owned_by": "diffkv"}]})
            else:
                self._generate("completion" if path == "/v1/completions" else "chat")
        except api.APIError as e:
            self._send_json(e.status, e.body(), e.headers)
        except EngineDown as e:
            self._send_json(503, api.error_body(str(e), "server_error", code="engine_unavailable"))
        except (ClientGone, ConnectionError) as e:
            log.debug("client %s went away during %s %s: %s", self.address_string(), method, path, e)
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - one bad request must not take the server down
            log.exception("unexpected error on %s %s", method, path)
            self.close_connection = True
            if not self._streaming:  # else the headers are out: closing the connection is all that is left
                self._send_json(500, api.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _dispatch

    # ---- generation ----
    def _encode(self, req: api.ParsedRequest) -> tuple[list[int], int | None]:
        """The prompt's token ids, and with a prefix-caching engine the tokens of a chat's earlier messages (the
        part other chats may share; ``chat_prefix``)."""
        tok, prefix = self.state.engine.tokenizer, None
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
                if self.state.engine.prefix is not None:
                    prefix = chat_prefix(tok, req.messages, ids)
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
        return list(ids), prefix

    def _generate(self, kind: str) -> None:
        state = self.state
        req = api.parse_request(kind, api.parse_json(self._read_body()))
        api.check_model(req, state.model_names, state.model_name)
        if not state.pending.acquire(blocking=False):
            state.count("http_429")
            raise api.APIError(429, f"the server has {state.max_pending} requests in flight: retry shortly",
                               type="rate_limit_error", code="too_many_requests", headers={"Retry-After": "1"})
        try:
            self._admitted(kind, req)
        finally:
            state.pending.release()

    def _admitted(self, kind: str, req: api.ParsedRequest) -> None:
        state = self.state
        if not state.engine_alive:
            raise EngineDown(state.engine_error or "the server is shutting down")
        ids, prefix = self._encode(req)
        params = api.sampling_params(req, len(ids), state.max_model_len)
        events: queue.Queue = queue.Queue()
        try:
            request = state.engine.add_request(ids, params, listener=events.put, prefix_tokens=prefix)
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
                    raise EngineDown(self.state.engine_error or "the server is shutting down") from None
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
            raise EngineDown("the request was cancelled by the server")
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
            except EngineDown as e:
                self._chunk(api.sse(api.error_body(str(e), "server_error", code="engine_unavailable")))
            if self._gone:  # the client went away while waiting
                return
            self._chunk(api.sse("[DONE]"))
            self._chunk(b"")
        except OSError as e:  # BrokenPipeError, ConnectionResetError, a stalled client's timeout
            log.debug("client %s: %s", self.address_string(), e)
            if not request.finished:
                self._disconnected(request)
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        """One HTTP/1.1 chunk (``b""`` ends the body)."""
        self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))
