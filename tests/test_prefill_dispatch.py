"""The Triton path's prefill uses the Triton prefill-scores kernel (interpreter on CPU): same tiers and scores."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from diffkv import DiffKVConfig
from diffkv.integrations.transformers import DiffKVCache
from diffkv.memory import HIGH_COL, LOW_COL
from diffkv.ops import prefill_scores as prefill_ops

CFG = DiffKVConfig(recent_window=4, score_window=4, alpha_high=1.5, alpha_low=0.5)
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _prefill(backend):
    """A tiny random Llama's prefill of a left-padded batch (lengths 12 and 9) into a fresh cache."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = DiffKVCache(model, CFG, attention_backend=backend)
    with torch.no_grad():  # one new token: the prefill only
        model.generate(ids.masked_fill(mask == 0, 0), attention_mask=mask, max_new_tokens=1, do_sample=False,
                       past_key_values=cache, pad_token_id=0)
    return cache


def _state(cache):
    out = []
    for layer in cache.layers:
        c = layer.compressor
        n_hi, n_lo = c.counts()
        tiers = []
        for tier, n in ((HIGH_COL, n_hi), (LOW_COL, n_lo)):
            scores, pos, _ = c.kv.read_meta(tier, c.items, n, max(int(n.max()), 1))
            tiers.append((scores, pos))
        out.append((n_hi, n_lo, tiers))
    return out


def test_triton_prefill_same_tiers_and_scores_as_torch():
    got, want = _state(_prefill("triton")), _state(_prefill("torch"))
    assert len(got) == len(want) == 2
    for (gh, gl, gt), (wh, wl, wt) in zip(got, want, strict=True):
        assert torch.equal(gh, wh) and torch.equal(gl, wl)
        assert int(gl.sum()) > 0  # the split produced both tiers
        for (gs, gp), (ws, wp) in zip(gt, wt, strict=True):
            assert torch.equal(gp, wp)
            torch.testing.assert_close(gs, ws, atol=1e-4, rtol=0)


def test_prefill_dispatch(monkeypatch):
    calls = []
    launcher = prefill_ops.prefill_scores

    def counting(*args, **kw):
        calls.append(kw.get("backend"))
        return launcher(*args, **kw)

    monkeypatch.setattr(prefill_ops, "prefill_scores", counting)
    _prefill("torch")
    assert calls == []
    _prefill("triton")
    assert calls == ["triton"] * 2  # one call per layer
