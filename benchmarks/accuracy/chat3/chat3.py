"""Issue #44: a 3-turn chat whose last question asks for a fact given in the first turn's context.

Turn 1: a ~2k-token essay with a pass key hidden in it (the needle task's text) and a question about the essay;
turn 2: a second question about the essay; turn 3: "What is the pass key?". One DiffKVCache serves the whole chat
(turns 2 and 3 are appended by ``KVStore.extend``), so the pass key must survive two turns of compression before
anyone asks for it. Cases: depths spread over the essay, pass key and essay from ``random.Random(f"chat3-{i}")``.
Resumable: one JSON line per (method, case) in ``--out``.

    python benchmarks/accuracy/chat3/chat3.py --methods full,'diffkv@x256+importance="peak"+prompt_scores="repeat"' \
        --profile benchmarks/calibration/qwen2.5-0.5b-full-smooth.json --out benchmarks/accuracy/chat3/results.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from diffkv.eval.answers import contains_passkey
from diffkv.eval.methods import get_method, method_stats
from diffkv.eval.tasks import NEEDLE_INTRO, NEEDLE_TEXT
from diffkv.prompts import essay_tokens
from diffkv.registry.models import load_model

TURNS = ["In one sentence, what is the essay about?", "Name one idea from the essay that the author argues for.",
         "What is the pass key? Answer with the number only."]
ANSWER_TOKENS = (48, 48, 16)


def case(tok, i: int, cases: int, context_tokens: int) -> dict:
    rng = random.Random(f"chat3-{i}")
    key = str(rng.randint(10000, 99999))
    hay = essay_tokens(tok, context_tokens, start_essay=rng.randrange(49))
    cut = int(len(hay) * (0.05 + 0.9 * i / max(cases - 1, 1)))
    context = NEEDLE_INTRO + tok.decode(hay[:cut]) + NEEDLE_TEXT.format(key=key) + tok.decode(hay[cut:])
    return {"id": f"chat3-{i}", "key": key, "depth": round(cut / len(hay), 3), "context": context}


@torch.no_grad()
def chat(model, tok, cache, sample: dict) -> tuple[list[str], int]:
    """The three turns through one cache. Returns (answers, tokens fed)."""
    messages, ids, out = [], None, None
    for turn, (question, budget) in enumerate(zip(TURNS, ANSWER_TOKENS, strict=True)):
        text = sample["context"] + "\n\n" + question if turn == 0 else question
        messages.append({"role": "user", "content": text})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=budget,
                             do_sample=False, pad_token_id=tok.pad_token_id or 0)
        answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
    return [m["content"] for m in messages[1::2]], int(out.shape[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--methods", default="full")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--cases", type=int, default=15)
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    out = Path(args.out)
    done = {(r["method"], r["id"]) for r in map(json.loads, out.read_text().splitlines())} if out.exists() else set()
    for name in args.methods.split(","):
        method = get_method(name)
        for i in range(args.cases):
            sample = case(tok, i, args.cases, args.context_tokens)
            if (name, sample["id"]) in done:
                continue
            cache = method.build(model, None, args.profile)
            t0 = time.perf_counter()
            answers, tokens = chat(model, tok, cache, sample)
            stats = method_stats(cache, model, tokens)
            if hasattr(cache, "release"):
                cache.release()
            row = {"method": name, "id": sample["id"], "depth": sample["depth"], "key": sample["key"],
                   "answers": answers, "correct": contains_passkey(answers[-1], sample["key"]),
                   "tokens": tokens, "seconds": round(time.perf_counter() - t0, 1),
                   "compression_physical": stats.get("compression_physical"),
                   "tokens_per_tier": stats.get("tokens_per_tier"), "profile": args.profile}
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(name, sample["id"], row["correct"], row["compression_physical"], row["seconds"], flush=True)


if __name__ == "__main__":
    main()
