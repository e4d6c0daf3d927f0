"""Specs for decoded JSON: small combinators that check a value field by field and return it parsed.

A spec is a function ``spec(value, path) -> parsed value``; ``path`` is the dotted field path (``""`` at the root)
and every mismatch raises :class:`SpecError` naming it and the expected value, e.g. ``field config.alpha_high:
expected a finite number in [0, 1e+06], got inf``. :func:`loads` decodes text defensively (nesting depth checked
on the raw text before ``json.loads`` recurses, duplicate keys refused). A schema built from these (the profile's,
:mod:`diffkv.profile_schema`) turns a :class:`SpecError` into its own error with :meth:`SpecError.message`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

from diffkv.core.checks import show_value
from diffkv.core.errors import UsageError

MAX_STR = 200  # longest string a plain :func:`string` accepts

Spec = Callable[[object, str], object]


class SpecError(UsageError):
    """A decoded JSON value that does not match its spec: ``path`` (``""`` for the root) and what is wrong there."""

    def __init__(self, path: str, detail: str):
        super().__init__(f"field {path}: {detail}" if path else detail)
        self.path, self.detail = path, detail

    def message(self, subject: str) -> str:
        """The message with the document named: ``"profile field x: ..."``, or ``"profile: ..."`` at the root."""
        return f"{subject} field {self.path}: {self.detail}" if self.path else f"{subject}: {self.detail}"


def fail(path: str, expected: str, value) -> SpecError:
    return SpecError(path, f"expected {expected}, got {show_value(value)}")


def number(lo: float, hi: float, lo_open: bool = False) -> Spec:
    """A finite JSON number (int or float, never a bool) in [lo, hi] (or (lo, hi]); returned as float."""
    expected = f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"

    def check(v, path):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            raise fail(path, expected, v)
        if not ((lo < v) if lo_open else (lo <= v)) or not v <= hi:  # exact for ints of any size
            raise fail(path, expected, v)
        return float(v)
    return check


def integer(lo: int, hi: int) -> Spec:
    def check(v, path):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise fail(path, f"an integer in [{lo}, {hi}]", v)
        return v
    return check


def string(choices: tuple[str, ...] | None = None, pattern: str | None = None, what: str = "") -> Spec:
    regex = re.compile(pattern) if pattern else None
    expected = what or (f"one of {list(choices)}" if choices else f"a printable string of 1 to {MAX_STR} characters")

    def check(v, path):
        if (not isinstance(v, str) or not 0 < len(v) <= MAX_STR or not v.isprintable()
                or (choices is not None and v not in choices) or (regex is not None and not regex.fullmatch(v))):
            raise fail(path, expected, v)
        return v
    return check


def boolean(v, path):
    if not isinstance(v, bool):
        raise fail(path, "true or false", v)
    return v


def constant(value) -> Spec:
    def check(v, path):
        if type(v) is not type(value) or v != value:
            raise fail(path, json.dumps(value), v)
        return v
    return check


def nullable(spec: Spec) -> Spec:
    def check(v, path):
        return None if v is None else spec(v, path)
    return check


def array(item: Spec, lo: int, hi: int, what: str = "") -> Spec:
    def check(v, path):
        if not isinstance(v, list) or not lo <= len(v) <= hi:
            raise fail(path, f"a list of {lo} to {hi} {what or 'items'}", v)
        return [item(x, f"{path}[{i}]") for i, x in enumerate(v)]
    return check


def obj(fields: dict[str, Spec], optional: dict[str, tuple[Spec, object]] | None = None) -> Spec:
    """A JSON object with exactly these keys (each required, no others), checked in this order; ``optional``:
    fields added later within a schema version, ``{name: (spec, default when missing)}``."""
    optional = optional or {}
    names = [*fields, *optional]

    def check(v, path):
        if not isinstance(v, dict):
            raise SpecError(path, f"expected an object with fields {names}, got {show_value(v)}")
        unknown = [k for k in v if k not in names]
        if unknown:
            raise SpecError(path, f"unknown field {show_value(unknown[0])}; expected only {names}")
        out = {}
        for key, spec in fields.items():
            sub = f"{path}.{key}" if path else key
            if key not in v:
                raise SpecError(sub, "missing (every field is required)")
            out[key] = spec(v[key], sub)
        for key, (spec, default) in optional.items():
            out[key] = spec(v[key], f"{path}.{key}" if path else key) if key in v else default
        return out
    return check


# ---------------------------------------------------------------- decoding text

# a string (closed, or running to the end of the text: always a match, so the scan stays linear) or a bracket
_JSON_TOKEN = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)|[\[\]{}]', re.S)


def nesting_depth(text: str, limit: int) -> int:
    """Deepest nesting of ``[``/``{`` outside strings, scanning stops once ``limit`` is passed (no recursion)."""
    depth = deepest = 0
    for m in _JSON_TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if depth > limit:
                break
        elif c in "]}":
            depth -= 1
    return deepest


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise SpecError("", f"key {show_value(k)} appears twice in one JSON object")
        d[k] = v
    return d


def loads(text: str):
    """``json.loads`` refusing duplicate keys (:class:`SpecError`); check :func:`nesting_depth` first, since
    ``json.loads`` recurses once per level. ValueError (JSONDecodeError, an int of too many digits) as json's."""
    return json.loads(text, object_pairs_hook=_no_duplicates)
