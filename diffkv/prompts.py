"""Prompts built from the offline data: long-context questions over Paul Graham essays."""

from __future__ import annotations

import torch

QUESTION = "In two sentences, what is the main argument of the essay above?"


def essay_tokens(tokenizer, num_tokens: int, start_essay: int = 0) -> list[int]:
    """``num_tokens`` token ids of PG essays (concatenated from essay ``start_essay`` on)."""
    from diffkv.registry.data import load_dataset

    essays = load_dataset("pg-essays")
    ids: list[int] = []
    for e in essays[start_essay:] + essays[:start_essay]:
        ids += tokenizer(e["text"] + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= num_tokens:
            break
    if len(ids) < num_tokens:
        raise ValueError(f"the PG essays hold only {len(ids)} tokens, fewer than the {num_tokens} asked for")
    return ids[:num_tokens]


def essay_question_ids(tokenizer, context_tokens: int, question: str = QUESTION) -> torch.Tensor:
    """Chat-formatted prompt: ``context_tokens`` of an essay, then ``question``. Returns input ids [1, L]."""
    context = tokenizer.decode(essay_tokens(tokenizer, context_tokens))
    content = f"{context}\n\n{question}"
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        return enc["input_ids"]
    return tokenizer(content, return_tensors="pt").input_ids
