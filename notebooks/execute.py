"""Run the notebooks here top to bottom and save them with their outputs (the committed copies).

    .venv/bin/python notebooks/execute.py                  # all of them, full size (a few minutes on a CPU)
    .venv/bin/python notebooks/execute.py 01_tour.ipynb    # one
    DIFFKV_NB_SMALL=1 .venv/bin/python notebooks/execute.py --no-save   # the short variant the tests run

Needs the ``notebooks`` extra (ipykernel, nbclient, nbformat, matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def execute(path: Path, timeout: int = 1800):
    """Execute ``path`` in a fresh python3 kernel with the notebooks folder as working directory; returns it."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="notebooks to run (default: every *.ipynb here)")
    p.add_argument("--no-save", action="store_true", help="run only; leave the files as they are")
    args = p.parse_args(argv)
    paths = [HERE / n for n in args.names] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        t0 = time.perf_counter()
        nb = execute(path)
        if not args.no_save:
            nbformat.write(nb, path)
        print(f"{path.name}: {time.perf_counter() - t0:.1f} s, {path.stat().st_size / 1e3:.0f} kB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
