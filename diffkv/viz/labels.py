"""Short, wrapped legend labels for method families of :mod:`diffkv.viz.frontier`.

A family is a method spec without its operating point, ``[variant]`` appended (:func:`diffkv.viz.load_runs`), e.g.
``diffkv-compact-meta+page_bytes=1472+low=K4V3+recent_window=32 [engine-eval/first100]``. :func:`short_label`
abbreviates the method name and option keys listed in :data:`NAMES` and :data:`KEYS`, drops quotes and a ``=true``,
writes large round numbers as ``1e6`` and keeps the ``[variant]`` (it names the results folder) as it is:
``compact-meta+pg=1472+low=K4V3+rw=32 [engine-eval/first100]``. :func:`wrap_label` breaks a label into lines at its
``+`` and before the ``[variant]``; :func:`legend_labels` gives every family of one panel a distinct label.
"""

from __future__ import annotations

import re

NAMES = {"diffkv-compact-meta": "compact-meta"}  # method names (the spec before its first "+")
KEYS = {"page_bytes": "pg", "recent_window": "rw", "score_after_window": "saw", "layer_alphas": "la",
        "alpha_high": "a_hi", "alpha_low": "a_lo", "importance": "imp", "prompt_scores": "ps"}  # option keys
WIDTH = 28  # characters per legend line


def _value(v: str) -> str:
    """An option value, shorter: quotes dropped, a number >= 10000 ending in zeros as ``1e6`` / ``25e4``."""
    v = v.strip("\"'")
    m = re.fullmatch(r"([1-9]\d*?)(0{4,})", v)
    return f"{m[1]}e{len(m[2])}" if m else v


def _pieces(family: str) -> list[str]:
    """The shortened parts of a family: the method name, each ``+key=value`` and the `` [variant]``, if any."""
    spec, bracket, variant = family.partition(" [")
    name, *fields = spec.split("+")
    out = [NAMES.get(name, name)]
    for f in fields:
        key, eq, val = f.partition("=")
        key = KEYS.get(key, key)
        val = _value(val)
        out.append("+" + (key if eq and val == "true" else key + eq + val))
    if bracket:
        out.append(" [" + variant)
    return out


def short_label(family: str) -> str:
    """``family`` abbreviated on one line: ``diffkv-compact-meta+page_bytes=1472+alpha_high=1000000 [v]`` ->
    ``compact-meta+pg=1472+a_hi=1e6 [v]``; a name without anything to abbreviate comes back unchanged."""
    return "".join(_pieces(family))


def wrap_label(family: str, width: int = WIDTH) -> str:
    """:func:`short_label` broken into lines of at most ``width`` characters where it can be: a new line starts at a
    ``+`` (it continues the spec) or at the ``[variant]``; a single part longer than ``width`` is not cut."""
    lines: list[str] = []
    for piece in _pieces(family):
        if lines and len(lines[-1]) + len(piece) <= width:
            lines[-1] += piece
        else:
            lines.append(piece.lstrip())
    return "\n".join(lines)


def legend_labels(families: list[str], width: int = WIDTH) -> dict[str, str]:
    """Family -> its wrapped label (:func:`wrap_label`), distinct within ``families``: families whose abbreviations
    collide keep their full name (wrapped at ``+``), so no two entries of one legend read the same."""
    labels = {f: wrap_label(f, width) for f in families}
    seen: dict[str, list[str]] = {}
    for f, label in labels.items():
        seen.setdefault(label, []).append(f)
    for same in seen.values():
        if len(set(same)) > 1:
            for f in same:
                labels[f] = "\n+".join(f.split("+"))
    return labels


def abbreviations(families: list[str]) -> list[str]:
    """``short = long`` for every abbreviation :func:`short_label` applies to ``families`` (a figure's key)."""
    used = {}
    for family in families:
        spec = family.partition(" [")[0]
        name, *fields = spec.split("+")
        if name in NAMES:
            used[NAMES[name]] = name
        for f in fields:
            key = f.partition("=")[0]
            if key in KEYS:
                used[KEYS[key]] = key
    return [f"{k} = {v}" for k, v in sorted(used.items(), key=lambda kv: kv[1])]
