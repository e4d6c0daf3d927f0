"""Issue #62 item 4: does prompt-lookup decoding give the tokens of plain decoding in generate() with DiffKVConfig()?
smollm2-135m, a 794-token essay prompt, 60 greedy tokens, each with and without ``invariant_rows`` (every linear
layer in 16-row blocks, the engine's batch-invariant numerics), with the prompt stored by the first call (the
default) or staged until its drafts are known (``chunked_prefill="deferred"``). Prints where the texts first differ.

    .venv/bin/python benchmarks/serve/batch_invariance/prompt_lookup.py
    .venv/bin/python benchmarks/serve/batch_invariance/prompt_lookup.py --profile profiles/smollm2-135m.json
"""
import argparse
import contextlib

import torch

from diffkv import DiffKVCache, DiffKVConfig
from diffkv.engine.invariance import invariant_rows
from diffkv.registry.data import load_dataset
from diffkv.registry.models import load_model


def generate(model, ids: dict, lookup: bool, invariant: bool, chunked: str = "extend", profile=None) -> list[int]:
    """60 greedy tokens through a fresh DiffKVCache (DiffKVConfig() or ``profile``), with prompt-lookup drafts or
    without."""
    cache = (DiffKVCache.from_profile(model, profile, chunked_prefill=chunked) if profile else
             DiffKVCache(model, DiffKVConfig(), chunked_prefill=chunked))
    kw = dict(prompt_lookup_num_tokens=10) if lookup else {}
    rows = invariant_rows(model) if invariant else contextlib.nullcontext()
    with torch.no_grad(), rows:
        out = model.generate(**ids, past_key_values=cache, max_new_tokens=60, do_sample=False, **kw)
    cache.release()
    return out[0, ids["input_ids"].shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="a profile for smollm2-135m instead of DiffKVConfig()")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m")
    essay = load_dataset("pg-essays")[3]["text"]
    ids = tok(essay[:4000] + "\n\nSummarize the essay above in one paragraph:\n", return_tensors="pt")
    ids = {k: v[:, -794:] for k, v in ids.items()}
    print("prompt tokens", ids["input_ids"].shape[1])
    for invariant in (False, True):
        for chunked in ("extend", "deferred"):
            plain, lookup = (generate(model, ids, lookup, invariant, chunked, args.profile) for lookup in (False, True))
            first = next((i for i, (x, y) in enumerate(zip(plain, lookup, strict=False)) if x != y), None)
            print("invariant_rows" if invariant else "plain linear", f"chunked_prefill={chunked}:",
                  "equal" if first is None else f"differ at {first}")


if __name__ == "__main__":
    main()
