"""Prefill importance scores: the Triton two-pass kernels (``diffkv.kernels.prefill_scores``) on CUDA, else the
torch reference ``diffkv.core.policy.prefill_scores`` (which materializes [B, H_q, W, L] fp32 logits)."""

from __future__ import annotations

import torch

from diffkv.core.policy import prefill_scores as prefill_scores_ref
from diffkv.ops.kernel_choice import use_triton

LOG2E = 1.4426950408889634


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90 (H100 / H200)


def shared_bytes(kernel: str, block_w: int, block_l: int, head_dim: int, elem_size: int, num_stages: int) -> int:
    """Shared memory of one program as Triton 3.6 lays it out for sm_90a (fit to ``benchmarks/gpu/compile_sm90.py``,
    exact for fp32 / bf16 inputs, head_dim 64-256, 2 and 3 stages).

    row_stats: the fp32 dot operands, 2 x (q [BLOCK_W, D] + k [BLOCK_L, D]) x 4 B, plus num_stages - 1 prefetched
    key tiles [BLOCK_L, D] in the input dtype (``elem_size`` bytes). column_scores: 2 x k [BLOCK_L, D] x 4 B plus
    num_stages - 1 prefetched query tiles [BLOCK_W, D].
    """
    if kernel == "row_stats":
        return 2 * (block_w + block_l) * head_dim * 4 + (num_stages - 1) * block_l * head_dim * elem_size
    return 2 * block_l * head_dim * 4 + (num_stages - 1) * block_w * head_dim * elem_size


def _num_stages(kernel: str, block_w: int, block_l: int, head_dim: int, elem_size: int) -> int:
    """Triton's default 3 pipeline stages, fewer where the program would not fit in an sm_90 SM's shared memory."""
    for stages in (3, 2):
        if shared_bytes(kernel, block_w, block_l, head_dim, elem_size, stages) <= SHARED_LIMIT:
            return stages
    return 1


def launch_settings(window: int, head_dim: int, elem_size: int = 4, block_l: int | None = None) -> dict:
    """Tiles: up to 64 window rows x 64 keys (32 keys at head_dim 256; ``block_l`` overrides), at least 16
    (``tl.dot``); pipeline stages per kernel within the shared memory of an sm_90 SM (``elem_size``: bytes of an
    input element). Only fp32 inputs at head_dim 256 get fewer than 3: row_stats 2 (3 need 256 KiB)."""
    block_w = max(16, min(64, _pow2(window)))
    block_l = block_l or (32 if head_dim > 128 else 64)
    return {"BLOCK_W": block_w, "BLOCK_L": block_l, "num_warps": 4,
            "row_stages": _num_stages("row_stats", block_w, block_l, head_dim, elem_size),
            "column_stages": _num_stages("column_scores", block_w, block_l, head_dim, elem_size)}


def prefill_scores(queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None, scaling: float,
                   score_window: int, *, backend: str = "auto", block_l: int | None = None,
                   peak: bool = False) -> torch.Tensor:
    """Importance of every prompt token from the last ``score_window`` queries (``diffkv.core.policy.prefill_scores``).

    queries: [B, H_q, L, D]; keys: [B, H_kv, L, D] (float16 / bfloat16 / float32, math in fp32); valid: [B, L] bool
    or None; peak: the max over the window's queries instead of the sum. Returns [B, H_kv, L] fp32. Extra global
    memory on the Triton path: 2 x [B, H_q, W] fp32 row statistics.
    ``block_l`` overrides the key tile (tests).
    """
    if not use_triton(backend, queries.is_cuda):
        return prefill_scores_ref(queries, keys, valid, scaling, score_window, peak=peak)
    b, hq, length, d = queries.shape
    hkv = keys.shape[1]
    if hq % hkv or keys.shape != (b, hkv, length, d):
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} do not match (GQA)")
    if d & (d - 1) or d < 16:
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {d}; use backend='torch'")
    from diffkv.kernels.prefill_scores import column_scores_kernel, row_stats_kernel

    w = min(score_window, length)
    q, k = queries.contiguous(), keys.contiguous()
    vmask = valid.to(torch.uint8).contiguous() if valid is not None else q  # dummy pointer when HAS_VALID is False
    cfg = launch_settings(w, d, max(q.element_size(), k.element_size()), block_l)
    m = torch.empty(b, hq, w, dtype=torch.float32, device=q.device)
    den = torch.empty_like(m)
    out = torch.empty(b, hkv, length, dtype=torch.float32, device=q.device)
    common = dict(q_ptr=q, k_ptr=k, valid_ptr=vmask, m_ptr=m, l_ptr=den, num_kv_heads=hkv, length=length, window=w,
                  qk_scale=float(scaling) * LOG2E, G=hq // hkv, D=d, BLOCK_W=cfg["BLOCK_W"], BLOCK_L=cfg["BLOCK_L"],
                  HAS_VALID=valid is not None, PRECISION="tf32x3" if q.is_cuda else "ieee",
                  num_warps=cfg["num_warps"])
    row_stats_kernel[(b * hq, -(-w // cfg["BLOCK_W"]))](num_q_heads=hq, num_stages=cfg["row_stages"], **common)
    column_scores_kernel[(b * hkv, -(-length // cfg["BLOCK_L"]))](out_ptr=out, PEAK=peak,
                                                                  num_stages=cfg["column_stages"], **common)
    return out
