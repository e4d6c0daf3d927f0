"""Decode attention over a head's retained tokens (high + low tiers in one softmax), torch reference.

The reference works on tokens gathered from the pages (``diffkv.core.page_io``) by ``diffkv.ops.paged_attention``'s
torch reference; the production backends (compiled CPU, Triton) attend straight from the pages
(``diffkv.ops.decode_step``).
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


def decode_attention_tiers(query: torch.Tensor, tiers: list, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over several tiers in one softmax, without concatenating their K/V.

    query: [B, H_q, D]; tiers: list of (keys [B, H_kv, M_i, D], values [B, H_kv, M_i, D], valid [B, H_kv, M_i]);
    values must be finite (exactly 0 at invalid slots, as ``PagedKV.read`` returns them).
    Returns ``out`` [B, H_q, D] fp32 and ``probs`` [B, H_q, sum M_i] fp32 (tiers in order).
    """
    b, hq, d = query.shape
    hkv = tiers[0][0].shape[1]
    q = query.float().view(b, hkv, hq // hkv, d)
    logits = [torch.matmul(q, k.transpose(-1, -2)).mul_(scaling).masked_fill_(~v[:, :, None, :], float("-inf"))
              for k, _, v in tiers]  # [B, H_kv, G, M_i]
    probs = torch.softmax(torch.cat(logits, -1), dim=-1).nan_to_num_(0.0)
    out = None
    for p, (_, vals, _) in zip(probs.split([lg.shape[-1] for lg in logits], -1), tiers, strict=True):
        o = torch.matmul(p, vals)
        out = o if out is None else out.add_(o)
    return out.view(b, hq, d), probs.view(b, hq, -1)
