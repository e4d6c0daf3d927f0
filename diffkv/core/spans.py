"""Words as spans of tokens: each prompt token's score max-pooled over its word (``DiffKVConfig.score_spans``).

A question reads a fact through a few of its tokens, yet the fact is all of them: qwen2.5 writes a 7-digit number as
7 digit tokens and a uuid as ~35 pieces with no space inside. Pooled over its word, every token of the fact scores
as its best token does, so the fact is kept or pruned whole. A word is a run of tokens between whitespace: a token
starts one when its text begins with whitespace or the token before it ends with whitespace (BPE vocabularies put
the space at the front of a token, " 2" or "Ġ", and newlines at the end, ".\\n"). Runs longer than ``SPAN_MAX``
tokens are cut into pieces of ``SPAN_MAX`` (text without spaces, e.g. code or a base64 blob, is not one fact).

The host knows the token ids and the tokenizer; the store knows neither: a host computes ``word_starts`` of each
prompt and hands them to ``KVStore.set_word_starts`` before its prefill.

    edges = word_edges(tokenizer)                       # once per tokenizer: [2, vocab] bool
    starts = word_starts(torch.tensor(ids), edges)      # [L] bool, True where a word starts
    pooled = pool_spans(score, starts[None], valid)     # score [B, H_kv, L] -> [B, H_kv, L]
"""

from __future__ import annotations

import torch

SPAN_MAX = 48  # tokens pooled as one word at most (a qwen2.5 uuid is ~36)


def word_edges(tokenizer) -> torch.Tensor:
    """[2, vocab] bool: row 0, the token's text begins with whitespace; row 1, it ends with whitespace. Ids the
    tokenizer cannot decode (holes in the vocabulary) count as whitespace at both ends. Raises ValueError for a
    tokenizer that cannot list its vocabulary."""
    if not all(hasattr(tokenizer, a) for a in ("__len__", "convert_ids_to_tokens", "convert_tokens_to_string")):
        raise ValueError(f"score_spans reads word boundaries from a Hugging Face tokenizer (len, "
                         f"convert_ids_to_tokens, convert_tokens_to_string); {type(tokenizer).__name__} has none")
    size = len(tokenizer)
    edges = torch.ones(2, size, dtype=torch.bool)
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(size)))):
        if piece is None:
            continue
        text = tokenizer.convert_tokens_to_string([piece])
        if text:
            edges[0, i], edges[1, i] = text[0].isspace(), text[-1].isspace()
    return edges


def word_starts(ids: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """ids: [L] int token ids of one prompt; edges: :func:`word_edges`. Returns [L] bool, True at the first token of
    each word (the first token of the prompt always). Raises ValueError for an id outside the vocabulary."""
    ids = ids.to(torch.long).cpu()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= edges.shape[1]):
        raise ValueError(f"word_starts: token ids must lie in [0, {edges.shape[1]}) (the tokenizer's vocabulary), "
                         f"got [{int(ids.min())}, {int(ids.max())}]; were they made by another tokenizer?")
    starts = edges[0, ids].clone()
    starts[1:] |= edges[1, ids[:-1]]
    if ids.numel():
        starts[0] = True
    return starts


def pool_spans(score: torch.Tensor, starts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each token's score as the max over its word (words of more than ``SPAN_MAX`` tokens cut into pieces).

    score: [B, H_kv, L] fp32 >= 0 (left-padded, 0 at padding); starts: [B, L] bool (:func:`word_starts`, left-padded
    like ``score``; padding is never pooled with a prompt token); valid: [B, L] bool. Returns [B, H_kv, L] fp32, 0 at
    padding.
    """
    b, h, length = score.shape
    index = torch.arange(length, device=score.device).expand(b, length)
    starts = starts.to(score.device) | ~valid | torch.roll(~valid, 1, -1)  # padding apart from the prompt
    start_of = torch.where(starts, index, 0).cummax(-1).values  # [B, L] index of each token's word start
    cut = (index - start_of) % SPAN_MAX == 0  # word starts, and every SPAN_MAX-th token inside a long word
    span = (cut.cumsum(-1) - 1).unsqueeze(1).expand(b, h, length)  # [B, H, L] span id, 0 .. L-1
    best = torch.zeros_like(score).scatter_reduce(-1, span, score, "amax", include_self=True)
    return best.gather(-1, span) * valid[:, None, :]
