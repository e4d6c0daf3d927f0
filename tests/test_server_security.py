"""`diffkv serve` refuses what it should: foreign Host (DNS rebinding) and Origin, non-JSON bodies, a missing or
wrong API key, unknown models, oversize bodies, too many requests at once, stalled clients; and it stays quiet and
serving when clients vanish. Raw http.client / sockets on loopback, a tiny random Llama, a 1.5 s request timeout."""

import argparse
import http.client
import json
import logging
import select
import socket
import struct
import sys
import threading
import traceback
from email.message import Message

import pytest
import torch
from test_server import CharTokenizer, tiny_engine, wait_until

from diffkv.core.errors import UsageError
from diffkv.serve import serve_cli
from diffkv.serve.http_guard import Guard, split_host
from diffkv.serve.openai_api import APIError
from diffkv.serve.server import start_server

KEY = "s3cret-key"
TIMEOUT_S = 1.5
BODY = {"model": "tiny-llama", "prompt": "HI", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    with start_server(tiny_engine(), "tiny-llama", allowed_hosts=("llm.example.com", "proxy.example:8443"),
                      cors_origins=("http://app.example",), api_key=KEY, model_aliases=("tiny-registry",),
                      max_body_bytes=4096, max_pending=1, request_timeout=TIMEOUT_S) as handle:
        yield handle


def _slot_free(server) -> bool:
    """The server's one pending slot is free. A request's handler releases it just after the answer went out, so a
    client that sends the next request at once can still find it taken (429) on a slow machine."""
    if not server.pending.acquire(blocking=False):
        return False
    server.pending.release()
    return True


def request(server, method, path, body=None, headers=None, host="default", key=KEY, ctype="application/json",
            wait_slot=True):
    """One request with exactly these headers (``host``/``key``/``ctype`` None: header left out);
    returns (status, headers, decoded JSON body or None). A generation request first waits for the pending slot
    (``wait_slot``) that the previous one may not have released yet."""
    if wait_slot and path.endswith("completions"):
        wait_until(lambda: _slot_free(server), what="the pending slot free")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
        given = {"Host": f"127.0.0.1:{server.port}" if host == "default" else host,
                 "Authorization": key and f"Bearer {key}", "Content-Type": ctype if body is not None else None,
                 "Content-Length": str(len(data)) if body is not None else None, **(headers or {})}
        for name, value in given.items():
            if value is not None:
                conn.putheader(name, value)
        conn.endheaders(data or None)
        resp = conn.getresponse()
        payload = resp.read()
        return resp.status, resp.headers, json.loads(payload) if payload else None
    finally:
        conn.close()


def complete(server, **kw):
    return request(server, "POST", "/v1/completions", BODY, **kw)


def assert_error(body, code, param=None):
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code and body["error"]["param"] == param and body["error"]["message"], body


def test_the_reported_request_is_refused(server):
    status, _, body = request(server, "POST", "/v1/completions", BODY, host="evil.example", ctype="text/plain",
                              headers={"Origin": "http://evil.example"})
    assert status == 403 and body["error"]["code"] == "host_not_allowed"


def test_foreign_host_is_refused(server):
    p = server.port
    for host in ("evil.example", f"evil.example:{p}", f"127.0.0.1:{p + 1}", f"localhost.evil.example:{p}",
                 "proxy.example:9999", f"10.1.2.3:{p}"):
        status, _, body = request(server, "GET", "/v1/models", host=host)
        assert status == 403, host
        assert_error(body, "host_not_allowed")
    for host in (f"localhost:{p}", f"LOCALHOST:{p}", f"[::1]:{p}", "llm.example.com", "llm.example.com:443",
                 "proxy.example:8443"):
        assert request(server, "GET", "/v1/models", host=host)[0] == 200, host
    assert request(server, "GET", "/v1/models", host="bad host:x:y")[0] == 400
    with socket.create_connection(("127.0.0.1", p), timeout=10) as s:  # HTTP/1.1 without Host
        s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        resp = http.client.HTTPResponse(s)
        resp.begin()
        assert resp.status == 400 and json.loads(resp.read())["error"]["code"] == "invalid_host"


def test_host_policy_units():
    def headers(host):
        m = Message()
        m["Host"] = host
        return m

    assert split_host("Name.Example.:8000") == ("name.example", 8000) and split_host("[::1]") == ("::1", None)
    for bad in ("", ":80", "a:b", "::1", "[::1", "a:123456"):
        with pytest.raises(ValueError):
            split_host(bad)
    every = Guard("0.0.0.0", 8000)
    every.check_host(headers("192.168.1.5:8000"))  # an address cannot be rebound
    every.check_host(headers("[fe80::1]:8000"))
    for host in ("myhost.lan:8000", "192.168.1.5:8001"):
        with pytest.raises(APIError):
            every.check_host(headers(host))
    Guard("10.0.0.7", 80).check_host(headers("10.0.0.7"))
    Guard("127.0.0.1", 8000, allowed_hosts=("*",)).check_host(headers("anything.example"))
    for kw in ({"allowed_hosts": ("a b:c",)}, {"cors_origins": ("app.example",)}, {"api_key": ""}):
        with pytest.raises(UsageError):
            Guard("127.0.0.1", 8000, **kw)


def test_foreign_origin_is_refused_an_allowed_one_gets_cors(server):
    status, headers, body = request(server, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    assert_error(body, "origin_not_allowed")
    assert complete(server, headers={"Origin": "http://evil.example"})[0] == 403
    assert complete(server, headers={"Origin": "null"})[0] == 403

    status, headers, body = complete(server, headers={"Origin": "http://app.example"})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert headers["Access-Control-Allow-Origin"] == "http://app.example" and headers["Vary"] == "Origin"
    status, headers, _ = complete(server, key=None, headers={"Origin": "http://app.example"})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == "http://app.example"  # readable by the page

    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
    status, headers, body = request(server, "OPTIONS", "/v1/chat/completions", key=None, headers=preflight)
    assert status == 204 and body is None
    assert headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type, x-stainless-os"
    status, headers, _ = request(server, "OPTIONS", "/v1/chat/completions", key=None,
                                 headers={**preflight, "Origin": "http://evil.example"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers


def test_only_json_bodies_are_accepted(server):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "application/jsonx", None):
        status, headers, body = complete(server, ctype=ctype)
        assert status == 415, ctype
        assert_error(body, "unsupported_media_type")
        assert headers["Connection"] == "close"  # the body was not read
    assert complete(server, ctype="application/json; charset=utf-8")[0] == 200
    assert complete(server, ctype="Application/JSON")[0] == 200


def test_api_key(server):
    for key in (None, "wrong", KEY[:-1], KEY + "x", "ünïcode"):
        status, headers, body = request(server, "GET", "/v1/models", key=key)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", key
        assert_error(body, "invalid_api_key")
        assert complete(server, key=key)[0] == 401
    for auth in (f"Basic {KEY}", KEY, f"Bearer  {KEY} x"):
        assert request(server, "GET", "/v1/models", key=None, headers={"Authorization": auth})[0] == 401
    assert request(server, "GET", "/v1/models", key=None, headers={"Authorization": f"bearer {KEY}"})[0] == 200
    assert request(server, "GET", "/metrics", key=None)[0] == 401
    assert request(server, "GET", "/health", key=None)[:3:2] == (200, {"status": "ok"})
    assert complete(server)[0] == 200


def test_unknown_model_is_404_known_names_and_a_missing_model_are_served(server):
    status, _, body = request(server, "POST", "/v1/completions", {**BODY, "model": "no-such-model"})
    assert status == 404
    assert body == {"error": {"message": body["error"]["message"], "type": "invalid_request_error",
                              "param": "model", "code": "model_not_found"}}
    assert "no-such-model" in body["error"]["message"] and "tiny-llama" in body["error"]["message"]
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert request(server, "POST", "/v1/chat/completions", chat)[0] == 404
    for model in ("tiny-llama", "tiny-registry"):
        assert request(server, "POST", "/v1/completions", {**BODY, "model": model})[0] == 200
    without = {k: v for k, v in BODY.items() if k != "model"}  # lenient: OpenAI requires it, curl users forget it
    status, _, body = request(server, "POST", "/v1/completions", without)
    assert status == 200 and body["model"] == "tiny-llama"
    assert request(server, "POST", "/v1/completions", {**BODY, "model": 7})[0] == 400


def test_oversize_body_is_413_without_reading_it(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/completions")
        for name, value in (("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
                            ("Content-Length", str(10 << 30))):
            conn.putheader(name, value)
        conn.endheaders()  # no body sent: the answer must come anyway
        resp = conn.getresponse()
        assert resp.status == 413 and resp.headers["Connection"] == "close"
        assert_error(json.loads(resp.read()), "request_too_large")
    finally:
        conn.close()
    assert request(server, "POST", "/v1/completions", {**BODY, "prompt": "A" * 5000})[0] == 413
    assert complete(server)[0] == 200


def test_too_many_pending_is_429(server):
    wait_until(lambda: _slot_free(server), what="the pending slot free")
    conn, resp = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30), None
    try:
        conn.request("POST", "/v1/completions", json.dumps({**BODY, "max_tokens": 230, "stream": True}),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")  # holds the one pending slot
        status, headers, body = complete(server, wait_slot=False)
        assert status == 429 and headers["Retry-After"] == "1"
        assert body["error"]["code"] == "too_many_requests" and body["error"]["type"] == "rate_limit_error"
        assert request(server, "GET", "/health")[0] == 200  # only generation is limited
    finally:  # the server cancels the stream at its next write
        if resp is not None:
            resp.close()
        conn.close()
    wait_until(lambda: not server.active)
    wait_until(lambda: complete(server)[0] == 200)
    assert server.metrics()["http_429"] >= 1


def _drained(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


def test_stalled_and_trickling_clients_are_dropped_others_served(server):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 200\r\n\r\n").encode()
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    trickle = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    try:
        stalled.sendall(head + b'{"prompt": "HI", ')  # a partial body, then nothing
        stop, sent = threading.Event(), []

        def dribble():  # a valid request one byte every 0.1 s: never stalls a read, never finishes in time
            for b in head:
                if stop.wait(0.1):
                    return
                try:
                    trickle.send(bytes([b]))
                except OSError:
                    return
                sent.append(b)

        t = threading.Thread(target=dribble, daemon=True)
        t.start()
        assert complete(server)[0] == 200  # meanwhile others are served
        answer = _drained(stalled)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer
        # cut off mid-headers: the whole request had TIMEOUT_S to arrive (the headers alone take ~14 s at this pace,
        # the default timeout is 30 s), however slowly the machine runs; no wall clock needed
        assert _drained(trickle) == b"" and len(sent) < len(head)
        stop.set()
        t.join(5)
    finally:
        stalled.close()
        trickle.close()
    assert complete(server)[0] == 200


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (what a killed client or a dropped keep-alive looks like to the server)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _handlers(server) -> list[threading.Thread]:
    """The server's live connection threads (one per connection: ``ThreadingHTTPServer.process_request_thread``)."""
    return [t for t in threading.enumerate() if getattr(t, "_target", None) == server.httpd.process_request_thread]


def _answered(sock: socket.socket) -> bool:
    """The server has sent something on ``sock`` or closed it (e.g. its request timeout ran out first)."""
    return bool(select.select([sock], [], [], 0)[0])


def _reading(server, caller: str) -> bool:
    """Some connection thread of ``server`` is blocked reading its socket, the read called from ``caller``
    (``handle_one_request``: waiting for the next request; ``_read_body``: for the rest of a body)."""
    frames = sys._current_frames()
    for t in _handlers(server):
        if t.ident in frames:
            stack = [f.name for f in traceback.extract_stack(frames[t.ident])]  # outermost first
            if stack[-1] == "readinto" and caller in stack[-4:-1]:
                return True
    return False


def test_vanishing_clients_leave_no_traceback(server, caplog, capsys):
    caplog.set_level(logging.DEBUG, logger="diffkv.serve")
    before = server.metrics()["client_disconnects"]
    # a keep-alive connection reset after one answer
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(f"GET /health HTTP/1.1\r\nHost: localhost:{server.port}\r\n\r\n".encode())
    got = b""
    while not got.endswith(b'{"status": "ok"}'):
        got += s.recv(4096)
    # the server now waits for the next request on this connection (unless its 1.5 s idle timeout closed it first)
    wait_until(lambda: _reading(server, "handle_one_request") or _answered(s), what="the server waiting")
    _reset(s)
    # a streaming request reset, then one closed, mid-stream
    for close in (_reset, socket.socket.close):
        wait_until(lambda: _slot_free(server), what="the pending slot free")
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        body = json.dumps({**BODY, "max_tokens": 230, "stream": True}).encode()
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: localhost:{server.port}\r\nContent-Type: "
                  f"application/json\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
                  .encode() + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
        close(s)
        wait_until(lambda: not server.active)
    # a request reset before its body arrived
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: localhost:{server.port}\r\nContent-Type: application/json"
              f"\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n{{".encode())
    wait_until(lambda: _reading(server, "_read_body") or _answered(s), what="the server reading the body")
    _reset(s)
    assert complete(server)[0] == 200  # still serving
    wait_until(lambda: server.metrics()["client_disconnects"] == before + 2)
    wait_until(lambda: not _handlers(server), what="every connection's handler done (and done logging)")
    loud = [r for r in caplog.records if r.exc_info or r.name.startswith("diffkv") and r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage() for r in loud]
    assert "Traceback" not in capsys.readouterr().err and "Traceback" not in caplog.text
    assert any("went away" in r.getMessage() or "reset" in r.getMessage().lower() for r in caplog.records)


def test_busy_port_is_a_usage_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=rf"port {port} is in use: pick another with --port, or --port 0"):
            start_server(tiny_engine(), "tiny-llama", port=port)
        p = argparse.ArgumentParser()
        serve_cli.add_arguments(p)
        args = p.parse_args(["--model", "no-such-model", "--port", str(port)])
        with pytest.raises(UsageError, match=f"port {port} is in use"):  # before the model would load
            serve_cli.run(args)


def test_cli_flags_and_defaults(monkeypatch):
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    args = p.parse_args(["--model", "m"])
    assert (args.host, args.allowed_hosts, args.cors_origin, args.api_key) == ("127.0.0.1", (), (), None)
    assert (args.max_body_bytes, args.max_pending, args.request_timeout) == (1 << 20, 256, 30.0)
    args = p.parse_args(["--model", "m", "--allowed-hosts", "a.example, b.example:8443", "--cors-origin", "*",
                         "--api-key", "k", "--max-body-bytes", "64KiB", "--max-pending", "8",
                         "--request-timeout", "5"])
    assert args.allowed_hosts == ("a.example", "b.example:8443") and args.cors_origin == ("*",)
    assert (args.api_key, args.max_body_bytes, args.max_pending, args.request_timeout) == ("k", 65536, 8, 5.0)
    for bad in (["--max-pending", "0"], ["--request-timeout", "0"], ["--allowed-hosts", "a:b:c"],
                ["--cors-origin", "app.example"], ["--api-key", ""]):
        with pytest.raises(UsageError):
            serve_cli.run(p.parse_args(["--model", "no-such-model", "--port", "0", *bad]))


def test_cli_passes_every_option_and_reads_the_key_from_the_environment(monkeypatch):
    import diffkv.registry.models

    engine = tiny_engine()
    monkeypatch.setattr(diffkv.registry.models, "load_model", lambda *a, **kw: (engine.model, CharTokenizer()))
    monkeypatch.setenv("DIFFKV_API_KEY", "from-env")
    seen = {}

    def fake_start(engine, name, host, port, **kw):
        seen.update(name=name, host=host, port=port, **kw)
        raise KeyboardInterrupt  # stop before serving

    monkeypatch.setattr(serve_cli, "start_server", fake_start)
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    argv = ["--model", "tiny-registry", "--served-model-name", "tiny-llama", "--port", "0", "--cache", "fp16",
            "--kv-budget", "1MiB", "--device", "cpu", "--max-model-len", "64", "--allowed-hosts", "llm.example",
            "--cors-origin", "http://app.example", "--max-body-bytes", "8KiB", "--max-pending", "3",
            "--request-timeout", "2.5"]
    with pytest.raises(KeyboardInterrupt):
        serve_cli.run(p.parse_args(argv))
    assert seen == {"name": "tiny-llama", "host": "127.0.0.1", "port": 0, "max_body_bytes": 8192,
                    "allowed_hosts": ("llm.example",), "cors_origins": ("http://app.example",),
                    "api_key": "from-env", "model_aliases": ("tiny-registry",), "max_pending": 3,
                    "request_timeout": 2.5}
    with pytest.raises(KeyboardInterrupt):
        serve_cli.run(p.parse_args([*argv, "--api-key", "from-flag"]))
    assert seen["api_key"] == "from-flag"
