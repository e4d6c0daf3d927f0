"""What every host of a :class:`~diffkv.cache.kv_store.KVStore` (the transformers cache, the serving engine, the
vLLM plug-in) checks and derives the same way, in one place (issue #44): a configuration against the model, and a
hybrid model's full-attention layers (the ones DiffKV pages) with their thresholds. The pages a prompt or a step
may take are the store's (:meth:`KVStore.prompt_pages`, :meth:`KVStore.step_pages`)."""

from __future__ import annotations

import dataclasses

from diffkv.core.config import DiffKVConfig


def check_config(config: DiffKVConfig, *, num_layers: int, head_dim: int, source: str = "config") -> None:
    """Raise ValueError (saying what to do) unless ``config`` can store this model: its head size, and per-layer
    thresholds (``layer_alphas``), when it has them, for ``num_layers`` layers. ``source`` names the config in the
    message (e.g. the profile file)."""
    if config.layer_alphas is not None and len(config.layer_alphas) != num_layers:
        raise ValueError(f"{source} has thresholds for {len(config.layer_alphas)} layers but the model has "
                         f"{num_layers}; use the profile calibrated for this model")
    config.validate(head_dim)


def full_layers(shape, model_name: str) -> list[int]:
    """Indices of the model's full-attention layers (the ones paged); the others must be sliding-window layers
    with a window. shape: :class:`~diffkv.hf.shape.KVShape`."""
    other = {t for t in shape.layer_types if t not in ("full_attention", "sliding_attention")}
    if other:
        raise ValueError(f"DiffKV stores full-attention and sliding-window layers; {model_name} also has "
                         f"{sorted(other)}")
    full = [i for i, t in enumerate(shape.layer_types) if t == "full_attention"]
    if not full:
        raise ValueError(f"{model_name} has no full-attention layer: nothing for the KV cache to page")
    if len(full) < shape.num_layers and not shape.sliding_window:
        raise ValueError(f"{model_name} has sliding-window layers but its config gives no sliding_window")
    return full


def table_config(config: DiffKVConfig, layers: list[int]) -> DiffKVConfig:
    """The config of a store whose table layer t is model layer ``layers[t]``: the same, with the thresholds of
    those layers (``layer_alphas``, when set)."""
    if config.layer_alphas is None:
        return config
    return dataclasses.replace(config, layer_alphas=tuple(config.layer_alphas[i] for i in layers))
