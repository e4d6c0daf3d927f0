"""A prefix-cache miss in the serving engine with repeat scores (qwen2.5-0.5b, the method of
``benchmarks/serve/prefix/run.py``), two ways, side by side on one thread, rounds alternating:
``one``: ``PrefixCache`` as it is, the re-read pass scores the prefix and stores it (``repeat_store``, 2 L + bridge
tokens of forward); ``two``: the engine's path before 2026-12-06, the re-read pass for the scores and then the
prefix's own forward into its slot (3 L + bridge). The old hand-over of the scores is gone from the code, so ``two``
runs its second forward into a window-scored twin of the engine: the same forwards, the tiers from other scores.
Prints a JSON line per run (seconds, the slot's bytes, peak RSS so far) and the median ratio two / one.

    .venv/bin/python benchmarks/repeat_scores/engine_prefix_speed.py [--tokens 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import time

import torch

from diffkv.engine import Engine, make_cache
from diffkv.eval.methods import get_method
from diffkv.hf.repeat_scores import repeat_scores
from diffkv.prompts import essay_tokens
from diffkv.registry.models import load_model

METHOD = 'diffkv@x256+importance="peak"+prompt_scores="repeat"'


def miss(eng: Engine, twin: Engine, ids: list[int], variant: str) -> tuple[float, int]:
    """Seconds to prefill the prefix ``ids`` into a new slot, and the bytes the slot holds; the slot is closed.
    ``twin``: the engine with window scores that takes ``two``'s second forward."""
    x = torch.tensor([ids])
    start = time.perf_counter()
    if variant == "one":
        slot = eng.prefix._prefill(ids, x.device)
    else:
        eng = twin
        slot = eng.cache.open_slot()
        with torch.inference_mode():
            repeat_scores(eng.model, x, torch.ones_like(x), twin.prefix.bridge)
            eng.model(input_ids=x, position_ids=torch.arange(len(ids))[None], use_cache=True,
                      past_key_values=eng.cache.prefix_step_cache(slot, len(ids)), logits_to_keep=1)
    seconds = time.perf_counter() - start
    held = eng.cache.store.held([slot])["bytes_in_pages"]
    eng.cache.close_slot(slot)
    return seconds, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--profile", default="profiles/qwen2.5-0.5b.json")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    ids = essay_tokens(tok, args.tokens)
    cfg = get_method(METHOD).storage(model, args.profile)
    engines = [Engine(model, tok, make_cache("diffkv", model, config=c, kv_budget_bytes=256 << 20, max_slots=4,
                                             max_model_len=args.tokens + 16), prefix_cache=True)
               for c in (cfg, dataclasses.replace(cfg, prompt_scores="window"))]
    for variant in ("one", "two"):
        miss(*engines, ids[:64], variant)  # warm-up
    times: dict[str, list[float]] = {"one": [], "two": []}
    for r in range(args.rounds):
        for variant in ("one", "two") if r % 2 == 0 else ("two", "one"):
            seconds, held = miss(*engines, ids, variant)
            times[variant].append(seconds)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            print(json.dumps({"round": r, "variant": variant, "tokens": len(ids), "seconds": round(seconds, 2),
                              "slot_bytes": held, "peak_rss_gib": round(rss, 2)}), flush=True)
    ratio = statistics.median(times["two"]) / statistics.median(times["one"])
    print(json.dumps({"median_two_over_one": round(ratio, 3), "rounds": args.rounds,
                      "medians_s": {k: round(statistics.median(v), 2) for k, v in times.items()}}))


if __name__ == "__main__":
    main()
