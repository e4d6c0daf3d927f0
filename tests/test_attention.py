import pytest
import torch

from diffkv.core.attention import decode_attention_ref, decode_attention_tiers


def slow_attention(q, k, v, valid, scaling):
    b, hq, d = q.shape
    hkv = k.shape[1]
    out, probs = torch.zeros(b, hq, d, dtype=torch.float64), torch.zeros(b, hq, k.shape[2], dtype=torch.float64)
    for s in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            idx = valid[s, kv].nonzero()[:, 0]
            if idx.numel() == 0:
                continue
            p = torch.softmax((k[s, kv, idx].double() @ q[s, h].double()) * scaling, 0)
            out[s, h] = p @ v[s, kv, idx].double()
            probs[s, h, idx] = p
    return out, probs


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (7, 1)])
def test_reference_and_tiers_match_loop(hq, hkv):
    torch.manual_seed(hq)
    b, d = 3, 16
    q = torch.randn(b, hq, d)
    t1, t2 = 11, 5
    k1, v1 = torch.randn(b, hkv, t1, d), torch.randn(b, hkv, t1, d)
    k2, v2 = torch.randn(b, hkv, t2, d), torch.randn(b, hkv, t2, d)
    m1 = torch.rand(b, hkv, t1) < 0.7
    m2 = torch.rand(b, hkv, t2) < 0.5
    m1[0, 0] = False  # a head with no high tokens
    m2[1] = False  # an empty low tier
    k, v, m = torch.cat([k1, k2], 2), torch.cat([v1, v2], 2), torch.cat([m1, m2], 2)
    want_out, want_p = slow_attention(q, k, v, m, 0.25)
    out, p = decode_attention_ref(q, k, v.masked_fill(~m[..., None], float("nan")), m, 0.25)  # NaN at empty slots
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p.double(), want_p, rtol=1e-5, atol=1e-6)
    tiers = [(k1, v1 * m1[..., None], m1), (k2, v2 * m2[..., None], m2)]
    out2, p2 = decode_attention_tiers(q, tiers, 0.25)
    torch.testing.assert_close(out2.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p2.double(), want_p, rtol=1e-5, atol=1e-6)
