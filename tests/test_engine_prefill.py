"""Batched prefill in the engine: same tokens and same stored KV as one request per forward, token budget, fallback.

Each test counts the model's forward calls (a hook on the top-level module), so batching that silently fell back
to one forward per request fails."""

import math

import pytest
import torch
from test_engine import GREEDY, CharTokenizer, assert_pool_full, engine, prompts, reference, tiny

from diffkv import DiffKVConfig
from diffkv.engine import SamplingParams
from diffkv.engine.request import Request
from diffkv.engine.scheduler import Scheduler
from diffkv.engine.step_cache import left_pad, pad_groups

DKV = DiffKVConfig(high="K8V4", low="K4V2", alpha_high=1.0, alpha_low=0.05, recent_window=4, score_window=4)
ODD = [prompts(1, seed=2)[0], [7], [9, 10], [11] * 5, [12] * 5]  # 1- and 2-token prompts, two of the same length


def counted(eng):
    """Count the model's forward calls on ``eng.calls``; prefill forwards = calls - decode steps."""
    eng.calls = 0

    def hook(*_):
        eng.calls += 1

    eng.model.register_forward_pre_hook(hook)
    return eng


def make(kind, **kw):
    if kind == "fp16":
        model = tiny()
        return model, counted_engine(model, "fp16", **kw)
    model = tiny(head_dim=64)  # real head sizes, where the tiers split
    return model, counted_engine(model, "diffkv", config=DKV, **kw)


def counted_engine(model, kind, **kw):
    return counted(engine(model, kind, **kw))


def prefill_calls(eng):
    return eng.calls - eng.counters.decode_steps


def stored(eng, slot):
    """Everything a slot holds, layer by layer: per item (n_high, n_low) and per tier in use (tier, keys, values,
    scores, positions) of its stored tokens."""
    kv, out = eng.cache.kv, []
    for layer in range(eng.cache.num_layers):
        items = kv.tables.select([slot], layers=[layer]).items
        counts = kv.tables.tokens_flat[items].long()
        tiers = []
        for tier in (0, 1):
            n = counts[:, tier]
            if int(n.max()) > 0:
                k, v, s, p, valid = kv.read(tier, items, n, int(n.max()))
                tiers.append((tier, k[valid], v[valid], s[valid], p[valid]))
        out.append((counts, tiers))
    return out


@pytest.mark.parametrize("kind", ["fp16", "diffkv"])
def test_batched_prefill_equals_one_at_a_time(kind):
    """Same-step arrivals of odd lengths, then staggered ones: same greedy tokens, fewer forwards (batched: the
    later arrivals ride in the decode forward, issue #61: one forward per step)."""
    runs, late = {}, [*prompts(2, seed=9, lo=2, hi=30), [5, 6, 7]]
    for mode in ("batched", "single"):
        model, eng = make(kind, prefill=mode)
        reqs = [eng.add_request(p, GREEDY) for p in ODD]  # five arrive in one step
        eng.step()
        assert prefill_calls(eng) == (1 if mode == "batched" else len(ODD))
        eng.step()
        reqs.append(eng.add_request(late[0], GREEDY))  # then one while the others decode
        eng.step()
        eng.step()
        reqs += [eng.add_request(p, GREEDY) for p in late[1:]]  # then two more: the engine's 8 slots are full
        eng.run()
        assert eng.counters.prefill_forwards == prefill_calls(eng) == (1 if mode == "batched" else len(reqs))
        assert eng.counters.mixed_prefills == (2 if mode == "batched" else 0)
        if mode == "batched":
            assert eng.calls == eng.steps  # one model forward per engine step
        assert eng.counters.prefill_fallbacks == 0 and all(r.finish_reason == "length" for r in reqs)
        runs[mode] = [r.output_ids for r in reqs]
        assert_pool_full(eng)
    assert runs["batched"] == runs["single"]
    if kind == "fp16":
        for out, p in zip(runs["batched"], [*ODD, *late], strict=True):
            assert out == reference(model, p, 20)


def _within_one_code_step(got, want, bits):
    """Dequantized rows [N, D] (one group per row) of the same tokens quantized from projections that differ in the
    last bits: a code may move by one step and the fp16 scale and zero by an ulp, nothing more. A row's min and max
    sit on codes 0 and 2^bits - 1, so its step is its range / (2^bits - 1); an ulp of the fp16 zero moves the row by
    at most 2^-10 of its magnitude m, one of the scale by 2^-10 of its range (<= 2 m). Returns how many rows differ
    at all (beyond fp32 rounding)."""
    step = (want.amax(-1, keepdim=True) - want.amin(-1, keepdim=True)) / (2 ** bits - 1)
    meta = 3 * 2.0 ** -10 * want.abs().amax(-1, keepdim=True)
    diff = (got - want).abs()
    assert (diff <= step + meta + 1e-6).all(), f"{bits}-bit rows moved by more than a code step: {diff.max()}"
    return int((diff > 1e-6).any(-1).sum())


@pytest.mark.parametrize("kind", ["fp16", "diffkv"])
def test_batched_prefill_stores_what_a_prefill_alone_stores(kind):
    """Every slot holds the same tiers, tokens, scores and positions after one batched forward as after its own."""
    states = {}
    for mode in ("batched", "single"):
        _, eng = make(kind, prefill=mode)
        ps = [*ODD, *prompts(2, seed=8, lo=60, hi=100)]  # long ones too: the diffkv tiers split
        reqs = [eng.add_request(p, SamplingParams(max_new_tokens=2, ignore_eos=True)) for p in ps]
        eng.step()  # the prefill only: fresh requests decode from the next step
        assert prefill_calls(eng) == (1 if mode == "batched" else len(ps))
        states[mode] = [stored(eng, r.slot) for r in reqs]
    tiers_used, rows, moved = set(), 0, 0
    for batched, single in zip(states["batched"], states["single"], strict=True):
        for (counts_b, tiers_b), (counts_s, tiers_s) in zip(batched, single, strict=True):
            assert torch.equal(counts_b, counts_s)
            tiers_used.add((counts_b > 0).sum(0).gt(0).sum().item())
            for (tier, *got), (tier_s, *want) in zip(tiers_b, tiers_s, strict=True):
                assert tier == tier_s
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    if i >= 2:  # scores (fp32 sums of the same softmax rows) and positions: exact up to fp32 rounding
                        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
                    elif kind == "fp16":
                        # raw fp32 storage (K16V16, raw_dtype float32): the stored K/V are the model's projections
                        # as computed; the padded batch's matmuls round differently in the last bits only (measured:
                        # 1.5e-7 at |x| ~ 1 over 2 layers of hidden size 64), so fp32's default tolerance
                        torch.testing.assert_close(g, w, rtol=1.3e-6, atol=1e-5)
                    else:
                        spec = DKV.tiers[tier].key if i == 0 else DKV.tiers[tier].value
                        assert spec.group_size is None  # one (scale, zero) per row
                        rows += len(w)
                        moved += _within_one_code_step(g, w, spec.bits)
    if kind == "diffkv":
        assert 2 in tiers_used, "the config was meant to use both tiers"
        assert moved <= rows // 10, f"{moved} of {rows} stored rows differ: more than last-bit noise"


def test_token_budget_splits_the_prefill_over_steps():
    model = tiny()
    ps = [list(range(3, 3 + n)) for n in (10, 12, 7, 30, 5, 6)]
    eng = counted_engine(model, "fp16", max_prefill_tokens=30)
    reqs = [eng.add_request(p, GREEDY) for p in ps]
    batches = []
    while eng.has_work():
        before = eng.counters.prefilled_tokens
        eng.step()
        if eng.counters.prefilled_tokens > before:
            batches.append(eng.counters.prefilled_tokens - before)
    # FCFS within 30 tokens a step: 10+12+7, then the 30-token prompt alone, then 5+6
    assert batches == [29, 30, 11] and eng.counters.prefill_forwards == prefill_calls(eng) == 1
    assert eng.counters.mixed_prefills == 2  # the later two rode in the decode forward
    for r, p in zip(reqs, ps, strict=True):
        assert r.output_ids == reference(model, p, 20)
    long = eng.add_request(list(range(3, 50)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    eng.run()  # longer than the budget: prefilled alone, never stuck
    assert long.finish_reason == "length"
    assert_pool_full(eng)


def test_a_pool_too_small_for_the_batch_falls_back_to_one_at_a_time():
    model = tiny()
    ps = prompts(6, seed=4, lo=20, hi=30)
    eng = counted_engine(model, "fp16", pages=4 * 2 * 2 * 3, reserve=None)
    eng.cache.admission_pages = lambda n, c: 0  # an estimate that is always too optimistic: all six admitted
    reqs = [eng.add_request(p, GREEDY) for p in ps]
    eng.step()
    assert eng.counters.prefill_fallbacks == 1, "the batch was meant to run out of pages midway"
    prefilled = [r for r in reqs if r.slot is not None]
    failed = [r for r in reqs if r in eng.scheduler.worst_case]
    assert prefilled == reqs[:len(prefilled)] and failed == [reqs[len(prefilled)]]
    assert list(eng.scheduler.waiting) == reqs[len(prefilled):], "the rest goes back to the front, in order"
    assert prefill_calls(eng) == 1 + len(prefilled) + 1  # the batch, each that fit, the one that did not
    pool = eng.cache.kv.pool
    pool.check_invariants(eng.cache.kv.tables)  # no page of the failed batch is leaked or owned twice
    eng.run()
    for r, p in zip(reqs, ps, strict=True):
        assert r.finish_reason == "length" and r.output_ids == reference(model, p, 20)
    assert_pool_full(eng)


def test_a_prompt_that_fails_its_prefill_fails_alone_in_a_batch():
    model = tiny()
    good = prompts(3, seed=6, lo=5, hi=20)
    want = [reference(model, p, 20) for p in good]
    bad = min(set(range(3, 96)) - {t for seq in (*good, *want) for t in seq})  # in no good prompt or output
    with torch.no_grad():
        model.model.embed_tokens.weight[bad] = float("nan")  # this token gives NaN keys
    eng = counted_engine(model, "fp16")
    reqs = [eng.add_request(p, GREEDY) for p in (good[0], [4, bad, 6], *good[1:])]
    eng.run()
    assert eng.counters.prefill_fallbacks == 1 and reqs[1].finish_reason == "error" and "NaN" in reqs[1].error
    assert [r.output_ids for r in (reqs[0], *reqs[2:])] == want
    assert_pool_full(eng)


def test_batched_prefill_recomputes_preempted_requests():
    """Preempted requests come back through a batched prefill of prompt + generated tokens, and nothing changes."""
    model = tiny()
    ps = prompts(8, seed=3, lo=10, hi=30)
    eng = counted_engine(model, "fp16", pages=4 * 2 * 2 * 3, reserve=None)
    reqs = eng.generate(ps, GREEDY)
    assert eng.counters.preemptions > 0 and eng.counters.recomputed_tokens > 0
    assert eng.counters.prefill_forwards == prefill_calls(eng) < len(ps) + eng.counters.preemptions
    for r, p in zip(reqs, ps, strict=True):
        assert r.output_ids == reference(model, p, 20)
    assert_pool_full(eng)


def test_admission_counts_the_pages_of_the_batch_and_the_token_budget():
    class PagePerToken:
        num_pages, max_slots, max_model_len = 100, 8, 1000

        def free_pages(self):
            return self.num_pages

        def admission_pages(self, n, compression):
            return n

        def decode_pages(self, requests, ratio=1.0):
            return math.ceil(sum(a for _, a in requests) * ratio)

    sched = Scheduler(PagePerToken(), watermark=0.0, reserve=None)
    reqs = [Request(list(range(n)), SamplingParams(max_new_tokens=1)) for n in (40, 40, 30, 10)]
    sched.waiting.extend(reqs)
    assert sched.admit() == reqs[:2], "40 + 40 pages fit the 100 free, 30 more do not (nothing allocated yet)"
    sched.running.clear()
    assert sched.admit(max_tokens=35) == [reqs[2]], "the first is admitted whatever its length, then the budget"
    assert sched.admit(max_tokens=5) == [reqs[3]]


def test_pad_groups_and_left_pad():
    assert pad_groups([5]) == [[0]]
    assert pad_groups([10, 9, 100, 8]) == [[2, 0], [1, 3]]  # 2 x 100 <= 2 x 110; then 9, 8
    for lengths in ([1, 1, 1], [3, 100, 50, 49, 2, 7], [64] * 5):
        groups = pad_groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert len(g) * max(lengths[i] for i in g) <= 2 * sum(lengths[i] for i in g)
    x = torch.arange(1, 8, dtype=torch.float32).view(1, 1, 7, 1)  # segments [1, 2, 3], [4], [5, 6, 7]
    padded = left_pad(x, [0, 3, 4], [3, 1, 3])[:, 0, :, 0]
    assert padded.tolist() == [[1, 2, 3], [0, 0, 4], [5, 6, 7]]
    assert left_pad(x, [0, 3, 4], [3, 1, 3], last=2)[:, 0, :, 0].tolist() == [[0, 2, 3], [0, 0, 4], [0, 6, 7]]


def test_engine_options_are_checked():
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        engine(tiny(), max_prefill_tokens=0)
    with pytest.raises(ValueError, match="prefill"):
        engine(tiny(), prefill="chunked")


def test_serve_side_by_side_compares_prefill_modes():
    from diffkv.bench.serve import serve_side_by_side
    from diffkv.engine import make_cache

    model = tiny()
    caches = [make_cache("fp16", model, kv_budget_bytes=1 << 20, max_slots=4, max_model_len=128)
              for _ in range(2)]
    ps = prompts(6, lo=5, hi=30)
    res = serve_side_by_side(model, CharTokenizer(), caches, ps, 5, 4, progress=False,
                             options=[{"prefill": "batched"}, {"prefill": "single"}],
                             labels=["fp16:batched", "fp16:single"])
    batched, single = res["fp16:batched"], res["fp16:single"]
    assert batched["generated_tokens"] == single["generated_tokens"] == 30
    assert batched["prefilled_tokens"] == single["prefilled_tokens"]
    assert batched["prefill_forwards"] < single["prefill_forwards"] == 6


@pytest.mark.parametrize("kind", ["fp16", "diffkv"])
def test_a_prompt_that_fails_in_the_decode_forward_fails_alone(kind):
    """Prompts admitted while others decode ride in the decode forward with their stores run after it (issue #61):
    a prompt whose keys are NaN fails alone, the one admitted beside it is prefilled again on its own, and the
    running requests never notice."""
    model = tiny() if kind == "fp16" else tiny(head_dim=64)
    good = prompts(3, seed=6, lo=5, hi=20)
    want = [reference(model, p, 20) for p in good]
    bad = min(set(range(3, 96)) - {t for seq in (*good, *want) for t in seq})  # in no good prompt or output
    with torch.no_grad():
        model.model.embed_tokens.weight[bad] = float("nan")  # this token gives NaN keys
    eng = counted_engine(model, kind, config=DKV if kind == "diffkv" else None)
    first = [eng.add_request(p, GREEDY) for p in good[:2]]
    eng.step()
    late = [eng.add_request([4, bad, 6], GREEDY), eng.add_request(good[2], GREEDY)]
    eng.step()
    assert eng.counters.mixed_prefills == 1 and eng.counters.prefill_fallbacks == 1
    assert late[0].finish_reason == "error" and "NaN" in late[0].error
    eng.run()
    assert [r.output_ids for r in (*first, late[1])] == [reference(model, p, 20) for p in good] if kind == "fp16" \
        else all(r.finish_reason == "length" for r in (*first, late[1]))
    assert_pool_full(eng)


def test_prompts_beyond_the_mixed_bound_keep_a_forward_of_their_own(monkeypatch):
    """Only up to ``MIXED_PREFILL_TOKENS`` prompt tokens ride in the decode forward (their keys and values of every
    layer wait there until it ends); more get a forward of their own, and the tokens are the same."""
    import diffkv.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "MIXED_PREFILL_TOKENS", 12)
    model = tiny()
    ps = [list(range(3, 13)), list(range(20, 30)), list(range(40, 60))]  # 10, 10 and 20 tokens
    eng = counted_engine(model, "fp16")
    reqs = [eng.add_request(ps[0], GREEDY)]
    eng.step()
    reqs.append(eng.add_request(ps[1], GREEDY))  # 10 tokens <= 12: in the decode forward
    eng.step()
    reqs.append(eng.add_request(ps[2], GREEDY))  # 20 tokens > 12: a forward of its own
    eng.step()
    assert eng.counters.mixed_prefills == 1 and eng.counters.prefill_forwards == prefill_calls(eng) == 2
    eng.run()
    assert [r.output_ids for r in reqs] == [reference(model, p, 20) for p in ps]
    assert_pool_full(eng)
