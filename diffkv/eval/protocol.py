"""When the question reaches the cache: with the prompt (``in-prompt``) or after the context was compressed
(``ask-after``).

DiffKV, H2O and SnapKV score the prompt's tokens by the attention of its last queries during prefill. In a
multi-turn chat, or a shared prefix reused by many requests, the context is prefilled (and compressed) before the
question exists, so those scores never see it. ``ask-after`` reproduces that: the prompt's tokens are the same as
``in-prompt``'s, but only the context goes through the prefill; the question and the chat template's tail
(generation prompt) are fed one token per step through the same cache (the decode path every method supports),
then the answer is generated greedily as in ``in-prompt``.

A sample supports ``ask-after`` when it names the held-back text: ``sample["question"]``, a suffix of the content
of its last message (the needle and ruler tasks set it). The question's tokens are held back together with
everything after them: the chat template's tail and the sample's ``answer_prefix``, if any.
"""

from __future__ import annotations

import torch

PROTOCOLS = ("in-prompt", "ask-after")
DEFAULT_PROTOCOL = "in-prompt"


def task_protocol(task, options: dict) -> str:
    """The protocol named by a run's task ``options`` (``"protocol"``; absent: :data:`DEFAULT_PROTOCOL`).

    ``ValueError`` for an unknown name, or for ``ask-after`` on a task whose samples name no question
    (``task.holds_question``).
    """
    name = options.get("protocol", DEFAULT_PROTOCOL)
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}; known protocols: {', '.join(PROTOCOLS)}")
    if name != DEFAULT_PROTOCOL and not task.holds_question:
        raise ValueError(f"the {name} protocol needs a task with a separate question (needle, ruler), not "
                         f"{task.name!r}")
    return name


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prompt_text(tokenizer, sample: dict) -> tuple[str, bool]:
    """The text of a sample's prompt and whether it is chat-formatted: the chat template with the generation prompt
    (the messages' contents joined by blank lines if the tokenizer has none), then the sample's ``answer_prefix``
    if it has one (the start of the answer, e.g. RULER's ``gen_prefix``; the model continues it)."""
    prefix = sample.get("answer_prefix") or ""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(sample["messages"], add_generation_prompt=True, tokenize=False)
        return text + prefix, True
    return "\n\n".join(m["content"] for m in sample["messages"]) + ("\n" + prefix if prefix else ""), False


def encode_prompt(tokenizer, sample: dict) -> list[int]:
    """Token ids of a sample's chat messages (chat template with generation prompt when the tokenizer has one), then
    its ``answer_prefix`` if any (:func:`prompt_text`)."""
    text, chat = prompt_text(tokenizer, sample)
    return tokenizer(text, add_special_tokens=not chat).input_ids


def question_tokens(tokenizer, sample: dict, prompt: list[int]) -> int:
    """How many of ``prompt``'s last tokens belong to the question and the template tail.

    prompt: the sample's token ids (:func:`encode_prompt`). The context is the prompt's text (:func:`prompt_text`)
    up to ``sample["question"]``; its tokens are the longest common prefix of ``prompt`` and the context's own
    tokenization, so a token that straddles the boundary counts as question. Returns n with 1 <= n < len(prompt).
    """
    question = sample.get("question")
    last = sample["messages"][-1]["content"] if sample.get("messages") else ""
    if not question or not last.endswith(question):
        raise ValueError(f"sample {sample.get('id')!r} names no question at the end of its last message; the "
                         "ask-after protocol needs one (the needle and ruler tasks have it)")
    text, chat = prompt_text(tokenizer, sample)
    cut = text.rfind(question)
    if cut < 0:
        raise ValueError(f"sample {sample.get('id')!r}: the chat template changed the question's text")
    context = tokenizer(text[:cut], add_special_tokens=not chat).input_ids
    held = len(prompt) - _common_prefix(prompt, context)
    if not 1 <= held < len(prompt):
        raise ValueError(f"sample {sample.get('id')!r}: cannot split its {len(prompt)}-token prompt before the "
                         f"question ({held} tokens held back)")
    return held


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """position ids [B, W] of a left-padded batch (as ``generate`` computes them; padding gets 1)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


@torch.no_grad()
def feed_context(model, ids: torch.Tensor, mask: torch.Tensor, cache, held: int) -> None:
    """Prefill ``ids[:, :W - held]`` through ``cache`` (unless it holds them already), then feed columns
    ``W - held .. W - 2`` one per step.

    ids, mask: [B, W] left-padded (every row's last ``held`` columns are real tokens). The last column is left for
    ``model.generate(ids, attention_mask=mask, past_key_values=cache)``, which continues from the cache's length.
    """
    width = ids.shape[1]
    if not 1 <= held < width or bool((mask[:, width - held:] == 0).any()):
        raise ValueError(f"cannot hold back {held} of {width} columns: they must be real tokens of every row")
    pos = _positions(mask)
    start = width - held
    filled = cache.get_seq_length()
    if filled not in (0, start):
        raise ValueError(f"the cache holds {filled} tokens; feed_context needs it empty or holding the {start} "
                         "context columns (diffkv.hf.repeat_scores.repeat_prefill)")
    if not filled:  # only the cache is wanted: logits_to_keep=1 spares the [B, W, vocab] logits
        model(ids[:, :start], attention_mask=mask[:, :start], position_ids=pos[:, :start], past_key_values=cache,
              use_cache=True, cache_position=torch.arange(start), logits_to_keep=1)
    for col in range(start, width - 1):
        model(ids[:, col:col + 1], attention_mask=mask[:, :col + 1], position_ids=pos[:, col:col + 1],
              past_key_values=cache, use_cache=True, cache_position=torch.tensor([col]), logits_to_keep=1)


def generate(model, ids: torch.Tensor, mask: torch.Tensor, cache, held: int = 0, **kwargs):
    """``model.generate`` through ``cache``, after :func:`feed_context` when ``held`` > 0 (``ask-after``).

    ids, mask: [B, W] left-padded prompts; kwargs go to ``generate``. Returns what ``generate`` returns (the
    sequences include the prompt's W columns).
    """
    if held:
        feed_context(model, ids, mask, cache, held)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, past_key_values=cache, **kwargs)
