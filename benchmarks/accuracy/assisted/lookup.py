"""Issue #44 item 4: prompt-lookup decoding through a DiffKVCache (drafts verified in one call, rejected ones
cropped), tokens/s with and without it, side by side in one process.

The prompt is an essay whose first paragraph is repeated at its end, so the lookup finds drafts. Rows: the lossless
cache (K16V16, alpha 0: output must equal greedy decoding without drafts) and the model's shipped profile (the
drafts change the scores and the prompt's split: the first verify call carries the prompt, so output may differ).

    python benchmarks/accuracy/assisted/lookup.py --out benchmarks/accuracy/assisted/lookup.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from diffkv import DiffKVConfig
from diffkv.integrations.transformers import DiffKVCache
from diffkv.prompts import essay_tokens
from diffkv.registry.models import load_model

LOSSLESS = DiffKVConfig(high="K16V16", low="K16V16", alpha_high=0.0, alpha_low=0.0, raw_dtype="float32",
                        smooth_keys=False)


def timed(model, cache, ids, n, lookup):
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, **kw)
    return out[0, ids.shape[1]:], time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context-tokens", type=int, default=800)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--lookup", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    ctx = essay_tokens(tok, args.context_tokens)
    ids = torch.tensor([ctx + ctx[:120]])
    rows = []
    for name, make in (("lossless", lambda: DiffKVCache(model, LOSSLESS)),
                       ("profile", lambda: DiffKVCache.from_profile(model, args.model))):
        plain, t_plain = timed(model, make(), ids, args.new_tokens, None)
        cache = make()
        drafted, t_drafted = timed(model, cache, ids, args.new_tokens, args.lookup)
        rows.append({"cache": name, "tokens_per_s_plain": round(args.new_tokens / t_plain, 2),
                     "tokens_per_s_lookup": round(args.new_tokens / t_drafted, 2),
                     "speedup": round(t_plain / t_drafted, 2), "same_output": bool(torch.equal(plain, drafted)),
                     "tokens_differing": int((plain != drafted).sum()),
                     "compression_physical_lookup": round(cache.stats()["compression_physical"], 2)})
        print(rows[-1], flush=True)
    out = {"command": f"python benchmarks/accuracy/assisted/lookup.py --model {args.model} --context-tokens "
                      f"{args.context_tokens} --new-tokens {args.new_tokens} --lookup {args.lookup}",
           "prompt_tokens": ids.shape[1], "rows": rows, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
