"""Byte sizes on the command line: ``2GiB``, ``512MiB``, ``64k``, ``1e9``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"2GiB"`` -> 2147483648. Raises ValueError for anything that is not a positive size."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
        if not m or m.group(2) not in _UNITS:
            raise ValueError(f"cannot read {text!r} as a byte size; use e.g. 2GiB, 512MiB, 64MB or 1e9")
        value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value <= 0:
        raise ValueError(f"a byte size must be positive, got {text!r}")
    return value
