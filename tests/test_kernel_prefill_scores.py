"""Triton prefill scores (interpreter on CPU) vs the torch reference ``diffkv.core.policy.prefill_scores``."""

import pytest
import torch

from diffkv.core.policy import prefill_scores as prefill_scores_ref
from diffkv.ops.prefill_scores import prefill_scores


def _check(b, hkv, g, length, d, window, pad=None, dtype=torch.float32, block_l=None, device="cpu"):
    torch.manual_seed(length + g)
    q = torch.randn(b, hkv * g, length, d, device=device).to(dtype)
    k = torch.randn(b, hkv, length, d, device=device).to(dtype)
    valid = None
    if pad is not None:
        valid = torch.arange(length, device=device)[None, :] >= torch.tensor(pad, device=device)[:, None]
    got = prefill_scores(q, k, valid, d ** -0.5, window, backend="triton", block_l=block_l)
    want = prefill_scores_ref(q, k, valid, d ** -0.5, window)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("g", [1, 3])
def test_window_shorter_than_prompt(g):
    _check(1, 2, g, 37, 64, 16, block_l=16)


def test_left_padding_gqa7_window_longer_than_prompt():
    """Ragged batch (left padding, one prompt of a single token) and W > L."""
    _check(2, 1, 7, 19, 64, 32, pad=[0, 18], block_l=16)


def test_head_dim_256_half_inputs():
    _check(1, 1, 2, 20, 256, 16, dtype=torch.bfloat16, block_l=16)


@pytest.mark.gpu
@pytest.mark.parametrize("d,g", [(64, 3), (128, 4), (256, 7)])
def test_gpu_long_prompt(d, g):
    _check(2, 2, g, 3001, d, 64, pad=[0, 1234], device="cuda")
