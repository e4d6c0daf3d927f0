"""Needle protocols: ``ask-after`` (context compressed before the question is fed) vs ``in-prompt``."""

import json

import pytest
import torch
from test_eval import fake_essays
from transformers import DynamicCache

from diffkv.eval.protocol import generate, question_tokens
from diffkv.eval.runner import RunConfig, _left_pad, encode_prompt, run_eval
from diffkv.eval.tasks import NEEDLE_QUESTION, get_task
from diffkv.eval.tiny import tiny_model_and_tokenizer

NEEDLE = {"lengths": [300], "depths": [0.0, 0.5, 1.0]}


@pytest.fixture
def offline(monkeypatch):
    fake_essays(monkeypatch)
    return tiny_model_and_tokenizer()


def test_question_tokens_split_the_prompt_before_the_question(offline):
    _, tok = offline
    for sample in get_task("needle").samples(tok, 0, NEEDLE):
        prompt = encode_prompt(tok, sample)
        held = question_tokens(tok, sample, prompt)
        assert tok.decode(prompt[-held:]) == NEEDLE_QUESTION + "\n<|assistant|>"  # the question + template tail
    with pytest.raises(ValueError, match="names no question"):
        question_tokens(tok, {"id": "q", "messages": [{"role": "user", "content": "hi"}]}, [1, 2, 3])


def test_ask_after_full_cache_equals_the_one_shot_prompt(offline):
    """Same tokens, fed differently: with the full cache the logits and the answer do not change."""
    model, tok = offline
    rows = [tok("a longer prompt, left padding for the other row " * 2).input_ids, tok("short, what?").input_ids]
    ids, mask = _left_pad(rows, tok.pad_token_id)  # [2, W]
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id, output_scores=True,
              return_dict_in_generate=True)
    ref = generate(model, ids, mask, DynamicCache(config=model.config), 0, **kw)
    for held in (1, 2, 9):
        out = generate(model, ids, mask, DynamicCache(config=model.config), held, **kw)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="real tokens"):  # the short row's padding cannot be fed as a token
        generate(model, ids, mask, DynamicCache(config=model.config), ids.shape[1] - 3, **kw)


def test_needle_ask_after_runs_every_method_and_records_the_protocol(offline, tmp_path):
    model, tok = offline
    base = dict(model="tiny", task="needle", batch_size=2, max_new_tokens=4, budget=0.5)
    ask = {**NEEDLE, "protocol": "ask-after"}
    one_shot = run_eval(RunConfig(method="full", out=str(tmp_path / "in"), task_options=NEEDLE, **base), model, tok,
                        progress=False)
    for method in ("full", "diffkv", "h2o", "snapkv"):
        m = run_eval(RunConfig(method=method, out=str(tmp_path / "ask"), task_options=ask, **base), model, tok,
                     progress=False)
        assert m["n"] == 3
    run_dir = tmp_path / "ask" / "tiny" / "needle"
    assert json.loads((run_dir / "full" / "config.json").read_text())["task_options"]["protocol"] == "ask-after"
    rows = {r["id"]: r for r in map(json.loads, (run_dir / "full" / "samples.jsonl").read_text().splitlines())}
    ref = {r["id"]: r for r in map(json.loads, (tmp_path / "in" / "tiny" / "needle" / "full" / "samples.jsonl")
                                   .read_text().splitlines())}
    assert {k: r["output"] for k, r in rows.items()} == {k: r["output"] for k, r in ref.items()}
    assert all(r["held_back"] == len(tok(NEEDLE_QUESTION + "\n<|assistant|>").input_ids) for r in rows.values())
    assert one_shot["compression_physical"] == 1.0
    with pytest.raises(ValueError, match="other settings"):  # one folder never mixes protocols
        run_eval(RunConfig(method="full", out=str(tmp_path / "ask"), task_options=NEEDLE, **base), model, tok,
                 progress=False)
    explicit = {**NEEDLE, "protocol": "in-prompt"}  # the default is not recorded: older runs still resume
    run_eval(RunConfig(method="full", out=str(tmp_path / "in"), task_options=explicit, **base), model, tok,
             progress=False)
    cfg = json.loads((tmp_path / "in" / "tiny" / "needle" / "full" / "config.json").read_text())
    assert "protocol" not in cfg["task_options"]


def test_bad_protocols_are_refused_before_anything_runs(offline, tmp_path, monkeypatch):
    import diffkv.registry.models
    from diffkv.cli import main

    model, tok = offline
    with pytest.raises(ValueError, match="unknown protocol 'later'"):
        run_eval(RunConfig(model="tiny", task="needle", method="full", out=str(tmp_path),
                           task_options={"protocol": "later"}), model, tok, progress=False)
    with pytest.raises(ValueError, match="needs a task with a separate question"):
        run_eval(RunConfig(model="tiny", task="gsm8k", method="full", out=str(tmp_path),
                           task_options={"protocol": "ask-after"}), model, tok, progress=False)
    assert not (tmp_path / "tiny").exists()
    monkeypatch.setattr(diffkv.registry.models, "load_model", lambda name: offline)
    assert main(["eval", "run", "--model", "tiny", "--task", "needle", "--methods", "full", "--out", str(tmp_path),
                 "--needle-lengths", "300", "--needle-protocol", "ask-later", "--no-progress"]) == 2


def test_ask_after_repeat_scores_one_forward_equals_scoring_then_prefilling(offline, tmp_path, monkeypatch):
    """At batch 1 the runner scores and stores the context in one forward (``repeat_prefill``); the answers and
    the bytes are those of the two-pass path (scores set by hand, then the context's prefill)."""
    import diffkv.eval.runner as runner
    from diffkv.hf.repeat_scores import repeat_scores

    model, tok = offline
    cfg = dict(model="tiny", task="needle", batch_size=1, max_new_tokens=4,
               method='diffkv+importance="peak"+prompt_scores="repeat"',
               task_options={**NEEDLE, "protocol": "ask-after"})
    merged = run_eval(RunConfig(out=str(tmp_path / "one"), **cfg), model, tok, progress=False)

    def two_pass(model, cache, ids, bridge):
        cache.set_prompt_scores(repeat_scores(model, ids, torch.ones_like(ids), bridge))

    monkeypatch.setattr(runner, "repeat_prefill", two_pass)
    separate = run_eval(RunConfig(out=str(tmp_path / "two"), **cfg), model, tok, progress=False)
    folder = "diffkv+importance=peak+prompt_scores=repeat"
    outputs = [[json.loads(line)["output"] for line in (tmp_path / d / "tiny" / "needle" / folder /
                                                         "samples.jsonl").read_text().splitlines()]
               for d in ("one", "two")]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3
    assert merged["compression_physical"] == separate["compression_physical"]
