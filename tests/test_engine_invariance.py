"""Batch-invariant engine mode: a request's tokens and cache do not depend on the other requests of its steps."""

import pytest
import torch
from torch import nn

from diffkv import DiffKVConfig
from diffkv.engine import Engine, SamplingParams, make_cache
from diffkv.engine import engine as engine_module
from diffkv.engine import prefill as prefill_module
from diffkv.engine.invariance import blocked_linear, invariant_rows, rows_are_invariant
from diffkv.engine.sampling import next_tokens
from diffkv.ops.row_blocks import padded_rows
from tests.test_engine import CharTokenizer, prompts, tiny

LOW_BITS = DiffKVConfig(high="K4V2", low="K4V1", alpha_high=1.0, alpha_low=0.3, recent_window=4, score_window=4)


def test_blocked_rows_equal_the_rows_of_a_large_blocked_product():
    torch.manual_seed(0)
    layer = nn.Linear(96, 160)
    x = torch.randn(3, 3, 96)  # 9 rows: computed as one block
    others = torch.randn(55, 96)
    with torch.inference_mode():
        big = blocked_linear(torch.cat([x.reshape(9, 96), others]), layer.weight, layer.bias)[:9]
        shifted = blocked_linear(torch.cat([others[:5], x.reshape(9, 96)]), layer.weight, layer.bias)[5:]
        with invariant_rows(layer):
            out = layer(x)
            alone = [layer(x.reshape(9, 96)[i]) for i in range(9)]  # 1-D input: one row
            pairs = [layer(x.reshape(9, 96)[i:i + 2]) for i in range(8)]
    assert out.shape == (3, 3, 160)
    assert torch.equal(out.reshape(9, 160), big) and torch.equal(shifted, big)  # neither neighbours nor position
    assert all(torch.equal(p, big[i:i + 2]) for i, p in enumerate(pairs))
    assert all(torch.equal(a, big[i]) for i, a in enumerate(alone))
    assert torch.allclose(big, nn.functional.linear(x.reshape(9, 96), layer.weight, layer.bias), atol=1e-5)
    assert "forward" not in layer.__dict__  # the class's forward again
    assert rows_are_invariant(layer)
    assert [padded_rows(n) for n in (0, 1, 15, 16, 17, 100)] == [0, 16, 16, 16, 32, 112]


def test_linear_subclasses_with_their_own_forward_are_refused():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(4, 4), Scaled(4, 4))
    assert not rows_are_invariant(model)
    with pytest.raises(ValueError, match="Scaled"), invariant_rows(model):
        pass


def test_the_forward_is_restored_when_it_raises():
    layer = nn.Linear(4, 4)
    with pytest.raises(RuntimeError), invariant_rows(layer):
        layer(torch.randn(2, 5))  # wrong width
    assert "forward" not in layer.__dict__


def run(model, kind, config, reqs, n_running, invariant, monkeypatch):
    """Per prompt: its tokens, its tier counts and the logits every step sampled it from."""
    logits: dict[int, list[torch.Tensor]] = {}

    def record(rows, batch):  # the engine's sampler, recording each request's logits row
        for req, row in zip(batch, rows, strict=True):
            logits.setdefault(id(req), []).append(row.clone())
        return next_tokens(rows, batch)

    monkeypatch.setattr(engine_module, "next_tokens", record)
    monkeypatch.setattr(prefill_module, "next_tokens", record)
    cache = make_cache(kind, model, kv_budget_bytes=1 << 22, raw_dtype="float32", config=config, max_slots=8,
                       max_model_len=128)
    eng = Engine(model, CharTokenizer(), cache, max_running=n_running, batch_invariant=invariant)
    done = eng.generate(reqs, SamplingParams(max_new_tokens=24, ignore_eos=True))
    return [(r.output_ids, r.kv_stats["tokens_per_tier"], torch.stack(logits[id(r)])) for r in done]


@pytest.mark.parametrize("kind,config", [("fp16", None), ("diffkv", LOW_BITS)])
def test_same_bits_alone_and_together(kind, config, monkeypatch):
    model = tiny("qwen")
    reqs = prompts(7, seed=3, lo=3, hi=30)
    alone = [run(model, kind, config, [p], 1, True, monkeypatch)[0] for p in reqs]
    together = run(model, kind, config, reqs, 7, True, monkeypatch)
    for (tokens, tiers, logits), (tokens1, tiers1, logits1) in zip(together, alone, strict=True):
        assert tokens == tokens1 and tiers == tiers1
        assert torch.equal(logits, logits1)  # every step's logits, to the last bit


def test_without_the_mode_the_bits_depend_on_the_batch(monkeypatch):
    """The reason for the mode (on MKL): the same requests, alone and together, get different logits bits."""
    if rows_are_invariant(tiny("qwen"), blocked=False):
        pytest.skip("this machine's GEMMs are batch-invariant without padding")
    model = tiny("qwen")
    reqs = prompts(7, seed=3, lo=3, hi=30)
    alone = [run(model, "fp16", None, [p], 1, False, monkeypatch)[0] for p in reqs]
    together = run(model, "fp16", None, reqs, 7, False, monkeypatch)
    assert any(not torch.equal(a[2], b[2]) for a, b in zip(alone, together, strict=True))


@pytest.mark.parametrize("kind,config", [("fp16", None), ("diffkv", LOW_BITS)])
def test_no_request_sees_another_s_content(kind, config, monkeypatch):
    """Isolation (#62 item 4b), without the mode: with the same lengths beside it, a request's tokens, tiers and
    every logits bit do not change when the other requests' tokens do (bits may follow the row count, never the
    rows' content)."""
    model = tiny("qwen")
    reqs = prompts(5, seed=3, lo=3, hi=30)
    g = torch.Generator().manual_seed(9)
    others = [reqs[0]] + [torch.randint(3, 90, (len(p),), generator=g).tolist() for p in reqs[1:]]
    assert all(a != b for a, b in zip(reqs[1:], others[1:], strict=True))
    first = run(model, kind, config, reqs, 5, False, monkeypatch)[0]
    again = run(model, kind, config, others, 5, False, monkeypatch)[0]
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])
