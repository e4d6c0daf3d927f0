"""Decoding helpers shared by the benchmarks, the evaluations, calibration and the engine."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end a generation: the model's generation config ``eos_token_id`` (one or a list) and the
    tokenizer's eos."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, context: int, cache) -> Iterator[torch.Tensor]:
    """Teacher-forced decoding through ``cache``, one token per step: the perplexity loop of every benchmark.

    ids: [B, L]. The prefill covers ``ids[:, :context]``; then for t = context .. L-1 yields the fp32 log-probs
    [B, V] of token t given every token before it (read from the cache), and feeds token t (except the last).
    """
    out = model(ids[:, :context], past_key_values=cache, use_cache=True)
    for t in range(context, ids.shape[1]):
        yield torch.log_softmax(out.logits[:, -1].float(), -1)
        if t + 1 < ids.shape[1]:
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)


def continuation_nll(model, ids: torch.Tensor, context: int, cache, progress=None) -> torch.Tensor:
    """Summed negative log-likelihood [B] (float64) of ``ids[:, context:]`` through ``cache`` (:func:`teacher_forced`).
    ``progress``: a bar advanced once per token."""
    nll = torch.zeros(ids.shape[0], dtype=torch.float64)
    for t, logp in enumerate(teacher_forced(model, ids, context, cache), start=context):
        nll -= logp.gather(1, ids[:, t:t + 1])[:, 0].double()
        if progress is not None:
            progress.update()
    return nll
