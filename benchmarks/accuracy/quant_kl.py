"""Teacher-forced KL of KV-cache configurations vs the full cache on recorded GSM8K reasoning traces.

    .venv/bin/python benchmarks/accuracy/quant_kl.py N CFG[,CFG...] [--model qwen2.5-0.5b]

For the first N samples of ``benchmarks/accuracy/<model>/gsm8k/full/samples.jsonl`` the chat prompt is prefilled
into a DiffKVCache and the first ``--tokens`` (160) tokens of the full cache's own answer are fed one at a time;
every next-token distribution is compared with one forward pass of the whole sequence without cache. CFG: a tier name
for a uniform tier with alpha = 0 (``K8V4``, ``K8V4-g16/16``, ``K16V16`` ...), ``bf16`` (K16V16 rounded to bfloat16),
``default``, or ``profile`` / ``profile*S`` (``--profile``, every threshold multiplied by S, alpha_low capped
at 1: a more or less aggressive operating point of the same calibrated profile). Suffixes: ``~TIER`` replaces the
low tier (``profile~K4V2``), ``+c`` sets ``center_keys`` (``K4V4+c``, ``default+c``, ``profile~K4V2+c``), ``+s``
sets ``smooth_keys`` (``K4V4+s``, ``profile~K4V2+s``); without a suffix keys are per-token (``smooth_keys=False``),
or as the profile says. ``+w`` (combinable: ``profile*4+s+w``) sets ``score_after_window``, ``+m``
``compact_meta``, ``+k`` ``symmetric_keys``, ``+p`` ``importance="peak"`` (torch backend: ``--backend torch``).
One JSON line per CFG: mean KL(full || cache) per token (nats), its 95th percentile, top-1 agreement and the
physical compression and tier fractions over all the samples.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from diffkv.calibration.quality import decode_logprobs
from diffkv.core.config import DiffKVConfig
from diffkv.eval.methods import scale_thresholds
from diffkv.eval.tasks import get_task
from diffkv.profile import load_profile
from diffkv.registry.models import load_model


def full_cache_traces(model, tok, model_name: str, n: int, tokens: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """The first ``n`` recorded GSM8K answers of the full cache, cut to ``tokens``: (context length, ids [1, L],
    reference log-probs [L - context - 1, V] from one forward pass without cache) each."""
    samples = {s["id"]: s for s in get_task("gsm8k").samples(tok)}
    path = Path(f"benchmarks/accuracy/{model_name}/gsm8k/full/samples.jsonl")
    out = []
    with torch.no_grad():
        for line in path.read_text().splitlines()[:n]:
            r = json.loads(line)
            prompt = tok.apply_chat_template(samples[r["id"]]["messages"], add_generation_prompt=True, tokenize=False)
            pid = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            oid = tok(r["output"], return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
            ids = torch.cat([pid, oid], 1)
            out.append((pid.shape[1], ids, torch.log_softmax(model(ids).logits[0, pid.shape[1]:-1].float(), -1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int)
    ap.add_argument("configs")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--profile", default=None, help="profile for the profile / profile*S configs")
    ap.add_argument("--backend", default="auto", help="decode backend: auto, torch, cpu")
    args = ap.parse_args()
    if "profile" in args.configs and not args.profile:
        ap.error("the profile configs need --profile PATH")
    model, tok = load_model(args.model)
    traces = full_cache_traces(model, tok, args.model, args.n, args.tokens)
    seqs, refs = [(c, ids) for c, ids, _ in traces], [ref for *_, ref in traces]
    for spec in args.configs.split(","):
        name, *flags = spec.split("+")
        center, smooth = "c" in flags, "s" in flags
        name, _, low = name.partition("~")
        if name == "default":
            cfg = DiffKVConfig()
        elif name == "bf16":
            cfg = DiffKVConfig(high="K16V16", low="K16V16", alpha_high=0.0, alpha_low=0.0, raw_dtype="bfloat16")
        elif name.startswith("profile"):
            cfg = load_profile(args.profile, model).config
        else:
            cfg = DiffKVConfig(high=name, low=name, alpha_high=0.0, alpha_low=0.0)
        keys = ({"center_keys": True, "smooth_keys": False} if center else {"smooth_keys": True} if smooth
                else {"smooth_keys": cfg.smooth_keys if name.startswith("profile") else False})  # plain: per-token
        cfg = dataclasses.replace(cfg, **keys, **({"low": low} if low else {}),
                                  score_after_window="w" in flags or cfg.score_after_window,
                                  compact_meta="m" in flags or cfg.compact_meta,
                                  symmetric_keys="k" in flags or cfg.symmetric_keys,
                                  importance="peak" if "p" in flags else cfg.importance)
        if name.startswith("profile"):  # scaled last: peak thresholds have no alpha_low cap
            cfg = scale_thresholds(cfg, float(name.partition("*")[2] or 1))
        start, kls, top1, fp16, held, tiers = time.time(), [], [], 0, 0, {"high": 0, "low": 0, "pruned": 0}
        for (context, ids), ref in zip(seqs, refs, strict=True):
            got, stats = decode_logprobs(model, ids, context, cfg, backend=args.backend)
            kls.append((ref.exp() * (ref - got[0])).sum(-1))
            top1.append((ref.argmax(-1) == got[0].argmax(-1)).float())
            fp16, held = fp16 + stats["fp16_bytes"], held + stats["bytes_in_pages"]
            tiers = {k: v + stats["tokens_per_tier"][k] for k, v in tiers.items()}
        kl, agree = torch.cat(kls), torch.cat(top1)
        total = sum(tiers.values())
        print(json.dumps({"model": args.model, "cfg": spec, "samples": args.n, "tokens": args.tokens,
                          "kl": round(float(kl.mean()), 5), "kl_p95": round(float(kl.quantile(0.95)), 4),
                          "top1": round(float(agree.mean()), 4), "compression_physical": round(fp16 / held, 3),
                          "tier_fractions": {k: round(v / total, 3) for k, v in tiers.items()},
                          "seconds": round(time.time() - start)}), flush=True)


if __name__ == "__main__":
    main()
