"""diffkv: differentiated KV-cache compression (DiffKV) for LLM inference."""

from diffkv.config import PRESETS, DiffKVConfig, QuantSpec, TierSpec

__version__ = "0.1.0"
__all__ = ["DiffKVConfig", "QuantSpec", "TierSpec", "PRESETS", "__version__"]
