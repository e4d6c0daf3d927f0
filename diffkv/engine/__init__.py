"""Continuous-batching serving engine over pluggable KV backends (``fp16`` paged cache, ``diffkv``)."""

from diffkv.engine.backend import BACKENDS, KVBackend, PagedBackend, fp16_config, make_backend
from diffkv.engine.engine import Engine
from diffkv.engine.request import Request, RequestEvent, SamplingParams, Status

__all__ = ["BACKENDS", "Engine", "KVBackend", "PagedBackend", "Request", "RequestEvent", "SamplingParams", "Status",
           "fp16_config", "make_backend"]
