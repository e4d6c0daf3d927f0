"""Where the pages go at the shared-prefix bench's peak (issue #62): the workload of ``run.py`` (seed 0, 32
questions) through the engine with prefix caching; at the step with the most pages in use, the pages of the
prefix's slot and, per reader, the pages it holds alone (its own tokens' pages and any copied partial pages).

    PYTHONPATH=benchmarks/serve/prefix .venv/bin/python benchmarks/serve/prefix/reader_pages.py
"""

from __future__ import annotations

import argparse
import json

import torch
from run import workload  # this folder's run.py

from diffkv.engine import Engine, SamplingParams, make_cache
from diffkv.eval.methods import get_method
from diffkv.registry.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--profile", default="qwen2.5-0.5b", help="path or shipped name")
    ap.add_argument("--questions", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    prefix, questions = workload(tok, args.questions, 2000, 0)
    prompts = [prefix + q for q, _ in questions]
    cfg = get_method("diffkv").storage(model, args.profile or None)
    cache = make_cache("diffkv", model, config=cfg, kv_budget_bytes=512 << 20, max_slots=args.questions + 2,
                       max_model_len=max(map(len, prompts)) + 20)
    eng = Engine(model, tok, cache, prefix_cache=True)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True), prefix_tokens=len(prefix))
    peak, at_peak = 0, None
    store = cache.store
    while eng.has_work():
        eng.step()
        used = eng.metrics()["pages_used"]
        if used > peak:
            readers = list(store.shares.of)
            source = {s for s, _ in store.shares.of.values()}
            own = {r: store.held([r])["pages"] - int(store.shares.of[r][1].sum()) for r in readers}
            peak, at_peak = used, {"source_pages": store.held(sorted(source))["pages"], "readers": len(readers),
                                   "reader_own_pages": sorted(own.values())}
    own = at_peak["reader_own_pages"]
    print(json.dumps({"peak_pages": peak, "page_bytes": cache.plan.page_bytes, **at_peak,
                      "mean_reader_own_pages": round(sum(own) / max(len(own), 1), 1)}, indent=1))


if __name__ == "__main__":
    main()
