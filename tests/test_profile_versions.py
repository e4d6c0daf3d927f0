"""Profiles that change get a new file name (issue #47): every shipped profile (``diffkv/profiles/NAME.json``) is
byte for byte a calibration result kept under its own name in ``benchmarks/calibration/``, and those files never
change in place (their SHA-256 is pinned here). Shipping a new calibration = add its file there (a new name, e.g.
``...-v2.json`` or dated), copy it over the shipped profile, and update the row below; a recorded command that names
the calibration file keeps running what it ran. Until 2026-12-03 shipped profiles were changed in place: the
accuracy README says which file each date used."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {  # shipped name: (calibration file it is a copy of, SHA-256 of that file)
    "gemma3-270m": ("gemma3-270m-full-compact-context.json",  # + its context point (#62: x32)
        "9ee6e64f43cfad804c9070a23a821e7f1e07f4606b1354772377ee23bc4fac23"),
    "qwen2.5-0.5b": ("qwen2.5-0.5b-full-compact-context.json",  # + its context point (#62: x32)
        "46d4d9045f022083c1a7e8179049b5aef0c0a8ca5beb91e4e8947d914d2b67f3"),
    "qwen2.5-1.5b": ("qwen2.5-1.5b-full-compact-context.json",  # + its context point (#62: x32)
        "88107d630bbfe5d31da2b1a5e0eccdbde7d485b667c42b2693a4c8b00531c5d6"),
    "smollm2-135m": ("smollm2-135m-full-compact-context.json",  # + its context point (#62: x8)
        "4ca71d426c30ccb0da0fe9840ce5ffa4182aaecd1b14d5b22e7ecb04599280eb"),
}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_shipped_profile_is_listed():
    assert sorted(p.stem for p in (ROOT / "diffkv" / "profiles").glob("*.json")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_profile_is_a_pinned_calibration_file(name):
    source, digest = SHIPPED[name]
    kept = ROOT / "benchmarks" / "calibration" / source
    assert sha(kept) == digest, f"{kept} changed in place: give the new calibration a new file name"
    assert sha(ROOT / "diffkv" / "profiles" / f"{name}.json") == digest, (
        f"diffkv/profiles/{name}.json is not {source}: ship a calibration kept under its own name, update SHIPPED")
