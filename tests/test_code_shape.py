"""The storage layer stays readable (issue #47): no function or method in ``diffkv/cache/`` over 40 lines
(scoring, key transforms and storage are separate steps, :mod:`diffkv.cache.scoring`)."""

from __future__ import annotations

import ast
from pathlib import Path

CACHE = Path(__file__).resolve().parents[1] / "diffkv" / "cache"
MAX_LINES = 40


def long_functions(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_the_cache_layer_is_over_40_lines():
    assert len(list(CACHE.glob("*.py"))) > 5
    assert not long_functions(CACHE)


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert long_functions(tmp_path) == [f"m.py:1 f ({MAX_LINES + 1} lines)"]


def test_hosts_reach_pages_and_slots_only_through_the_store():
    """Issue #61: outside ``diffkv/cache/`` and ``diffkv/memory/`` nothing reaches into a store's pool or tables
    (``.kv.pool``, ``.kv.tables``); hosts use ``KVStore``'s methods (``diffkv.cache.store_pages``)."""
    import re

    pkg = Path(__file__).resolve().parents[1] / "diffkv"
    reach = re.compile(r"\.kv\.(pool|tables)\b")
    found = [f"{p.relative_to(pkg)}:{i}" for p in pkg.rglob("*.py")
             if p.relative_to(pkg).parts[0] not in ("cache", "memory")
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if reach.search(line)]
    assert not found, f"reach into a store's pool or tables: {found}"
