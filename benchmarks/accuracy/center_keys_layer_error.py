"""Per layer: 4-bit per-token key error with and without subtracting the heads' median prompt key (center_keys).

    .venv/bin/python benchmarks/accuracy/center_keys_layer_error.py > benchmarks/accuracy/center_keys_layer_error.txt

One GSM8K prompt plus the first tokens of the full cache's own answer (qwen2.5-0.5b, 400 tokens at most) go through
the model once; per layer, over all KV heads and tokens: mean and max of ||fq(k - c) - (k - c)|| / ||k|| (c = 0 and
c = per-channel median of the prompt keys; fq = 4-bit asymmetric quantization over the whole head_dim, as K4).
"""

import json
from pathlib import Path

import torch
from transformers import DynamicCache

from diffkv.eval.tasks import get_task
from diffkv.registry.models import load_model


def fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-8)
    return ((x - lo) / scale).round() * scale + lo


def main() -> None:
    model, tok = load_model("qwen2.5-0.5b")
    samples = {s["id"]: s for s in get_task("gsm8k").samples(tok)}
    row = json.loads(Path("benchmarks/accuracy/qwen2.5-0.5b/gsm8k/full/samples.jsonl").read_text().splitlines()[0])
    prompt = tok.apply_chat_template(samples[row["id"]]["messages"], add_generation_prompt=True, tokenize=False)
    ids = tok(prompt + row["output"], return_tensors="pt", add_special_tokens=False).input_ids[:, :400]
    n_prompt = len(tok(prompt, add_special_tokens=False).input_ids)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    print(f"sample {row['id']}: {n_prompt} prompt tokens, {ids.shape[1]} in all; relative 4-bit key error")
    print("layer  mean: plain -> centered   max: plain -> centered   (token of the centered max)")
    for i, layer in enumerate(cache.layers):
        k = layer.keys[0].float()  # [H, T, D]
        c = k[:, :n_prompt].median(dim=1).values[:, None]
        plain = (fake_quant(k, 4) - k).norm(dim=-1) / k.norm(dim=-1)
        centered = (fake_quant(k - c, 4) - (k - c)).norm(dim=-1) / k.norm(dim=-1)
        worst = int(centered.max(dim=0).values.argmax())
        print(f"{i:>5}  {plain.mean():.3f} -> {centered.mean():.3f}    {plain.max():.2f} -> {centered.max():.2f}"
              f"    ({worst})")


if __name__ == "__main__":
    main()
