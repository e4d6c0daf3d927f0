"""The RULER task families, generated offline (templates verbatim from NVIDIA RULER as lm-evaluation-harness ports
them; ``benchmarks/accuracy/ruler.md`` says where the data differ).

A family builds one prompt from ``(key, units, src)``: ``key`` seeds every random choice (:class:`random.Random`),
``units`` sizes the haystack (essay tokens, noise sentences, needle lines, list entries or words; the caller fits it
to the requested prompt length) and ``src`` (:class:`Source`) holds the offline material. A prompt is a dict
``{"content", "question", "reference", "answer_prefix"}``: ``question`` is the suffix of ``content`` that the
``ask-after`` protocol holds back, ``answer_prefix`` RULER's ``gen_prefix`` (the start of the assistant's answer).
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
DEPTHS = [round(100 * i / 39) for i in range(40)]  # needle depths in % (RULER: np.linspace(0, 100, 40))
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assgined the value {query}, they are:")  # sic, as in RULER
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
QA_INSTRUCTION = ("Answer the question based on the given documents. Only give me the answer and do not output any "
                  "other words.")
QA_TEMPLATE = (QA_INSTRUCTION + "\n\nThe following are given documents.\n\n{context}\n\n" + QA_INSTRUCTION
               + "\n\nQuestion: {query}")
QA_QUERY = 'Which word was replaced by "____" in this sentence from one of the documents: "{cloze}"'
BLANK = "____"
RARE = 3  # qa blanks a word of at most this many occurrences in the essays when the context has one
ZETA2 = math.pi ** 2 / 6  # zeta(2): RULER's fwe draws word counts from a Zipf law with alpha = 2


@dataclass
class Source:
    """Offline material of one sample: ``words`` (the essays' vocabulary), ``corpus_counts`` (occurrences of each
    lowercased word in all the essays), ``essay(n)`` (the text of the sample's first n essay tokens, whitespace
    collapsed), the requested ``length`` and ``icl_units`` (the size of vt's example)."""

    words: list[str]
    corpus_counts: dict[str, int] = field(default_factory=dict)
    essay: Callable[[int], str] = lambda n: ""
    length: int = 4096
    icl_units: int = 50


def split(template: str, **kw) -> tuple[str, str]:
    """``template`` formatted, cut before ``{context}``'s end: (text before the context, question after it)."""
    head, _, tail = template.partition("{context}")
    return head.format(**kw), tail.format(**kw)


def prompt(template: str, context: str, reference, prefix: str, **kw) -> dict:
    head, question = split(template, **kw)
    return {"content": head + context + question, "question": question, "reference": reference,
            "answer_prefix": prefix}


def sentences(text: str) -> list[str]:
    """Sentences of collapsed text (split after . ! ? before a space; RULER uses nltk's sent_tokenize)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def draw(rng: random.Random, kind: str, words: list[str]) -> str:
    """A random needle key or value: 7-digit number, uuid4, or two vocabulary words joined by '-'."""
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(words)}-{rng.choice(words)}"


def noise_blocks(units: int, end: str = "") -> list[str]:
    """``units`` noise sentences in blocks of five (the last one may be short), each block ending with ``end``."""
    return [" ".join(NOISE[j % 5] for j in range(i, min(i + 5, units))) + end for i in range(0, units, 5)]


def niah(key: str, units: int, src: Source, *, haystack: str, k: str = "words", v: str = "numbers",
         num_k: int = 1, num_v: int = 1, num_q: int = 1) -> dict:
    """Needle(s) ``One of the special magic {v} for {key} is: {value}.`` in an essay, a repeated noise paragraph
    (``repeat``) or other needles (``needle``); asked: ``num_q`` of the ``num_k`` keys, every value of each."""
    rng, num_k = random.Random(key), max(num_k, num_q)
    keys, values, needles = [], [], []
    while len(keys) < num_k:
        name = draw(rng, k, src.words)
        if name in keys:
            continue
        keys.append(name)
        values.append([draw(rng, v, src.words) for _ in range(num_v)])
        needles += [NEEDLE.format(type_needle_v=v, key=name, value=x) for x in values[-1]]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), num_q)
    pos = random.Random(f"{key}-positions")
    if haystack == "essay":
        sents = sentences(src.essay(units))
        cuts = sorted(int(len(sents) * d / 100) for d in pos.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for cut, needle in zip(cuts, needles, strict=True):
            parts += sents[last:cut] + [needle]
            last = cut
        context = " ".join(parts + sents[last:])
    else:
        if haystack == "repeat":
            lines = noise_blocks(units)
        else:  # distractor needles, their keys distinct from the real ones
            hay, lines = random.Random(f"{key}-haystack"), []
            while len(lines) < units:
                name = draw(hay, k, src.words)
                if name not in keys:
                    lines.append(NEEDLE.format(type_needle_v=v, key=name, value=draw(hay, v, src.words)))
        for index, needle in zip(sorted(pos.sample(range(len(lines)), len(needles)), reverse=True), needles,
                                 strict=True):
            lines.insert(index, needle)
        context = "\n".join(lines)
    queries = [keys[i] for i in asked]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, type_v = NIAH_TEMPLATE, v
    if num_q * num_v == 1:  # singular wording, as RULER
        for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(a, b)
        type_v = v[:-1]
    prefix = (f"The special magic {type_v} for {query} mentioned in the provided text "
              + ("is" if num_q * num_v == 1 else "are"))
    return prompt(template, context, [a for i in asked for a in values[i]], prefix, type_needle_v=type_v, query=query)


def vt_parts(rng: random.Random, units: int, letters: int, hops: int = 4) -> tuple[str, list[str], str]:
    """A chain ``VAR A = 12345``, ``VAR B = VAR A`` ... among ``units`` noise sentences: (context, names, value)."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99998))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    blocks = noise_blocks(units, "\n")
    for j, at in enumerate(sorted(rng.sample(range(len(blocks)), len(chain)))):
        blocks.insert(at + j, chain[j])
    return " ".join(blocks).replace(". \n", ".\n"), names, value


def vt_example(key: str, units: int) -> str:
    """RULER's in-context example for vt: a shorter chain (3-letter names) with its answer."""
    context, names, value = vt_parts(random.Random(key), units, 3)
    head, question = split(VT_TEMPLATE, query=value)
    return (head + context + question + " " + VT_PREFIX.format(num_v=len(names), query=value) + " "
            + " ".join(names) + "\n\n")


def vt(key: str, units: int, src: Source) -> dict:
    """Variable tracking: one chain of 4 hops hidden in noise; answer every name bound to the value."""
    context, names, value = vt_parts(random.Random(key), units, 5)
    p = prompt(VT_TEMPLATE, context, names, VT_PREFIX.format(num_v=len(names), query=value), query=value)
    p["content"] = vt_example(f"{key}-example", src.icl_units) + p["content"]
    return p


def cwe(key: str, units: int, src: Source) -> dict:
    """Common words: 10 words repeated 30 times (6 below 4k tokens) and ``units`` entries of other words repeated
    3 times (once), shuffled into a numbered list; answer the 10."""
    rng = random.Random(key)
    common_reps, rare_reps = (30, 3) if src.length >= 4096 else (6, 1)
    words = list(src.words)
    rng.shuffle(words)
    rare = math.ceil(units / rare_reps)
    if 10 + rare > len(words):
        raise ValueError(f"cwe needs {10 + rare} distinct words; the essays' vocabulary holds {len(words)}")
    entries = words[:10] * common_reps + [w for w in words[10:10 + rare] for _ in range(rare_reps)][:units]
    rng.shuffle(entries)
    context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))
    return prompt(CWE_TEMPLATE, context, words[:10], CWE_PREFIX)


def fwe(key: str, units: int, src: Source) -> dict:
    """Frequent words: ``units`` draws of coded 6-letter words with Zipf counts (alpha 2; the top rank is '...',
    noise); answer the three that follow it."""
    rng, size = random.Random(key), max(src.length // 50, 8)
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."
    text = [w for r, w in enumerate(ranked, 1) for _ in range(int(units * r ** -2 / ZETA2))]
    rng.shuffle(text)
    return prompt(FWE_TEMPLATE, " ".join(text), ranked[1:4], FWE_PREFIX)


def qa(key: str, units: int, src: Source) -> dict:
    """Cloze QA over essay documents (the offline stand-in for RULER's SQuAD/HotpotQA): the essay text in documents
    of five sentences, shuffled; the question quotes a sentence of one document with a word blanked, a word of 5+
    letters that occurs once in the context (preferably one of at most ``RARE`` occurrences in all the essays, so
    that the sentence alone rarely gives it away); answer the word."""
    rng, sents = random.Random(key), sentences(src.essay(units))
    docs = [" ".join(sents[i:i + 5]) for i in range(0, len(sents), 5)]
    counts = Counter(re.findall(r"[a-z]+", (" ".join(docs) + QA_TEMPLATE + QA_QUERY).lower()))
    candidates = [(s, w) for s in sents[:5 * max(len(docs) - 1, 1)] if len(s.split()) >= 8  # not the cut last doc
                  for w in dict.fromkeys(re.findall(r"\b[A-Za-z]{5,}\b", s)) if counts[w.lower()] == 1]
    if not candidates:
        raise ValueError("qa: the essay text holds no sentence with a word that occurs once")
    rare = [c for c in candidates if src.corpus_counts.get(c[1].lower(), 0) <= RARE]  # harder to guess
    sentence, word = rng.choice(rare or candidates)
    rng.shuffle(docs)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
    cloze = re.sub(rf"\b{word}\b", BLANK, sentence, count=1)
    return {"content": QA_TEMPLATE.format(context=context, query=QA_QUERY.format(cloze=cloze)),
            "question": "\n\n" + QA_INSTRUCTION + "\n\nQuestion: " + QA_QUERY.format(cloze=cloze),
            "reference": [word], "answer_prefix": "Answer:"}


def _niah(**kw):
    return lambda key, units, src: niah(key, units, src, **kw)


TOKENS_TO_GENERATE = {"vt": 30, "cwe": 120, "fwe": 50, "qa": 32}  # RULER's answer budgets; the needles 128

# name: (builder, metric, least units, haystack unit, tokens per unit (a first guess for the length fit))
FAMILIES: dict[str, tuple[Callable[[str, int, Source], dict], str, int, str, float]] = {
    "niah_single_1": (_niah(haystack="repeat"), "all", 5, "noise sentence", 5.0),
    "niah_single_2": (_niah(haystack="essay"), "all", 64, "essay token", 1.0),
    "niah_single_3": (_niah(haystack="essay", v="uuids"), "all", 64, "essay token", 1.0),
    "niah_multikey_1": (_niah(haystack="essay", num_k=4), "all", 64, "essay token", 1.0),
    "niah_multikey_2": (_niah(haystack="needle"), "all", 1, "needle line", 20.0),
    "niah_multikey_3": (_niah(haystack="needle", k="uuids", v="uuids"), "all", 1, "needle line", 40.0),
    "niah_multivalue": (_niah(haystack="essay", num_v=4), "all", 64, "essay token", 1.0),
    "niah_multiquery": (_niah(haystack="essay", num_q=4), "all", 64, "essay token", 1.0),
    "vt": (vt, "all", 25, "noise sentence", 5.0),
    "cwe": (cwe, "all", 0, "list entry", 4.0),
    "fwe": (fwe, "all", 100, "coded word", 2.0),
    "qa": (qa, "part", 64, "essay token", 1.0),
}
