"""Baseline KV caches for comparisons with DiffKV (transformers ``Cache`` classes): KIVI-style quantization and
token eviction (H2O, SnapKV, StreamingLLM)."""

from diffkv.baselines.eviction import EvictionCache, EvictionPolicy
from diffkv.baselines.kivi import KIVICache
from diffkv.baselines.policies import H2OPolicy, SnapKVPolicy, StreamingLLMPolicy

__all__ = ["EvictionCache", "EvictionPolicy", "H2OPolicy", "KIVICache", "SnapKVPolicy", "StreamingLLMPolicy"]
