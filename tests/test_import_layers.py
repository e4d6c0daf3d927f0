"""Imports point down: core <- memory, kernels, ops <- cache <- registry, hf <- caches (integrations, baselines)
<- engine <- apps (serve, the HTTP front, among them), core's modules import nothing but core, and no import cycle
between units nor between the modules of the engine and of the server. Read from the source (every import statement,
function-level ones included), so a lazy import that breaks the layering fails here too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "diffkv"

# Each unit's layer; a module may import from its own layer or any lower one. A folder is one unit, except the
# modules of ``core`` and ``registry``, each a unit of its own (so a cycle between two of them fails here too).
# ``__init__`` is the package facade: it imports the config and names its lazy attributes as strings.
# core: pure functions and data; memory (pool, tables, allocator), kernels and ops (launchers) work on device memory
# with them; cache (PagedKV, LayerCompressor) is the storage layer every host drives.
CORE = ["errors", "units", "paths", "checks", "tiers", "config", "quant", "layout", "policy", "page_io", "bookkeeping",
        "attention", "stats", "json_spec", "rotation", "backends", "spans", "points"]
LAYERS = {
    0: ["__init__", "core", *(f"core.{m}" for m in CORE)],
    1: ["memory", "kernels", "ops"],
    2: ["cache"],
    3: ["registry", "registry.fetch", "registry.models", "registry.data", "hf", "prompts", "profile",
        "profile_schema"],
    4: ["integrations", "baselines"],
    5: ["engine"],
    6: ["bench", "calibration", "eval", "demo", "viz", "registry.cli", "cli", "integrations.lm_eval", "lm_eval_tasks",
        "serve"],
}
LAYER_OF = {unit: layer for layer, units in LAYERS.items() for unit in units}


def unit(module: str) -> str:
    """``diffkv.memory.pool`` -> ``memory``; ``diffkv`` (or a name it defines) -> ``__init__``; a module with its
    own entry (``diffkv.integrations.lm_eval``) -> that entry."""
    parts = module.split(".")
    if len(parts) > 2 and ".".join(parts[1:3]) in LAYER_OF:
        return ".".join(parts[1:3])
    if len(parts) == 1 or not ((PKG / parts[1]).is_dir() or (PKG / f"{parts[1]}.py").is_file()):
        return "__init__"
    return parts[1]


def is_module(module: str) -> bool:
    """Whether the dotted name ``module`` (``diffkv.core.policy``) is a module or package of diffkv."""
    path = PKG.joinpath(*module.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path, runtime: bool = False) -> set[str]:
    """diffkv modules imported by the file at ``path`` (absolute and relative imports, at any depth; ``runtime``:
    not those under ``if TYPE_CHECKING:``)."""
    mod = "diffkv." + ".".join(path.relative_to(PKG).with_suffix("").parts)
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if runtime:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("diffkv")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(mod.split(".")[:-node.level] + ([base] if base else []))
            if base.startswith("diffkv"):
                found |= {f"{base}.{a.name}" if base == "diffkv" or is_module(f"{base}.{a.name}") else base
                          for a in node.names}
    return found


def edges() -> set[tuple[str, str]]:
    """(unit, unit it imports) over the package; ``__main__`` entry points (they call the CLI) are left out."""
    out = set()
    for path in PKG.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        src = unit("diffkv." + ".".join(path.relative_to(PKG).with_suffix("").parts))
        out |= {(src, unit(m)) for m in imports(path) if unit(m) != src}
    return out


def test_every_unit_has_a_layer():
    units = {unit("diffkv." + ".".join(p.relative_to(PKG).with_suffix("").parts)) for p in PKG.rglob("*.py")}
    assert units <= set(LAYER_OF), f"give these a layer in LAYERS: {sorted(units - set(LAYER_OF))}"


def test_core_imports_only_core():
    """core is a layer of pure functions and data: no module of it imports memory, ops, kernels or anything above
    (not even the package facade)."""
    out = sorted(f"{path.relative_to(PKG)} -> {m}" for path in (PKG / "core").rglob("*.py") for m in imports(path)
                 if m != "diffkv.core" and not m.startswith("diffkv.core."))
    assert not out, "core imports outside core: " + ", ".join(out)


def test_every_core_module_is_listed():
    """Each module of core is its own unit (so cycles between them are found): list new ones in CORE."""
    found = {p.stem for p in (PKG / "core").glob("*.py")} - {"__init__"}
    assert found == set(CORE), f"CORE differs from diffkv/core/: missing {sorted(found - set(CORE))}, " \
                               f"gone {sorted(set(CORE) - found)}"


def test_imports_point_down():
    up = sorted((a, b) for a, b in edges() if LAYER_OF[b] > LAYER_OF[a])
    assert not up, "imports from a higher layer: " + ", ".join(f"{a} -> {b}" for a, b in up)


def test_no_import_cycle_between_units_of_a_layer():
    graph: dict[str, set[str]] = {}
    for a, b in edges():
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen))
                   for n in graph.get(start, ()))

    cycles = sorted((a, b) for a, b in edges() if reaches(b, a, set()))
    assert not cycles, f"import cycles through: {cycles}"


def _module_level_imports(path: Path) -> set[str]:
    """diffkv modules imported when ``path`` is imported (module-level statements, ``if TYPE_CHECKING`` left out)."""
    mod = "diffkv." + ".".join(path.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + \
                [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("diffkv.")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("diffkv."):
                found |= {f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names}
            elif base == "diffkv":
                found |= {f"diffkv.{a.name}" for a in node.names if is_module(f"diffkv.{a.name}")} or {"diffkv"}
    return found


def test_no_module_imports_itself_back():
    names = {p: "diffkv." + ".".join(p.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
             for p in PKG.rglob("*.py")}
    graph = {names[p]: {m for m in _module_level_imports(p) if m in names.values()} for p in names}

    def path_back(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    cycles = [c for c in map(path_back, sorted(graph)) if c]
    assert not cycles, "module import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_torch_reference_is_named_in_ops_reference():
    """One home for the oracle: each ``*_ref`` function defined in the package is importable from
    ``diffkv.ops.reference`` (defined there, or the pure per-token math of ``core`` re-exported)."""
    import diffkv.ops.reference as reference

    defined = {node.name for p in PKG.rglob("*.py") for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
               if isinstance(node, ast.FunctionDef) and node.name.endswith("_ref")}
    assert defined >= {"paged_decode_attention_ref", "place_store_ref", "store_tokens_ref"}
    assert sorted(defined - set(reference.__all__)) == []
    assert all(callable(getattr(reference, name)) for name in reference.__all__)


def test_no_import_cycle_between_modules_of_a_folder():
    """Inside each package folder, module imports (function-level ones included, type-checking ones not) form no
    cycle (issue #47)."""
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        if path.name in ("__main__.py", "__init__.py"):
            continue
        mod = "diffkv." + ".".join(path.relative_to(PKG).with_suffix("").parts)
        folder = mod.rsplit(".", 1)[0]
        graph[mod] = {m for m in imports(path, runtime=True)
                      if m.rsplit(".", 1)[0] == folder and m != mod and is_module(m)}

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        if a == b:
            return True
        seen.add(a)
        return any(reaches(n, b, seen) for n in graph.get(a, ()) if n not in seen)

    cycles = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if reaches(b, a, set())})
    assert not cycles, f"import cycles inside a folder: {cycles}"


@pytest.mark.parametrize("package", ["engine", "serve"])
def test_no_import_cycle_between_modules_of_the_engine_and_the_server(package):
    """Within ``diffkv.engine`` and ``diffkv.serve`` module by module (runtime imports; the package facade aside):
    a reader can follow each module from what it imports."""
    graph = {}
    for path in (PKG / package).glob("*.py"):
        if path.name != "__init__.py":
            graph[path.stem] = {m.split(".")[2] for m in imports(path, runtime=True)
                                if m.startswith(f"diffkv.{package}.") and m.count(".") >= 2} - {path.stem}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen))
                   for n in graph.get(start, ()))

    cycles = sorted((a, b) for a, deps in graph.items() for b in deps if reaches(b, a, set()))
    assert len(graph) >= 5 and not cycles, f"import cycles in diffkv.{package}: {cycles}"
