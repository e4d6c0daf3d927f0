"""Issue #62 item 4: does prompt-lookup decoding give the tokens of plain decoding in generate() with DiffKVConfig()?
smollm2-135m, a 794-token essay prompt, 60 greedy tokens, each with and without ``invariant_rows`` (every linear
layer in 16-row blocks, the engine's batch-invariant numerics). Prints where the two texts first differ.

    .venv/bin/python benchmarks/serve/batch_invariance/prompt_lookup.py
"""
import torch

from diffkv import DiffKVCache, DiffKVConfig
from diffkv.engine.invariance import invariant_rows
from diffkv.registry.models import load_model

torch.set_num_threads(1)
model, tok = load_model("smollm2-135m")
from diffkv.registry.data import load_dataset

essay = load_dataset("pg-essays")[3]["text"]
ids = tok(essay[:4000] + "\n\nSummarize the essay above in one paragraph:\n", return_tensors="pt")
ids = {k: v[:, -794:] for k, v in ids.items()}
print("prompt", ids["input_ids"].shape)
def run(lookup, inv, cfg):
    cache = DiffKVCache(model, cfg)
    kw = dict(prompt_lookup_num_tokens=10) if lookup else {}
    with torch.no_grad():
        if inv:
            with invariant_rows(model):
                out = model.generate(**ids, past_key_values=cache, max_new_tokens=60, do_sample=False, **kw)
        else:
            out = model.generate(**ids, past_key_values=cache, max_new_tokens=60, do_sample=False, **kw)
    cache.release()
    return out[0, ids["input_ids"].shape[1]:].tolist()
for inv in (False, True):
    a = run(False, inv, DiffKVConfig()); b = run(True, inv, DiffKVConfig())
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print("invariant" if inv else "plain", "equal" if a == b else f"differ at {first}")
