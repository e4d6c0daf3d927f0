"""Peak bytes a DiffKVCache holds while a prompt arrives in chunks, for both designs of issue #44 item 2, and the
whole-prompt prefill for reference (one 4k needle prompt, qwen2.5-0.5b, shipped profile, 1472-B pages).

``extend``: the first chunk is compressed at once, each later one appended by KVStore.extend (what the cache holds
grows with the compressed prompt). ``deferred``: every chunk is held at full precision (the model's dtype) until
the first decode step, then split as one prompt. Measured: ``cache.nbytes()`` after every chunk (the peak is the
largest), and after the first generated token.

    python benchmarks/accuracy/chunked/peak.py --out benchmarks/accuracy/chunked/peak.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from diffkv.eval.runner import encode_prompt
from diffkv.eval.tasks import get_task
from diffkv.integrations.transformers import DiffKVCache
from diffkv.profile import load_profile
from diffkv.registry.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--profile", default="profiles/qwen2.5-0.5b.json")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    config = dataclasses.replace(load_profile(args.profile, model).config, page_bytes=1472)
    sample = get_task("needle").samples(tok, options={"lengths": (args.length,), "depths": (0.5,)})[0]
    ids = torch.tensor([encode_prompt(tok, sample)])
    rows = []
    for mode, chunk in (("whole", ids.shape[1]), ("extend", args.chunk), ("deferred", args.chunk)):
        cache = DiffKVCache(model, config, chunked_prefill="deferred" if mode == "deferred" else "extend")
        held, t0 = [], time.perf_counter()
        with torch.no_grad():
            for s in range(0, ids.shape[1], chunk):
                out = model(ids[:, s:s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
                held.append(cache.nbytes())
            model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)  # the first decode step
        stats = cache.stats()
        rows.append({"mode": mode, "chunk": chunk, "peak_bytes_during_prefill": max(held),
                     "bytes_after_first_decode_step": cache.nbytes(), "seconds": round(time.perf_counter() - t0, 1),
                     "compression_physical": round(stats["compression_physical"], 3)})
        print(rows[-1], flush=True)
        cache.release()
    out = {"command": f"python benchmarks/accuracy/chunked/peak.py --model {args.model} --profile {args.profile} "
                      f"--length {args.length} --chunk {args.chunk}", "prompt_tokens": ids.shape[1], "rows": rows,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
