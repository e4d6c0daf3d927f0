"""Build C sources into a shared library with the system C compiler, once per source version, and load it (ctypes).

Used by the compiled CPU kernels (``decode_cpu``) and ring operations (``diffkv.memory.ring_cpu``). The library goes
to ``cache_home()/build/<name>-<hash>.so``; the hash covers the sources, headers, flags and this CPU's instruction
set (libraries built with ``-march=native`` must not travel to another machine through a shared cache).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from diffkv.core.paths import cache_home

log = logging.getLogger("diffkv.kernels")


class CompileError(RuntimeError):
    """A C library could not be built; the torch reference path still works."""


def _cpu_id() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def compiler() -> str:
    """``$CC``, else ``cc`` or ``gcc`` on the PATH; raises :class:`CompileError` when there is none."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise CompileError("no C compiler found (set $CC or install gcc); use the 'torch' backend")
    return cc


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True)
    except OSError as err:
        raise CompileError(f"cannot run the C compiler {cmd[0]!r} ({err}); set $CC or use the 'torch' backend") from err


def build(name: str, sources: dict[Path, list[str]], *, headers: tuple[Path, ...] = (), link: list[str] = (),
          optional: list[str] = ()) -> ctypes.CDLL:
    """Compile each source with its flags (plus ``-O3 -fPIC``), link them into one library and load it.

    sources: {path: extra compiler flags}. optional: flags for every step (e.g. ``-fopenmp``, ``-march=native``)
    that are dropped, one attempt later, if the compiler refuses them. Raises :class:`CompileError`.
    """
    digest = hashlib.sha256()
    for path in (*sources, *headers):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(repr((sorted((p.name, f) for p, f in sources.items()), link, optional, _cpu_id())).encode())
    target = cache_home() / "build" / f"{name}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        cc = compiler()
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp, target.name)
            for extra in (list(optional), []):
                errors = _compile(cc, sources, extra, list(link), Path(tmp), built)
                if not errors:
                    break
            else:
                raise CompileError(f"{cc} failed to build {name}:\n{errors[-2000:]}")
            os.replace(built, target)  # atomic: concurrent builders each install a complete file
    return ctypes.CDLL(str(target))


def loads(library) -> bool:
    """Whether ``library()`` (a cached builder like ``decode_cpu.library``) builds and loads here. When it does not,
    the callers fall back to torch: say so once per library, with the reason, in the ``diffkv`` log."""
    try:
        library()
    except (CompileError, OSError) as err:
        if library not in _warned:
            _warned.add(library)
            log.warning("%s.%s is unavailable, falling back to the torch path (slower): %s",
                        library.__module__, library.__name__, str(err).splitlines()[0])
        return False
    return True


_warned: set = set()


def _compile(cc: str, sources: dict[Path, list[str]], extra: list[str], link: list[str], tmp: Path,
             out: Path) -> str:
    """Compile and link; returns the compiler's error output, empty on success."""
    objects = []
    for i, (path, flags) in enumerate(sources.items()):
        obj = tmp / f"{i}.o"
        proc = _run([cc, "-O3", "-fPIC", *extra, *flags, "-c", str(path), "-o", str(obj)])
        if proc.returncode:
            return proc.stderr or f"exit code {proc.returncode}"
        objects.append(str(obj))
    proc = _run([cc, "-shared", *extra, *objects, "-o", str(out), *link])
    return "" if proc.returncode == 0 else (proc.stderr or f"exit code {proc.returncode}")
