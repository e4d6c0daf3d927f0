"""copy_peaks as it was before 2026-12-06 (commit 1834116): the baseline of copy_peaks_speed.py."""

import torch


def copy_peaks(query: torch.Tensor, key: torch.Tensor, n: int, copy_start: int, scaling: float,
               chunk: int = 256) -> torch.Tensor:
    """Peak causal attention probability each of the first ``n`` keys receives from queries ``copy_start ..``.

    query: [H_q, T, D]; key: [H_kv, T, D] (GQA: H_q = G * H_kv). Returns [H_kv, n] fp32, the max over those queries
    and over the G query heads of each KV head.
    """
    hq, t, _ = query.shape
    hkv = key.shape[0]
    k = key.float().repeat_interleave(hq // hkv, 0)  # [H_q, T, D]
    best = torch.zeros(hq, n, dtype=torch.float32, device=query.device)
    cols = torch.arange(t, device=query.device)
    for start in range(copy_start, t, chunk):
        rows = torch.arange(start, min(start + chunk, t), device=query.device)
        logits = torch.matmul(query[:, rows].float(), k.transpose(1, 2)) * scaling  # [H_q, c, T]
        logits = logits.masked_fill(cols[None, None, :] > rows[None, :, None], float("-inf"))
        best = torch.maximum(best, torch.softmax(logits, -1)[..., :n].amax(1))
    return best.view(hkv, hq // hkv, n).amax(1)

