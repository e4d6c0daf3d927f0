"""Word starts without a call by hand: with ``DiffKVConfig(score_spans=True)`` a :class:`DiffKVCache` reads each
prompt's word boundaries (:mod:`diffkv.core.spans`) from the ``input_ids`` of the model's first forward through it.

A forward pre-hook on the model, installed by the cache (never at import) and removed by ``cache.release()``. It does
nothing when the word starts were set by hand, when the call goes through another cache or once the cache holds
tokens. The tokenizer gives the word boundaries: pass ``tokenizer=`` to the cache; without it the hook loads the one
in the model's folder (``model.config.name_or_path``).
"""

from __future__ import annotations

import torch

from diffkv.core.spans import word_edges, word_starts


class WordsOnFirstForward:
    """The pre-hook of one cache (``cache.set_word_starts`` per batch row, before its prompt is stored)."""

    def __init__(self, model, cache, tokenizer=None):
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.edges: torch.Tensor | None = None
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def remove(self) -> None:
        self.handle.remove()

    def get_edges(self) -> torch.Tensor:
        if self.edges is None:
            tok = self.tokenizer
            if tok is None:
                from transformers import AutoTokenizer

                try:
                    tok = AutoTokenizer.from_pretrained(self.model.config.name_or_path)
                except (OSError, ValueError) as err:
                    raise ValueError("DiffKVConfig(score_spans=True) reads word boundaries from the tokenizer: build "
                                     f"the cache with tokenizer= ({err})") from None
            self.edges = word_edges(tok)
        return self.edges

    def __call__(self, module, args, kwargs):
        cache = self.cache
        if kwargs.get("past_key_values") is not cache or cache.holds_tokens() or cache.word_starts is not None:
            return None  # another cache's call, a prompt already stored, or word starts set by hand
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("DiffKVCache(score_spans=True) reads the prompt's words from input_ids; with "
                             "inputs_embeds call cache.set_word_starts(...) first (diffkv.core.spans.word_starts)")
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask[:, -ids.shape[1]:]
        edges = self.get_edges()
        cache.set_word_starts([word_starts(row[keep.bool()], edges) for row, keep in zip(ids, mask, strict=True)])
        return None
