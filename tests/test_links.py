"""Every relative link in README.md, docs/, benchmarks/README.md, benchmarks/accuracy/README.md and the frozen
studies in benchmarks/studies/ resolves to a tracked file or folder (issue #47), every ``#anchor`` into a Markdown
file names one of its headings, and the accuracy README stays an index (the studies moved out of it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
        ROOT / "benchmarks" / "accuracy" / "README.md", *sorted((ROOT / "benchmarks" / "studies").glob("*.md")),
        *sorted((ROOT / "benchmarks" / "studies").glob("*/README.md"))]
ACCURACY_README_MAX_LINES = 300


def tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = set(out.split())
    return files | {str(Path(f).parents[i]) for f in files for i in range(len(Path(f).parents) - 1)}


def is_tracked(rel: str, files: set[str]) -> bool:
    """``rel`` is tracked, or is under a tracked symlink to a tracked folder (``profiles/`` -> ``diffkv/profiles/``)."""
    if rel in files:
        return True
    path = (ROOT / rel).resolve()
    return path.is_relative_to(ROOT) and str(path.relative_to(ROOT)) in files


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+\s+(.*)$", path.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto:


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    files, broken = tracked(), []
    for target in links(doc):
        where, _, anchor = target.partition("#")
        path = (doc.parent / where).resolve() if where else doc
        rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else None
        if not (rel is not None and is_tracked(rel, files)) and rel != str(doc.relative_to(ROOT)):
            broken.append(f"{target} (no tracked {rel})")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no heading #{anchor} in {rel})")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links: {broken}"


def test_links_are_found():
    assert len(links(ROOT / "README.md")) >= 5
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert len(DOTTED.findall(design)) + len(PATH_NAME.findall(design)) >= 20  # code names to resolve
    assert len(list((ROOT / "benchmarks" / "studies").glob("20*.md"))) >= 10


def test_accuracy_readme_is_an_index():
    """The dated studies live in benchmarks/studies/; the accuracy README keeps methods, commands, results, links."""
    lines = (ROOT / "benchmarks" / "accuracy" / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= ACCURACY_README_MAX_LINES, f"{len(lines)} lines: move dated studies to benchmarks/studies/"


REPO_PATH = re.compile(r"`((?:benchmarks|diffkv|docs|tests|scripts|profiles|notebooks|requirements)/[\w./@+=-]*)`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_repo_paths_exist(doc):
    """A path written in backticks (``benchmarks/accuracy/chunked/run.sh``) names a tracked file or folder, in every
    file of DOCS, the frozen studies included (a study that names a file removed later gets the path fixed or the
    backticks dropped). ``profiles/X`` resolves through the tracked ``profiles`` symlink."""
    files = tracked()
    named = {p.rstrip("/.") for p in REPO_PATH.findall(doc.read_text(encoding="utf-8"))}
    missing = sorted(p for p in named if not is_tracked(p, files))
    assert not missing, f"{doc.relative_to(ROOT)} names paths that are not in the repository: {missing}"


def test_readme_is_short_and_its_prose_lines_fit():
    """README.md: at most 250 lines; lines of prose (not tables, not code blocks) at most 120 characters."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    prose = re.sub(r"```.*?```", "", text, flags=re.S).splitlines()
    long = [line[:60] for line in prose if len(line) > 120 and not line.startswith("|")]
    assert not long, f"README prose lines over 120 characters: {long}"


DOTTED = re.compile(r"`(diffkv(?:\.\w+)+)(?:\(\))?`")
PATH_NAME = re.compile(r"`((?:\w+/)+\w+)\.([A-Za-z_]\w*(?:\.\w+)*)(?:\(\))?`")  # `hf/routing.install_router`
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "sh", "txt", "c", "h", "png", "toml", "yaml", "yml", "csv", "ipynb"}


def resolves(dotted: str) -> bool:
    """Whether ``a.b.c.d`` is an importable module, or one followed by a chain of attributes. A name under a module
    that needs an optional package this machine lacks (vLLM) counts as resolved."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("diffkv"):
                return True  # an optional dependency
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("doc", [d for d in DOCS if "studies" not in d.parts], ids=lambda p: str(p.relative_to(ROOT)))
def test_named_code_objects_exist(doc):
    """A code name written in backticks resolves: ``diffkv.cache.kv_store.KVStore`` as an import, and
    ``hf/routing.install_router`` (a module of ``diffkv/`` by its path, then a name in it) likewise. The frozen
    studies are exempt: they name the code of their day."""
    text = doc.read_text(encoding="utf-8")
    named = set(DOTTED.findall(text))
    for path, name in PATH_NAME.findall(text):
        if name.split(".")[0] in FILE_SUFFIXES or not (ROOT / "diffkv" / f"{path}.py").exists():
            continue
        named.add("diffkv." + path.replace("/", ".") + "." + name)
    missing = sorted(n for n in named if not resolves(n))
    assert not missing, f"{doc.relative_to(ROOT)}: names that do not resolve: {missing}"


def test_a_study_is_one_dated_folder_with_a_note():
    """benchmarks/studies/README.md: a study is ``<YYYY-MM-DD>-<slug>/`` with a README.md, listed in the index (the
    older single-file studies stay as they were moved)."""
    studies = ROOT / "benchmarks" / "studies"
    index = (studies / "README.md").read_text()
    for folder in sorted(p for p in studies.iterdir() if p.is_dir()):
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9][a-z0-9.-]*", folder.name), folder.name
        assert (folder / "README.md").is_file(), f"{folder.name}/ has no README.md (the study's note)"
        assert f"]({folder.name}/" in index, f"{folder.name}/ is not in benchmarks/studies/README.md's table"
