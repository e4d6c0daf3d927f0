"""OpenAI-compatible request parsing and response bodies for :mod:`diffkv.serve.server` (no I/O here).

Parsing is strict: unknown fields, wrong types and out-of-range values raise :class:`APIError` (HTTP 400) with an
OpenAI-style error body, so a typo is never silently ignored. A few OpenAI fields the engine does not implement are
accepted at their neutral value only (``presence_penalty: 0``, ``logprobs: null`` ...).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from diffkv.engine.request import SamplingParams

_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "n", "user",
           "ignore_eos"}
_FIELDS = {"completion": _COMMON | {"prompt"}, "chat": _COMMON | {"messages", "max_completion_tokens"}}
_NEUTRAL = {"presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (None, False), "top_logprobs": (None, 0),
            "echo": (False,), "best_of": (None, 1), "logit_bias": (None, {}), "suffix": (None,)}
_ROLES = ("system", "user", "assistant")
FINISH_REASONS = {"length": "length", "stop": "stop", "cancelled": "abort", "error": "error"}
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts


class APIError(Exception):
    """An error answered with ``status``, an OpenAI error body and any extra response ``headers``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(slots=True)
class ParsedRequest:
    """A validated request. ``prompt``: text or token ids (completions); ``messages``: the chat (chat)."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    stream: bool = False
    include_usage: bool = False
    sampling: dict = field(default_factory=dict)  # SamplingParams fields but max_new_tokens


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same(v, a) -> bool:
    if a is None or isinstance(a, bool):
        return v is a
    return (_is_number(v) if _is_number(a) else type(v) is type(a)) and v == a


def _bad(param: str, what: str, value) -> APIError:
    shown = json.dumps(value)[:80] if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return APIError(400, f"'{param}' must be {what}, got {shown}", param=param)


def parse_request(kind: str, body: dict) -> ParsedRequest:
    """Validate a ``/v1/completions`` (kind "completion") or ``/v1/chat/completions`` (kind "chat") body."""
    for name in body:
        if name not in _FIELDS[kind] and name not in _NEUTRAL:
            raise APIError(400, f"unknown field '{name}'", param=name, code="unknown_field")
    for name, allowed in _NEUTRAL.items():
        if name in body and not any(_same(body[name], a) for a in allowed):
            raise APIError(400, f"'{name}' is not supported by this server (only {allowed[-1]!r})", param=name)
    present = {k: v for k, v in body.items() if v is not None}
    model = present.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "a string", model)
    req = ParsedRequest(kind, model)
    if kind == "completion":
        req.prompt = _prompt(present.get("prompt"))
    else:
        req.messages = _messages(present.get("messages"))
    for name in ("max_tokens", "max_completion_tokens"):
        if name in present:
            if not _is_int(present[name]) or present[name] < 1:
                raise _bad(name, "an integer >= 1", present[name])
            req.max_tokens, req.max_tokens_param = present[name], name
    if present.get("n", 1) != 1 or not _is_int(present.get("n", 1)):
        raise APIError(400, "only n = 1 is supported", param="n")
    for name in ("stream", "ignore_eos"):
        if not isinstance(present.get(name, False), bool):
            raise _bad(name, "a boolean", present[name])
    req.stream = present.get("stream", False)
    opts = present.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} \
                or not isinstance(opts.get("include_usage", False), bool):
            raise _bad("stream_options", '{"include_usage": true|false}', opts)
        req.include_usage = opts.get("include_usage", False)
    if "user" in present and not isinstance(present["user"], str):
        raise _bad("user", "a string", present["user"])
    req.sampling = _sampling(present)
    return req


def check_model(req: ParsedRequest, names, served: str) -> None:
    """404 unless ``req.model`` is one of ``names``; a request without ``model`` gets the served model (OpenAI
    requires the field; curl users and single-model clients often leave it out)."""
    if req.model is not None and req.model not in names:
        raise APIError(404, f"the model '{req.model[:200]}' does not exist: this server serves '{served}'",
                       param="model", code="model_not_found")


def _prompt(prompt) -> str | list[int]:
    if prompt is None:
        raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "only one prompt per request is supported", param="prompt")
    raise _bad("prompt", "a non-empty string or a non-empty list of token ids", prompt)


def _messages(messages) -> list[dict]:
    if messages is None:
        raise APIError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of {role, content} objects", messages)
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(param, "an object", m)
        if set(m) - {"role", "content", "name"}:
            raise APIError(400, f"{param} has unknown fields {sorted(set(m) - {'role', 'content', 'name'})}",
                           param=param)
        if m.get("role") not in _ROLES:
            raise _bad(f"{param}.role", f"one of {list(_ROLES)}", m.get("role"))
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and set(p) ==
                                             {"type", "text"} and isinstance(p["text"], str) for p in content):
            content = "".join(p["text"] for p in content)  # text parts
        if not isinstance(content, str):
            raise _bad(f"{param}.content", "a string (or a list of text parts)", content)
        out.append({"role": m["role"], "content": content})
    return out


def _sampling(present: dict) -> dict:
    out = {"ignore_eos": present.get("ignore_eos", False)}
    t = present.get("temperature", 1.0)
    if not _is_number(t) or not 0 <= t <= 2:
        raise _bad("temperature", "a number in [0, 2] (0 = greedy)", t)
    p = present.get("top_p", 1.0)
    if not _is_number(p) or not 0 < p <= 1:
        raise _bad("top_p", "a number in (0, 1]", p)
    out["temperature"], out["top_p"] = float(t), float(p)
    stop = present.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 16 or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", "a non-empty string or a list of at most 16 of them", present.get("stop"))
    out["stop"] = tuple(stop)
    if "seed" in present:
        s = present["seed"]
        if not _is_int(s) or not SEED_RANGE[0] <= s <= SEED_RANGE[1]:
            raise _bad("seed", "a 64-bit integer", s)
        out["seed"] = s
    return out


def sampling_params(req: ParsedRequest, prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """The engine parameters of ``req`` for a prompt of ``prompt_tokens``; checks both fit the context.
    Default ``max_tokens``: 16 for completions (as OpenAI), the rest of the context for chat."""
    param = "prompt" if req.kind == "completion" else "messages"
    if prompt_tokens >= max_model_len:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens but the model's context is {max_model_len} "
                       "tokens (including at least one generated token)", param=param,
                       code="context_length_exceeded")
    name = req.max_tokens_param
    if req.max_tokens is not None and req.max_tokens >= max_model_len:
        raise APIError(400, f"'{name}' ({req.max_tokens}) must be below the model's context of {max_model_len} "
                       "tokens", param=name)
    max_tokens = req.max_tokens or (16 if req.kind == "completion" else max_model_len - prompt_tokens)
    if prompt_tokens + max_tokens > max_model_len:
        raise APIError(400, f"prompt ({prompt_tokens} tokens) + {name} ({max_tokens}) exceeds the model's context "
                       f"of {max_model_len} tokens", param=name, code="context_length_exceeded")
    try:
        return SamplingParams(max_new_tokens=max_tokens, **req.sampling)
    except ValueError as e:
        raise APIError(400, str(e)) from None


# ---- responses ----
class ResponseBuilder:
    """Bodies and stream chunks of one request in OpenAI's format."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def body(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict:
        reason = FINISH_REASONS.get(finish_reason, finish_reason)
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            head = self._head("text_completion")
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            head = self._head("chat.completion")
        return {**head, "choices": [choice], "usage": self.usage(prompt_tokens, completion_tokens)}

    def chunk(self, delta: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        """One stream chunk: new text ``delta`` (None: none) and/or the end (``finish_reason``)."""
        reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
        if self.kind == "completion":
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            return {**self._head("text_completion"), "choices": [choice]}
        d = {"role": "assistant", "content": delta or ""} if role else {"content": delta} if delta is not None else {}
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._head(obj), "choices": [], "usage": self.usage(prompt_tokens, completion_tokens)}


def sse(payload: dict | str) -> bytes:
    """One Server-Sent Event: ``data: <json>\\n\\n`` (or ``data: [DONE]\\n\\n`` for the string "[DONE]")."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
