"""diffkv: differentiated KV-cache compression (DiffKV) for LLM inference."""

from diffkv.core.config import PRESETS, DiffKVConfig, QuantSpec, TierSpec

__version__ = "0.1.0"
__all__ = ["DiffKVCache", "DiffKVConfig", "QuantSpec", "TierSpec", "PRESETS", "attach", "__version__"]

_LAZY = {"DiffKVCache": "diffkv.integrations.transformers", "attach": "diffkv.integrations.attach"}


def __getattr__(name: str):
    """``diffkv.DiffKVCache`` and ``diffkv.attach`` import torch and transformers on first use, not at import."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'diffkv' has no attribute {name!r}")
