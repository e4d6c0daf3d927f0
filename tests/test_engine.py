"""Serving engine on tiny random models: exactness vs generate(), preemption, cancellation, no leaked page."""

import math
import random

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from diffkv import DiffKVConfig
from diffkv.engine import Engine, SamplingParams, make_cache

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)


class CharTokenizer:
    """Token t <-> character chr(65 + t % 26); enough to test text, deltas and stop strings."""

    eos_token_id = None

    def __call__(self, text, **kwargs):  # letters as before; other characters (e.g. newlines) inside the vocab too
        return type("Enc", (), {"input_ids": [(ord(c) - 65) % 93 + 3 for c in text]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + t % 26) for t in ids)


def tiny(kind="llama", **over):
    torch.manual_seed(0)
    cfg = {**SMALL, **over}
    model = LlamaForCausalLM(LlamaConfig(**cfg)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**cfg))
    model.generation_config.eos_token_id = None
    return model.eval()


def prompts(n, seed=1, lo=4, hi=40):
    g = random.Random(seed)
    return [[g.randrange(3, 96) for _ in range(g.randrange(lo, hi))] for _ in range(n)]


def reference(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             past_key_values=DynamicCache(config=model.config), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine(model, kind="fp16", pages=None, **kw):
    cfg = kw.pop("config", None)
    probe = make_cache(kind, model, kv_budget_bytes=1 << 20, raw_dtype="float32", config=cfg, max_slots=8,
                       max_model_len=128)
    budget = probe.budget_for_pages(pages) if pages else 1 << 20
    cache = make_cache(kind, model, kv_budget_bytes=budget, raw_dtype="float32", config=cfg, max_slots=8,
                       max_model_len=128)
    return Engine(model, CharTokenizer(), cache, **kw)


def assert_pool_full(eng):
    pool = eng.cache.kv.pool
    assert pool.free_pages() == pool.num_pages
    pool.check_invariants(eng.cache.kv.tables)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fp16_cache_equals_generate_with_staggered_arrivals(kind):
    model = tiny(kind)
    eng = engine(model)
    ps = [*prompts(4), [7]]  # a one-token prompt too
    reqs = []
    for p in ps:  # a new request arrives every other step while the others decode
        reqs.append(eng.add_request(p, GREEDY))
        eng.step()
        eng.step()
    eng.run()
    for r, p in zip(reqs, ps, strict=True):
        assert r.finish_reason == "length" and r.output_ids == reference(model, p, 20)
    assert eng.peak_running >= 3
    assert_pool_full(eng)


@pytest.mark.parametrize("reserve", [None, (0.7, 0.1, 0.001)], ids=["no-reserve", "decode-reserve"])
def test_preemption_and_cancellation_keep_outputs_and_pages(reserve):
    model = tiny()
    ps = prompts(8, seed=3, lo=10, hi=30)
    want = {i: reference(model, p, 20) for i, p in enumerate(ps)}
    # each request needs ~2 pages per head at its end; 8 heads-layers * ... make the pool hold about 3 requests
    eng = engine(model, pages=4 * 2 * 2 * 3, reserve=reserve)
    finished = {}

    def listener(ev):
        if ev.finished:
            assert ev.request.id not in finished, "a request finished twice"
            finished[ev.request.id] = ev.finish_reason

    reqs, cancelled = arrive_and_cancel(eng, ps, 0.05, listener=listener)
    if reserve is None:
        assert eng.counters.preemptions > 0, "the pool was meant to force preemption"
    assert len(finished) == len(ps)
    for i, r in reqs.items():
        if finished[r.id] == "cancelled":
            assert i in cancelled
        else:
            assert finished[r.id] == "length" and r.output_ids == want[i], f"request {i} changed"
    assert_pool_full(eng)


def arrive_and_cancel(eng, ps, cancel_p, listener=None, each_step=None):
    """Run ``eng`` until idle while the prompts ``ps`` arrive at random steps and, with probability ``cancel_p`` per
    step, a random submitted request is cancelled (seeded). Returns ({index: request}, indices cancelled)."""
    rng, reqs, cancelled = random.Random(7), {}, set()
    pending = list(enumerate(ps))
    while pending or eng.has_work():
        if pending and rng.random() < 0.5:
            i, p = pending.pop(0)
            reqs[i] = eng.add_request(p, GREEDY, listener=listener)
        if reqs and rng.random() < cancel_p:
            i = rng.choice(sorted(reqs))
            if not reqs[i].finished:
                reqs[i].cancel()
                cancelled.add(i)
        eng.step()
        if each_step is not None:
            each_step()
    return reqs, cancelled


def test_decode_reserve_avoids_preemption_thrash():
    model = tiny()
    ps = prompts(8, seed=3, lo=10, hi=30)
    runs = {}
    for reserve in (None, (0.7, 0.1, 0.001)):
        eng = engine(model, pages=4 * 2 * 2 * 3, reserve=reserve)
        reqs = eng.generate(ps, SamplingParams(max_new_tokens=20, ignore_eos=True))
        runs[reserve] = (eng.counters.preemptions, [r.output_ids for r in reqs], eng.scheduler.reserve_ratio)
        assert_pool_full(eng)
    (thrash, out_none, _), (calm, out_reserve, ratio) = runs.values()
    assert out_none == out_reserve
    assert calm < thrash, f"the decode reserve should preempt less ({calm} vs {thrash})"
    assert 0.1 <= ratio <= 1.0


def test_decode_reserve_ratio_decays_and_jumps_at_preemption():
    eng = engine(tiny(), reserve=(0.5, 0.2, 0.1))
    sched = eng.scheduler
    for want in (0.4, 0.3, 0.2, 0.2):
        sched.end_step()
        assert sched.reserve_ratio == pytest.approx(want)
    sched.running.append(eng.add_request([1, 2, 3], GREEDY))
    sched.preempt_newest()
    assert sched.reserve_ratio == 1.0
    for bad in [(0.1, 0.5, 0.0), (1.5, 0.1, 0.0), (0.5, 0.1, -1.0)]:
        with pytest.raises(ValueError, match="reserve"):
            engine(tiny(), reserve=bad)


def test_diffkv_cache_compresses_and_frees():
    model = tiny(head_dim=64)  # real head sizes: at head_dim 16 the per-token metadata dominates
    cfg = DiffKVConfig(high="K8V4", low="K4V2", alpha_high=1.0, alpha_low=0.05, recent_window=4, score_window=4)
    eng = engine(model, kind="diffkv", config=cfg)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts(4, lo=80, hi=110)]
    for _ in range(6):
        eng.step()
    m = eng.metrics()
    assert m["running"] == 4 and m["compression_physical"] > 1.5
    eng.run()
    assert all(r.finish_reason == "length" and len(r.output_ids) == 12 for r in reqs)
    assert_pool_full(eng)


def test_stop_strings_eos_and_streamed_text():
    model = tiny()
    eng = engine(model)
    p = prompts(1)[0]
    full = reference(model, p, 20)
    text = CharTokenizer().decode(full)
    stop = text[5:7]
    deltas = []
    r = eng.add_request(p, SamplingParams(max_new_tokens=20, stop=(stop,)), listener=lambda e: deltas.append(e.delta))
    eng.run()
    assert r.finish_reason == "stop" and r.text == text[:text.find(stop)] and "".join(deltas) == r.text
    eng.outputs.eos = {full[3]}
    r = eng.add_request(p, SamplingParams(max_new_tokens=20))
    eng.run()
    assert r.finish_reason == "stop" and r.output_ids == full[:full.index(full[3])]
    assert_pool_full(eng)


def test_seeded_sampling_is_reproducible_across_batches():
    model = tiny()
    p = prompts(1)[0]
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    alone = engine(model).generate([p], params)[0].output_ids
    eng = engine(model)
    others = [eng.add_request(q, GREEDY) for q in prompts(3, seed=5)]
    mine = eng.add_request(p, params)
    eng.run()
    assert mine.output_ids == alone and all(o.finished for o in others)
    nucleus = engine(model).generate([p], SamplingParams(max_new_tokens=10, temperature=1.0, top_p=1e-6,
                                                         ignore_eos=True))[0]
    assert nucleus.output_ids == reference(model, p, 10)  # a tiny nucleus keeps only the argmax


def test_clear_errors():
    model = tiny()
    eng = engine(model, pages=20)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match="maximum context"):
        eng.add_request([5] * 120, GREEDY)
    with pytest.raises(ValueError, match="KV pages"):
        eng.add_request([5] * 100, SamplingParams(max_new_tokens=2))
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(stop=("",))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="unknown KV cache kind"):
        make_cache("int3", model, kv_budget_bytes=1 << 20)
    assert not eng.has_work()


def test_request_that_could_not_finish_alone_is_refused_up_front():
    model = tiny()
    eng = engine(model, pages=2 * 2 * 4)  # 4 pages per head: fits a short prompt, not its 100 new tokens
    with pytest.raises(ValueError, match="KV budget"):
        eng.add_request(prompts(1, lo=6, hi=7)[0], SamplingParams(max_new_tokens=100, ignore_eos=True))
    r = eng.add_request(prompts(1, lo=6, hi=7)[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng.run()
    assert r.finish_reason == "length"
    assert_pool_full(eng)


@pytest.mark.real_model
def test_fp16_cache_equals_generate_on_smollm2():
    from diffkv.bench.serve import gsm8k_prompts
    from diffkv.registry.models import load_model

    model, tok = load_model("smollm2-135m")
    ps = gsm8k_prompts(tok, 3)
    cache = make_cache("fp16", model, kv_budget_bytes=64 << 20, raw_dtype="float32", max_slots=4,
                       max_model_len=512)
    eng = staggered_equals_generate(model, tok, cache, ps, 12)
    assert_pool_full(eng)


def staggered_equals_generate(model, tok, cache, ps, n):
    """Requests arriving one step apart through an engine on ``cache``: greedy outputs equal ``generate``'s."""
    eng = Engine(model, tok, cache)
    reqs = []
    for p in ps:
        reqs.append(eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        eng.step()
    eng.run()
    for r, p in zip(reqs, ps, strict=True):
        assert r.output_ids == reference(model, p, n)
    return eng


def test_a_failing_decode_step_fails_its_requests_and_frees_their_pages():
    model = tiny()
    eng = engine(model)
    reqs = [eng.add_request(p, GREEDY) for p in prompts(3)]
    eng.step()  # prefills
    model.model.layers[1].self_attn.k_proj.weight.data[0, 0] = float("nan")  # the next keys are NaN
    eng.run()
    assert all(r.finish_reason == "error" and "NaN" in r.error for r in reqs)
    assert_pool_full(eng)


def test_a_prefill_that_does_not_fit_is_requeued_and_retried_at_its_worst_case():
    model = tiny()
    ps = prompts(6, seed=4, lo=20, hi=30)
    eng = engine(model, pages=4 * 2 * 2 * 3, reserve=None)  # the decode reserve alone would avoid the failure
    eng.cache.admission_pages = lambda n, c: 0  # an estimate that is always too optimistic
    reqs = [eng.add_request(p, GREEDY) for p in ps]
    failed = set()
    while eng.has_work():
        eng.step()
        failed |= eng.scheduler.worst_case  # cleared for a request when it finishes
    assert failed, "the pool was meant to refuse some prefill midway"
    for r, p in zip(reqs, ps, strict=True):
        assert r.finish_reason == "length" and r.output_ids == reference(model, p, 20)
    assert_pool_full(eng)


def test_gsm8k_few_shot_prompts_use_held_out_worked_examples(monkeypatch):
    import diffkv.registry.data
    from diffkv.bench.serve import gsm8k_prompts
    from diffkv.eval import answers
    from diffkv.eval.tasks import GSM8K, GSM8K_PROMPT, worked_answer

    rows = [{"question": f"q{i}?", "answer": f"It is {i} * 2 = <<{i}*2={2 * i}>>{2 * i}.\n#### {2 * i}"}
            for i in range(6)]
    monkeypatch.setattr(diffkv.registry.data, "load_dataset", lambda name: rows)

    class ChatTokenizer:  # records the conversation instead of tokenizing it
        def apply_chat_template(self, messages, **kw):
            return {"input_ids": [m["content"] for m in messages]}

    assert worked_answer(rows[3]["answer"]) == "It is 3 * 2 = 6.\nThe answer is 6."
    assert answers.extract_number(worked_answer(rows[3]["answer"])) == answers.gsm8k_reference(rows[3]["answer"])
    zero = gsm8k_prompts(ChatTokenizer(), 2)
    assert [len(p) for p in zero] == [1, 1] and "q0?" in zero[0][0] and "q1?" in zero[1][0]
    two = gsm8k_prompts(ChatTokenizer(), 3, shots=2)
    for i, turns in enumerate(two):
        assert len(turns) == 5 and f"q{i}?" in turns[-1]
        assert "q4?" in turns[0] and turns[1] == worked_answer(rows[4]["answer"]) and "q5?" in turns[2]
    with pytest.raises(ValueError, match="GSM8K test split"):
        gsm8k_prompts(ChatTokenizer(), 5, shots=2)  # an exemplar would also be served
    few = GSM8K().samples(None, options={"shots": 2})  # the eval task: same ids and references, exemplars left out
    assert [s["id"] for s in few] == [s["id"] for s in GSM8K().samples(None)][:4]
    assert [s["reference"] for s in few] == ["0", "2", "4", "6"] and few[0]["messages"][:2] == [
        {"role": "user", "content": GSM8K_PROMPT.format(**rows[4])},
        {"role": "assistant", "content": worked_answer(rows[4]["answer"])}]
    with pytest.raises(ValueError, match="shots must be in"):
        GSM8K().samples(None, options={"shots": 6})


def test_scheduler_reserves_decode_growth_but_always_admits_a_lone_request():
    from diffkv.engine.request import Request
    from diffkv.engine.scheduler import Scheduler

    class PagePerToken:  # one page per token, whatever the compression
        num_pages, max_slots, max_model_len, used = 100, 4, 1000, 0

        def free_pages(self):
            return self.num_pages - self.used

        def admission_pages(self, n, compression):
            return n

        def decode_pages(self, requests, ratio=1.0):
            return math.ceil(sum(a for _, a in requests) * ratio)

    for reserve, second_admitted in [((1.0, 1.0, 0.0), False), (None, True)]:
        cache = PagePerToken()
        sched = Scheduler(cache, watermark=0.0, reserve=reserve)
        sched.waiting.extend([Request(list(range(50)), SamplingParams(max_new_tokens=200)),
                              Request(list(range(10)), SamplingParams(max_new_tokens=10))])
        first = sched.next_admission()
        assert first is not None, "a lone request that fits must be admitted whatever its decode reserve"
        cache.used = 50
        # the second needs 10 pages now, plus (200 + 10) ahead at ratio 1 with the reserve
        assert (sched.next_admission() is not None) == second_admitted


def test_serve_side_by_side_reports_consistent_counts():
    from diffkv.bench.serve import serve_side_by_side

    model = tiny(head_dim=64)
    cfg = DiffKVConfig(high="K8V4", low="K4V2", alpha_high=1.0, alpha_low=0.05, recent_window=4, score_window=4)
    caches = [make_cache(kind, model, kv_budget_bytes=1 << 20, config=cfg if kind == "diffkv" else None,
                         max_slots=4, max_model_len=128) for kind in ("fp16", "diffkv")]
    ps = prompts(5, lo=20, hi=40)
    res = serve_side_by_side(model, CharTokenizer(), caches, ps, 6, 4, progress=False)
    assert set(res) == {"fp16", "diffkv"}
    for r in res.values():
        assert r["completed"] == 5 and r["generated_tokens"] == 30 and r["pool_full_again"]
        assert r["peak_running"] <= 4 and r["prefill_s"] + r["decode_s"] <= r["time_s"] + 0.015  # each rounded to 0.01
        assert r["prefilled_tokens"] - r["recomputed_tokens"] >= sum(map(len, ps))
        assert r["recomputed_tokens"] == 0 or r["preemptions"] > 0


def test_triton_decode_workspace_is_counted_in_the_budget():
    """On the Triton backend (interpreter here) the decode workspace and plan buffers are cache bytes too: the budget
    reserves their bound for every slot, and what they hold after real steps stays within it."""
    from diffkv.memory.owned import owned_bytes
    from diffkv.ops.decode_plan import workspace_bound_bytes

    model = tiny()
    cfg = DiffKVConfig(recent_window=4, score_window=4)
    kw = dict(kv_budget_bytes=1 << 20, raw_dtype="float32", config=cfg, max_slots=4, max_model_len=64)
    cpu, triton = (make_cache("diffkv", model, attention_backend=b, **kw) for b in ("cpu", "triton"))
    bound = workspace_bound_bytes((triton.plan.tiers[0], triton.plan.tiers[-1]), True, max_slots=4, num_layers=2,
                                  num_kv_heads=triton.num_kv_heads, num_heads=triton.num_heads,
                                  head_dim=triton.head_dim, max_seq_len=64, device="cpu")
    assert triton.fixed_bytes - cpu.fixed_bytes == bound and triton.num_pages < cpu.num_pages
    eng = Engine(model, CharTokenizer(), triton)
    for p in prompts(3, seed=5, hi=20):
        eng.add_request(p, SamplingParams(max_new_tokens=3, ignore_eos=True))
    while eng.has_work():
        eng.step()
        assert owned_bytes(eng.cache) == eng.cache.nbytes() <= eng.cache.kv_budget_bytes
    assert sum(t.nbytes for t in triton.store.workspace.tensors()) > 0  # the Triton step ran and took its scratch
    held = triton.store.step_bytes()  # head sets, positions, flags, outputs and the workspace, as they grew
    assert held <= triton.bookkeeping_bytes(4), (held, bound)


@pytest.mark.parametrize("kind", ["fp16", "diffkv"])
def test_cache_holds_no_byte_beyond_its_budget(kind):
    """Every tensor reachable from the cache (an independent walk) is counted by nbytes() and fits the budget."""
    from diffkv.memory.owned import owned_bytes

    model = tiny()
    eng = engine(model, kind, pages=200, config=DiffKVConfig(recent_window=4, score_window=4) if kind == "diffkv"
                 else None)
    for p in prompts(6, seed=5):
        eng.add_request(p, GREEDY)
    budget = eng.cache.kv_budget_bytes
    while eng.has_work():
        eng.step()
        held = eng.cache.nbytes()
        assert owned_bytes(eng.cache) == held <= budget
    assert eng.cache.stats([], [])["bytes_held"] <= budget
