"""Method names (issue #47): ``diffkv`` is the library's defaults, ``diffkv-paper`` the published configuration, and
every method spec in a recorded command still names a method; a run recorded when ``diffkv`` meant the published
configuration resumes with that meaning."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from diffkv import DiffKVConfig
from diffkv.eval.methods import get_method, recorded_spec
from diffkv.eval.runner import RunConfig, prepare_dir

ROOT = Path(__file__).resolve().parents[1]
METHODS_ARG = re.compile(r"--methods[ =](?:'([^']*)'|\"([^\"]*)\"|([^\s`|)]+))")


def recorded_specs() -> set[str]:
    """Every literal spec after ``--methods`` in the benchmarks' scripts and READMEs and the top-level README."""
    files = [ROOT / "README.md", *(p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".sh", ".md"))]
    specs = set()
    for path in files:
        for match in METHODS_ARG.finditer(path.read_text(encoding="utf-8")):
            text = next(g for g in match.groups() if g is not None)
            specs.update(s.strip("'").removesuffix('"' if s.count('"') % 2 else "") for s in text.split(",")
                         if s and not set(s) & set("$\\{}<>[]") and not re.fullmatch(r"[A-Z]+|\W.*", s))  # no M, ...
    return specs


def test_recorded_commands_name_methods():
    specs = recorded_specs()
    assert {"diffkv", "diffkv-smooth", "full", "diffkv-compact-meta+page_bytes=1472"} <= specs
    for spec in sorted(specs):
        get_method(spec)  # a renamed or removed method would raise ValueError naming the known ones


def test_diffkv_is_the_library_default_and_paper_the_published():
    assert get_method("diffkv").storage(None, None) == DiffKVConfig()
    assert get_method("diffkv-smooth").storage(None, None) == DiffKVConfig()
    paper = get_method("diffkv-paper").storage(None, None)
    assert paper == DiffKVConfig(smooth_keys=False) and paper != DiffKVConfig()
    assert get_method("diffkv-compact-meta").storage(None, None).smooth_keys is False  # variants of the paper's


@pytest.mark.parametrize("spec, recorded, built", [
    ("diffkv", {}, "diffkv-paper"),
    ("diffkv@x4+page_bytes=1472", {}, "diffkv-paper@x4+page_bytes=1472"),
    ("diffkv", {"method_names": 2}, "diffkv"),
    ("diffkv-compact-meta", {}, "diffkv-compact-meta"),
    ("full", {}, "full"),
])
def test_recorded_spec(spec, recorded, built):
    assert recorded_spec(spec, recorded) == built


def test_old_run_folder_resumes_with_its_meaning(tmp_path):
    cfg = RunConfig(model="smollm2-135m", task="needle", method="diffkv", out=str(tmp_path))
    _, new = prepare_dir(cfg)
    assert new["method_names"] == 2 and recorded_spec(cfg.method, new) == "diffkv"
    old = {k: v for k, v in new.items() if k != "method_names"}  # as written before the rename
    (cfg.run_dir() / "config.json").write_text(json.dumps(old))
    _, resumed = prepare_dir(cfg)
    assert "method_names" not in resumed and recorded_spec(cfg.method, resumed) == "diffkv-paper"
    other = RunConfig(model="smollm2-135m", task="needle", method="diffkv-paper", out=str(tmp_path))
    assert "method_names" not in prepare_dir(other)[1]
