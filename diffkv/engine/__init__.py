"""Continuous-batching serving engine over a KV cache of one of two kinds (``fp16`` paged cache, ``diffkv``)."""

from diffkv.engine.cache import CACHE_KINDS, EngineCache, PagedCache, fp16_config, make_cache
from diffkv.engine.engine import Engine
from diffkv.engine.request import Request, RequestEvent, SamplingParams, Status

__all__ = ["CACHE_KINDS", "Engine", "EngineCache", "PagedCache", "Request", "RequestEvent", "SamplingParams", "Status",
           "fp16_config", "make_cache"]
