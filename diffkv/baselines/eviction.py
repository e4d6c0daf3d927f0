"""Token-eviction caches (H2O, SnapKV, StreamingLLM) as transformers caches on the ``diffkv`` attention router.

Eviction baselines need the attention probabilities of the tokens they keep, and the model's dense mask no longer
matches their (shorter) cache. So, like :class:`~diffkv.integrations.transformers.DiffKVCache`, each layer leaves
a pending entry on the model's :class:`~diffkv.hf.routing.Router` in ``update`` and computes the
attention itself in ``attend``: the prompt through SDPA (plus the policy's importance scores), decode steps
eagerly over the kept tokens (plus score accumulation). Nothing is patched at import time.

Kept tokens live in rectangular tensors ``[B, H_kv, T, D]``; ``pos`` ``[B, H_kv, T]`` holds each slot's token
index within its sequence (-1: empty slot, from ragged budgets in a left-padded batch). Slot order is free: keys
are post-RoPE, so attention does not depend on it.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache

from diffkv.core.stats import with_window_layers
from diffkv.hf.layer import RoutedLayer, cache_layers
from diffkv.hf.routing import install_router, sdpa_attention_forward, valid_from_mask
from diffkv.hf.shape import kv_shape


class EvictionPolicy:
    """Which tokens to keep. Subclasses set the class flags and override the score hooks.

    ``ratio`` is the fraction of seen tokens kept (the token budget); ``priority`` ranks kept candidates
    (higher = keep), protected tokens (``protected``) are always kept.
    """

    name = "eviction"
    decode_eviction = True  # False: only the prompt is compressed (SnapKV); decode tokens are all kept
    accumulates = False  # True: decode attention probabilities are added to the scores (H2O)
    score_bytes = 0  # metadata bytes per kept (token, head) besides fp16 K/V (e.g. a fp32 accumulated score)

    def __init__(self, ratio: float):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"{type(self).__name__}: budget ratio must be in (0, 1], got {ratio!r}")
        self.ratio = ratio

    def budget(self, seen: torch.Tensor) -> torch.Tensor:
        """Tokens to keep per sequence. seen: [B] tokens seen so far. Returns [B] int64 (at most ``seen``)."""
        keep = torch.ceil(seen.double() * self.ratio).long().clamp_min(self.min_keep())
        return torch.minimum(keep, seen)

    def min_keep(self) -> int:
        return 1

    def prefill_scores(self, query, keys, valid, scaling) -> torch.Tensor:
        """query: [B, H_q, L, D]; keys: [B, H_kv, L, D]; valid: [B, L]. Returns scores [B, H_kv, L] fp32."""
        return torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)

    def protected(self, pos: torch.Tensor, seen: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """pos: [B, H, T] token indices (-1 = empty); seen, keep: [B]. Returns [B, H, T] bool (always kept)."""
        return torch.zeros_like(pos, dtype=torch.bool)

    def priority(self, score: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Ranking among unprotected tokens (higher = keep). score, pos: [B, H, T]."""
        return score


def attention_probs(query, keys, scaling, key_mask=None, causal_from: int | None = None):
    """Softmax attention probabilities in fp32.

    query: [B, H_q, q, D]; keys: [B, H_kv, T, D]; key_mask: [B, H_kv or 1, T] bool (True = attend);
    causal_from: if given, query i sits at key index ``causal_from + i`` and cannot see later keys.
    Returns [B, H_q, q, T].
    """
    groups = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1) if groups > 1 else keys
    logits = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scaling
    if key_mask is not None:
        m = key_mask.repeat_interleave(groups, dim=1) if key_mask.shape[1] > 1 and groups > 1 else key_mask
        logits = logits.masked_fill(~m[:, :, None, :], float("-inf"))
    if causal_from is not None:
        qi = torch.arange(query.shape[2], device=query.device)[:, None] + causal_from
        logits = logits.masked_fill(torch.arange(keys.shape[2], device=keys.device)[None, :] > qi, float("-inf"))
    return torch.softmax(logits, -1).nan_to_num_(0.0)


def keep_top(priority: torch.Tensor, keep: torch.Tensor, *tensors: torch.Tensor):
    """Gather the ``keep[b]`` highest-priority slots of every (b, h). priority: [B, H, T]; keep: [B].

    Returns the gathered ``tensors`` ([B, H, T', ...], T' = max keep) and a [B, H, T'] bool of filled slots.
    """
    width = int(keep.max()) if keep.numel() else 0
    idx = torch.topk(priority, width, dim=-1).indices  # [B, H, T']
    filled = torch.arange(width, device=priority.device)[None, None, :] < keep[:, None, None]
    out = []
    for t in tensors:
        ix = idx.view(*idx.shape, *([1] * (t.dim() - 3))).expand(*idx.shape, *t.shape[3:])
        out.append(t.gather(2, ix))
    return out, filled


class EvictionLayer(RoutedLayer):
    """One full-attention layer of an :class:`EvictionCache` (see the module docstring)."""

    def __init__(self, cache: EvictionCache, layer_idx: int):
        super().__init__(layer_idx)
        self.cache, self.policy = cache, cache.policy
        self.seen = self.pos = self.score = None

    @property
    def router(self):
        return self.cache.router

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """query: [B, H_q, q, D]; key, value: this call's [B, H_kv, q, D]. Returns ([B, q, H_q, D], None)."""
        if self.phase == "prefill":
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
            self._prefill(query, key, value, valid_from_mask(attention_mask, *key.shape[:1], key.shape[2],
                                                              key.device), scaling)
            return out, None
        return self._decode(query, key, value, scaling), None

    def _prefill(self, query, key, value, valid, scaling) -> None:
        b, h, length, _ = key.shape
        self.seen = valid.sum(1)
        index = valid.long().cumsum(1) - 1
        pos = torch.where(valid, index, -1)[:, None, :].expand(b, h, length)
        score = self.policy.prefill_scores(query, key, valid, scaling)
        self._store(key, value, pos, score)

    def _decode(self, query, key, value, scaling) -> torch.Tensor:
        b, h = key.shape[:2]
        new_pos = self.seen[:, None, None].expand(b, h, 1)
        self.seen = self.seen + 1
        keys, values = torch.cat([self.keys, key], 2), torch.cat([self.values, value], 2)
        pos = torch.cat([self.pos, new_pos], 2)
        score = torch.cat([self.score, torch.zeros(b, h, 1, device=key.device)], 2)
        p = attention_probs(query, keys, scaling, key_mask=pos >= 0)  # [B, H_q, 1, T]
        out = torch.matmul(p.to(values.dtype), values.repeat_interleave(query.shape[1] // h, dim=1))
        if self.policy.accumulates:
            score = score + p[:, :, 0].view(b, h, -1, p.shape[-1]).sum(2)
        if self.policy.decode_eviction:
            self._store(keys, values, pos, score)
        else:
            self.keys, self.values, self.pos, self.score = keys, values, pos, score
        return out.transpose(1, 2).to(query.dtype)

    def _store(self, keys, values, pos, score) -> None:
        """Keep the budgeted tokens of [B, H, T] candidates (all of them when the budget allows)."""
        keep = self.policy.budget(self.seen)
        valid = pos >= 0
        if bool((valid.sum(-1) <= keep[:, None]).all()) and self.pos is not None:
            self.keys, self.values, self.pos, self.score = keys, values, pos, score
            return
        prio = self.policy.priority(score, pos).float()
        prio = prio.masked_fill(self.policy.protected(pos, self.seen, keep), float("inf"))
        prio = prio.masked_fill(~valid, float("-inf"))
        (self.keys, self.values, pos, self.score), filled = keep_top(prio, keep, keys, values, pos, score)
        self.pos = pos.masked_fill(~filled, -1)

    def kept(self) -> torch.Tensor:
        """[B, H_kv] tokens kept per sequence and head."""
        return (self.pos >= 0).sum(-1)

class EvictionCache(Cache):
    """transformers cache that keeps a token budget per layer and KV head, chosen by ``policy``.

    Parameters
    ----------
    model: the causal LM (its attention is routed through ``diffkv``; other caches keep working).
    policy: an :class:`EvictionPolicy` instance (``H2OPolicy``, ``SnapKVPolicy``, ``StreamingLLMPolicy``).
    """

    def __init__(self, model, policy: EvictionPolicy):
        self.policy = policy
        shape = kv_shape(model)
        self.head_dim = shape.head_dim
        super().__init__(layers=cache_layers(shape, lambda i: EvictionLayer(self, i)))
        self.router = install_router(model)

    def release(self) -> None:
        """Drop the kept tensors (for symmetry with DiffKVCache.release)."""
        for layer in self.layers:
            if isinstance(layer, EvictionLayer):
                layer.keys = layer.values = layer.score = None

    def stats(self) -> dict:
        """Same keys as ``DiffKVCache.stats()``: kept tokens are 'high' (fp16), evicted ones 'pruned'."""
        layers = [x for x in self.layers if isinstance(x, EvictionLayer) and x.seen is not None]
        if not layers:
            return {"layers_compressed": 0, "tokens_seen": 0}
        seen = int(layers[0].seen.sum())
        heads = layers[0].pos.shape[1]
        total = seen * len(layers) * heads
        kept = sum(int(x.kept().sum()) for x in layers)
        fp16 = total * 4 * self.head_dim
        kept_bytes = kept * (4 * self.head_dim + self.policy.score_bytes)
        return with_window_layers({
            "layers_compressed": len(layers), "tokens_seen": seen,
            "tokens_per_tier": {"high": kept, "low": 0, "pruned": total - kept},
            "tier_fractions": {"high": kept / total, "low": 0.0, "pruned": 1 - kept / total},
            "tokens_per_head": [x.kept().tolist() for x in layers],  # [L'][B][H]
            "fp16_bytes": fp16, "bytes_in_pages": kept_bytes,
            "compression_physical": fp16 / kept_bytes if kept_bytes else math.inf,
            "compression_theoretical": total / kept if kept else math.inf,
        }, self, seen)
