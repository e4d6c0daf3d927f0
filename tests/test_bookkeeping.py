"""Compact metadata (DiffKVConfig.compact_meta): fp16 mean scores and positions mod 2^16, against the paper's fields."""

import dataclasses

import pytest
import torch
from test_cache_hf import EXACT, generate, left_padded_batch, tiny
from test_engine import CharTokenizer, assert_pool_full, engine, prompts, staggered_equals_generate
from test_engine import tiny as tiny_engine_model
from transformers import DynamicCache

from diffkv import DiffKVConfig
from diffkv.cache.paged_kv import PagedKV
from diffkv.core import bookkeeping
from diffkv.core.layout import bytes_per_token, plan_for_config
from diffkv.core.tiers import TierSpec
from diffkv.engine import SamplingParams, make_cache
from diffkv.integrations.transformers import DiffKVCache
from diffkv.memory import HIGH_COL, LOW_COL, HeadTables, PagePool, allocate, trim

AGGRESSIVE = dict(alpha_high=4.0, alpha_low=1.0, recent_window=4, score_window=4, smooth_keys=False)


def peaked_tiny():
    """The tiny qwen2 model with queries scaled up: peaked attention, so that tokens get pruned and demoted."""
    model = tiny("qwen2")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
    return model


def test_positions_wrap_and_ages_stay_exact():
    pos = torch.tensor([-70000, -64, -1, 0, 1, 32767, 32768, 65535, 65536, 100000, 1 << 40])
    stored = bookkeeping.encode_positions(pos, True)
    assert stored.dtype == torch.int16
    for position in (pos.max().item(), pos.max().item() + 65535):
        age = bookkeeping.ages(torch.tensor(position), stored, True)
        true = position - pos
        ok = true < 65536
        assert torch.equal(age[ok], true[ok]) and ok.sum() >= 1
        assert torch.equal(bookkeeping.full_positions(torch.tensor(position), stored, True)[ok], pos[ok])
    assert torch.equal(bookkeeping.encode_positions(stored, True), stored)  # re-encoding stored values: unchanged
    assert torch.equal(bookkeeping.encode_positions(pos, False), pos.to(torch.int32))


def _run(gain: torch.Tensor, lag: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(compact mean, fp16 running sum) after feeding gain [steps, tokens] to tokens written at position 0."""
    mean = torch.zeros(gain.shape[1], dtype=torch.float16)
    fp16_sum = torch.zeros(gain.shape[1], dtype=torch.float16)
    for age in range(gain.shape[0]):  # age before the step
        if age == lag:
            mean.zero_()
        mean = bookkeeping.updated(mean, gain[age].float(), torch.full((gain.shape[1],), age), lag, True)
        fp16_sum = fp16_sum + gain[age].half()
    return mean.double(), fp16_sum.double()


@pytest.mark.parametrize("lag", [0, 16])
def test_fp16_mean_tracks_the_exact_mean(lag):
    """3000 steps of noisy attention: each step rounds the mean once, so the error is a random walk of fp16 ulps
    (measured: 2.0 % at most, 0.6 % on average). A burst followed by 2900 steps of small attention: an fp16 *sum*
    stops growing at once (its increments fall below half its ulp: measured 30 % low; the reason scores are
    means); the mean follows the decline until its own update falls below half an ulp (~2000 steps), then stays
    high (measured: 15 %), the conservative side: a fading token keeps its precision longer."""
    gen = torch.Generator().manual_seed(0)
    gain = torch.rand(3000, 64, generator=gen, dtype=torch.float64) * 2e-3  # [steps, tokens]
    gain[:, :8] *= 200  # a few heavy hitters
    mean, _ = _run(gain, lag)
    torch.testing.assert_close(mean, gain[lag:].sum(0) / (3000 - lag), rtol=0.03, atol=0)
    burst = torch.full((3000, 4), 3e-3, dtype=torch.float64)
    burst[:100] = 0.2
    mean, fp16_sum = _run(burst, 0)
    assert ((mean / burst.mean(0)) - 1).abs().max() < 0.2 and (mean >= burst.mean(0)).all()
    assert (1 - fp16_sum / burst.sum(0)).min() > 0.25


def test_layout_saves_four_bytes_per_token_and_head():
    for name in ("K8V4", "K4V2", "K16V16", "K4V2-g32/16"):
        for d in (64, 128, 256):
            tier = TierSpec.parse(name)
            assert bytes_per_token(tier, d, compact=True) == bytes_per_token(tier, d) - 4
    cfg = DiffKVConfig(compact_meta=True)
    for lay in plan_for_config(cfg, 64).tiers:
        assert lay.compact and (lay.score_bytes, lay.pos_bytes) == (2, 2)
        assert lay.pos_offset == lay.score_offset + 2 * lay.tokens_per_page and lay.end <= lay.page_bytes


def test_paged_kv_round_trip_and_mean_update():
    cfg = DiffKVConfig(compact_meta=True, smooth_keys=False)
    d = 64
    plan = plan_for_config(cfg, d)
    pool = PagePool(plan.page_bytes, 64)
    tables = HeadTables.for_config(cfg, plan, 1, 1, 2, 256)
    kv = PagedKV(pool, tables, plan, cfg)
    hs = tables.select([tables.acquire_slot()], layers=[0])
    allocate(pool, tables, hs, [120])
    n = torch.tensor([70, 50])
    tables.tokens_flat[hs.items] = torch.stack([n, torch.zeros(2, dtype=torch.long)], 1).int()
    rows = torch.arange(2).repeat_interleave(n)
    idx = torch.cat([torch.arange(int(c)) for c in n])
    position = 70000  # beyond int16 and uint16: positions come back through the modulo
    pos = position - 1 - torch.randint(0, 3000, (len(idx),))
    means = torch.rand(len(idx)) * 0.01
    kv.write(HIGH_COL, hs.items[rows], idx, torch.randn(len(idx), d), torch.randn(len(idx), d), means, pos,
             before_trim=True, validate=True)
    trim(pool, tables, hs)
    at = torch.full((2,), position)
    s, p, valid = kv.read_meta(HIGH_COL, hs.items, n, int(n.max()), at)
    assert torch.equal(s[rows, idx], means.half().float()) and torch.equal(p[rows, idx], pos)
    with pytest.raises(ValueError, match="position"):
        kv.read_meta(HIGH_COL, hs.items, n, int(n.max()))
    gain = torch.rand(2, int(n.max()))
    kv.add_scores(HIGH_COL, hs.items, n, gain, position=at)
    want = bookkeeping.updated(means.half(), gain[rows, idx], position - pos, 0, True)
    assert torch.equal(kv.read_meta(HIGH_COL, hs.items, n, int(n.max()), at)[0][rows, idx], want.float())
    _, _, _, low_pos, _ = kv.read(LOW_COL, hs.items, torch.zeros(2, dtype=torch.long), 1)  # an empty tier reads fine
    assert low_pos.dtype == torch.int16


BACKENDS = ["torch", "cpu"]  # the compiled step is required (conftest)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_exact_config_equals_dynamic_cache(backend):
    model = tiny("llama")
    ids, mask = left_padded_batch()
    want = generate(model, DynamicCache(config=model.config), ids, mask, 30)
    cache = DiffKVCache(model, dataclasses.replace(EXACT, compact_meta=True), attention_backend=backend)
    assert torch.equal(generate(model, cache, ids, mask, 30), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_prunes_like_the_paper_fields_with_fewer_bytes(backend):
    model = peaked_tiny()
    ids, mask = left_padded_batch()
    stats = {}
    for compact in (False, True):
        cache = DiffKVCache(model, DiffKVConfig(compact_meta=compact, **AGGRESSIVE), attention_backend=backend)
        generate(model, cache, ids, mask, 40)
        stats[compact] = cache.stats()
    tiers = {c: s["tokens_per_tier"] for c, s in stats.items()}
    total = sum(tiers[False].values())
    assert sum(tiers[True].values()) == total and tiers[False]["pruned"] > 0 and tiers[False]["low"] > 0
    for t in ("high", "low", "pruned"):  # the same rule up to fp16 rounding of the means: near-ties may flip
        assert abs(tiers[True][t] - tiers[False][t]) <= 0.05 * total, (t, tiers)
    assert stats[True]["bytes_in_pages"] < stats[False]["bytes_in_pages"]


def test_triton_backend_generates_like_the_reference():
    """Compact fields and scale-only keys through the Triton kernels (interpreter): the torch path's tokens and
    tiers."""
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(12, 9), total=12)
    cfg = DiffKVConfig(compact_meta=True, symmetric_keys=True, **AGGRESSIVE)
    ref = DiffKVCache(model, cfg, attention_backend="torch")
    want = generate(model, ref, ids, mask, 4)
    cache = DiffKVCache(model, cfg, attention_backend="triton")
    assert torch.equal(generate(model, cache, ids, mask, 4), want)
    assert cache.layers[0].compressor.backend == "triton"
    assert cache.stats()["tokens_per_tier"] == ref.stats()["tokens_per_tier"]


@pytest.mark.gpu
def test_triton_backend_generates_like_the_reference_on_cuda():
    """The same check on a GPU: Triton kernels on CUDA vs the torch reference on CUDA."""
    model = tiny("llama").cuda()
    ids, mask = (t.cuda() for t in left_padded_batch(lengths=(12, 9), total=12))
    cfg = DiffKVConfig(compact_meta=True, symmetric_keys=True, **AGGRESSIVE)
    ref = DiffKVCache(model, cfg, attention_backend="torch")
    want = generate(model, ref, ids, mask, 8)
    cache = DiffKVCache(model, cfg, attention_backend="triton")
    assert torch.equal(generate(model, cache, ids, mask, 8), want)
    assert cache.stats()["tokens_per_tier"] == ref.stats()["tokens_per_tier"]


def test_long_sequences_are_refused_clearly(monkeypatch):
    model = tiny("llama")
    monkeypatch.setattr(bookkeeping, "COMPACT_MAX_TOKENS", 30)
    ids, mask = left_padded_batch()
    cache = DiffKVCache(model, DiffKVConfig(compact_meta=True, **AGGRESSIVE), attention_backend="torch")
    with pytest.raises(ValueError, match="longer than compact metadata allows"):
        generate(model, cache, ids, mask, 20)


def test_engine_serves_compact_pages_exactly_and_with_fewer_bytes():
    """The serving engine on compact pages: K16 with nothing pruned equals generate(); compressing, the same work
    holds fewer bytes than with the paper's fields, and every page comes back."""
    model = tiny_engine_model(head_dim=64)
    exact = DiffKVConfig(high="K16V16", low="K16V16", alpha_high=0.0, alpha_low=0.0, recent_window=4,
                         score_window=4, smooth_keys=False, compact_meta=True)
    cache = make_cache("diffkv", model, kv_budget_bytes=4 << 20, raw_dtype="float32", config=exact,
                       max_slots=4, max_model_len=128)
    assert_pool_full(staggered_equals_generate(model, CharTokenizer(), cache, prompts(3), 10))
    held = {}
    for lean in (False, True):
        cfg = DiffKVConfig(alpha_high=1.0, alpha_low=0.05, recent_window=4, score_window=4, compact_meta=lean,
                           symmetric_keys=lean)
        eng = engine(model, kind="diffkv", config=cfg)
        for p in prompts(4, lo=80, hi=110):
            eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True))
        for _ in range(6):
            eng.step()
        held[lean] = eng.metrics()["compression_physical"]
        eng.run()
        assert_pool_full(eng)
    assert held[True] > held[False] > 1.5
