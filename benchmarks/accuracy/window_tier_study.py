"""How far can bits alone go on reasoning traces? A teacher-forced study of two-format caches, not library code.

    nice -n 5 .venv/bin/python benchmarks/accuracy/window_tier_study.py --n 8 --tokens 384 \
        --old 'K4V2:smooth,K4V2:chan,K3V2:chan,K4V3:smooth' --resume       # appends to window_tier_study.jsonl
    .venv/bin/python benchmarks/accuracy/window_tier_study.py --table --plot   # markdown table, window_tier_study.png

Issue #30 asks whether per-channel key scales and 3-bit codes can carry GSM8K to >= 4.5x without pruning the
trace. This measures the best case of such a cache: for each query, the ``--window`` newest keys and values
(itself included) are read in the recent-window format (``--recent``, default K8V4 with smoothed keys, the
library's high tier) and every older token in the ``--old`` format; nothing is pruned and no old token is kept
high (the real cache keeps ~12 % of old tokens high: this is the quality floor at the byte ceiling). KL(full ||
cache) of the next-token distributions over the answer tokens of qwen's own greedy GSM8K answers
(``gen512/<model>/gsm8k/full``), one forward per sequence with a custom attention function.

Old-token key schemes (``KxVy:scheme``, values always per-token asymmetric over head_dim, as in the library):

* ``tok``: per-token asymmetric keys (the published codec);
* ``smooth``: the library's ``smooth_keys`` (per-channel mid-range / half-range of the prompt, then per token);
* ``chan`` / ``chan@G``: per channel over groups of G (32) **consecutive** tokens: the best case for per-channel
  scales; in DiffKV's low tier a page holds tokens demoted at different steps, not always neighbours;
* ``smooth+chan``: per-channel groups of the smoothed keys (the same codes up to the fp16 of the group metadata).
* ``chan+held``: the buildable form of ``chan`` (#30 item 1, "the open group held at the higher precision"): a
  group's scales can only be set once its last token has left the window, so until then all its tokens are read
  (and counted in the bytes) in the recent format. Causal, unlike ``chan``, whose groups may straddle the window.

Value schemes, after a slash (``K4V2:smooth/rot``): none (per token, as the library), ``rot`` (a randomized
Hadamard per layer and KV head first: the output is rotated back, so attention only pays D log D per query),
``lib`` (the library's ``rotate_values``: one sign vector for every layer and head, ``diffkv.core.rotation``) or
``smooth`` (the prompt values' per-channel mid-range and half-range taken out first, as ``smooth_keys`` for keys).

Bytes per token and KV head (the ``theoretical`` ratio, before pages): codes + fp16 metadata + 4 B of compact
bookkeeping; chan metadata ``4 D / G``; the smoothing vectors (``2 D`` fp32 per head and sequence) amortized.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
import key_quant_study as kq  # noqa: E402  (the fake quantizers and the sequence loader)

from diffkv.core import rotation  # noqa: E402
from diffkv.registry.models import load_model  # noqa: E402

ATTN = "window_tier_study"
OUT = Path("benchmarks/accuracy/window_tier_study.jsonl")
BOOKKEEPING = 4  # compact_meta: fp16 mean + int16 position


class Fmt:
    """One storage format: key bits + scheme, value bits."""

    def __init__(self, spec: str):
        tier, _, scheme = spec.partition(":")
        scheme, _, self.value_scheme = scheme.partition("/")
        if self.value_scheme not in ("", "rot", "lib", "smooth"):
            raise SystemExit(f"{spec}: value schemes are rot, lib and smooth")
        kb, vb = tier[1:].split("V")
        self.spec, self.kbits, self.vbits = spec, int(kb), int(vb)
        scheme = scheme or "tok"
        self.page = int(scheme.split("@")[1]) if "@" in scheme else kq.PAGE
        self.flags = frozenset(scheme.split("@")[0].split("+"))

    def keys(self, module, key: torch.Tensor) -> torch.Tensor:
        kq.State.flags, kq.State.kbits, kq.State.page = self.flags, self.kbits, self.page
        return kq.quant_keys(module, key)

    def values(self, module, value: torch.Tensor) -> torch.Tensor:
        """value: [B, H, T, D]. ``/rot``: per (layer, KV head) randomized Hadamard before per-token quantization,
        rotated back (the attention output would be); ``/smooth``: per channel, the prompt values' mid-range and
        half-range taken out first (the output gets them back: the softmax weights sum to 1)."""
        v = value.float()
        if self.value_scheme == "rot":
            q = kq.State.signs[module.layer_idx][:, :, None] * kq.State.hadamard  # [H, D, D], orthonormal
            rotated = kq.fq(torch.einsum("bhtd,hde->bhte", v, q), self.vbits)
            return torch.einsum("bhte,hde->bhtd", rotated, q).to(value.dtype)
        if self.value_scheme == "lib":  # exactly what DiffKVConfig(rotate_values=True) stores
            return rotation.unrotate(kq.fq(rotation.rotate(v), self.vbits)).to(value.dtype)
        if self.value_scheme == "smooth":
            prompt = v[:, :, :kq.State.prompt_len]
            lo, hi = prompt.amin(2, keepdim=True), prompt.amax(2, keepdim=True)
            mid, half = ((hi + lo) / 2).half().float(), ((hi - lo) / 2).clamp_min(1e-3).half().float()
            return (kq.fq((v - mid) / half, self.vbits) * half + mid).to(value.dtype)
        return kq.fq(v, self.vbits).to(value.dtype)

    def bytes(self, d: int) -> float:
        """Per token and head, long-sequence limit (without the per-sequence smoothing vectors)."""
        key = 2 * d if self.kbits >= 16 else d * self.kbits / 8 + (4 * d / self.page if "chan" in self.flags else 4)
        return key + kq.value_bytes(self.vbits, d) + BOOKKEEPING


class St:
    recent: Fmt = None
    old: Fmt = None
    window = 64
    active = False


def window_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Eager attention where query i reads token j in the recent format if i - j < window, else in the old one."""
    kq.State.calls += 1
    if not St.active:
        return kq.sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    b, hq, t, d = query.shape
    rep = hq // key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    rel = torch.arange(t)[:, None] - torch.arange(t)[None, :]
    near, far = (rel >= 0) & (rel < St.window), rel >= St.window
    if "held" in St.old.flags:  # old only once the token's whole group has left the window
        group_end = (torch.arange(t) // St.old.page + 1) * St.old.page - 1  # last position of j's group
        far = group_end[None, :] <= torch.arange(t)[:, None] - St.window
        near = (rel >= 0) & ~far
    logits, vals = [], []
    for fmt in (St.recent, St.old):
        k = fmt.keys(module, key).float().repeat_interleave(rep, 1)
        vals.append(fmt.values(module, value).float().repeat_interleave(rep, 1))
        logits.append(query.float() @ k.transpose(-1, -2) * scale)
    s = torch.where(near, logits[0], torch.where(far, logits[1], float("-inf")))
    p = torch.softmax(s, -1)
    out = (p * near) @ vals[0] + (p * far) @ vals[1]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=384, help="answer tokens per sequence (teacher-forced)")
    ap.add_argument("--recent", default="K8V4:smooth", help="format of the recent window")
    ap.add_argument("--old", default="K4V2:smooth", help="comma-separated formats of the older tokens")
    ap.add_argument("--window", default="64", help="comma-separated recent-window sizes")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--table", action="store_true", help="print a markdown table of --out and exit")
    ap.add_argument("--plot", action="store_true", help="with --table: also draw KL against compression (.png)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.table:
        table(args.out)
        return plot(args.out) if args.plot else None
    torch.set_num_threads(2)
    kq.check_codec()
    model, tok = load_model(args.model)
    AttentionInterface.register(ATTN, window_attention)
    AttentionMaskInterface.register(ATTN, sdpa_mask)
    model.set_attn_implementation(ATTN)
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = cfg.num_hidden_layers
    kq.State.hadamard = kq.sylvester(d)  # the /rot value scheme's rotations, as key_quant_study's
    kq.State.signs = (torch.randint(0, 2, (layers, cfg.num_key_value_heads, d),
                                    generator=torch.Generator().manual_seed(kq.SEED)) * 2 - 1).float()

    seqs, source = kq.load_sequences(model, tok, f"gen512/{args.model}", args.n, args.tokens)
    refs = []
    with torch.no_grad():
        for context, ids in seqs:
            St.active, kq.State.calls = False, 0
            logits = model(ids, logits_to_keep=ids.shape[1] - context + 1).logits[0, :-1].float()
            refs.append(torch.log_softmax(logits, -1))
    lengths = [int(ids.shape[1]) for _, ids in seqs]
    done = set()
    if args.resume and args.out.exists():
        done = {(r["model"], r["recent"], r["old"], r["window"], r["n_samples"], r["tokens"])
                for r in map(json.loads, args.out.read_text().splitlines())}
    command = " ".join(["nice -n 5", ".venv/bin/python", *map(shlex.quote, sys.argv)])
    print(f"# {args.model}: {len(seqs)} sequences, lengths {lengths}, source {source}", file=sys.stderr)
    for window in map(int, args.window.split(",")):
        for old in args.old.split(","):
            key = (args.model, args.recent, old, window, len(seqs), args.tokens)
            if key in done:
                continue
            St.recent, St.old, St.window, St.active = Fmt(args.recent), Fmt(old), window, True
            start, kls, agree = time.time(), [], []
            with torch.no_grad():
                for (context, ids), ref in zip(seqs, refs, strict=True):
                    kq.State.prompt_len, kq.State.calls = context, 0
                    got = torch.log_softmax(model(ids, logits_to_keep=ids.shape[1] - context + 1).logits[0, :-1]
                                            .float(), -1)
                    assert kq.State.calls == layers
                    kls.append((ref.exp() * (ref - got)).sum(-1).clamp_min(0))
                    agree.append((ref.argmax(-1) == got.argmax(-1)).float())
            St.active = False
            kl, top1 = torch.cat(kls), torch.cat(agree)
            smooth = 8 * d * (bool({"smooth"} & (St.recent.flags | St.old.flags))  # 2 D fp32 per sequence
                              + ("smooth" in (St.recent.value_scheme, St.old.value_scheme)))
            total = sum((t - old_tokens(t, window)) * St.recent.bytes(d) + old_tokens(t, window) * St.old.bytes(d)
                        + smooth for t in lengths)
            row = {"model": args.model, "recent": args.recent, "old": old, "window": window,
                   "kl_mean": round(float(kl.mean()), 5), "kl_p95": round(float(kl.quantile(0.95)), 5),
                   "top1": round(float(top1.mean()), 4), "old_bytes": St.old.bytes(d),
                   "recent_bytes": St.recent.bytes(d), "bytes_per_token_head": round(total / sum(lengths), 2),
                   "theoretical": round(4 * d * sum(lengths) / total, 3), "n_samples": len(seqs),
                   "tokens": args.tokens, "mean_seq_len": round(sum(lengths) / len(lengths), 1),
                   "seconds": round(time.time() - start, 1), "source": source, "command": command}
            print(json.dumps(row), file=args.out.open("a"), flush=True)
            print(f"{old:14s} W{window:<4d} kl {row['kl_mean']:.4f} p95 {row['kl_p95']:.4f} top1 {row['top1']:.3f} "
                  f"B {row['bytes_per_token_head']:.1f} -> {row['theoretical']:.2f}x  {row['seconds']} s",
                  file=sys.stderr, flush=True)


def old_tokens(length: int, window: int) -> int:
    """Tokens of a ``length``-token sequence stored in the old format (``chan+held``: closed groups only)."""
    if "held" not in St.old.flags:
        return max(length - window, 0)
    return max(length - window, 0) // St.old.page * St.old.page


def table(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    print("| recent (window) | older tokens | KL mean | KL p95 | top-1 | B / token / head | theoretical × |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["model"], -r["theoretical"])):
        print(f"| {r['recent']} ({r['window']}) | {r['old']} | {r['kl_mean']:.4f} | {r['kl_p95']:.4f} | "
              f"{100 * r['top1']:.1f} % | {r['bytes_per_token_head']:.1f} | {r['theoretical']:.2f}× |")


def plot(path: Path) -> None:
    """KL against the theoretical compression, one marker per old-token key scheme, one colour per recent format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {}
    for r in rows:
        recent = f"{r['recent'].split(':')[0]} window of {r['window']}"
        colour = colours.setdefault(recent, f"C{len(colours)}")
        marker = "D" if "held" in r["old"] else "s" if "chan" in r["old"] else "o"
        ax.scatter(r["theoretical"], r["kl_mean"], color=colour, marker=marker, s=30)
        label = r["old"].replace(":smooth", "").replace(":chan+held", " held").replace(":chan", " ch")
        ax.annotate(label, (r["theoretical"], r["kl_mean"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    for recent, colour in colours.items():
        ax.scatter([], [], color=colour, label=recent)
    ax.scatter([], [], color="grey", marker="s", label="per-channel keys (best case)")
    ax.scatter([], [], color="grey", marker="D", label="per-channel keys, open group held high")
    ax.scatter([], [], color="grey", marker="o", label="smoothed per-token keys")
    ax.set_yscale("log")
    ax.set_xlabel("compression before pages (fp16 bytes / stored bytes)")
    ax.set_ylabel("KL(full || cache), nats per token")
    ax.set_title(f"{rows[0]['model']}: recent window vs older tokens, nothing pruned", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
