"""The RULER-style suite (``diffkv.eval.ruler``): deterministic samples whose references follow from their prompts,
prompt lengths, the ask-after split, RULER's string-match scoring, per-family metrics and option errors."""

import json
import random
import re
from collections import Counter

import pytest

from diffkv.eval import ruler
from diffkv.eval.cli import _task_options, add_arguments
from diffkv.eval.metrics import _groups
from diffkv.eval.protocol import question_tokens, task_protocol
from diffkv.eval.ruler_families import FAMILIES, NEEDLE
from diffkv.eval.runner import RunConfig, encode_prompt, run_eval
from diffkv.eval.tasks import get_task
from diffkv.eval.tiny import tiny_model_and_tokenizer
from diffkv.registry import data as data_module

LENGTH = 2200
SYLLABLES = ["ba", "ko", "ri", "mu", "te", "lo", "sa", "ne", "di", "fu", "ga", "pi", "zo", "ve", "cu", "ha"]


def fake_pg_essays():
    """Twelve essays of made-up words (a vocabulary of a few thousand) in sentences, without the essay wheel."""
    rng = random.Random(0)
    word = lambda: "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))  # noqa: E731
    essays = []
    for e in range(12):
        sents = [" ".join([word().capitalize()] + [word() for _ in range(rng.randint(7, 14))]) + "."
                 for _ in range(40)]
        essays.append({"title": f"essay {e}", "text": "\n".join(sents)})
    return essays


@pytest.fixture
def offline(monkeypatch):
    essays = fake_pg_essays()

    def load(name):
        if name != "pg-essays":
            raise KeyError(name)
        return essays

    monkeypatch.setattr(data_module, "load_dataset", load)
    return tiny_model_and_tokenizer()


def _samples(tok, seed=0, **opts):
    return get_task("ruler").samples(tok, seed, {"lengths": [LENGTH], "samples": 2, **opts})


def test_samples_are_deterministic_per_seed_and_complete(offline):
    _, tok = offline
    a, b, c = _samples(tok), _samples(tok), _samples(tok, seed=1)
    assert a == b and len(a) == 2 * len(FAMILIES)
    assert [s["family"] for s in a[:len(FAMILIES)]] == list(FAMILIES)  # one of each family first
    assert len({s["id"] for s in a}) == len(a) and [s["id"] for s in a] == [s["id"] for s in c]
    for x, y in zip(a, c, strict=True):
        assert x["messages"] != y["messages"] and x["reference"] != y["reference"], x["id"]
    one = _samples(tok, families=["vt"], samples=1)[0]  # a sample does not depend on the other families
    assert one == next(s for s in a if s["id"] == one["id"])
    for s in a:
        assert set(s) == {"id", "messages", "reference", "family", "length", "question", "answer_prefix",
                          "max_new_tokens"}
        assert s["max_new_tokens"] == {"vt": 30, "cwe": 120, "fwe": 50, "qa": 32}.get(s["family"], 128)
        assert s["messages"][-1]["content"].endswith(s["question"]) and s["length"] == LENGTH
        assert isinstance(s["reference"], list) and all(s["reference"])


def _needles(text):
    found = {}
    for key, value in re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", text):
        found.setdefault(key, []).append(value)
    return found


def _check_reference(s):
    content, fam, ref = s["messages"][0]["content"], s["family"], s["reference"]
    context = content[:-len(s["question"])]
    if fam.startswith("niah"):
        needles = _needles(context)
        asked = re.search(r" for (.+) mentioned in the provided text\?$", s["question"]).group(1)
        keys = re.split(r", and |, ", asked)
        assert sorted(v for k in keys for v in needles[k]) == sorted(ref)
        assert all(NEEDLE.split(" {")[0] in content for _ in ref)
        expected = {"niah_multikey_1": 4, "niah_multiquery": 4}.get(fam, 1)
        if fam in ("niah_multikey_2", "niah_multikey_3"):
            assert len(needles) > 5  # a haystack of distractor needles
        else:
            assert len(needles) == expected
        assert len(keys) == (4 if fam == "niah_multiquery" else 1)
        assert len(ref) == (4 if fam in ("niah_multivalue", "niah_multiquery") else 1)
    elif fam == "vt":
        main = context[context.rindex("Memorize and track"):]  # after the in-context example
        value = re.search(r"the value (\d+) in the text above\.$", s["question"]).group(1)
        bound, links = set(), dict(re.findall(r"VAR (\w+) = VAR (\w+)", main))
        bound |= {name for name, v in re.findall(r"VAR (\w+) = (\d+)", main) if v == value}
        while True:
            more = {a for a, b in links.items() if b in bound} - bound
            if not more:
                break
            bound |= more
        assert bound == set(ref) and len(ref) == 5
        assert value in s["answer_prefix"]
    elif fam == "cwe":
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", context))
        top = {w for w, _ in counts.most_common(10)}
        assert top == set(ref) and min(counts[w] for w in ref) > max(c for w, c in counts.items() if w not in ref)
    elif fam == "fwe":
        counts = Counter(w for w in context.split() if re.fullmatch(r"[a-z]{6}", w))
        ranked = [w for w, _ in counts.most_common()]
        assert ranked[:3] == ref and counts[ranked[2]] > counts[ranked[3]]
    elif fam == "qa":
        cloze = re.search(r'this sentence from one of the documents: "(.+)"$', s["question"]).group(1)
        assert cloze.count("____") == 1 and len(ref) == 1
        assert context.count(cloze.replace("____", ref[0])) == 1
        assert len(re.findall(rf"\b{ref[0]}\b", content, flags=re.IGNORECASE)) == 1
        assert re.search(r"Document \d+:\n", context)
    else:
        raise AssertionError(fam)


def test_every_reference_follows_from_its_prompt(offline):
    _, tok = offline
    for s in _samples(tok, samples=3):
        _check_reference(s)


def test_prompts_fill_the_length_and_split_before_the_question(offline):
    _, tok = offline
    unit = {"niah_multikey_3": 120, "niah_multikey_2": 80, "niah_single_1": 25, "vt": 25, "cwe": 16, "fwe": 12}
    for s in _samples(tok, lengths=[LENGTH, 2600]):
        ids = encode_prompt(tok, s)
        assert s["length"] - unit.get(s["family"], 4) <= len(ids) <= s["length"], (s["id"], len(ids))
        held = question_tokens(tok, s, ids)
        assert tok.decode(ids[-held:]) == s["question"] + "\n<|assistant|>" + s["answer_prefix"]
    with pytest.raises(ValueError, match="ruler length 300 is too short for vt"):
        _samples(tok, lengths=[300], families=["vt"])


def test_ask_after_runs_and_records_per_family_metrics(offline, tmp_path):
    model, tok = offline
    opts = {"lengths": [1000], "samples": 1, "families": ["niah_single_2", "fwe"]}
    base = dict(model="tiny", task="ruler", method="full", batch_size=2, max_new_tokens=60)
    one_shot = run_eval(RunConfig(out=str(tmp_path / "in"), task_options=opts, **base), model, tok, progress=False)
    ask = run_eval(RunConfig(out=str(tmp_path / "ask"), task_options={**opts, "protocol": "ask-after"}, **base),
                   model, tok, progress=False)
    assert one_shot["n"] == ask["n"] == 2 and set(ask["per_family"]) == {"niah_single_2", "fwe"}
    assert all(f["n"] == 1 and "score" in f for f in ask["per_family"].values())
    rows = [json.loads(x) for x in (tmp_path / "ask/tiny/ruler/full/samples.jsonl").read_text().splitlines()]
    ref = {r["id"]: r for r in map(json.loads, (tmp_path / "in/tiny/ruler/full/samples.jsonl").read_text()
                                   .splitlines())}
    samples = {s["id"]: s for s in get_task("ruler").samples(tok, 0, opts)}
    for r in rows:  # the full cache answers the same whether the question came with the context or after it
        assert r["output"] == ref[r["id"]]["output"] and r["family"] == samples[r["id"]]["family"]
        assert r["new_tokens"] <= samples[r["id"]]["max_new_tokens"]  # fwe: 50 of the run's 60
        assert ref[r["id"]]["runner"] == "engine" and "runner" not in r  # both runners cut at a sample's budget
    held = [len(tok(s["question"] + "\n<|assistant|>" + s["answer_prefix"]).input_ids) for s in samples.values()]
    assert {r["held_back"] for r in rows} == {max(held)}  # one batch: the longer question sets the split
    assert json.loads((tmp_path / "ask/tiny/ruler/full/metrics.json").read_text())["per_family"] == ask["per_family"]


def test_string_match_scoring():
    task = get_task("ruler")
    multi = {"family": "niah_multivalue", "length": 4096, "reference": ["1234567", "7654321", "1111111", "2222222"]}
    out = task.score(multi, " 1234567, 7654321 and 1111111.")
    assert out["score"] == 0.75 and not out["correct"] and out["family"] == "niah_multivalue"
    assert task.score(multi, "1234567 7654321 1111111 2222222")["correct"]
    vt = {"family": "vt", "length": 4096, "reference": ["ABCDE", "FGHIJ"]}
    assert task.score(vt, " abcde fghij")["score"] == 1.0  # case-insensitive
    qa = {"family": "qa", "length": 4096, "reference": ["Hilbert", "David Hilbert"]}
    assert task.score(qa, " it was HILBERT")["score"] == 1.0  # part: any reference
    assert task.score(qa, "Gauss")["score"] == 0.0
    assert task.score({**vt, "reference": ["AB\x01C"]}, "ab\nc")["score"] == 0.0
    assert ruler.postprocess("  a\x00b\t ") == "a\nb" and ruler.string_match("xAy", ["a"], "part") == 1.0
    with pytest.raises(ValueError, match="unknown RULER metric"):
        ruler.string_match("x", ["x"], "some")


def test_per_family_and_per_length_groups():
    rows = {str(i): {"family": f, "length": n, "correct": c, "score": sc}
            for i, (f, n, c, sc) in enumerate([("vt", 4096, True, 1.0), ("vt", 8192, False, 0.6),
                                               ("qa", 4096, True, 1.0), ("qa", 4096, False, 0.0)])}
    g = _groups(rows)
    assert g["per_family"]["vt"] == {"n": 2, "accuracy": 0.5, "score": 0.8, "per_length": {
        "4096": {"n": 1, "accuracy": 1.0, "score": 1.0}, "8192": {"n": 1, "accuracy": 0.0, "score": 0.6}}}
    assert g["per_family"]["qa"] == {"n": 2, "accuracy": 0.5, "score": 0.5}
    assert g["score_mean_of_families"] == pytest.approx(0.65)
    assert _groups({"a": {"correct": True}}) == {}


def test_fit_units_finds_the_largest_fitting_size():
    assert ruler.fit_units(lambda u: 3 * u + 10, 100, 1) == (30, 3.0)
    assert ruler.fit_units(lambda u: 3 * u + 10, 101, 1, start=80)[0] == 30
    assert ruler.fit_units(lambda u: u * u, 1000, 0, rate=0.5)[0] == 31
    with pytest.raises(ruler.TooShort, match="shortest prompt holds 40 tokens"):
        ruler.fit_units(lambda u: 3 * u + 10, 30, 10)


@pytest.mark.parametrize("opts,match", [
    ({"depths": [0.5]}, "unknown option.*depths"),
    ({"lengths": [0]}, "ruler lengths must be integers"),
    ({"lengths": ["4k"]}, "ruler lengths must be integers"),
    ({"families": ["niah", "vt"]}, r"ruler families: unknown \['niah'\]"),
    ({"families": []}, "ruler families"),
    ({"samples": 0}, "ruler samples"),
])
def test_bad_options_name_the_option(opts, match):
    with pytest.raises(ValueError, match=match):
        ruler.check_options(opts)


def test_cli_flags_and_early_errors(offline, tmp_path, monkeypatch):
    import argparse

    import diffkv.registry.models
    from diffkv.cli import main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["run", "--task", "ruler", "--ruler-lengths", "4096,8192", "--ruler-families",
                              "vt,qa", "--ruler-samples", "3", "--ruler-protocol", "ask-after"])
    opts = _task_options(args)
    assert opts == {"lengths": [4096, 8192], "families": ["vt", "qa"], "samples": 3, "protocol": "ask-after"}
    assert ruler.check_options(opts) == ([4096, 8192], ["vt", "qa"], 3)
    assert task_protocol(get_task("ruler"), opts) == "ask-after"
    both = parser.parse_args(["run", "--task", "ruler", "--needle-protocol", "in-prompt", "--ruler-protocol",
                              "ask-after"])
    with pytest.raises(ValueError, match="contradicts"):
        _task_options(both)

    def no_model(name):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(diffkv.registry.models, "load_model", no_model)
    for flags in (["--ruler-families", "nope"], ["--ruler-samples", "0"], ["--ruler-protocol", "later"]):
        assert main(["eval", "run", "--model", "tiny", "--task", "ruler", "--methods", "full", "--out",
                     str(tmp_path), "--no-progress", *flags]) == 2


def test_a_run_resumes_with_more_samples_per_family_and_keeps_the_first(offline, tmp_path):
    """Sample i of a family does not depend on how many are asked, so a run grows (#60: the disjoint slice from 3 to
    10 per family); asking fewer than it holds is other settings."""
    model, tok = offline
    base = dict(model="tiny", task="ruler", method="full", batch_size=2, max_new_tokens=8, out=str(tmp_path))
    opts = {"lengths": [1000], "families": ["niah_single_1", "fwe"]}
    run_eval(RunConfig(task_options={**opts, "samples": 1}, **base), model, tok, progress=False)
    path = tmp_path / "tiny/ruler/full/samples.jsonl"
    first = path.read_text().splitlines()
    assert len(first) == 2
    grown = run_eval(RunConfig(task_options={**opts, "samples": 2}, **base), model, tok, progress=False)
    lines = path.read_text().splitlines()
    assert grown["n"] == 4 and lines[:2] == first and len({json.loads(x)["id"] for x in lines}) == 4
    assert json.loads((tmp_path / "tiny/ruler/full/config.json").read_text())["task_options"]["samples"] == 2
    with pytest.raises(ValueError, match="other settings"):
        run_eval(RunConfig(task_options={**opts, "samples": 1}, **base), model, tok, progress=False)
