"""KIVI-style asymmetric low-bit KV cache as a transformers ``Cache``.

Based on Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (ICML 2024): keys are quantized
**per channel** (each channel's scale/zero shared by a group of ``group_size`` consecutive tokens), values **per
token** (groups of ``group_size`` channels); the newest tokens stay in full precision in a residual of fewer than
``residual`` tokens, which is quantized and flushed as a whole once it reaches ``residual`` tokens (``residual`` is a
multiple of ``group_size``; KIVI's defaults are 32 and 128).

This is a *simulation* of the numerics: the dequantized values are kept in the model dtype and attention runs
through SDPA, while ``stats()`` counts the bytes of the packed format KIVI stores (``bits`` per element plus an
fp16 scale and zero per group, fp16 for the residual). Every seen column is kept, so the dense mask stays valid.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from diffkv.core.quant import dequantize, quantize
from diffkv.core.stats import with_window_layers
from diffkv.hf.layer import cache_layers
from diffkv.hf.shape import kv_shape


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, per_channel: bool) -> torch.Tensor:
    """Quantize + dequantize. x: [B, H, T, D]; per_channel groups ``group_size`` tokens per channel (T must be a
    multiple of it), else ``group_size`` channels per token. Returns [B, H, T, D] in x.dtype."""
    y = x.transpose(-1, -2) if per_channel else x  # [B, H, D, T] for keys: groups run along tokens
    codes, scale, zero = quantize(y.float(), bits, group_size, meta_dtype=torch.float32, validate=False)
    out = dequantize(codes, scale, zero, dtype=x.dtype)
    return out.transpose(-1, -2) if per_channel else out


class KIVILayer(CacheLayerMixin):
    """One full-attention layer: quantized body + full-precision residual, both ``[B, H_kv, T, D]``."""

    is_sliding = False

    def __init__(self, bits: int, group_size: int, residual: int):
        super().__init__()
        self.bits, self.group_size, self.residual = bits, group_size, residual
        self.body_k = self.body_v = self.res_k = self.res_v = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        empty = key_states[:, :, :0]
        self.body_k, self.body_v, self.res_k, self.res_v = empty, empty, empty, empty
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states: [B, H_kv, q, D]. Returns all seen K/V [B, H_kv, T, D] (body dequantized)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        res_k, res_v = torch.cat([self.res_k, key_states], 2), torch.cat([self.res_v, value_states], 2)
        flush = (res_k.shape[2] // self.residual) * self.residual
        if flush:
            qk = fake_quantize(res_k[:, :, :flush], self.bits, self.group_size, per_channel=True)
            qv = fake_quantize(res_v[:, :, :flush], self.bits, self.group_size, per_channel=False)
            self.body_k, self.body_v = torch.cat([self.body_k, qk], 2), torch.cat([self.body_v, qv], 2)
            res_k, res_v = res_k[:, :, flush:], res_v[:, :, flush:]
        self.res_k, self.res_v = res_k, res_v
        return torch.cat([self.body_k, res_k], 2), torch.cat([self.body_v, res_v], 2)

    def token_counts(self) -> tuple[int, int]:
        """(quantized, full-precision) tokens per sequence and head."""
        return self.body_k.shape[2], self.res_k.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if not self.is_initialized else self.body_k.shape[2] + self.res_k.shape[2]

    def get_max_length(self) -> int:
        return -1


class KIVICache(Cache):
    """KIVI cache (see the module docstring).

    Parameters
    ----------
    model: the causal LM (attention unchanged: SDPA over the dequantized K/V).
    bits: 2 or 4 (KIVI-2 / KIVI-4). group_size: tokens per key group / channels per value group (divides head_dim).
    residual: full-precision window size, a multiple of ``group_size``.
    """

    def __init__(self, model, bits: int = 2, group_size: int = 32, residual: int = 128):
        shape = kv_shape(model)
        self.head_dim, self.num_kv_heads = shape.head_dim, shape.num_kv_heads
        if bits not in (1, 2, 4, 8):
            raise ValueError(f"KIVI bits must be 1, 2, 4 or 8, got {bits!r}")
        if group_size < 1 or self.head_dim % group_size:
            raise ValueError(f"group_size {group_size} must divide head_dim {self.head_dim}")
        if residual < group_size or residual % group_size:
            raise ValueError(f"residual {residual} must be a positive multiple of group_size {group_size}")
        self.bits, self.group_size, self.residual = bits, group_size, residual
        super().__init__(layers=cache_layers(shape, lambda i: KIVILayer(bits, group_size, residual)))

    def release(self) -> None:
        for layer in self.layers:
            if isinstance(layer, KIVILayer):
                layer.body_k = layer.body_v = None

    def stats(self, tokens_seen: int | None = None) -> dict:
        """Same keys as ``DiffKVCache.stats()``: residual tokens are 'high' (fp16), quantized ones 'low'.

        Columns of a left-padded batch are all counted (KIVI keeps every column); pass ``tokens_seen`` (valid
        tokens in the batch) to report that number instead.
        """
        layers = [x for x in self.layers if isinstance(x, KIVILayer) and x.is_initialized]
        if not layers:
            return {"layers_compressed": 0, "tokens_seen": 0}
        batch = layers[0].res_k.shape[0]
        n_low, n_high = layers[0].token_counts()
        cells = batch * len(layers) * self.num_kv_heads
        d, g, bits = self.head_dim, self.group_size, self.bits
        low_bytes = 2 * d * bits / 8 + 4 * d / g + 4 * d / g  # K and V codes; K per-channel and V per-token meta
        fp16 = cells * (n_low + n_high) * 4 * d
        kept = cells * (n_low * low_bytes + n_high * 4 * d)
        bits_total = cells * (n_low * 2 * bits + n_high * 32)
        seen = tokens_seen or batch * (n_low + n_high)
        return with_window_layers({
            "layers_compressed": len(layers), "tokens_seen": seen,
            "tokens_per_tier": {"high": cells * n_high, "low": cells * n_low, "pruned": 0},
            "tier_fractions": {"high": n_high / max(n_low + n_high, 1), "low": n_low / max(n_low + n_high, 1),
                               "pruned": 0.0},
            "fp16_bytes": fp16, "bytes_in_pages": int(kept),
            "compression_physical": fp16 / kept if kept else math.inf,
            "compression_theoretical": cells * (n_low + n_high) * 32 / bits_total if bits_total else math.inf,
        }, self, seen)
