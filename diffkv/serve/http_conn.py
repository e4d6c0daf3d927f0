"""The connection layer of ``diffkv serve``'s HTTP handler: timeouts, quiet disconnects, JSON answers, the body.

:class:`DeadlineIO` bounds how long one request (line, headers and body) may take to arrive, so a client that sends
a byte at a time cannot hold a thread; :class:`GuardedHandler` uses it, lets clients that leave go quietly, adds the
CORS headers of an allowed origin to every answer, and reads a POST body only once it is JSON of an allowed size.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING

from diffkv.serve.http_guard import check_json_body, cors_headers
from diffkv.serve.openai_api import APIError

if TYPE_CHECKING:
    from diffkv.serve.server import ServerHandle

log = logging.getLogger("diffkv.serve")


class DeadlineIO(socket.SocketIO):
    """A socket reader: each read waits at most ``timeout`` seconds and, while ``deadline`` (``time.monotonic``) is
    set, fails once it has passed, however slowly the bytes trickle in."""

    def __init__(self, sock: socket.socket, timeout: float | None):
        super().__init__(sock, "rb")
        self.timeout, self.deadline = timeout, None

    def readinto(self, b):
        wait = self.timeout
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request did not arrive in time")
            wait = left if wait is None else min(wait, left)
        self._sock.settimeout(wait)
        return super().readinto(b)


class ClientGone(Exception):
    """The client closed or reset the connection while the request was read: nothing to answer."""


class GuardedHandler(BaseHTTPRequestHandler):
    """The connection layer of ``diffkv serve``'s handler: read timeouts and the request deadline, quiet
    disconnects, CORS headers on answers, JSON answers, the checked body of a POST."""

    protocol_version = "HTTP/1.1"
    server_version = "diffkv"
    _cors: str | None = None  # the allowed Origin of the current request
    _body_read = False

    @property
    def state(self) -> ServerHandle:
        return self.server.state

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        log.info("%s %s", self.address_string(), format % args)

    def setup(self) -> None:
        self.timeout = self.state.request_timeout  # each read or write may stall this long
        super().setup()
        self.rfile.close()
        self._reader = DeadlineIO(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        """Wait for a request's first byte, then give the whole request ``request_timeout`` seconds to arrive."""
        self._cors = None
        self._end_deadline()
        try:
            if not self.rfile.peek(1):
                self.close_connection = True
                return
            if self.state.request_timeout is not None:
                self._reader.deadline = time.monotonic() + self.state.request_timeout
            super().handle_one_request()
        except (ConnectionError, TimeoutError) as e:  # an idle keep-alive client left, or stalled mid-request
            log.debug("client %s: %s", self.address_string(), e)
            self.close_connection = True

    def _end_deadline(self) -> None:
        """The request is in (or refused): later reads and writes get the per-operation timeout again."""
        if self._reader.deadline is not None:
            self._reader.deadline = None
            self.connection.settimeout(self.timeout)

    def end_headers(self) -> None:
        self.send_header("X-Content-Type-Options", "nosniff")
        if self._cors:
            for k, v in cors_headers(self._cors, self.headers, self.command == "OPTIONS").items():
                self.send_header(k, v)
        super().end_headers()

    def _send_json(self, status: int, body: dict | None, headers: dict | None = None) -> None:
        """Answer ``body`` as JSON (None: no body), with extra ``headers``; a client gone by now is let go."""
        self._end_deadline()
        if not self._body_read and (self.headers.get("Content-Length", "0") != "0"
                                    or "Transfer-Encoding" in self.headers):
            self.close_connection = True  # an unread body would be taken for the next request
        if status >= 400:
            self.state.count("http_4xx" if status < 500 else "http_5xx")
        data = b"" if body is None else json.dumps(body, ensure_ascii=False).encode()
        try:
            self.send_response(status)
            if body is not None:
                self.send_header("Content-Type", "application/json")
            if status != 204:
                self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except OSError as e:
            log.debug("client %s went away before the %d answer: %s", self.address_string(), status, e)
            self.close_connection = True

    def _read_body(self) -> bytes:
        check_json_body(self.headers)
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise APIError(411, "send the body with a Content-Length header, not chunked")
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise APIError(411, "a Content-Length header is required")
        if not (length.isascii() and length.isdigit()) or len(self.headers.get_all("Content-Length")) > 1:
            self.close_connection = True
            raise APIError(400, f"bad Content-Length {length[:40]!r}")
        if int(length) > self.state.max_body_bytes:
            self.close_connection = True
            raise APIError(413, f"the body has {length} bytes; the limit is {self.state.max_body_bytes}",
                           code="request_too_large")
        try:
            raw = self.rfile.read(int(length))
        except TimeoutError:
            self.close_connection = True
            raise APIError(408, f"the request did not arrive within {self.state.request_timeout} s",
                           code="request_timeout") from None
        except OSError as e:
            raise ClientGone(str(e)) from None
        if len(raw) < int(length):
            self.close_connection = True
            raise APIError(400, "the body ended before Content-Length bytes")
        self._end_deadline()
        self._body_read = True
        return raw
