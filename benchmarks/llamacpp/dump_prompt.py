"""Write the decode benchmark's prompt token ids (``diffkv.prompts.essay_tokens``) to JSON for llama.cpp.

    nice -n 10 .venv/bin/python benchmarks/llamacpp/dump_prompt.py --models qwen2.5-0.5b --sizes 4096 16384
    nice -n 10 .venv/bin/python benchmarks/llamacpp/dump_prompt.py --models smollm2-135m --sizes 4096

``diffkv bench decode`` prefills ``essay_tokens(tokenizer, n)`` exactly (no BOS, no chat template), so the same
ids, tokenized by the converted model's own tokenizer, are written to ``prompt_<model>_<n>.json`` next to this
file: ``{"model", "tokenizer", "prompt_tokens", "ids"}``. A size the essays cannot fill is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    from transformers import AutoTokenizer

    from diffkv.prompts import essay_tokens
    from diffkv.registry.models import model_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["qwen2.5-0.5b", "smollm2-135m"])
    p.add_argument("--sizes", nargs="*", type=int, default=[4096, 16384])
    args = p.parse_args()
    for name in args.models:
        folder = model_dir(name)
        if not folder.is_dir():
            print(f"{name}: not pulled ({folder}); run `diffkv models pull {name}` first", file=sys.stderr)
            return 1
        tok = AutoTokenizer.from_pretrained(str(folder))
        for n in args.sizes:
            try:
                ids = essay_tokens(tok, n)
            except ValueError as err:
                print(f"{name} n={n}: skipped ({err})")
                continue
            out = HERE / f"prompt_{name}_{n}.json"
            out.write_text(json.dumps({"model": name, "tokenizer": str(folder), "prompt_tokens": n, "ids": ids}))
            print(f"{name} n={n}: wrote {out.name} (first ids {ids[:5]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
