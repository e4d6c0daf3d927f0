"""Every relative link in README.md and docs/ resolves to a tracked file or folder (issue #47), and every
``#anchor`` into a Markdown file names one of its headings."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = set(out.split())
    return files | {str(Path(f).parents[i]) for f in files for i in range(len(Path(f).parents) - 1)}


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
        if rel not in files and not (rel == str(doc.relative_to(ROOT))):
            broken.append(f"{target} (no tracked {rel})")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no heading #{anchor} in {rel})")
    assert not broken, f"{doc.name}: broken links: {broken}"


def test_links_are_found():
    assert len(links(ROOT / "README.md")) >= 5


REPO_PATH = re.compile(r"`((?:benchmarks|diffkv|docs|tests|scripts|profiles|notebooks|requirements)/[\w./@+=-]*)`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_repo_paths_exist(doc):
    """A path written in backticks (``benchmarks/accuracy/chunked/run.sh``) names a tracked file or folder."""
    files = tracked()
    named = {p.rstrip("/.") for p in REPO_PATH.findall(doc.read_text(encoding="utf-8"))}
    missing = sorted(p for p in named if p not in files)
    assert not missing, f"{doc.name} names paths that are not in the repository: {missing}"
