"""Evaluation tasks on the offline data (``diffkv.registry.data``): prompts, references and scoring.

A task turns dataset records into samples ``{"id", "messages" | "ids", "reference", ...}`` and scores a model
output with :meth:`Task.score` -> ``{"prediction", "correct"}`` (ruler adds ``score``, ``family`` and ``length``,
see ``diffkv.eval.ruler``). Generation tasks (gsm8k, aime2025, gpqa-diamond, needle, ruler) are run by
``runner.generate_batches``; ``ppl`` is teacher-forced through the cache (``runner.ppl_batches``).
"""

from __future__ import annotations

import random
import re

from diffkv.eval import answers
from diffkv.eval.ruler import Ruler  # RULER-style suite (its own modules: ruler, ruler_families)

GSM8K_PROMPT = ("Solve the following math problem step by step. At the end, write the final answer as "
                "\"The answer is N.\" where N is a number.\n\nQuestion: {question}")
AIME_PROMPT = ("Solve the following competition problem. Reason step by step, then put the final answer (an integer "
               "from 0 to 999) in \\boxed{{}}.\n\n{problem}")
GPQA_PROMPT = ("Answer the following multiple choice question. Think step by step, then finish with a line "
               "\"Answer: X\" where X is one of {letters}.\n\n{question}\n\n{choices}")
NEEDLE_INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
NEEDLE_TEXT = " The pass key is {key}. Remember it. {key} is the pass key. "
NEEDLE_QUESTION = "\n\nWhat is the pass key? Answer with the number only."


class Task:
    """Base task. ``kind`` is ``"generate"`` or ``"ppl"``; ``max_new_tokens`` is the default generation length."""

    name = "task"
    kind = "generate"
    max_new_tokens = 256
    holds_question = False  # True: samples name their question (``sample["question"]``), for ask-after

    def samples(self, tokenizer, seed: int = 0, options: dict | None = None) -> list[dict]:
        raise NotImplementedError

    def score(self, sample: dict, output: str) -> dict:
        raise NotImplementedError


class GSM8K(Task):
    """Grade-school math, final-number exact match. Option ``shots`` (default 0): that many worked examples as
    user/assistant turns before each question (few-shot chain of thought). The exemplars are the last ``shots``
    test questions, which are then left out of the samples, so sample ``gsm8k-i`` is the same question for any
    ``shots``."""

    name, max_new_tokens = "gsm8k", 256

    def samples(self, tokenizer, seed=0, options=None):
        from diffkv.registry.data import load_dataset

        data = load_dataset("gsm8k")
        shots = int((options or {}).get("shots", 0))
        if not 0 <= shots < len(data):
            raise ValueError(f"gsm8k shots must be in [0, {len(data) - 1}], got {shots}")
        examples = []
        for r in data[len(data) - shots:] if shots else []:
            examples += [{"role": "user", "content": GSM8K_PROMPT.format(**r)},
                         {"role": "assistant", "content": worked_answer(r["answer"])}]
        return [{"id": f"gsm8k-{i}", "messages": examples + [{"role": "user", "content": GSM8K_PROMPT.format(**r)}],
                 "reference": answers.gsm8k_reference(r["answer"])} for i, r in enumerate(data[:len(data) - shots])]

    def score(self, sample, output):
        pred = answers.extract_number(output)
        return {"prediction": pred, "correct": pred is not None and pred == sample["reference"]}


def worked_answer(answer: str) -> str:
    """A GSM8K reference solution as a model answer: calculator annotations ``<<48/2=24>>`` removed and the final
    ``#### N`` line written as the prompt asks (``The answer is N.``)."""
    steps, _, final = answer.rpartition("####")
    return re.sub(r"<<[^>]*>>", "", steps).strip() + f"\nThe answer is {final.strip()}."


class AIME2025(Task):
    name, max_new_tokens = "aime2025", 1024

    def samples(self, tokenizer, seed=0, options=None):
        from diffkv.registry.data import load_dataset

        return [{"id": f"aime2025-{i}", "messages": [{"role": "user", "content": AIME_PROMPT.format(**r)}],
                 "reference": answers.normalize_number(r["answer"])} for i, r in enumerate(load_dataset("aime2025"))]

    score = GSM8K.score


class GPQADiamond(Task):
    name, max_new_tokens = "gpqa-diamond", 512

    def samples(self, tokenizer, seed=0, options=None):
        from diffkv.registry.data import load_dataset

        out = []
        for i, r in enumerate(load_dataset("gpqa-diamond")):
            letters = "ABCD"[:len(r["choices"])]
            choices = "\n".join(f"({letter}) {c}" for letter, c in zip(letters, r["choices"], strict=True))
            text = GPQA_PROMPT.format(letters=", ".join(letters), question=r["question"], choices=choices)
            out.append({"id": f"gpqa-{i}", "messages": [{"role": "user", "content": text}],
                        "reference": letters[r["answer"]], "num_choices": len(letters)})
        return out

    def score(self, sample, output):
        pred = answers.extract_choice(output, sample["num_choices"])
        return {"prediction": pred, "correct": pred == sample["reference"]}


class Needle(Task):
    """Passkey retrieval in PG essays. Options: ``lengths`` (prompt tokens, default 1024, 2048), ``depths``
    (fraction of the haystack before the needle, default 0, .25, .5, .75, 1), ``repeats`` (default 1), ``protocol``
    (``in-prompt``, the default, or ``ask-after``: the context is compressed before the question is fed; see
    ``diffkv.eval.protocol``). Passkey and essay offset of each cell come from
    ``random.Random(f"{seed}-{length}-{depth}-{repeat}")``."""

    name, max_new_tokens, holds_question = "needle", 16, True

    def samples(self, tokenizer, seed=0, options=None):
        from diffkv.prompts import essay_tokens

        opts = options or {}
        lengths, depths = opts.get("lengths", (1024, 2048)), opts.get("depths", (0.0, 0.25, 0.5, 0.75, 1.0))
        overhead = len(tokenizer(NEEDLE_INTRO + NEEDLE_TEXT.format(key=12345) + NEEDLE_QUESTION,
                                 add_special_tokens=False).input_ids) + 24  # + chat template tokens
        out = []
        for length in lengths:
            if length <= overhead:
                raise ValueError(f"needle length {length} must exceed the prompt overhead of {overhead} tokens")
            for depth in depths:
                if not 0.0 <= depth <= 1.0:
                    raise ValueError(f"needle depth must be in [0, 1], got {depth}")
                for rep in range(int(opts.get("repeats", 1))):
                    rng = random.Random(f"{seed}-{length}-{depth}-{rep}")
                    key = str(rng.randint(10000, 99999))
                    hay = essay_tokens(tokenizer, length - overhead, start_essay=rng.randrange(49))
                    cut = int(round(depth * len(hay)))
                    text = (NEEDLE_INTRO + tokenizer.decode(hay[:cut]) + NEEDLE_TEXT.format(key=key)
                            + tokenizer.decode(hay[cut:]) + NEEDLE_QUESTION)
                    out.append({"id": f"needle-{length}-{depth:.2f}-{rep}", "length": length, "depth": depth,
                                "messages": [{"role": "user", "content": text}], "reference": key,
                                "question": NEEDLE_QUESTION})
        return out

    def score(self, sample, output):
        return {"prediction": output.strip()[:32], "correct": answers.contains_passkey(output, sample["reference"])}


class Perplexity(Task):
    """Perplexity of PG-essay continuations decoded token by token through the cache. Options: ``context``
    (default 1024 tokens), ``continuation`` (default 256), ``essays`` (default 8; sample i starts at essay i)."""

    name, kind, max_new_tokens = "ppl", "ppl", 0

    def samples(self, tokenizer, seed=0, options=None):
        from diffkv.prompts import essay_tokens

        opts = options or {}
        context, continuation = int(opts.get("context", 1024)), int(opts.get("continuation", 256))
        if context < 1 or continuation < 1:
            raise ValueError(f"ppl needs context >= 1 and continuation >= 1, got {context}, {continuation}")
        return [{"id": f"ppl-essay{i}", "ids": essay_tokens(tokenizer, context + continuation, start_essay=i),
                 "context": context, "reference": None} for i in range(int(opts.get("essays", 8)))]


TASKS: dict[str, Task] = {t.name: t for t in (GSM8K(), AIME2025(), GPQADiamond(), Needle(), Ruler(), Perplexity())}


def get_task(name: str) -> Task:
    """The task called ``name``; ``ValueError`` listing the known names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]
