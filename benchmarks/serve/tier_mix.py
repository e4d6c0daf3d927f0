"""Tier mix of DiffKV on the `bench serve` prompts: where the tokens of a served sequence end up.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve/tier_mix.py --shots 0 --new-tokens 256,512
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve/tier_mix.py --shots 4 --new-tokens 256

The first ``--prompts`` GSM8K prompts of ``diffkv bench serve --shots N`` (cut to the shortest, so no padding) are
generated greedily through a ``DiffKVCache`` with the smollm2 profile for exactly each number of new tokens; one
JSON line per length with the tier fractions over all layers and heads and the physical compression.
"""

import argparse
import json

import torch

from diffkv.bench.serve import gsm8k_prompts
from diffkv.integrations.transformers import DiffKVCache
from diffkv.registry.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shots", type=int, default=0)
    ap.add_argument("--new-tokens", default="256")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--profile", default="profiles/smollm2-135m.json")
    args = ap.parse_args()
    model, tok = load_model("smollm2-135m")
    ids = gsm8k_prompts(tok, args.prompts, args.shots)
    shortest = min(map(len, ids))
    batch = torch.tensor([p[-shortest:] for p in ids])
    for n in map(int, args.new_tokens.split(",")):
        cache = DiffKVCache.from_profile(model, args.profile)
        with torch.no_grad():
            model.generate(batch, past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        st = cache.stats()
        cache.release()
        print(json.dumps({"shots": args.shots, "prompt_tokens": shortest, "new_tokens": n,
                          "tier_fractions": {k: round(v, 3) for k, v in st["tier_fractions"].items()},
                          "compression_physical": round(st["compression_physical"], 2)}), flush=True)


if __name__ == "__main__":
    main()
