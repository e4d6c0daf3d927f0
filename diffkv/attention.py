"""Decode attention over a head's retained tokens (high + low tiers in one softmax), torch reference.

The reference works on tokens gathered from the pages (``diffkv.store``); the dispatch point for the Triton paged
kernel (reads pages directly, GQA-shared) is :func:`decode_attention`.
"""

from __future__ import annotations

import torch


def decode_attention_ref(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence attends to its head's retained tokens.

    query: [B, H_q, D]; keys, values: [B, H_kv, T, D] (any float dtype, math in fp32); valid: [B, H_kv, T] bool
    (False = empty slot). H_q must be a multiple of H_kv (GQA: query head h reads KV head h // (H_q // H_kv)).
    Returns ``out`` [B, H_q, D] fp32 and ``probs`` [B, H_q, T] fp32 (0 at invalid slots; a head with no valid
    token gets zero output).
    """
    b, hq, d = query.shape
    hkv, t = keys.shape[1], keys.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    g = hq // hkv
    q = query.float().view(b, hkv, g, d)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)) * scaling  # [B, H_kv, G, T]
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    values = values.float().masked_fill(~valid[..., None], 0.0)  # empty slots may hold any bytes (NaN too)
    out = torch.matmul(probs, values)  # [B, H_kv, G, D]
    return out.view(b, hq, d), probs.view(b, hq, t)


def decode_attention(query, keys, values, valid, scaling):
    """Dispatch point: the torch reference (the CPU production path). See :func:`decode_attention_ref`."""
    return decode_attention_ref(query, keys, values, valid, scaling)
