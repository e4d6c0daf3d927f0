"""Attention shapes of a transformers model, read once from its (text) config."""

from __future__ import annotations

from dataclasses import dataclass


def text_config(config):
    """The text part of a multimodal config (Gemma-3), the config itself otherwise."""
    return getattr(config, "get_text_config", lambda: config)()


@dataclass(frozen=True)
class KVShape:
    """num_layers, query heads, KV heads, head_dim, each layer's type (``"full_attention"`` or
    ``"sliding_attention"``; all full when the config does not say), the sliding window and the longest position
    (None when the config does not say)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    max_position_embeddings: int | None = None

    @property
    def full_attention_only(self) -> bool:
        return all(t == "full_attention" for t in self.layer_types)


def kv_shape(model_or_config) -> KVShape:
    """:class:`KVShape` of a transformers model or config."""
    tc = text_config(getattr(model_or_config, "config", model_or_config))
    heads = tc.num_attention_heads
    layers = tc.num_hidden_layers
    types = tuple(getattr(tc, "layer_types", None) or ["full_attention"] * layers)
    return KVShape(num_layers=layers, num_heads=heads,
                   num_kv_heads=getattr(tc, "num_key_value_heads", None) or heads,
                   head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads, layer_types=types,
                   sliding_window=getattr(tc, "sliding_window", None),
                   max_position_embeddings=getattr(tc, "max_position_embeddings", None))
