"""Answer extraction and metrics: GSM8K-style final numbers, multiple-choice letters, passkeys, mean ± stderr.

The number extraction follows lm-evaluation-harness' GSM8K filters: a ``#### N`` or ``The answer is N`` statement
("strict-match") wins, then ``\\boxed{N}``, else the last number in the text ("flexible-extract"). Numbers are
compared after removing ``$``, ``,`` and a trailing ``.``, as values (``18.00 == 18``).
"""

from __future__ import annotations

import math
import re

_NUM = r"-?[$0-9.,]*[0-9]"
_STRICT = [re.compile(r"####\s*(" + _NUM + ")"),
           re.compile(r"[Tt]he (?:final )?answer is:?\s*\$?\\?\(?\s*(" + _NUM + ")"),
           re.compile(r"\\boxed\{\s*(" + _NUM + r")\s*\}")]
_ANY_NUM = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")
_CHOICE_STRICT = re.compile(r"[Aa]nswer(?: is)?\s*[:：]?\s*\**\s*\(?([A-Z])\)?(?![A-Za-z])")
_CHOICE_PAREN = re.compile(r"\(([A-Z])\)")
_CHOICE_ALONE = re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])")


def normalize_number(text: str | None) -> str | None:
    """``"$1,150.00"`` -> ``"1150"``; ``None`` if ``text`` holds no number."""
    if text is None:
        return None
    t = text.replace("$", "").replace(",", "").strip().rstrip(".")
    try:
        value = float(t)
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    return str(int(value)) if value == int(value) else repr(value)


def extract_number(text: str) -> str | None:
    """Final numeric answer of a model output (normalized), or ``None``. Strict statements win over the last number."""
    for pattern in _STRICT:
        found = pattern.findall(text)
        if found:
            value = normalize_number(found[-1])
            if value is not None:
                return value
    for candidate in reversed(_ANY_NUM.findall(text)):
        value = normalize_number(candidate)
        if value is not None:
            return value
    return None


def gsm8k_reference(answer: str) -> str:
    """The gold number of a GSM8K answer string (the text after ``####``)."""
    if "####" not in answer:
        raise ValueError(f"not a GSM8K answer (no '####'): {answer[-80:]!r}")
    value = normalize_number(answer.split("####")[-1])
    if value is None:
        raise ValueError(f"GSM8K answer has no number after '####': {answer[-80:]!r}")
    return value


def extract_choice(text: str, num_choices: int = 4) -> str | None:
    """Letter picked in a multiple-choice answer (``Answer: C``, ``(C)``, a lone ``C``; last one wins) or None."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:num_choices]
    for pattern in (_CHOICE_STRICT, _CHOICE_PAREN, _CHOICE_ALONE):
        found = [c for c in pattern.findall(text) if c in letters]
        if found:
            return found[-1]
    return None


def contains_passkey(text: str, passkey: str) -> bool:
    """True if the digits of ``passkey`` appear as a whole number in ``text``."""
    return re.search(rf"(?<!\d){re.escape(passkey)}(?!\d)", text) is not None


def mean_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std, ddof 1; 0 for fewer than 2 values)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)
