"""The ``diffkv`` attention function for transformers, and the explicit cache <-> attention handle.

transformers does not pass the cache to the attention function. A :class:`Router` is installed on the model's
attention modules (by ``DiffKVCache(model, ...)``, explicitly, never at import time): a DiffKV cache layer's
``update`` leaves a pending entry keyed by layer index and the very key tensor it returned; the attention
function consumes it only if it receives that same tensor. Any other call (another cache, a sliding-window layer
kept in a plain cache, no cache) runs SDPA unchanged, so the model stays correct whatever cache it is given.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "diffkv"


class Router:
    """Pending DiffKV layer calls of one model: ``{layer_idx: (key tensor, layer)}``."""

    def __init__(self):
        self.pending: dict[int, tuple[torch.Tensor, object]] = {}

    def expect(self, layer_idx: int, key: torch.Tensor, layer) -> None:
        self.pending[layer_idx] = (key, layer)

    def take(self, layer_idx: int, key: torch.Tensor):
        entry = self.pending.get(layer_idx)
        if entry is None or entry[0] is not key:
            return None
        del self.pending[layer_idx]
        return entry[1]


def diffkv_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: DiffKV for layers of a DiffKV cache, SDPA otherwise.

    query: [B, H_q, q, D]; key, value: what the cache's ``update`` returned. Returns ([B, q, H_q, D], None).
    """
    router = getattr(module, "_diffkv_router", None)
    layer = router.take(module.layer_idx, key) if router is not None else None
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    return layer.attend(module, query, key, value, attention_mask, scaling, **kwargs)


def valid_from_mask(mask, batch: int, length: int, device) -> torch.Tensor:
    """valid [B, L] bool from the prefill mask (bool: True = attend; float: 0 = attend; None: all valid)."""
    if mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    last = mask[:, 0, -1, -length:]
    return last if last.dtype == torch.bool else last == 0


def register() -> None:
    """Register the attention and mask functions under ``"diffkv"`` (idempotent)."""
    AttentionInterface.register(ATTN_NAME, diffkv_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def attention_modules(model) -> list:
    """The attention modules of a transformers model (modules with a ``layer_idx`` and q/k/v projections)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj") and hasattr(m, "v_proj")]


def install_router(model) -> Router:
    """Route the model's attention through ``diffkv`` (idempotent). Returns the model's router."""
    register()
    mods = attention_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no attention modules with k_proj/v_proj/layer_idx; "
                         "DiffKVCache supports decoder-only transformers models (Llama, Qwen2, Gemma-3, ...)")
    router = getattr(mods[0], "_diffkv_router", None) or Router()
    for m in mods:
        m._diffkv_router = router
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    return router


def uninstall_router(model, attn_implementation: str = "sdpa") -> None:
    """Undo :func:`install_router`: remove the handles and restore ``attn_implementation``."""
    for m in attention_modules(model):
        if hasattr(m, "_diffkv_router"):
            del m._diffkv_router
    if model.config._attn_implementation == ATTN_NAME:
        model.set_attn_implementation(attn_implementation)
