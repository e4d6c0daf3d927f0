"""Checked configuration values: every field is checked when its object is made.

Numbers are finite and in range, integers are ints (a ``bool`` is never a number), names are strings. A bad value
raises :class:`ConfigError` (a :class:`~diffkv.core.errors.UsageError`, so a ``ValueError``) whose message names the
field, the expected value and what was given.
"""

from __future__ import annotations

import math
import numbers

from diffkv.core.errors import UsageError


class ConfigError(UsageError):
    """A configuration value out of its type or range; the message names the field and the expected value."""


def show_value(value, limit: int = 60) -> str:
    """Short repr for messages (never raises: a huge int or a deep list has no cheap repr)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a message must not fail
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bad_value(field: str, expected: str, value) -> ConfigError:
    return ConfigError(f"{field}: expected {expected}, got {show_value(value)}")


def check_int(field: str, value, lo: int, hi: int, hint: str = "") -> int:
    """``value`` as an int in [lo, hi] (a bool or a float is refused); ConfigError naming ``field`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
        raise bad_value(field, f"an integer in [{lo}, {hi}]{hint}", value)
    return int(value)


def check_real(field: str, value, lo: float, hi: float, hint: str = "") -> float:
    """``value`` as a finite float in [lo, hi] (ints allowed, bools refused); ConfigError naming ``field``."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if ok and isinstance(value, numbers.Integral):
        ok = lo <= value <= hi  # exact: a huge int never reaches float()
    elif ok:
        try:
            f = float(value)
        except (OverflowError, ValueError):
            f = math.nan
        ok = math.isfinite(f) and lo <= f <= hi
    if not ok:
        raise bad_value(field, f"a finite number in [{lo:g}, {hi:g}]{hint}", value)
    return float(value)
