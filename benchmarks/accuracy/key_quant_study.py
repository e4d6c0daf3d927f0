"""Which key-quantization scheme survives 4 bits (and 3, 2)? A teacher-forced study, not library code.

    nice -n 5 .venv/bin/python benchmarks/accuracy/key_quant_study.py --model qwen2.5-0.5b --n 8 --tokens 160 \
        --grid '16/4,2/tok;8/4/tok,bias,chan;4/4/all' --resume   # appends to key_quant_study.jsonl
    .venv/bin/python benchmarks/accuracy/key_quant_study.py --table   # markdown tables from the .jsonl

For the first N samples of ``benchmarks/accuracy/<model>/gsm8k/full/samples.jsonl`` (chat prompt as in
``quant_kl.py``, then the first ``--tokens`` tokens of the full cache's own answer; a model without recorded traces
gets its own greedy answer, generated here without any compression) the whole prompt+answer runs in ONE forward
pass, no cache. A custom attention function registered with transformers' ``AttentionInterface`` fake-quantizes
the post-RoPE keys and values ([B, H_kv, T, D]) of every layer and then calls SDPA, so every token's key and value
is quantized (the worst case: no high tier, no recent window). Reported per model x scheme x bits: KL(full ||
quantized) of the next-token distributions over the answer tokens (mean, p95), top-1 agreement and the bytes per
token and KV head (codes + metadata, keys + values).

Key schemes (flags joined by ``+``; values are always per-token asymmetric, the library's codec):

* ``tok``: per-token asymmetric over the whole head_dim, fp16 scale + zero (what the library does);
* ``bias``: quantize ``k - RoPE(pos) b_k`` (b_k = the layer's k_proj bias per KV head, rotated by the model's own
  rotary embedding) and add ``RoPE(pos) b_k`` back exactly; free (the bias is a model constant, the position is
  known at attention time);
* ``rot``: per (layer, KV head) randomized Hadamard rotation (fixed seed) before quantization, rotated back after
  (equivalently: queries rotated the same way); free;
* ``sink``: the first 4 tokens' keys kept in fp16 (values are quantized as all others); costs 2 D bytes per sink
  token, amortized over the sequence;
* ``chan``: KIVI's axis: per channel, asymmetric over groups of 32 consecutive tokens (the last partial group too),
  fp16 scale + zero per channel and group: 4 D bytes per group, amortized over the tokens of the group;
* ``center``: the library's ``center_keys``: subtract the per-channel median of the prompt keys (per head), add it
  back; costs D fp32 per head and sequence, amortized over the sequence.
* ``smooth``: per (layer, KV head) and channel, the prompt keys' mid-range ``c`` and half-range ``s`` (fp16), frozen
  after the prompt; every key is stored as ``(k - c) / s`` quantized per token and read back as ``code * s + c``.
  Streaming-friendly (no page-level scales, nothing to close): attention folds ``s`` into the query (``q * s``) and
  ``q . c`` is the same for every token, so it cancels in the softmax. Costs 2 D fp16 per head and sequence.

The quantizer is :mod:`diffkv.core.quant`'s math (fp16 zero rounded down, scale rounded up, round-half-even,
clamp), written here for any bit width (3 bits has no library codec) and checked bit-identical with
``diffkv.core.quant`` at 8, 4 and 2 bits at start-up. Sanity rows: ``K16`` (keys and values rounded to fp16) must
give KL ~ 0; ``hook`` checks that the attention function ran once per layer and forward.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from diffkv.core import quant
from diffkv.eval.tasks import get_task
from diffkv.registry.models import load_model

ATTN = "key_quant_study"
SINKS = 4
PAGE = 32
SEED = 1234
OUT = Path("benchmarks/accuracy/key_quant_study.jsonl")
SCHEMES = ("tok", "bias", "rot", "rot+bias", "center", "chan", "chan+bias",
           "sink", "sink+bias", "sink+rot+bias", "sink+center", "sink+chan+bias",
           "smooth", "smooth+bias", "sink+smooth", "smooth+rot")
FLAGS = ("tok", "bias", "rot", "center", "chan", "sink", "smooth")


class State:
    """What the attention function does on the current forward (module-level: transformers passes no handle)."""

    active = False
    flags: frozenset = frozenset()
    kbits = vbits = 16
    prompt_len = 0
    cos = sin = None  # [1, T, D] of the current sequence
    signs = None  # [L, H, D] +-1 of the randomized Hadamard rotations
    hadamard = None  # [D, D] orthonormal Sylvester matrix
    calls = 0
    page = PAGE  # tokens per group of the per-channel ("chan") scales


def fq(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Fake-quantize ``x`` (fp32) along its last dimension, one group: diffkv.core.quant's asymmetric min-max math."""
    if bits >= 16:
        return x.half().float()
    qmax = (1 << bits) - 1
    zero = quant.round_to(x.amin(-1) + 0.0, torch.float16, up=False).float()
    span = x.amax(-1) - zero
    scale = quant.round_to((span / torch.full_like(span, qmax)).clamp_min(quant.SCALE_FLOOR), torch.float16,
                           up=True).float()
    q = torch.round((x - zero[..., None]) / scale[..., None]).clamp_(0, qmax)
    return q * scale[..., None] + zero[..., None]


def fq_channel(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per channel over groups of State.page consecutive tokens (x: [B, H, T, D]; the last group may be partial)."""
    page = State.page
    return torch.cat([fq(x[:, :, s:s + page].transpose(-1, -2), bits).transpose(-1, -2)
                      for s in range(0, x.shape[2], page)], 2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def quant_keys(module, key: torch.Tensor) -> torch.Tensor:
    st, k = State, key.float()
    if st.kbits >= 16:
        return k.half().float().to(key.dtype)
    _, h, t, d = k.shape
    off = torch.zeros_like(k[:, :, :1])
    if "bias" in st.flags:
        b = module.k_proj.bias.float().view(h, d)[None, :, None, :]  # [1, H, 1, D]
        off = b * st.cos[:, None] + rotate_half(b) * st.sin[:, None]  # RoPE(pos) b: [1, H, T, D]
    if "center" in st.flags:  # torch's median is the lower median, as nanmedian in diffkv/core/compressor.py
        off = k[:, :, :st.prompt_len].median(dim=2).values[:, :, None, :]
    x = k - off
    s0 = SINKS if "sink" in st.flags else 0
    body = x[:, :, s0:]
    mid = half = None
    if "smooth" in st.flags:  # per-channel mid-range and half-range of the prompt's keys (after the sinks), fp16
        lo = body[:, :, :max(st.prompt_len - s0, 1)].amin(2, keepdim=True)
        hi = body[:, :, :max(st.prompt_len - s0, 1)].amax(2, keepdim=True)
        mid = ((hi + lo) / 2).half().float()
        half = ((hi - lo) / 2).clamp_min(1e-3).half().float()
        body = (body - mid) / half
    if "rot" in st.flags:
        q = st.signs[module.layer_idx][:, :, None] * st.hadamard  # [H, D, D]: diag(s) H, orthonormal
        body = torch.einsum("bhtd,hde->bhte", body, q)
    body = fq_channel(body, st.kbits) if "chan" in st.flags else fq(body, st.kbits)
    if "rot" in st.flags:
        body = torch.einsum("bhte,hde->bhtd", body, q)
    if mid is not None:
        body = body * half + mid
    out = torch.cat([x[:, :, :s0], body], 2) + off
    out[:, :, :s0] = k[:, :, :s0].half().float()  # sinks: fp16 as stored
    return out.to(key.dtype)


def study_attention(module, query, key, value, attention_mask, **kwargs):
    State.calls += 1
    if State.active:
        key = quant_keys(module, key)
        value = fq(value.float(), State.vbits).to(value.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def sylvester(d: int) -> torch.Tensor:
    if d & (d - 1):
        raise ValueError(f"head_dim {d} is not a power of two: no Sylvester Hadamard matrix")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def key_bytes(flags: frozenset, bits: int, d: int, t: int) -> float:
    """Bytes per token and head of the keys of a t-token sequence under a scheme (fp16 metadata)."""
    if bits >= 16:
        return 2.0 * d
    s0 = SINKS if "sink" in flags else 0
    n = t - s0
    codes = n * d * bits / 8
    meta = 4 * d * math.ceil(n / State.page) if "chan" in flags else 4 * n
    extra = 2 * d * s0 + (4 * d if "center" in flags or "smooth" in flags else 0)  # fp16 sinks; per-head vectors
    return (codes + meta + extra) / t


def value_bytes(bits: int, d: int) -> float:
    return 2.0 * d if bits >= 16 else d * bits / 8 + 4


def check_codec() -> None:
    x = torch.randn(64, 8, 64) * 30 + torch.randn(64, 1, 64) * 200
    for bits in (8, 4, 2):
        ref = quant.dequantize(*quant.quantize(x, bits))
        if not torch.equal(fq(x, bits), ref):
            raise AssertionError(f"fake quantizer differs from diffkv.core.quant at {bits} bits")


def load_sequences(model, tok, name: str, n: int, tokens: int) -> tuple[list, str]:
    samples = {s["id"]: s for s in get_task("gsm8k").samples(tok)}
    path = Path(f"benchmarks/accuracy/{name}/gsm8k/full/samples.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()][:n] if path.exists() else None
    seqs = []
    for i in range(n):
        sid = rows[i]["id"] if rows else f"gsm8k-{i}"
        prompt = tok.apply_chat_template(samples[sid]["messages"], add_generation_prompt=True, tokenize=False)
        pid = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        if rows:
            oid = tok(rows[i]["output"], return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
        else:  # own greedy answer, full precision
            out = model.generate(pid, attention_mask=torch.ones_like(pid), max_new_tokens=tokens, do_sample=False)
            oid = out[:, pid.shape[1]:]
        seqs.append((pid.shape[1], torch.cat([pid, oid], 1)))
    return seqs, (str(path) if rows else "own greedy answers to gsm8k-0..N-1 (no recorded traces)")


def run_model(args, name: str, out) -> None:
    model, tok = load_model(name)
    AttentionInterface.register(ATTN, study_attention)
    AttentionMaskInterface.register(ATTN, sdpa_mask)
    model.set_attn_implementation(ATTN)
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, layers = cfg.num_key_value_heads, cfg.num_hidden_layers
    has_bias = all(m.k_proj.bias is not None for m in model.modules() if hasattr(m, "k_proj"))
    State.hadamard = sylvester(d)
    State.signs = (torch.randint(0, 2, (layers, h, d), generator=torch.Generator().manual_seed(SEED)) * 2 - 1).float()
    with torch.no_grad():
        seqs, source = load_sequences(model, tok, name, args.n, args.tokens)
        refs, ropes = [], []
        for context, ids in seqs:
            pos = torch.arange(ids.shape[1])[None]
            ropes.append(model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos))
            State.active, State.calls = False, 0
            logits = model(ids, logits_to_keep=ids.shape[1] - context + 1).logits[0, :-1].float()
            assert State.calls == layers, f"attention hook ran {State.calls} times, expected {layers}"
            refs.append(torch.log_softmax(logits, -1))
    n_tok = sum(r.shape[0] for r in refs)
    print(f"# {name}: {len(seqs)} sequences, {n_tok} answer tokens, lengths "
          f"{[int(ids.shape[1]) for _, ids in seqs]}, source {source}", file=sys.stderr, flush=True)
    lengths = [int(ids.shape[1]) for _, ids in seqs]

    runs = [("tok", 16, 16)] if args.sanity else []  # fp16 keys and values: KL must be ~0
    for kbits, vbits, schemes in args.grid:
        for kb, vb, scheme in ((kb, vb, s) for kb in kbits for vb in vbits for s in schemes):
            if not has_bias:  # no k_proj bias (Llama): "bias" is a no-op, drop it
                scheme = "+".join(f for f in scheme.split("+") if f != "bias") or "tok"
            if kb >= 16:
                scheme = "tok"  # fp16 keys: the scheme plays no role
            if (scheme, kb, vb) not in runs:
                runs.append((scheme, kb, vb))
    done = set()
    if args.resume and args.out.exists():
        for line in args.out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["model"], r["scheme"], r["kbits"], r["vbits"]))
    command = " ".join(["nice -n 5", ".venv/bin/python", *map(shlex.quote, sys.argv)])
    for scheme, kb, vb in runs:
        label = scheme if State.page == PAGE or "chan" not in scheme else f"{scheme}@{State.page}"
        if (name, label, kb, vb) in done:
            continue
        flags = frozenset(scheme.split("+"))  # label: the scheme, with "@PAGE" for chan at a non-default page
        State.flags, State.kbits, State.vbits, State.active = flags, kb, vb, True
        start, kls, agree = time.time(), [], []
        with torch.no_grad():
            for (context, ids), ref, (cos, sin) in zip(seqs, refs, ropes, strict=True):
                State.prompt_len, State.cos, State.sin, State.calls = context, cos, sin, 0
                logits = model(ids, logits_to_keep=ids.shape[1] - context + 1).logits[0, :-1].float()
                got = torch.log_softmax(logits, -1)
                assert State.calls == layers
                kls.append((ref.exp() * (ref - got)).sum(-1).clamp_min(0))
                agree.append((ref.argmax(-1) == got.argmax(-1)).float())
        kl, top1 = torch.cat(kls), torch.cat(agree)
        kbytes = sum(key_bytes(flags, kb, d, t) * t for t in lengths) / sum(lengths)
        row = {"model": name, "scheme": label, "kbits": kb, "vbits": vb,
               "kl_mean": round(float(kl.mean()), 5), "kl_p95": round(float(kl.quantile(0.95)), 5),
               "top1": round(float(top1.mean()), 4),
               "bytes_per_token_head": round(kbytes + value_bytes(vb, d), 3), "key_bytes": round(kbytes, 3),
               "fp16_bytes": 4 * d, "n_tokens": n_tok, "n_samples": len(seqs),
               "mean_seq_len": round(sum(lengths) / len(lengths), 1),
               "seconds": round(time.time() - start, 1), "source": source, "command": command}
        print(json.dumps(row), file=out, flush=True)
        print(f"{name} {label:14s} K{kb}V{vb}  kl {row['kl_mean']:.4f}  p95 {row['kl_p95']:.4f}  "
              f"top1 {row['top1']:.3f}  B/tok/head {row['bytes_per_token_head']:.1f}  {row['seconds']} s",
              file=sys.stderr, flush=True)


def table(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for model in dict.fromkeys(r["model"] for r in rows):
        for vb in sorted({r["vbits"] for r in rows if r["model"] == model}, reverse=True):
            sel = [r for r in rows if r["model"] == model and r["vbits"] == vb]
            print(f"\n**{model}, values {vb} bits** (bytes = keys + values per token and KV head; fp16 = "
                  f"{sel[0]['fp16_bytes']} B)\n")
            print("| scheme | K bits | KL mean | KL p95 | top-1 | key B | total B |")
            print("|---|---|---|---|---|---|---|")
            order = {sc: i for i, sc in enumerate(dict.fromkeys((*SCHEMES, *(r["scheme"] for r in sel))))}
            for r in sorted(sel, key=lambda r: (-r["kbits"], order[r["scheme"]])):
                print(f"| {r['scheme']} | {r['kbits']} | {r['kl_mean']:.4f} | {r['kl_p95']:.4f} | "
                      f"{100 * r['top1']:.1f} % | {r['key_bytes']:.1f} | {r['bytes_per_token_head']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", help="comma-separated model names")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--kbits", default="4,3,2")
    ap.add_argument("--vbits", default="4,2")
    ap.add_argument("--grid", default=None, help="instead of --kbits/--vbits/--schemes: KBITS/VBITS/SCHEMES items "
                    "joined by ';', e.g. '16,8/4/tok,bias;4/4/all' (all = every scheme)")
    ap.add_argument("--page", type=int, default=PAGE, help=f"tokens per per-channel group of chan (default {PAGE}); "
                    "rows get the scheme name chan...@PAGE when it is not the default")
    ap.add_argument("--no-sanity", dest="sanity", action="store_false", help="skip the K16V16 (fp16) row")
    ap.add_argument("--resume", action="store_true", help="skip rows already in the .jsonl")
    ap.add_argument("--table", action="store_true", help="print markdown tables of the .jsonl and exit")
    ap.add_argument("--out", type=Path, default=OUT, help=f"JSON lines output, appended (default {OUT})")
    args = ap.parse_args()
    if args.table:
        return table(args.out)
    grid = args.grid or f"{args.kbits}/{args.vbits}/{args.schemes}"
    args.grid = []
    for item in grid.split(";"):
        kbits, vbits, schemes = item.split("/")
        schemes = SCHEMES if schemes == "all" else tuple(schemes.split(","))
        if any(f not in FLAGS for sc in schemes for f in sc.split("+")):
            ap.error(f"unknown scheme in {schemes}; flags are {FLAGS}")
        args.grid.append(([int(b) for b in kbits.split(",")], [int(b) for b in vbits.split(",")], schemes))
    torch.set_num_threads(2)
    State.page = args.page
    check_codec()
    with args.out.open("a") as out:
        for name in args.model.split(","):
            run_model(args, name, out)


if __name__ == "__main__":
    main()
