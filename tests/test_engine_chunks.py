"""Chunked prefill as scheduling in the serving engine (``Engine(prefill_chunk=N)``, issue #44 item 5)."""

import pytest
from test_engine import GREEDY, assert_pool_full, engine, prompts, reference, tiny

from diffkv import DiffKVConfig
from diffkv.engine import SamplingParams

EXACT = DiffKVConfig(high="K16V16", low="K16V16", alpha_high=0.0, alpha_low=0.0, recent_window=4, score_window=4,
                     smooth_keys=False)


@pytest.mark.parametrize("kind", ["fp16", "diffkv"])
def test_chunked_prompts_equal_generate_and_running_requests_keep_decoding(kind):
    """A 90-token prompt in chunks of 16 arrives while two requests decode: it takes six steps, the two keep getting
    a token every step, and every output is generate()'s (lossless settings)."""
    model = tiny()
    eng = engine(model, kind, config=EXACT if kind == "diffkv" else None, prefill_chunk=16)
    short = prompts(2, lo=8, hi=12)
    long = prompts(1, seed=5, lo=90, hi=91)[0]
    early = [eng.add_request(p, GREEDY) for p in short]
    eng.step()
    late = eng.add_request(long, SamplingParams(max_new_tokens=8, ignore_eos=True))
    counts = []
    while late.pending or not late.output_ids:
        eng.step()
        counts.append([len(r.output_ids) for r in early])
    assert len(counts) == 6 and eng.prefill_chunks == 5  # 16 in the first step's prefill, 5 chunk forwards
    assert all(b[i] == a[i] + 1 for a, b in zip(counts, counts[1:], strict=False) for i in range(2))
    eng.run()
    for r, p in zip([*early, late], [*short, long], strict=True):
        assert r.output_ids == reference(model, p, len(r.output_ids))
    assert_pool_full(eng)


def test_chunked_prefill_compresses_and_is_checked():
    model = tiny()
    eng = engine(model, "diffkv", config=DiffKVConfig(recent_window=4, score_window=4, alpha_high=3.0,
                                                       alpha_low=1.0), prefill_chunk=16)
    req = eng.add_request(prompts(1, seed=2, lo=80, hi=81)[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.run()
    assert len(req.output_ids) == 4 and req.kv_stats["tokens_per_tier"]["low"] > 0
    assert_pool_full(eng)
    with pytest.raises(ValueError, match="prefill_chunk"):
        engine(model, "diffkv", prefill_chunk=0)
