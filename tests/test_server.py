"""`diffkv serve` on a tiny random Llama over loopback: OpenAI bodies and streams, every error path, a client that
disconnects mid-stream, a bounded concurrent load test (stdlib http.client, no network)."""

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from diffkv.core.units import parse_bytes
from diffkv.engine import Engine, make_cache
from diffkv.serve.server import start_server

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
JSON = {"Content-Type": "application/json"}
POOL_PAGES = 240  # 4 tokens per page and 2 layers x 2 heads: a request of n tokens takes about n pages


class CharTokenizer:
    """Character-level: every character is a token in [3, 96); decodes to letters. Has a trivial chat template."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return type("Enc", (), {"input_ids": [3 + ord(c) % 93 for c in text]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + t % 26) for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                               else "")
        return text if not tokenize else self(text).input_ids


def tiny_engine(pages=POOL_PAGES, **kw):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    model.generation_config.eos_token_id = None
    probe = make_cache("fp16", model, kv_budget_bytes=1 << 20, raw_dtype="float32", max_slots=16)
    cache = make_cache("fp16", model, kv_budget_bytes=probe.budget_for_pages(pages), raw_dtype="float32",
                       max_slots=16, max_model_len=256)
    return Engine(model, CharTokenizer(), cache, **kw)


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    with start_server(tiny_engine(), "tiny-llama") as handle:
        yield handle


def call(server, method, path, body=None, headers=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={**JSON, **(headers or {})})
        resp = conn.getresponse()
        payload = resp.read()
        return resp.status, json.loads(payload) if payload else None
    finally:
        conn.close()


def stream(server, path, body):
    """POST a streaming request; returns (status, [decoded data payloads], saw_done)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers=JSON)
        resp = conn.getresponse()
        assert resp.getheader("Content-Type").startswith("text/event-stream")
        chunks, done = [], False
        for line in resp:
            line = line.decode().rstrip("\n")
            if not line:
                continue
            assert line.startswith("data: ") and not done, line
            if line == "data: [DONE]":
                done = True
            else:
                chunks.append(json.loads(line[6:]))
        return resp.status, chunks, done
    finally:
        conn.close()


def complete(server, prompt="HELLO", **kw):
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}
    return call(server, "POST", "/v1/completions", body)


def wait_until(cond, timeout=30.0, what=None):
    """Poll ``cond()`` until it is true; fail after ``timeout`` seconds (generous: a loaded machine is slow, but a
    condition that never comes is a failure, not a hang)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what or cond}"
        time.sleep(0.01)


def assert_pool_full(engine, timeout=30.0):
    pool = engine.cache.kv.pool
    wait_until(lambda: pool.free_pages() == pool.num_pages, timeout, "every page back in the pool")


CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        "max_tokens": 10, "temperature": 0, "ignore_eos": True}


def test_completions_and_chat_whole_and_streamed(server):
    status, body = complete(server, "HELLO", max_tokens=12)
    assert status == 200 and body["object"] == "text_completion" and body["model"] == "tiny-llama"
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and len(choice["text"]) == 12
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    ids = CharTokenizer()("HELLO").input_ids
    assert complete(server, ids, max_tokens=12)[1]["choices"][0]["text"] == choice["text"]  # token-id prompt

    status, chunks, done = stream(server, "/v1/completions", {"prompt": "HELLO", "max_tokens": 12, "temperature": 0,
                                                              "ignore_eos": True,
                                                              "stream_options": {"include_usage": True}})
    assert status == 200 and done
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12

    stop = choice["text"][4:6]
    status, body = complete(server, "HELLO", max_tokens=12, stop=[stop])
    assert body["choices"][0] == {"index": 0, "text": choice["text"][:choice["text"].find(stop)], "logprobs": None,
                                  "finish_reason": "stop"}

    status, body = call(server, "POST", "/v1/chat/completions", CHAT)
    assert status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(msg["content"]) == 10 and body["choices"][0]["finish_reason"] == "length"
    prompt = CharTokenizer().apply_chat_template(CHAT["messages"], add_generation_prompt=True)
    assert body["usage"]["prompt_tokens"] == len(prompt)
    status, chunks, done = stream(server, "/v1/chat/completions", CHAT)
    assert status == 200 and done and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def test_sampling_with_seed_is_reproducible(server):
    a = complete(server, "SEED", temperature=0.9, top_p=0.95, seed=7)[1]["choices"][0]["text"]
    b = complete(server, "SEED", temperature=0.9, top_p=0.95, seed=7)[1]["choices"][0]["text"]
    assert a == b and len(a) == 12


def _raw(server, data: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(data)
        resp = http.client.HTTPResponse(s)
        resp.begin()
        return resp.status, json.loads(resp.read())


BAD = [  # (path, raw body, status, param)
    ("/v1/completions", b'{"prompt": "HI", ', 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["A", "B"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "HI", "max_token": 4}, 400, "max_token"),
    ("/v1/completions", {"prompt": "HI", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "HI", "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "HI", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "A" * 300}, 400, "prompt"),
    ("/v1/completions", {"prompt": "A" * 200, "max_tokens": 100}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "A" * 100, "max_tokens": 150}, 400, "prompt"),  # the engine: pool too small
    ("/v1/completions", {"prompt": "HI", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "HI", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "HI", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "HI", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "HI", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "HI", "seed": 1 << 70}, 400, "seed"),
    ("/v1/completions", {"prompt": "HI", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "HI", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "HI", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "HI", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "extra": 1}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A" * 300}]}, 400, "messages"),
]


def test_errors_are_openai_shaped_and_the_server_keeps_serving(server):
    for path, body, want, param in BAD:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, err = call(server, "POST", path, raw=raw)
        assert status == want, (body, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"], err
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param, (body, err)
    for method, path, want in (("GET", "/nope", 404), ("POST", "/nope", 404), ("GET", "/v1/completions", 405),
                               ("POST", "/health", 405), ("DELETE", "/v1/chat/completions", 405)):
        status, err = call(server, method, path, body={"prompt": "HI"} if method == "POST" else None)
        assert status == want and err["error"]["message"], (method, path, err)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n" % server.port
    assert _raw(server, head + b"Content-Length: 2000000\r\n\r\n")[0] == 413
    assert _raw(server, head + b"Content-Length: abc\r\n\r\n")[0] == 400
    assert _raw(server, head + b"\r\n")[0] == 411
    # the neutral value of an unsupported field is fine; the server still answers
    status, body = complete(server, "HI", max_tokens=3, presence_penalty=0, logprobs=None, user="me")
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert call(server, "GET", "/health") == (200, {"status": "ok"})
    assert_pool_full(server.engine)


def test_keep_alive_connection_serves_mixed_requests(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    ok = json.dumps({"prompt": "KEEP", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    try:
        for method, path, body, want in (("GET", "/health", None, 200), ("POST", "/v1/completions", ok, 200),
                                         ("POST", "/v1/completions", '{"prompt": ', 400),
                                         ("POST", "/v1/completions", json.dumps({"prompt": "KEEP", "max_tokens": 4,
                                                                                  "stream": True}), 200),
                                         ("POST", "/nope", ok, 404), ("POST", "/v1/completions", ok, 200)):
            conn.request(method, path, body=body, headers=JSON)
            resp = conn.getresponse()
            data = resp.read()
            assert resp.status == want, (path, data)
            assert data.endswith(b"data: [DONE]\n\n") if b"stream" in (body or "").encode() else json.loads(data)
    finally:
        conn.close()


def test_health_metrics_models(server):
    assert call(server, "GET", "/health") == (200, {"status": "ok"})
    status, m = call(server, "GET", "/metrics")
    assert status == 200 and m["cache"] == "fp16" and m["pages_total"] == POOL_PAGES
    for key in ("running", "waiting", "pages_free", "pages_used", "compression_physical", "preemptions",
                "tokens_per_s", "client_disconnects", "http_requests"):
        assert key in m
    assert call(server, "GET", "/v1/models")[1]["data"][0]["id"] == "tiny-llama"


def test_chats_sharing_their_first_messages_share_their_pages():
    """--prefix-cache: chats with the same system message prefill it once; each answers as without the cache;
    /metrics counts the hits."""
    system = {"role": "system", "content": "You read the following document with care. " * 3}
    chats = [{"model": "tiny-llama", "max_tokens": 6, "temperature": 0,
              "messages": [system, {"role": "user", "content": q}]} for q in ("WHAT IS IT", "WHO WROTE IT", "WHY")]
    answers = {}
    for prefix_cache in (False, True):
        with start_server(tiny_engine(prefix_cache=prefix_cache), "tiny-llama") as handle:
            answers[prefix_cache] = [call(handle, "POST", "/v1/chat/completions", c)[1]["choices"][0]["message"]
                                     for c in chats]
            metrics = call(handle, "GET", "/metrics")[1]
    assert answers[True] == answers[False]
    assert metrics["prefix_misses"] == 1 and metrics["prefix_hits"] == 2 and metrics["prefix_shared_bytes"] > 0


def test_client_disconnect_mid_stream_cancels_and_frees_pages(server):
    before = server.metrics()["client_disconnects"]
    seen = []
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "ABCDE", "max_tokens": 230, "temperature": 0,
                                                              "ignore_eos": True, "stream": True}), headers=JSON)
    resp = conn.getresponse()
    while len(seen) < 3:
        seen += [line for line in [resp.readline()] if line.startswith(b"data: ")]
    (request,) = [r for r in list(server.active) if r.params.max_new_tokens == 230]
    resp.close()
    conn.close()  # mid-stream: the server notices at its next write and cancels
    assert request.wait(30) and request.finish_reason == "cancelled" and len(request.output_ids) < 230
    assert_pool_full(server.engine)
    assert server.metrics()["client_disconnects"] == before + 1
    assert complete(server, "HI", max_tokens=2)[0] == 200


def _disconnect_mid_stream(server, body) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}), headers=JSON)
    resp = conn.getresponse()
    got = 0
    while got < 3:
        got += resp.readline().startswith(b"data: ")
    resp.close()
    conn.close()


def _client(server, i, results):
    kind = i % 4
    try:
        if i == 11:
            _disconnect_mid_stream(server, {"prompt": "GONE", "max_tokens": 200, "temperature": 0, "ignore_eos": True})
            results.append(("gone", 0, None))
        elif kind == 0:
            status, body = complete(server, f"LOAD {i}", max_tokens=8 + i)
            results.append(("ok", status, body["choices"][0]["finish_reason"]))
        elif kind == 1:
            status, chunks, done = stream(server, "/v1/chat/completions", {**CHAT, "max_tokens": 6 + i})
            results.append(("ok", status, done and chunks[-1]["choices"][0]["finish_reason"]))
        elif kind == 2:
            status, chunks, done = stream(server, "/v1/completions", {"prompt": "X" * (10 + i), "max_tokens": 10,
                                                                      "temperature": 0.7, "seed": i})
            results.append(("ok", status, done and chunks[-1]["choices"][0]["finish_reason"]))
        else:
            status, body = call(server, "POST", "/v1/completions", raw=b'{"prompt": [' if i % 8 == 3 else
                                json.dumps({"prompt": "HI", "max_tokens": -1}).encode())
            results.append(("bad", status, body["error"]["type"]))
    except Exception as e:  # noqa: BLE001 - reported by the assertion below
        results.append(("exc", i, repr(e)))


def test_concurrent_load_mixed_clients(server):
    results = []
    threads = [threading.Thread(target=_client, args=(server, i, results), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    # every client gets its answer: the load does not hang (a generous bound, not a speed test)
    wait_until(lambda: not any(t.is_alive() for t in threads), 120, "all 12 clients answered")
    assert len(results) == 12 and not [r for r in results if r[0] == "exc"], results
    assert all(s == 200 and reason in ("length", "stop") for k, s, reason in results if k == "ok"), results
    assert all(s == 400 and t == "invalid_request_error" for k, s, t in results if k == "bad"), results
    assert sum(k == "bad" for k, *_ in results) == 2
    assert call(server, "GET", "/health") == (200, {"status": "ok"})
    assert_pool_full(server.engine)
    assert server.metrics()["peak_running"] >= 2


def test_many_clients_connecting_at_once_are_all_answered(server):
    """More simultaneous connections than socketserver's default listen backlog (5): none is reset."""
    n, results = 48, []
    barrier = threading.Barrier(n)

    def client(i):
        barrier.wait()
        try:
            results.append(complete(server, f"AT ONCE {i}", max_tokens=2)[0])
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    wait_until(lambda: not any(t.is_alive() for t in threads), 120, f"all {n} clients answered")
    assert results == [200] * n, [r for r in results if r != 200]


def test_engine_failure_is_reported_not_hung():
    engine = tiny_engine()

    def broken_step():
        raise RuntimeError("boom")

    engine.step = broken_step
    with start_server(engine, "tiny-llama") as handle:
        status, body = complete(handle, "HI")
        assert status in (500, 503) and "boom" in body["error"]["message"]
        status, body = call(handle, "GET", "/health")
        assert status == 503 and "boom" in body["error"]


def test_close_ends_streams_in_flight():
    handle = start_server(tiny_engine(), "tiny-llama")
    out = []
    body = {"prompt": "LONG", "max_tokens": 230, "temperature": 0, "ignore_eos": True}
    client = threading.Thread(target=lambda: out.append(stream(handle, "/v1/completions", body)), daemon=True)
    client.start()
    try:
        wait_until(lambda: handle.active, what="the stream in flight")
    finally:
        handle.close()
    client.join(60)
    assert not client.is_alive() and out, "the stream did not end"
    status, chunks, done = out[0]
    assert status == 200 and done and "shutting down" in chunks[-1]["error"]["message"]


def test_parse_bytes_and_cli_registration():
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("1e9") == 10**9
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("4096") == 4096 and parse_bytes("64k") == 64000
    for bad in ("", "2XB", "-1GiB", "0", "GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    from diffkv.cli import build_parser
    from diffkv.serve import serve_cli

    args = build_parser().parse_args(["serve", "--model", "m", "--kv-budget", "512MiB", "--cache", "fp16"])
    assert args.func is serve_cli.run and args.kv_budget == 512 << 20 and args.host == "127.0.0.1"
    assert args.port == 8000 and args.cache == "fp16"


@pytest.mark.real_model
def test_diffkv_serve_smollm2_smoke():
    proc = subprocess.Popen([sys.executable, "-m", "diffkv.cli", "serve", "--model", "smollm2-135m", "--port", "0",
                             "--kv-budget", "64MiB", "--max-model-len", "512"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    try:
        port = None
        for line in proc.stdout:
            if m := re.search(r"listening on http://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
                break
        assert port, "the server did not start"
        handle = type("H", (), {"port": port})()
        status, body = call(handle, "POST", "/v1/chat/completions", {"messages": [
            {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8, "temperature": 0})
        assert status == 200 and body["choices"][0]["message"]["content"], body
        status, chunks, done = stream(handle, "/v1/completions", {"prompt": "The capital of France is",
                                                                   "max_tokens": 6, "temperature": 0})
        assert status == 200 and done and chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        proc.terminate()
        proc.wait(30)
