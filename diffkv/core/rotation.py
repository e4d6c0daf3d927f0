"""Randomized Hadamard rotation of the stored values (``DiffKVConfig.rotate_values``, beyond the paper).

A value vector ``v`` [D] is stored as ``R v = H (s * v)``: ``s`` a fixed pseudo-random sign per channel, ``H`` the
orthonormal Walsh-Hadamard transform over blocks of ``B`` channels, ``B`` the largest power of two dividing D (all
of D at 64, 128, 256; 8 at 40). Every rotated channel mixes a block's channels with equal weight, so a few outlier
channels no longer set every token's quantization range: per-token 2-bit values lose half their KL on qwen2.5-0.5b's
GSM8K traces at the same bytes (benchmarks/studies/2026-12-03-rotate-values.md). Attention is linear in the values,
so ``sum_t p_t R v_t = R sum_t p_t v_t``: the cache attends over the stored (rotated) values as usual and the output
is rotated back once per query head, ``R^-1 o = s * H o`` (``H`` is symmetric and its own inverse). Both are one
matmul with ``M = diag(s) H``, fp32 [D, D] (64 KB at D = 128), built once per (D, device) by log2(B) butterfly
stages: a constant of the code, like a compiled kernel, shared by every cache and not part of any.
"""

from __future__ import annotations

import torch

SIGN_SEED = 20261203
_MATRICES: dict[tuple[int, str], torch.Tensor] = {}


def block_size(head_dim: int) -> int:
    """Channels per Hadamard block: the largest power of two dividing ``head_dim`` (positive)."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return head_dim & -head_dim


def signs(head_dim: int, device: torch.device | str) -> torch.Tensor:
    """The fixed random signs, fp32 [head_dim] of +-1 on ``device`` (the same for every layer, head and run)."""
    bits = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(SIGN_SEED))
    return (bits * 2 - 1).float().to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal block Walsh-Hadamard transform along the last dimension (fp32; its own inverse).

    x: [..., D] -> fp32 [..., D], blocks of :func:`block_size` (D) channels, Sylvester order."""
    d = x.shape[-1]
    b = block_size(d)
    y = x.float().reshape(-1, d // b, b)
    h = 1
    while h < b:
        y = y.view(y.shape[0], d // b, b // (2 * h), 2, h)
        y = torch.stack((y[:, :, :, 0] + y[:, :, :, 1], y[:, :, :, 0] - y[:, :, :, 1]), 3)
        h *= 2
    return (y.reshape(x.shape) * b ** -0.5).contiguous()


def matrix(head_dim: int, device: torch.device | str) -> torch.Tensor:
    """``M = diag(s) H``, fp32 [head_dim, head_dim], cached per (head_dim, device): ``rotate(v) = v @ M``."""
    key = (head_dim, str(torch.device(device)))
    if key not in _MATRICES:
        _MATRICES[key] = hadamard(torch.diag(signs(head_dim, "cpu"))).to(device)
    return _MATRICES[key]


def rotate(values: torch.Tensor) -> torch.Tensor:
    """Values as stored: ``H (s * v)``. values: [..., D] -> same shape and dtype."""
    return (values.float() @ matrix(values.shape[-1], values.device)).to(values.dtype)


def unrotate(out: torch.Tensor) -> torch.Tensor:
    """Attention outputs over rotated values, back to the model's basis: ``s * H o``. out: [..., D] -> fp32."""
    return out.float() @ matrix(out.shape[-1], out.device).T
