"""Issue #46, why vt loses in the ask-after protocol: the tier each token of a vt sample's chain gets, with the
question in the prompt (the long-context setting: window scores + score_spans, thresholds x2) and with it after the
context (repeat scores, thresholds x64), and the answer each cache then gives. A vt prompt hides 5 assignments
``VAR ABCDE = ...`` in noise after a worked example with 3-letter names; the answer is the 5 names.

    .venv/bin/python benchmarks/accuracy/ruler/vt_tiers.py [--ids ruler-vt-4096-5,ruler-vt-4096-6,ruler-vt-4096-0]
        [--protocols ask-after --ask-after-method 'diffkv-compact-meta@x16+...']

Per sample and protocol: the answer, and the share of (layer, KV head, token) cells kept high / low / pruned for the
chain's name tokens (each ``VAR NAME`` of the 5 references, every occurrence), the chain's value tokens (the digits
after ``=``), the worked example's ``VAR`` lines and the whole context. One thread; ~2-4 min a sample.
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from diffkv.eval.methods import get_method
from diffkv.eval.protocol import feed_context, question_tokens
from diffkv.eval.runner import encode_prompt
from diffkv.eval.tasks import get_task
from diffkv.hf.repeat_scores import BRIDGE, repeat_prefill
from diffkv.registry.models import load_model
from diffkv.viz.tiers import HIGH, LOW, PRUNED, track_tiers

PROFILE = "profiles/qwen2.5-0.5b.json"
METHODS = {"in-prompt": "diffkv-compact-meta@x2+page_bytes=1472+score_spans=true",
           "ask-after": 'diffkv-compact-meta@x64+page_bytes=1472+importance="peak"+prompt_scores="repeat"'}


def char_spans(tok, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The decoded text and each token's [start, end) characters in it."""
    text, spans = "", []
    for i in range(len(ids)):
        piece = tok.decode(ids[: i + 1])
        spans.append((len(text), len(piece)))
        text = piece
    return text, spans


def tokens_of(pattern: str, text: str, spans: list[tuple[int, int]], limit: int) -> list[int]:
    """Indices (< limit) of the tokens that overlap a match of ``pattern`` in ``text``."""
    hits = set()
    for m in re.finditer(pattern, text):
        hits.update(i for i, (a, b) in enumerate(spans[:limit]) if a < m.end() and b > m.start() and b > a)
    return sorted(hits)


def shares(tiers: torch.Tensor, idx: list[int]) -> dict[str, float | int]:
    """tiers: int8 [layers, kv_heads, tokens] -> share of the cells at ``idx`` in each tier."""
    cells = tiers[:, :, idx]
    cells = cells[cells >= 0]
    return {"tokens": len(idx)} | {name: round(float((cells == t).float().mean()), 3)
                                   for name, t in (("high", HIGH), ("low", LOW), ("pruned", PRUNED))}


def run(model, tok, sample: dict, protocol: str, method: str) -> dict:
    ids = encode_prompt(tok, sample)
    held = question_tokens(tok, sample, ids) if protocol == "ask-after" else 0
    x = torch.tensor([ids])
    cache = get_method(method).build(model, None, PROFILE)
    tracker = track_tiers(cache)
    context = len(ids) - held
    if protocol == "ask-after":
        repeat_prefill(model, cache, x[:, :context], tok(BRIDGE, add_special_tokens=False).input_ids)
        feed_context(model, x, torch.ones_like(x), cache, held)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), past_key_values=cache, do_sample=False,
                             max_new_tokens=sample.get("max_new_tokens") or 30, pad_token_id=tok.eos_token_id)
    answer = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    tiers = tracker.prefill_map()
    cache.release()
    text, spans = char_spans(tok, ids)
    names = "|".join(re.escape(r) for r in sample["reference"])
    example = text.find(sample["reference"][0])  # the worked example sits before the first chain line
    example_lines = [i for i in tokens_of(r"VAR [A-Z]{3} = [^\n.]*", text, spans, context) if spans[i][0] < example]
    return {"id": sample["id"], "protocol": protocol, "method": method, "answer": answer.strip(),
            "references": sample["reference"],
            "chain_names": shares(tiers, tokens_of(rf"VAR (?:{names})\b", text, spans, tiers.shape[-1])),
            "chain_values": shares(tiers, tokens_of(rf"(?<=(?:{names}) = )\d+", text, spans, tiers.shape[-1])),
            "example_lines": shares(tiers, example_lines),
            "context": shares(tiers, list(range(tiers.shape[-1])))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", default="ruler-vt-4096-5,ruler-vt-4096-6,ruler-vt-4096-0")
    ap.add_argument("--protocols", default="ask-after,in-prompt")
    ap.add_argument("--ask-after-method", default=METHODS["ask-after"], help="the method of the ask-after runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("qwen2.5-0.5b")
    wanted = args.ids.split(",")
    samples = {s["id"]: s for s in get_task("ruler").samples(tok, 0, {"lengths": [4096], "samples": 10})}
    for sid in wanted:
        for protocol in args.protocols.split(","):
            method = args.ask_after_method if protocol == "ask-after" else METHODS[protocol]
            print(json.dumps(run(model, tok, samples[sid], protocol, method)), flush=True)


if __name__ == "__main__":
    main()
