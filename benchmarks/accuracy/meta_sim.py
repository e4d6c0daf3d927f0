"""Simulated compact metadata: teacher-forced KL of scale-only (symmetric) quantization of keys and/or values.

    .venv/bin/python benchmarks/accuracy/meta_sim.py N VARIANT[,VARIANT...] \
        --profile benchmarks/calibration/qwen2.5-0.5b-full-smooth.json

A decision aid for issue #16 item 2 (metadata <= 8 B per token and head), run BEFORE building a storage format:
VARIANT is ``asym`` (today's (scale, zero) per group), ``symK``, ``symV`` or ``symKV``. A symmetric tensor is
quantized as ``x ~ (q - qmax / 2) * scale`` with ``scale = max|x| / (qmax / 2)`` rounded up to fp16: the grid a
scale-only format would store (no zero). It is simulated inside today's storage by writing the implied zero
``-scale * qmax / 2`` (rounded to fp16), so the bytes counted are today's; only the KL matters here.
The cache runs on the torch reference backend (the only one that quantizes through ``diffkv.core.page_io``), on
the recorded GSM8K answers of the full cache, like ``quant_kl.py``. One JSON line per variant.
"""

import argparse
import json
import time
from itertools import islice

import torch
from quant_kl import full_cache_traces  # a sibling script: its folder is on sys.path when this one runs

import diffkv.core.page_io as page_io
from diffkv.core.quant import SCALE_FLOOR, max_code, round_to
from diffkv.hf.generation import teacher_forced
from diffkv.integrations.transformers import DiffKVCache
from diffkv.profile import load_profile
from diffkv.registry.models import load_model

_quantize = page_io.quantize


def sym_quantize(x, bits, group_size=None, meta_dtype=torch.float16, validate=True):
    """Scale-only quantization in quantize()'s signature: codes [..., D] uint8, scale, implied zero [..., G]."""
    xf = x.float()
    g = x.shape[-1] if group_size is None else group_size
    xg = xf.reshape(*x.shape[:-1], x.shape[-1] // g, g)
    half = max_code(bits) / 2
    amax = xg.abs().amax(-1)
    scale = round_to((amax / torch.full_like(amax, half)).clamp_min(SCALE_FLOOR), meta_dtype, up=True)
    q = torch.round(xg / scale.float().unsqueeze(-1) + half).clamp_(0, max_code(bits)).to(torch.uint8)
    return q.reshape(x.shape), scale, (-scale.float() * half).to(meta_dtype)


def use(variant: str) -> None:
    """Route page_io._encode's quantize to the symmetric one for the tensors ``variant`` names."""
    sym = {"asym": (), "symK": ("keys",), "symV": ("values",), "symKV": ("keys", "values")}[variant]
    encode = page_io._encode.__wrapped__ if hasattr(page_io._encode, "__wrapped__") else page_io._encode

    def wrapped(x, name, *args, **kwargs):
        page_io.quantize = sym_quantize if name in sym else _quantize
        try:
            return encode(x, name, *args, **kwargs)
        finally:
            page_io.quantize = _quantize
    wrapped.__wrapped__ = encode
    page_io._encode = wrapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int)
    ap.add_argument("variants")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--profile", required=True)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    cfg = load_profile(args.profile, model).config
    seqs = full_cache_traces(model, tok, args.model, args.n, args.tokens)
    with torch.no_grad():
        for variant in args.variants.split(","):
            use(variant)
            start, kls, top1, fp16, held = time.time(), [], [], 0, 0
            for context, ids, ref in seqs:
                cache = DiffKVCache(model, cfg, attention_backend="torch")
                got = torch.stack(list(islice(teacher_forced(model, ids, context, cache), 1, None)), 1)[0]
                st = cache.stats()
                cache.release()
                kls.append((ref.exp() * (ref - got)).sum(-1))
                top1.append((ref.argmax(-1) == got.argmax(-1)).float())
                fp16, held = fp16 + st["fp16_bytes"], held + st["bytes_in_pages"]
            kl = torch.cat(kls)
            print(json.dumps({"model": args.model, "variant": variant, "profile": args.profile, "samples": args.n,
                              "tokens": args.tokens, "kl": round(float(kl.mean()), 5),
                              "kl_p95": round(float(kl.quantile(0.95)), 4),
                              "top1": round(float(torch.cat(top1).mean()), 4),
                              "compression_physical_today": round(fp16 / held, 3),
                              "seconds": round(time.time() - start)}), flush=True)


if __name__ == "__main__":
    main()
