"""Triton prefill scores (interpreter on CPU) vs the torch reference ``diffkv.core.policy.prefill_scores``."""

import pytest
import torch

from diffkv.core.policy import prefill_scores as prefill_scores_ref
from diffkv.ops.prefill_scores import SHARED_LIMIT, launch_settings, prefill_scores, shared_bytes


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


def test_head_dim_256_fp32_launcher_tiles():
    """fp32 inputs at head_dim 256 with the launcher's own tiles (BLOCK_W 64, as in ``test_gpu_long_prompt[256-7]``):
    the shape whose shared memory tests/test_compile_sm90.py checks for sm_90a."""
    _check(1, 1, 2, 40, 256, 64, pad=[3])


@pytest.mark.gpu
@pytest.mark.parametrize("d,g", [(64, 3), (128, 4), (256, 7)])
def test_gpu_long_prompt(d, g):
    _check(2, 2, g, 3001, d, 64, pad=[0, 1234], device="cuda")


def test_launch_settings_fit_sm90_shared_memory():
    """Triton's default 3 stages wherever they fit in 227 KiB; fp32 at head_dim 256 gives row_stats 2 (3: 256 KiB)."""
    for d in (64, 128, 256):
        for elem in (2, 4):
            cfg = launch_settings(64, d, elem)
            for kernel, stages in (("row_stats", cfg["row_stages"]), ("column_scores", cfg["column_stages"])):
                assert shared_bytes(kernel, 64, cfg["BLOCK_L"], d, elem, stages) <= SHARED_LIMIT
                assert stages == (2 if (kernel, d, elem) == ("row_stats", 256, 4) else 3)
