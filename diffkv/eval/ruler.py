"""RULER-style long-context suite on the offline PG essays: the ``ruler`` task of ``diffkv eval``.

The 12 families of :mod:`diffkv.eval.ruler_families` (RULER's 13 tasks, its two QA sets replaced by one cloze QA over
the essays), each prompt fitted to the requested length in tokens of the model's tokenizer, chat template and answer
prefix included (the largest haystack whose prompt holds at most ``length`` tokens). Scoring is RULER's string
match, case-insensitive: ``all`` (the fraction of the references found in the output; vt, cwe, fwe and the needles)
and ``part`` (1 if any reference is found; qa). A row's ``correct`` is a full score; ``score`` is RULER's number.

Options (``task_options``): ``lengths`` (prompt tokens, default 4096), ``families`` (default all), ``samples`` per
family and length (default 50), ``protocol`` (``in-prompt`` | ``ask-after``, see :mod:`diffkv.eval.protocol`).
Sample ``i`` of a family at a length comes from ``random.Random(f"{seed}-{family}-{length}-{i}")`` alone.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter

from diffkv.eval.ruler_families import FAMILIES, TOKENS_TO_GENERATE, Source, vt_example

DEFAULT_LENGTHS = (4096,)
DEFAULT_SAMPLES = 50
OPTIONS = ("lengths", "families", "samples", "protocol")
MIN_LENGTH = 128
VT_EXAMPLE_TOKENS = 470  # RULER's vt example: 500 tokens with its 30 to generate
VT_LEAST = 25  # noise sentences of the least vt example (five blocks: one per assignment of the chain)


class TooShort(ValueError):
    """The smallest haystack already exceeds the length."""


def fit_units(measure, length: int, least: int, start: int | None = None, rate: float = 1.0) -> tuple[int, float]:
    """The largest ``units >= least`` with ``measure(units) <= length`` for a ``measure`` that grows about linearly:
    a secant search from ``start`` (default ``least``) with the first guess ``rate`` tokens per unit, then
    interpolation between the closest fitting and overflowing sizes. Returns (units, the last rate estimate).
    ``TooShort`` when ``measure(least) > length``."""
    lo = hi = prev = None  # (units, tokens)
    units = max(least, least if start is None else start)
    for _ in range(64):
        n = measure(units)
        if prev is not None and units != prev[0] and n != prev[1]:
            rate = max((n - prev[1]) / (units - prev[0]), 1e-3)
        prev = (units, n)
        if n <= length and (lo is None or units > lo[0]):
            lo = (units, n)
        elif n > length and (hi is None or units < hi[0]):
            hi = (units, n)
        if lo is not None and (lo[1] == length or (hi is not None and hi[0] - lo[0] <= 1)):
            return lo[0], rate
        if lo is None:
            if units == least:
                raise TooShort(f"its shortest prompt holds {n} tokens")
            units = max(least, units - max(1, math.ceil((n - length) / rate)))
        elif hi is None:
            units = lo[0] + max(1, int((length - lo[1]) / rate))
        else:
            (a, na), (b, nb) = lo, hi
            units = min(max(a + round((length - na) * (b - a) / max(nb - na, 1)), a + 1), b - 1)
    raise RuntimeError(f"the length fit did not converge (fitting {lo}, overflowing {hi})")


def check_options(options: dict | None) -> tuple[list[int], list[str], int]:
    """(lengths, families, samples) of a run's ``task_options``; ``ValueError`` naming a bad option."""
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise ValueError(f"ruler: unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    lengths = opts.get("lengths", DEFAULT_LENGTHS)
    lengths = [lengths] if isinstance(lengths, int) else list(lengths)
    if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < MIN_LENGTH for n in lengths):
        raise ValueError(f"ruler lengths must be integers >= {MIN_LENGTH} (prompt tokens), got {lengths}")
    families = opts.get("families", list(FAMILIES))
    families = [families] if isinstance(families, str) else list(families)
    bad = [f for f in families if f not in FAMILIES]
    if bad or not families:
        raise ValueError(f"ruler families: unknown {bad or families}; known: {', '.join(FAMILIES)}")
    samples = opts.get("samples", DEFAULT_SAMPLES)
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ValueError(f"ruler samples (per family and length) must be an integer >= 1, got {samples!r}")
    return sorted(dict.fromkeys(lengths)), list(dict.fromkeys(families)), samples


def essay_vocabulary() -> tuple[list[str], Counter, int]:
    """The essays' vocabulary (sorted lowercase words of 4-10 letters, as written), the occurrences of every
    lowercased word and the number of essays."""
    from diffkv.registry.data import load_dataset

    essays = load_dataset("pg-essays")
    words = {w for e in essays for w in re.findall(r"(?<![\w'’-])[a-z]{4,10}(?![\w'’-])", e["text"])}
    return sorted(words), Counter(w for e in essays for w in re.findall(r"[a-z]+", e["text"].lower())), len(essays)


def postprocess(text: str) -> str:
    """RULER's prediction cleanup: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match(output: str, references: list[str], metric: str = "all") -> float:
    """RULER's per-sample score: ``all`` = fraction of ``references`` in ``output``, ``part`` = 1 if any is
    (case-insensitive substring match)."""
    pred = postprocess(output).lower()
    hits = [r.lower() in pred for r in references]
    if metric == "all":
        return sum(hits) / len(hits)
    if metric == "part":
        return float(any(hits))
    raise ValueError(f"unknown RULER metric {metric!r} (all | part)")


class Ruler:
    """RULER's synthetic families on the shipped PG essays (see the module doc and ``benchmarks/accuracy/ruler.md``).
    Samples: ``{"id", "messages", "reference" (list), "family", "length", "question", "answer_prefix",
    "max_new_tokens"}`` (RULER's budget of the family: the runners cut the answer there), ordered by length, then
    sample index, then family (``--limit 12`` takes one sample of each family)."""

    name, kind, holds_question = "ruler", "generate", True  # a diffkv.eval.tasks.Task (tasks imports this module)
    samples_grow = True  # sample i of a family does not depend on ``samples``: a run resumes with more
    max_new_tokens = 128  # RULER's largest budget (niah); a sample carries its family's (cwe 120, fwe 50, ...)

    def check_options(self, options: dict | None) -> None:
        check_options(options)

    def samples(self, tokenizer, seed=0, options=None):
        from diffkv import prompts
        from diffkv.eval.protocol import encode_prompt

        lengths, families, count = check_options(options)
        words, counts, n_essays = essay_vocabulary()
        essays: dict[int, list[int]] = {}  # start essay -> token ids, shared by the samples of a length
        out = []
        for length in lengths:
            essays.clear()
            fitted: dict[str, tuple[int, float]] = {}  # family -> (units, tokens per unit) of its last sample
            icl = VT_LEAST
            if "vt" in families:  # the size of vt's in-context example, fitted once per length as RULER does
                try:  # a quarter of the prompt below 2k tokens; its least size (about 250 tokens) at the least
                    icl = fit_units(lambda u, n=length: len(tokenizer(vt_example(f"{seed}-vt-{n}", u),
                                                                      add_special_tokens=False).input_ids),
                                    min(VT_EXAMPLE_TOKENS, length // 4), VT_LEAST, None, 5.0)[0]
                except TooShort:
                    icl = VT_LEAST
            for i in range(count):
                for family in families:
                    key = f"{seed}-{family}-{length}-{i}"
                    build, _, least, unit, rate = FAMILIES[family]
                    src = Source(words, counts, length=length, icl_units=icl)
                    if unit == "essay token":
                        start = random.Random(f"{key}-essay").randrange(n_essays)
                        if start not in essays:
                            essays[start] = prompts.essay_tokens(tokenizer, 2 * length, start_essay=start)
                        src.essay = lambda n, hay=essays[start]: re.sub(r"\s+", " ", tokenizer.decode(hay[:n])).strip()

                    def sample(units, key=key, build=build, src=src, family=family, length=length, i=i):
                        p = build(key, units, src)
                        return {"id": f"ruler-{family}-{length}-{i}", "family": family, "length": length,
                                "messages": [{"role": "user", "content": p["content"]}],
                                "reference": p["reference"], "question": p["question"],
                                "answer_prefix": p["answer_prefix"],
                                "max_new_tokens": TOKENS_TO_GENERATE.get(family, self.max_new_tokens)}

                    last = fitted.get(family)
                    fitted[family] = self._fit(lambda u, sample=sample: len(encode_prompt(tokenizer, sample(u))),
                                               length, least, last[0] if last else None, last[1] if last else rate,
                                               family, length)
                    out.append(sample(fitted[family][0]))
        return out

    @staticmethod
    def _fit(measure, length, least, start, rate, what, requested):
        try:
            return fit_units(measure, length, least, start, rate)
        except TooShort as err:
            raise ValueError(f"ruler length {requested} is too short for {what}: {err}") from None

    def score(self, sample, output):
        metric = FAMILIES[sample["family"]][1]
        score = string_match(output, sample["reference"], metric)
        return {"prediction": postprocess(output), "correct": score == 1.0, "score": score,
                "family": sample["family"], "length": sample["length"]}
