"""Attention whose rows' bits do not depend on the rows computed with them: the numerics that let a prompt's
attention give the same bits alone, with draft tokens after it or in chunks (``chunked_prefill="deferred"`` of
``diffkv.integrations.transformers.DiffKVCache``; issue #62 item 4). The linear layers' counterpart is
``diffkv.engine.invariance.invariant_rows``, which uses the same block size."""

from __future__ import annotations

import torch
from torch import nn

ROW_BLOCK = 16  # rows per block, here and in the engine's batch-invariant linear layers


def padded_rows(rows: int) -> int:
    """Rows a product of ``rows`` rows (>= 0) is computed over: the next multiple of :data:`ROW_BLOCK`."""
    return -(-rows // ROW_BLOCK) * ROW_BLOCK


def blocked_gemm(gemm, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``gemm(x, weight, bias)`` (x: [..., in] -> [..., out], e.g. ``F.linear``) computed as products of exactly
    :data:`ROW_BLOCK` rows (the last padded with zero rows): each output row has the bits it has in any other
    blocked product (the engine's batch-invariant mode, ``diffkv.engine.invariance``; the vLLM plug-in's)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0:
        return gemm(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if padded_rows(rows) > rows:
        flat = torch.cat([flat, flat.new_zeros(padded_rows(rows) - rows, x.shape[-1])])
    out = torch.cat([gemm(flat[i:i + ROW_BLOCK], weight, bias) for i in range(0, flat.shape[0], ROW_BLOCK)])
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def blocked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
                      scaling: float) -> torch.Tensor:
    """Causal attention of the ``q`` newest of ``k`` positions with each query row's bits independent of how many
    rows were computed with it (a prompt alone, a prompt with draft tokens after it, a prompt in chunks).

    Rows go in blocks of :data:`ROW_BLOCK` aligned to absolute positions (block ``b`` holds positions
    ``16 b .. 16 b + 15``), each over exactly the keys ``0 .. 16 b + 15`` (missing ones zero, masked): a row then
    meets the same shapes and the same unmasked values whatever came with it, and a masked key adds an exact 0.
    query: [B, H_q, q, D]; key, value: [B, H_kv, k, D]; allowed: bool [B, 1, q, k] (True = attend) or None
    (causal). Returns [B, q, H_q, D], the layout of transformers' ``sdpa_attention_forward``."""
    b, hq, q, d = query.shape
    k = key.shape[2]
    first = k - q  # absolute position of the first query row
    pos = torch.arange(first, k, device=query.device)
    if allowed is None:
        allowed = (torch.arange(k, device=query.device)[None, :] <= pos[:, None]).expand(b, 1, q, k)
    out = query.new_empty(b, q, hq, d)
    for start in range(first // ROW_BLOCK * ROW_BLOCK, k, ROW_BLOCK):
        end = start + ROW_BLOCK  # keys of this block: 0 .. end-1
        lo, hi = max(start, first), min(end, k)  # the block's real rows
        rows = torch.zeros(b, hq, ROW_BLOCK, d, dtype=query.dtype, device=query.device)
        rows[:, :, lo - start:hi - start] = query[:, :, lo - first:hi - first]
        mask = torch.zeros(b, 1, ROW_BLOCK, end, dtype=torch.bool, device=query.device)
        mask[..., 0] = True  # rows outside the call attend to key 0 only (no NaN); their outputs are dropped
        mask[:, :, lo - start:hi - start] = False
        mask[:, :, lo - start:hi - start, :min(end, k)] = allowed[:, :, lo - first:hi - first, :min(end, k)]
        mask[..., 0] |= ~mask.any(-1)  # padding rows (left padding): finite, dropped by the caller
        keys, values = (torch.cat([t[:, :, :end], t.new_zeros(b, t.shape[1], max(end - k, 0), d)], 2)
                        for t in (key, value))
        o = nn.functional.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scaling,
                                                       enable_gqa=hq != key.shape[1])
        out[:, lo - first:hi - first] = o[:, :, lo - start:hi - start].transpose(1, 2)
    return out
