"""Per-question comparison of the lean-metadata GSM8K runs (``compact/``) with the profile's paper-fields run
(``profiled-smooth/``, same profile, 256 tokens, batch 5; 100 questions recorded, its first 40 compared) and the
full cache (``qwen2.5-0.5b/``) on the questions every run answered. Run from the checkout:

    .venv/bin/python benchmarks/accuracy/compare_lean_gsm8k.py
"""
from pathlib import Path

from diffkv.eval.metrics import _compression, read_samples

ROOT = Path("benchmarks/accuracy")
REFS = {"full": ROOT / "qwen2.5-0.5b/gsm8k/full", "profile": ROOT / "profiled-smooth/qwen2.5-0.5b/gsm8k/diffkv"}
RUNS = {m: ROOT / "compact/qwen2.5-0.5b/gsm8k" / m
        for m in ("diffkv-compact", "diffkv-compact-meta", "diffkv-symmetric-keys")}


def key(i):
    return int(i.rsplit("-", 1)[1])


runs = {name: read_samples(path) for name, path in {**REFS, **RUNS}.items() if (path / "samples.jsonl").is_file()}
ids = sorted(set.intersection(*(set(r) for name, r in runs.items() if name in RUNS)), key=key)
print(f"{len(ids)} questions ({ids[0]} .. {ids[-1]})\n")
print("| run | correct | physical × (these questions) | vs profile: lost / gained | vs full: lost / gained |")
print("|---|---|---|---|---|")
for name, rows in runs.items():
    rows = {i: rows[i] for i in ids}
    ok = {i for i in ids if rows[i]["correct"]}
    cells = []
    for ref in ("profile", "full"):
        ref_ok = {i for i in ids if runs[ref][i]["correct"]}
        lost, gained = sorted(ref_ok - ok, key=key), sorted(ok - ref_ok, key=key)
        cells.append("–" if ref == name else f"{len(lost)} / {len(gained)}"
                     + (f" (lost {', '.join(i.split('-')[1] for i in lost) or '–'};"
                        f" gained {', '.join(i.split('-')[1] for i in gained) or '–'})"))
    physical = _compression(rows)["compression_physical"]
    print(f"| {name} | {len(ok)}/{len(ids)} | {physical:.2f} | {cells[0]} | {cells[1]} |")
print("\ncorrect question numbers:")
for name, rows in runs.items():
    print(f"  {name:<22}", " ".join(i.split("-")[1] for i in ids if rows[i]["correct"]))
