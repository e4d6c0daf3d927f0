"""RULER-style (or needle) samples as token ids for the kvpress peers, and the peers' outputs scored by string match.

Runs in diffkv's venv; ``run_kvpress.py`` (kvpress's own venv) reads what ``export`` writes and writes the outputs
that ``score`` reads, so nothing of kvpress is imported by diffkv and nothing of diffkv by the kvpress run.

    .venv/bin/python benchmarks/peers/ruler_ids.py export --model qwen2.5-0.5b --samples 2 \\
        --protocol ask-after --out benchmarks/peers/ruler-4k/samples-ask-after.jsonl
    .venv/bin/python benchmarks/peers/ruler_ids.py score benchmarks/peers/ruler-4k/<run>.jsonl

Each exported line: ``id``, ``family``, ``protocol``, ``ids`` (the prompt's token ids exactly as ``diffkv eval run
--task ruler`` encodes them, ``runner.encode_prompt``), ``held`` (the tokens fed after the compressed prefill: the
question and the chat template's tail for ``ask-after``, as ``protocol.question_tokens`` counts them; 1 for
``in-prompt``, the prompt's last token, so the press sees the whole question), ``max_new_tokens``, ``references``
and ``metric`` (RULER's string match, or ``passkey`` for the needle: ``diffkv.eval.answers.contains_passkey``).
``score`` writes ``<run>.metrics.json``: per family and overall, RULER's score (mean of per-sample scores) and the
full-score count, with the kept fraction the run reports.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from transformers import AutoTokenizer

from diffkv.eval.answers import contains_passkey
from diffkv.eval.protocol import question_tokens
from diffkv.eval.ruler import FAMILIES, string_match
from diffkv.eval.runner import encode_prompt
from diffkv.eval.tasks import get_task
from diffkv.registry.models import resolve_model


def export(args) -> None:
    tok = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    if args.task == "ruler":
        options = {"lengths": [args.length], "samples": args.samples, "protocol": args.protocol}
        if args.families:
            options["families"] = args.families.split(",")
    else:  # needle: the passkey grid of `diffkv eval run --task needle`
        options = {"lengths": [args.length], "depths": [float(d) for d in args.depths.split(",")],
                   "protocol": args.protocol}
    task = get_task(args.task)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for s in task.samples(tok, seed=args.seed, options=options):
            ids = encode_prompt(tok, s)
            held = question_tokens(tok, s, ids) if args.protocol == "ask-after" else 1
            family = s.get("family", args.task)
            row = {"id": s["id"], "family": family, "protocol": args.protocol, "model": args.model,
                   "ids": ids, "held": held, "max_new_tokens": s.get("max_new_tokens") or task.max_new_tokens,
                   "references": s["reference"] if isinstance(s["reference"], list) else [str(s["reference"])],
                   "metric": FAMILIES[family][1] if args.task == "ruler" else "passkey"}
            print(json.dumps(row), file=out)
    print(f"wrote {args.out}")


def score(args) -> None:
    rows = [json.loads(line) for line in args.outputs.read_text().splitlines()]
    fam = defaultdict(list)
    for r in rows:  # the scorers of diffkv's own tasks: RULER's string match, the needle's passkey match
        fam[r["family"]].append(float(contains_passkey(r["output"], r["references"][0])) if r["metric"] == "passkey"
                                else string_match(r["output"], r["references"], r["metric"]))
    per = {f: {"score": sum(v) / len(v), "full": sum(x == 1.0 for x in v), "n": len(v)} for f, v in sorted(fam.items())}
    scores = [x for v in fam.values() for x in v]
    kept = [r["kept_fraction"] for r in rows if r.get("kept_fraction") is not None]
    metrics = {"run": args.outputs.name, "press": rows[0].get("press"), "n": len(scores),
               "ruler_score": sum(scores) / len(scores), "full": sum(x == 1.0 for x in scores),
               "mean_kept_fraction": sum(kept) / len(kept) if kept else None, "per_family": per,
               "command": rows[0].get("command")}
    path = args.outputs.with_suffix(".metrics.json")
    path.write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if k != "per_family"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write the samples as token ids")
    e.add_argument("--task", choices=("ruler", "needle"), default="ruler")
    e.add_argument("--model", default="qwen2.5-0.5b")
    e.add_argument("--length", type=int, default=4096)
    e.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle: comma-separated depths")
    e.add_argument("--samples", type=int, default=2, help="per family")
    e.add_argument("--families", default=None, help="comma-separated (default: all)")
    e.add_argument("--protocol", choices=("in-prompt", "ask-after"), default="ask-after")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("score", help="score a run_kvpress.py output file")
    s.add_argument("outputs", type=Path)
    args = ap.parse_args()
    export(args) if args.cmd == "export" else score(args)


if __name__ == "__main__":
    main()
