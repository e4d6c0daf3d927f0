"""Issue #45: requests sharing a long prefix through the engine, with and without prefix caching, fp16 vs DiffKV,
side by side in one process on one model.

Workload: a ~2k-token document (PG essays with ``--questions`` facts "The secret code of NAME is NNNNN." spread
through it) shared by every request, then a ~64-token question asking for one code; greedy, short answers.
Prefix = the chat prompt up to the end of the document; each request adds its question.

* ``fp16``: the fp16 paged cache with prefix caching (its answers are the full cache's: fp16 K/V, no pruning);
* ``diffkv``: DiffKV with prefix caching (``--method``: repeat scores, so the document is scored without a
  question); first ``--miss-checks`` questions one at a time as misses (the prefix evicted before each), then the
  same as hits (prefix kept): ``hit_equals_miss`` and their time to first token; then all questions at once;
* ``diffkv-no-prefix``: the same DiffKV thresholds with window scores, each prompt prefilled whole;
* ``diffkv-window-prefix``: prefix caching with those window scores (the prefix scored by its own last queries:
  no re-read pass, the cheaper query-agnostic score).

Peak bytes = the most page bytes in use at any step while all questions run (what the pool holds: shared pages
once). ``python benchmarks/serve/prefix/run.py --out benchmarks/serve/prefix/results.json``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import resource
import time

import torch

from diffkv.engine import Engine, SamplingParams, make_cache
from diffkv.eval.methods import get_method
from diffkv.prompts import essay_tokens
from diffkv.registry.models import load_model

NAMES = ["Alder", "Birch", "Cedar", "Dahlia", "Elm", "Fern", "Gorse", "Hazel", "Iris", "Juniper", "Kale", "Laurel",
         "Maple", "Nettle", "Oak", "Poplar", "Quince", "Rowan", "Sage", "Thyme", "Umber", "Violet", "Willow",
         "Yarrow", "Zinnia", "Aspen", "Basil", "Clover", "Daisy", "Ember", "Flint", "Garnet"]
ASK = ("Question: what is the secret code of {name}? The document above gives each name a five-digit secret code. "
       "Read it carefully and answer with the five digits of the code only, nothing else.")


def workload(tok, n_questions: int, doc_tokens: int, seed: int = 0):
    """(prefix ids, [(question ids, answer)]): a document with one code per name, and one question per name.
    seed 0: the recorded workload; another seed: other essays (from essay ``5 * seed``), other codes, the names in
    another order through the document."""
    g = random.Random(seed)
    words = tok.decode(essay_tokens(tok, doc_tokens, start_essay=5 * seed)).split(" ")
    names = NAMES[:n_questions] if seed == 0 else g.sample(NAMES, n_questions)
    facts = [(name, str(g.randrange(10000, 100000))) for name in names]
    for i, (name, code) in reversed(list(enumerate(facts))):  # evenly spread, from 3 % to 97 % of the document
        at = int(len(words) * (0.03 + 0.94 * i / max(n_questions - 1, 1)))
        words.insert(at, f"The secret code of {name} is {code}.")
    marker = "\u0001"
    text = tok.apply_chat_template([{"role": "user", "content": " ".join(words) + marker + "{q}"}],
                                   add_generation_prompt=True, tokenize=False)
    head, tail = text.split(marker)
    prefix = tok(head, add_special_tokens=False).input_ids
    questions = [(tok("\n\n" + tail.replace("{q}", ASK.format(name=name)), add_special_tokens=False).input_ids, code)
                 for name, code in facts]
    return prefix, questions


def answer(tok, ids: list[int]) -> str | None:
    """The first five-digit number of the output (the answer; what follows it is not scored)."""
    found = re.search(r"\d{5}", tok.decode(ids))
    return None if found is None else found[0]


def correct(tok, ids: list[int], code: str) -> bool:
    return answer(tok, ids) == code


def run_all(eng: Engine, prompts: list[list[int]], prefix: int | None, params) -> tuple[list[list[int]], int]:
    """Every prompt at once; (answers, peak page bytes in use over the steps)."""
    reqs = [eng.add_request(p, params, prefix_tokens=prefix) for p in prompts]
    peak = 0
    while eng.has_work():
        eng.step()
        peak = max(peak, eng.metrics()["pages_used"])
    return [r.output_ids for r in reqs], peak * eng.cache.plan.page_bytes


def alone(eng: Engine, prompt: list[int], prefix: int, params) -> tuple[list[int], float]:
    """One request alone; (answer, seconds to its first token)."""
    t0 = time.perf_counter()
    req = eng.add_request(prompt, params, prefix_tokens=prefix)
    while not req.output_ids and not req.finished:
        eng.step()
    ttft = time.perf_counter() - t0
    eng.run()
    return req.output_ids, ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--profile", default="benchmarks/calibration/qwen2.5-0.5b-full-smooth.json")
    ap.add_argument("--method", default='diffkv@x256+importance="peak"+prompt_scores="repeat"')
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--miss-checks", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="0: the recorded workload; others: other essays and codes")
    ap.add_argument("--kv-budget", type=int, default=512 << 20)
    ap.add_argument("--runs", default="diffkv,fp16,diffkv-no-prefix,diffkv-window-prefix",
                    help="which runs, comma-separated (fp16 gives the full cache's answers)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    prefix, questions = workload(tok, args.questions, args.doc_tokens, args.seed)
    prompts = [prefix + q for q, _ in questions]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    size = dict(kv_budget_bytes=args.kv_budget, max_slots=args.questions + 2, max_model_len=max(map(len, prompts))
                + args.new_tokens + 8)
    cfg = get_method(args.method).storage(model, args.profile or None)  # --profile "": the library defaults
    out: dict = {"command": "python benchmarks/serve/prefix/run.py " + " ".join(
        f"--{k.replace('_', '-')} '{v}'" for k, v in vars(args).items() if k != "out"),
        "prefix_tokens": len(prefix), "question_tokens": [len(q) for q, _ in questions]}
    codes = [c for _, c in questions]

    def engine(kind: str, config=None, prefix_cache: bool = True, prefix_scores: str = "context") -> Engine:
        return Engine(model, tok, make_cache(kind, model, config=config, **size), prefix_cache=prefix_cache,
                      prefix_scores=prefix_scores)

    runs = {}
    want = args.runs.split(",")
    window = dataclasses.replace(cfg, prompt_scores="window")
    if "diffkv" in want:  # with prefix caching: misses one at a time, the same as hits, then all at once
        eng = engine("diffkv", cfg)
        miss, hit = [], []
        for p in prompts[:args.miss_checks]:
            while eng.prefix.evict_one():
                pass
            miss.append(alone(eng, p, len(prefix), params))
        for p in prompts[:args.miss_checks]:
            hit.append(alone(eng, p, len(prefix), params))
        got, peak = run_all(eng, prompts, len(prefix), params)
        runs["diffkv"] = (got, peak, eng.metrics())
        out["hit_equals_miss"] = all(a[0] == b[0] for a, b in zip(miss, hit, strict=True))
        out["hit_equals_miss_checked"] = len(miss)
        out["ttft_miss_s"] = [round(t, 2) for _, t in miss]
        out["ttft_hit_s"] = [round(t, 2) for _, t in hit]
        out["ttft_hit_vs_miss"] = round(sum(t for _, t in miss) / sum(t for _, t in hit), 2)
        out["concurrent_equals_alone"] = [got[i] == hit[i][0] for i in range(len(hit))]
    for name, kind, config, cached in (("fp16", "fp16", None, True), ("diffkv-no-prefix", "diffkv", window, False),
                                       ("diffkv-window-prefix", "diffkv", window, True)):
        if name in want:
            eng = engine(kind, config, prefix_cache=cached, prefix_scores="window")  # as named: window scores
            runs[name] = (*run_all(eng, prompts, len(prefix) if cached else None, params), eng.metrics())
    full = runs["fp16"][0] if "fp16" in runs else None
    for name, (got, peak, metrics) in runs.items():
        right = sum(correct(tok, g, c) for g, c in zip(got, codes, strict=True))
        same = None if full is None else sum(answer(tok, g) == answer(tok, f) for g, f in zip(got, full, strict=True))
        out[name] = {"peak_page_bytes": peak, "correct": right, "answer_matches_full": same,
                     "matches_full": None if full is None else sum(g == f for g, f in zip(got, full, strict=True)),
                     "n": len(got),
                     "answers": [tok.decode(g) for g in got],
                     **{k: v for k, v in metrics.items() if k.startswith("prefix_")}}
    for name in ("diffkv", "diffkv-window-prefix"):
        if name in runs and "fp16" in runs:
            out[f"bytes_vs_fp16_prefix_cache{'' if name == 'diffkv' else '_window'}"] = round(
                runs["fp16"][1] / runs[name][1], 2)
    out["rss_max_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    out["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
