"""Issue #62 item 4: does prompt-lookup decoding give the tokens of plain decoding in generate() with DiffKVConfig()?
smollm2-135m, essay prompts (~800 tokens: the first 4,000 characters of a pg-essays text and a request for a
summary), 60 greedy tokens, each with and without ``invariant_rows`` (every linear layer in 16-row blocks, the
engine's batch-invariant numerics), with the prompt stored by the first call (the default) or staged until its
drafts are known (``chunked_prefill="deferred"``), or told the prompt's length (``DiffKVCache.set_prompt_length``:
the drafts sent with it are appended as decode steps). ``--draft MODEL``: assisted decoding with that draft model
(same tokenizer, e.g. qwen2.5-0.5b for qwen2.5-1.5b; its own cache is transformers' default) instead of prompt
lookup. Prints where the texts first differ; ``--json`` keeps every row.

    .venv/bin/python benchmarks/serve/batch_invariance/prompt_lookup.py                # essay 3, all four modes
    .venv/bin/python benchmarks/serve/batch_invariance/prompt_lookup.py --profile profiles/smollm2-135m.json
    .venv/bin/python benchmarks/serve/batch_invariance/prompt_lookup.py --model qwen2.5-0.5b \
        --profile profiles/qwen2.5-0.5b.json --essays 16 --modes invariant-prompt-length --json out.json
    .venv/bin/python benchmarks/serve/batch_invariance/prompt_lookup.py --essays 16 --modes invariant-deferred \
        --json benchmarks/serve/batch_invariance/prompt_lookup16.json
    .venv/bin/python benchmarks/serve/batch_invariance/prompt_lookup.py --model qwen2.5-1.5b --draft qwen2.5-0.5b \
        --profile profiles/qwen2.5-1.5b.json --essays 16 --modes invariant-prompt-length --json out.json
"""
import argparse
import contextlib
import json
from pathlib import Path

import torch

from diffkv import DiffKVCache, DiffKVConfig
from diffkv.engine.invariance import invariant_rows
from diffkv.registry.data import load_dataset
from diffkv.registry.models import load_model

MODES = {"plain-extend": (False, "extend"), "plain-deferred": (False, "deferred"),
         "invariant-extend": (True, "extend"), "invariant-deferred": (True, "deferred"),
         "invariant-prompt-length": (True, "prompt-length")}  # extend + DiffKVCache.set_prompt_length


def generate(model, ids: dict, lookup: bool, invariant: bool, chunked: str = "extend", profile=None,
             draft=None) -> list[int]:
    """60 greedy tokens through a fresh DiffKVCache (DiffKVConfig() or ``profile``), with drafts (prompt lookup, or
    the ``draft`` model's) or without."""
    mode = "extend" if chunked == "prompt-length" else chunked
    cache = (DiffKVCache.from_profile(model, profile, chunked_prefill=mode) if profile else
             DiffKVCache(model, DiffKVConfig(), chunked_prefill=mode))
    if chunked == "prompt-length":  # the prompt prefilled alone, the drafts sent with it appended as decode steps
        cache.set_prompt_length(ids["input_ids"].shape[1])
    kw = {} if not lookup else dict(assistant_model=draft) if draft is not None else dict(prompt_lookup_num_tokens=10)
    rows = invariant_rows(model) if invariant else contextlib.nullcontext()
    with torch.no_grad(), rows:
        out = model.generate(**ids, past_key_values=cache, max_new_tokens=60, do_sample=False, **kw)
    cache.release()
    return out[0, ids["input_ids"].shape[1]:].tolist()


def essay_prompt(tok, text: str) -> dict:
    ids = tok(text[:4000] + "\n\nSummarize the essay above in one paragraph:\n", return_tensors="pt")
    return {k: v[:, -794:] for k, v in ids.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", help="a profile for the model instead of DiffKVConfig()")
    parser.add_argument("--draft", help="assisted decoding with this draft model instead of prompt lookup")
    parser.add_argument("--essays", type=int, help="the first N essays (default: essay 3 alone)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--json", type=Path, help="write one row per essay and mode here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    draft = None if args.draft is None else load_model(args.draft)[0]
    essays = load_dataset("pg-essays")
    which = range(args.essays) if args.essays else [3]
    rows = []
    for e in which:
        ids = essay_prompt(tok, essays[e]["text"])
        for mode in args.modes:
            invariant, chunked = MODES[mode]
            plain, lookup = (generate(model, ids, x, invariant, chunked, args.profile, draft) for x in (False, True))
            first = next((i for i, (x, y) in enumerate(zip(plain, lookup, strict=False)) if x != y), None)
            rows.append({"model": args.model, "essay": e, "prompt_tokens": ids["input_ids"].shape[1], "mode": mode,
                         "profile": args.profile, "draft": args.draft, "first_difference": first})
            print(f"essay {e} {mode}:", "equal" if first is None else f"differ at {first}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1) + "\n")
    for mode in args.modes:
        same = sum(r["first_difference"] is None for r in rows if r["mode"] == mode)
        print(f"{mode}: {same} / {len(which)} equal")


if __name__ == "__main__":
    main()
