"""kvpress presses on diffkv's RULER-style samples, token id for token id. Runs in kvpress's own venv, not diffkv's.

    python3 -m venv ~/.venvs/kvpress
    ~/.venvs/kvpress/bin/pip install torch==2.13.0 kvpress==0.5.5
    ~/.venvs/kvpress/bin/python benchmarks/peers/run_kvpress.py benchmarks/peers/ruler-4k/samples-ask-after.jsonl \\
        --model ~/.cache/diffkv/models/qwen2.5-0.5b --press kvzip --compression-ratio 0.8 --out OUT.jsonl

For every sample of ``ruler_ids.py export``: the first ``len(ids) - held`` tokens are prefilled through the press
into a ``DynamicCache`` (``model.model(...)``, as kvpress's own pipeline does, so KVzip's context reconstruction
runs), then the ``held`` tokens (the question and the chat template's tail for ``ask-after``; the last prompt token
for ``in-prompt``) are fed at their true positions and the answer is decoded greedily, fp32, up to the sample's
``max_new_tokens`` or an end-of-sequence token. ``compression_ratio`` is kvpress's: the fraction of the context's
tokens removed (``1 - 1/r`` keeps the bytes of an r-times compressed cache at fp16); the kept fraction reported
counts what attention can still read, whether the press removed the rest or masked it (KVzip masks). One JSON line
per sample: the output text, the kept fraction of the context, seconds, and the sample's references and metric
for ``ruler_ids.py score``. Resumable: samples already in ``--out`` are skipped. Two processes may share one
``--out`` (one of them with ``--reverse``, so they meet in the middle): the file is re-read before each sample and
before each write, so no sample is written twice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from kvpress import ExpectedAttentionPress, KVzipPress, SnapKVPress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

PRESSES = {"none": None, "snapkv": SnapKVPress, "expected_attention": ExpectedAttentionPress, "kvzip": KVzipPress}


@torch.no_grad()
def answer(model, press, ids: list[int], held: int, max_new_tokens: int, eos: set[int]) -> tuple[list[int], float]:
    """Greedy answer token ids and the kept fraction of the ``len(ids) - held`` context tokens."""
    ids_t = torch.tensor([ids])
    n = ids_t.shape[1]
    context, tail = ids_t[:, :n - held], ids_t[:, n - held:]
    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=context, past_key_values=cache)
    kept = kept_fraction(model, cache, context.shape[1])
    logits = model(input_ids=tail, past_key_values=cache, position_ids=torch.arange(n - held, n)[None],
                   logits_to_keep=1).logits
    out = []
    for step in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos or step == max_new_tokens - 1:
            break
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                       position_ids=torch.tensor([[n + step]]), logits_to_keep=1).logits
    return out, kept


def kept_fraction(model, cache, context_tokens: int) -> float:
    """Context (token, head) cells the attention can still read, over every layer: what the cache kept minus what
    the press masks (KVzip and the head-wise presses mask keys, ``masked_key_indices``, instead of removing them)."""
    kept = total = 0
    for layer, module in zip(cache.layers, (m.self_attn for m in model.model.layers), strict=True):
        heads = layer.keys.shape[1]
        masked = getattr(module, "masked_key_indices", None)
        kept += layer.keys.shape[2] * heads - (0 if masked is None else len(masked[0]))
        total += context_tokens * heads
    return kept / total


def done_ids(out: Path) -> set[str]:
    """Ids of the complete lines of ``out`` (a line still being appended by another process is not one)."""
    if not out.exists():
        return set()
    return {json.loads(line)["id"] for line in out.read_text().splitlines() if line.endswith("}")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("samples", type=Path)
    ap.add_argument("--model", required=True, help="folder of the model (diffkv models path NAME)")
    ap.add_argument("--press", choices=list(PRESSES), required=True)
    ap.add_argument("--compression-ratio", type=float, default=0.0)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reverse", action="store_true", help="last sample first (a second process on the same --out)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(str(Path(args.model).expanduser()), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(Path(args.model).expanduser()))
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    kind = PRESSES[args.press]
    press = None if kind is None else kind(compression_ratio=args.compression_ratio)
    rows = [json.loads(line) for line in args.samples.read_text().splitlines()][:args.limit]
    command = " ".join(map(shlex.quote, [sys.executable, *sys.argv]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for r in reversed(rows) if args.reverse else rows:
        if r["id"] in done_ids(args.out):
            continue
        start = time.time()
        tokens, kept = answer(model, press, r["ids"], r["held"], r["max_new_tokens"], eos)
        row = {"id": r["id"], "family": r["family"], "protocol": r["protocol"], "press": args.press,
               "compression_ratio": args.compression_ratio, "output": tok.decode(tokens, skip_special_tokens=True),
               "new_tokens": len(tokens), "kept_fraction": round(kept, 4), "context_tokens": len(r["ids"]) - r["held"],
               "seconds": round(time.time() - start, 1), "references": r["references"], "metric": r["metric"],
               "command": command}
        if r["id"] in done_ids(args.out):  # the other process got there first
            continue
        with args.out.open("a") as out:
            print(json.dumps(row), file=out)
        print(f"{r['id']} kept {kept:.3f} {row['seconds']} s: {row['output'][:60]!r}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
