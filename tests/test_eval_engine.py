"""Evaluation through the serving engine: the same answers and compression as the fixed-batch generate() path."""

import json

import pytest

from diffkv.eval.engine_runner import engine_for
from diffkv.eval.methods import get_method
from diffkv.eval.runner import RunConfig, run_eval
from diffkv.eval.tiny import tiny_model_and_tokenizer
from diffkv.registry import data as data_module


def fake_gsm8k(name):
    assert name == "gsm8k"
    # prompts of different lengths, so the fixed path pads and the engine's requests end at different steps
    return [{"question": f"What is {i} + {i}?" + " Think." * (i % 4), "answer": f"#### {2 * i}"} for i in range(7)]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(data_module, "load_dataset", fake_gsm8k)
    return tiny_model_and_tokenizer()


def rows(path):
    return {r["id"]: r for r in map(json.loads, (path / "samples.jsonl").read_text().splitlines())}


def both(model, tok, tmp_path, method):
    """(engine rows, generate rows, engine metrics, generate metrics) of one method on the same samples."""
    out = {}
    for runner in ("engine", "generate"):
        cfg = RunConfig(model="tiny", task="gsm8k", method=method, out=str(tmp_path / runner), limit=7, batch_size=3,
                        max_new_tokens=10, runner=runner, max_batch=3)
        metrics = run_eval(cfg, model, tok, progress=False)
        out[runner] = rows(cfg.run_dir()), metrics
    return out["engine"][0], out["generate"][0], out["engine"][1], out["generate"][1]


PRUNING = "diffkv-compact@x8+alpha_low=1.0+recent_window=4+score_window=4"  # prunes even a random model's tokens


@pytest.mark.parametrize("method", ["full", "K16V16", "diffkv@x8", PRUNING])
def test_engine_answers_and_compression_equal_the_fixed_batches(offline, tmp_path, method):
    model, tok = offline
    eng, gen, m_eng, m_gen = both(model, tok, tmp_path, method)
    assert set(eng) == set(gen) and len(eng) == 7
    for i in eng:
        assert eng[i]["runner"] == "engine" and "runner" not in gen[i]
        assert (eng[i]["output"], eng[i]["new_tokens"], eng[i]["prompt_tokens"]) == \
            (gen[i]["output"], gen[i]["new_tokens"], gen[i]["prompt_tokens"])
    # per-sample stats (engine) and per-batch stats (generate) add up to the same tokens, tiers and bytes
    for key in ("compression_physical", "compression_theoretical", "tokens_per_tier", "accuracy"):
        assert m_eng[key] == pytest.approx(m_gen[key]), key
    tiers = m_eng["tokens_per_tier"]
    if method == "full":
        assert m_eng["compression_physical"] == 1.0 and tiers["low"] == tiers["pruned"] == 0
    if method.startswith("diffkv"):  # the methods split tokens, so the comparison covers tiers and pruning
        assert tiers["low"] > 0 and m_eng["compression_physical"] > 1.5
    if "alpha_low" in method:
        assert tiers["pruned"] > 0


def test_runner_choice_resume_and_clear_errors(offline, tmp_path):
    model, tok = offline
    base = dict(model="tiny", task="gsm8k", out=str(tmp_path), batch_size=2, max_new_tokens=4)
    run_eval(RunConfig(method="K8V4", limit=3, **base), model, tok, progress=False)  # auto: the engine
    path = tmp_path / "tiny" / "gsm8k" / "K8V4"
    assert json.loads((path / "config.json").read_text())["runner"] == "engine"
    m = run_eval(RunConfig(method="K8V4", limit=5, max_batch=4, **base), model, tok, progress=False)
    assert m["n"] == 5 and len((path / "samples.jsonl").read_text().splitlines()) == 5  # only the 2 new ones
    with pytest.raises(ValueError, match="other settings.*runner"):
        run_eval(RunConfig(method="K8V4", limit=5, runner="generate", **base), model, tok, progress=False)
    run_eval(RunConfig(method="h2o@0.5", limit=2, **base), model, tok, progress=False)  # no page layout: generate
    assert json.loads((tmp_path / "tiny" / "gsm8k" / "h2o@0.5" / "config.json").read_text())["runner"] == "generate"
    with pytest.raises(ValueError, match="the engine cannot run 'kivi2'.*--runner generate"):
        run_eval(RunConfig(method="kivi2", runner="engine", limit=2, **base), model, tok, progress=False)
    with pytest.raises(ValueError, match="unknown runner"):
        run_eval(RunConfig(method="full", runner="fast", limit=2, **base), model, tok, progress=False)
    for bad in ({"start": -1}, {"max_batch": 0}):
        with pytest.raises(ValueError, match="start must be >= 0"):
            run_eval(RunConfig(method="full", limit=2, **base, **bad), model, tok, progress=False)
    second = run_eval(RunConfig(method="K8V4", start=5, limit=2, **base), model, tok, progress=False)
    assert second["n"] == 2 and second["n_requested"] == 2  # samples 5 and 6 of the task, added to the folder
    assert len((path / "samples.jsonl").read_text().splitlines()) == 7
    # a run recorded before the engine runner existed (no "runner" in its config) resumes on generate()
    old = tmp_path / "tiny" / "gsm8k" / "K4V4"
    run_eval(RunConfig(method="K4V4", limit=2, runner="generate", **base), model, tok, progress=False)
    cfg = json.loads((old / "config.json").read_text())
    del cfg["runner"], cfg["max_batch"]
    (old / "config.json").write_text(json.dumps(cfg))
    m = run_eval(RunConfig(method="K4V4", limit=3, **base), model, tok, progress=False)
    assert m["n"] == 3 and json.loads((old / "config.json").read_text())["runner"] == "generate"
    assert not any("runner" in r for r in rows(old).values())  # the third sample too came from generate()


def test_engine_pool_fits_every_sample_at_its_worst_case(offline, monkeypatch):
    from diffkv.eval import engine_runner

    model, tok = offline
    eng = engine_for(model, tok, get_method("K16V16"), None, max_batch=5, max_model_len=300)
    cache = eng.cache
    worst = cache.prefill_pages(300) + cache.decode_pages([(300, 1)])
    assert cache.num_pages - eng.scheduler.watermark_pages >= 5 * worst and cache.max_slots == 5
    alone = engine_for(model, tok, get_method("K16V16"), None, max_batch=1, max_model_len=300)
    alone.scheduler.check_fits(300 - 1)  # one sample: its pool is not short by the watermark
    assert eng.scheduler.max_running == 5 and cache.nbytes() <= cache.kv_budget_bytes
    page = cache.plan.page_bytes + 8
    monkeypatch.setattr(engine_runner, "POOL_BYTES_LIMIT", 3 * worst * page)  # room for 3 samples at the worst case
    capped = engine_for(model, tok, get_method("K16V16"), None, max_batch=5, max_model_len=300)
    assert capped.scheduler.max_running == 3 and capped.cache.num_pages >= 3 * worst
    with pytest.raises(ValueError, match="not a paged cache.*--runner generate"):
        engine_for(model, tok, get_method("snapkv"), None, max_batch=2, max_model_len=64)
    with pytest.raises(ValueError, match="--max-batch must be >= 1"):
        engine_for(model, tok, get_method("full"), None, max_batch=0, max_model_len=64)
