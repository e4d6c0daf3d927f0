"""Prompt scores that do not depend on the question: how much the model attends to each prompt token when it reads
the prompt again (KVzip's idea, "query-agnostic" importance; ``DiffKVConfig(prompt_scores="repeat")``).

For each prompt, one forward pass without cache over ``prompt + bridge + prompt`` (``bridge``: e.g. "Repeat the
text above."), at the model's own positions; in every full-attention layer the queries of the second copy attend
causally over everything before them, and a token of the first copy scores the largest probability any of them
gives it, the max over the query heads of its KV head's group too (the same GQA aggregation as the window
scores, ``diffkv.core.policy``). A token the model needs to reproduce the prompt scores high, whatever question
comes later. The pass costs one forward over twice the prompt; the probabilities are computed in chunks of
queries, so its extra memory is ``chunk x (2 L + bridge)`` floats per query head.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN = "diffkv_repeat_scores"
BRIDGE = "\n\nRepeat the text above exactly.\n\n"


class _Pass:
    """What the attention function needs during one scoring pass, and what it collects."""

    def __init__(self, n: int, copy_start: int, chunk: int):
        self.n, self.copy_start, self.chunk = n, copy_start, chunk
        self.scores: dict[int, torch.Tensor] = {}  # model layer -> [H_kv, n]


_ACTIVE: list[_Pass] = []  # the pass running now (transformers hands the attention function no handle of ours)


def copy_peaks(query: torch.Tensor, key: torch.Tensor, n: int, copy_start: int, scaling: float,
               chunk: int = 256) -> torch.Tensor:
    """Peak causal attention probability each of the first ``n`` keys receives from queries ``copy_start ..``.

    query: [H_q, T, D]; key: [H_kv, T, D] (GQA: H_q = G * H_kv). Returns [H_kv, n] fp32, the max over those queries
    and over the G query heads of each KV head. A chunk of queries ``start .. stop - 1`` reads only keys
    ``.. stop - 1`` (the later ones are masked for all of them) and exponentiates only the first ``n`` columns
    (``p = exp(logit - logsumexp)``); each query head group reads its KV head in place (no repeated keys).
    """
    hq, t, d = query.shape
    hkv = key.shape[0]
    g = hq // hkv
    q = (query.float() * scaling).view(hkv, g, t, d)
    k = key.float()[:, None]  # [H_kv, 1, T, D]
    best = torch.zeros(hkv, n, dtype=torch.float32, device=query.device)
    for start in range(copy_start, t, chunk):
        stop = min(start + chunk, t)
        logits = torch.matmul(q[:, :, start:stop], k[:, :, :stop].transpose(-1, -2))  # [H_kv, G, c, stop]
        causal = torch.ones(stop - start, stop - start, dtype=torch.bool, device=query.device).triu(1)
        logits[..., start:].masked_fill_(causal, float("-inf"))
        lse = torch.logsumexp(logits, -1, keepdim=True)
        peak = logits[..., :n].sub_(lse).amax(2).amax(1)  # [H_kv, n] (exp is monotonic: max first)
        best = torch.maximum(best, peak.exp_())
    return best


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA for the output; in full-attention layers also the copy's peaks (``copy_peaks``)."""
    out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    state = _ACTIVE[-1] if _ACTIVE else None
    if state is not None and not getattr(module, "sliding_window", None):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        state.scores[module.layer_idx] = copy_peaks(query[0], key[0], state.n, state.copy_start, scale, state.chunk)
    return out


@contextlib.contextmanager
def _scoring(model):
    """The model's attention set to :func:`_attention` for the block, restored after (registered on first use)."""
    AttentionInterface.register(ATTN, _attention)
    AttentionMaskInterface.register(ATTN, sdpa_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTN)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@torch.no_grad()
def repeat_scores(model, ids: torch.Tensor, mask: torch.Tensor, bridge_ids: list[int], *,
                  chunk: int = 256) -> list[torch.Tensor | None]:
    """Repeat scores of left-padded prompts, for ``DiffKVCache.set_prompt_scores``.

    ids, mask: [B, W] (mask 0 = left padding); bridge_ids: the tokens between the prompt and its copy (e.g. the
    tokenizer's ids of :data:`BRIDGE`). Returns one entry per model layer: [B, H_kv, W] fp32 (0 at padding), None
    for sliding-window layers. Each prompt is scored alone, so a score does not depend on the batch.
    """
    if ids.shape != mask.shape or ids.dim() != 2:
        raise ValueError(f"ids and mask must both be [B, W], got {tuple(ids.shape)} and {tuple(mask.shape)}")
    b, w = ids.shape
    layers = model.config.get_text_config().num_hidden_layers
    out: list[torch.Tensor | None] = [None] * layers
    bridge = torch.tensor(bridge_ids, dtype=ids.dtype, device=ids.device)
    for row in range(b):
        prompt = ids[row][mask[row].bool()]
        n = prompt.numel()
        if n == 0:
            raise ValueError(f"prompt {row} has no tokens")
        state = _Pass(n, n + bridge.numel(), chunk)
        _ACTIVE.append(state)
        try:
            with _scoring(model):
                model(torch.cat([prompt, bridge, prompt])[None], use_cache=False, logits_to_keep=1)
        finally:
            _ACTIVE.pop()
        for layer, score in state.scores.items():
            if out[layer] is None:
                out[layer] = torch.zeros(b, score.shape[0], w, dtype=torch.float32, device=ids.device)
            out[layer][row, :, w - n:] = score
    return out
