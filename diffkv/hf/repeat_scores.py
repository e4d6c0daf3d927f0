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
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from diffkv.core.spans import word_starts
from diffkv.hf.layer import RoutedLayer

ATTN = "diffkv_repeat_scores"
# sink(layer_idx, query [1, H_q, L, D], key [1, H_kv, L, D], value [1, H_kv, L, D], scaling, scores [H_kv, L] fp32 or
# None for a sliding-window layer): the first copy of one layer, post-RoPE, as a prefill of the prompt would see it
LayerSink = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], None]
BRIDGE = "\n\nRepeat the text above exactly.\n\n"


class _Pass:
    """What the attention function needs during one scoring pass, and what it collects."""

    def __init__(self, n: int, copy_start: int, chunk: int, sink: LayerSink | None = None):
        self.n, self.copy_start, self.chunk = n, copy_start, chunk
        self.scores: dict[int, torch.Tensor] = {}  # model layer -> [H_kv, n]
        self.sink = sink  # repeat_store: takes each layer's first copy as the pass goes


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
    if state is None:
        return out
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if not getattr(module, "sliding_window", None):
        state.scores[module.layer_idx] = copy_peaks(query[0], key[0], state.n, state.copy_start, scale, state.chunk)
    if state.sink is not None:
        n = state.n
        state.sink(module.layer_idx, query[:, :, :n], key[:, :, :n], value[:, :, :n], scale,
                   state.scores.get(module.layer_idx))
    return out


def _cache_sink(cache) -> LayerSink:
    """repeat_prefill's sink: each layer's first copy into ``cache`` (a DiffKVCache), as a prefill through it would
    store it; sliding-window layers (kept uncompressed by transformers) take it as they are."""

    def sink(layer_idx: int, q, k, v, scaling: float, scores) -> None:
        layer = cache.layers[layer_idx]
        if not isinstance(layer, RoutedLayer):
            layer.update(k, v)
            return
        layer.lazy_initialization(k, v)
        store = cache._store_for(k)
        valid = torch.ones(1, k.shape[2], dtype=torch.bool, device=k.device)
        split = store.prefill(layer_idx, cache.slots, q, k, v, valid, scaling, scores[None])
        layer.processed = k.shape[2]
        layer.prompt_stored(split)

    return sink


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


@torch.no_grad()
def repeat_prefill(model, cache, ids: torch.Tensor, bridge_ids: list[int], *, chunk: int = 256) -> None:
    """Score one prompt and store it in ``cache`` in the same forward: the re-read pass over
    ``prompt + bridge + prompt`` (:func:`repeat_scores`) also hands each layer's first copy to the cache, so the
    prompt is not run again (2 L + bridge tokens of forward instead of 3 L + bridge). The first copy's queries, keys
    and values are those of a prefill through the cache (causal attention: its tokens never see the copy), so the
    cache stores the split that scores set by hand and a prefill would store.

    cache: a fresh ``DiffKVCache`` with ``prompt_scores="repeat"`` (and with ``score_spans``, a tokenizer or
    ``set_word_starts``); ids: [1, L] token ids, no padding. Afterwards the cache holds L tokens; continue with the
    next ones (e.g. ``model(next_ids, past_key_values=cache, cache_position=torch.arange(L, ...))`` or ``generate``
    on the whole sequence). If the pass fails, the cache is released (its pages back in the pool) and the error
    raised.
    """
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"repeat_prefill takes one prompt, ids [1, L] with L >= 1, got {tuple(ids.shape)}; "
                         "score a batch with repeat_scores and cache.set_prompt_scores")
    if getattr(cache, "config", None) is None or cache.config.prompt_scores != "repeat":
        raise ValueError("repeat_prefill needs a DiffKVCache with DiffKVConfig(prompt_scores='repeat')")
    if cache.holds_tokens():
        raise ValueError("repeat_prefill stores a prompt into an empty cache; this one already holds tokens")
    if cache.config.score_spans and cache.word_starts is None:
        if cache._words_hook is None:
            raise ValueError("score_spans: call cache.set_word_starts(...) before repeat_prefill")
        cache.set_word_starts([word_starts(ids[0], cache._words_hook.get_edges())])
    try:
        repeat_store(model, ids, bridge_ids, _cache_sink(cache), chunk=chunk)
    except BaseException:
        cache.release()  # some layers may hold the prompt: give their pages back (the cache cannot be used again)
        raise


@torch.no_grad()
def repeat_store(model, ids: torch.Tensor, bridge_ids: list[int], sink: LayerSink, *, chunk: int = 256) -> None:
    """The re-read pass of one prompt (ids: [1, L], no padding) that hands every layer's first copy and its repeat
    scores to ``sink`` (:data:`LayerSink`) as the forward reaches it: a store that takes them (``repeat_prefill``'s
    DiffKVCache, the engine's prefix slot) holds the prompt, scored without any question, after one forward of
    2 L + bridge tokens. An error in the sink or the model propagates; undoing what the sink stored is the caller's.
    """
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"repeat_store takes one prompt, ids [1, L] with L >= 1, got {tuple(ids.shape)}")
    n = ids.shape[1]
    bridge = torch.tensor(bridge_ids, dtype=ids.dtype, device=ids.device)
    state = _Pass(n, n + bridge.numel(), chunk, sink=sink)
    _ACTIVE.append(state)
    try:
        with _scoring(model):
            model(torch.cat([ids[0], bridge, ids[0]])[None], use_cache=False, logits_to_keep=1)
    finally:
        _ACTIVE.pop()
