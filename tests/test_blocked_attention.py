"""``blocked_attention``: causal attention whose rows' bits do not depend on the rows computed with them (the
prompt's attention under ``chunked_prefill="deferred"``, issue #62 item 4)."""

import pytest
import torch

from diffkv.ops.row_blocks import blocked_attention

SDPA = torch.nn.functional.scaled_dot_product_attention


@pytest.mark.parametrize("q_heads,kv_heads,d", [(6, 2, 32), (4, 4, 24)])
def test_rows_keep_their_bits_whatever_follows_or_precedes_them(q_heads, kv_heads, d):
    g = torch.Generator().manual_seed(q_heads + d)
    n, extra = 53, 11  # a prompt, then drafts sent with it
    q, k, v = (torch.randn(2, h, n + extra, d, generator=g) for h in (q_heads, kv_heads, kv_heads))
    scale = d ** -0.5
    alone = blocked_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], None, scale)
    with_drafts = blocked_attention(q, k, v, None, scale)
    assert torch.equal(with_drafts[:, :n], alone)
    cut = 21  # the same prompt in two calls, the second over the keys of both
    chunks = torch.cat([blocked_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], None, scale),
                        blocked_attention(q[:, :, cut:n], k[:, :, :n], v[:, :, :n], None, scale)], 1)
    assert torch.equal(chunks, alone)
    want = SDPA(q, k, v, is_causal=True, scale=scale, enable_gqa=q_heads != kv_heads).transpose(1, 2)
    torch.testing.assert_close(with_drafts, want, rtol=1e-5, atol=1e-6)


def test_left_padding_mask_and_all_padding_rows():
    """A bool mask (left padding of the second row): its rows follow it; rows that may attend to nothing stay finite."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 20, 16, generator=g) for _ in range(3))
    allowed = torch.ones(20, 20).tril().bool().expand(2, 1, 20, 20).clone()
    allowed[1, :, :, :5] = False  # 5 padding columns
    out = blocked_attention(q, k, v, allowed, 0.25)
    assert torch.isfinite(out).all()
    want = SDPA(q[1:, :, 5:], k[1:, :, 5:], v[1:, :, 5:], is_causal=True, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out[1:, 5:], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[:1], SDPA(q[:1], k[:1], v[:1], is_causal=True, scale=0.25).transpose(1, 2),
                               rtol=1e-5, atol=1e-6)
