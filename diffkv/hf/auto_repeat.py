"""Repeat scores without a call by hand: with ``DiffKVConfig(prompt_scores="repeat")`` a :class:`DiffKVCache` runs
the re-read pass (:func:`diffkv.hf.repeat_scores.repeat_scores`) itself, just before the model's first forward
through it, on that call's ``input_ids`` and ``attention_mask``.

A forward pre-hook on the model, installed by the cache (never at import) and removed by ``cache.release()``. It
does nothing when the scores were set by hand (``set_prompt_scores``), when the call goes through another cache, or
once the cache holds tokens. The bridge between the prompt and its copy is :data:`~diffkv.hf.repeat_scores.BRIDGE`
in the tokenizer's ids: pass ``tokenizer=`` (or ``bridge_ids=``) to the cache; without either the hook loads the
tokenizer from the model's folder (``model.config.name_or_path``).
"""

from __future__ import annotations

import torch

from diffkv.hf.repeat_scores import BRIDGE, repeat_scores


class RepeatOnFirstForward:
    """The pre-hook of one cache. bridge_ids: token ids, or None to take them from ``tokenizer`` / the model's
    folder when first needed."""

    def __init__(self, model, cache, tokenizer=None, bridge_ids: list[int] | None = None):
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.bridge_ids = None if bridge_ids is None else [int(t) for t in bridge_ids]
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def remove(self) -> None:
        self.handle.remove()

    def bridge(self) -> list[int] | None:
        if self.bridge_ids is None:
            tok = self.tokenizer
            if tok is None:
                try:
                    from transformers import AutoTokenizer

                    tok = AutoTokenizer.from_pretrained(self.model.config.name_or_path)
                except (OSError, ValueError):
                    return None  # the cache's own error then says what to pass
            self.bridge_ids = tok(BRIDGE, add_special_tokens=False).input_ids
        return self.bridge_ids

    def __call__(self, module, args, kwargs):
        cache = self.cache
        if kwargs.get("past_key_values") is not cache or cache.prompt_scores is not None or cache.holds_tokens():
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("DiffKVCache(prompt_scores='repeat') scores the prompt from input_ids; with "
                             "inputs_embeds call cache.set_prompt_scores(diffkv.hf.repeat_scores(...)) first")
        bridge = self.bridge()
        if bridge is None:
            return None
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask[:, -ids.shape[1]:]
        cache.set_prompt_scores(repeat_scores(self.model, ids, mask, bridge))
        return None
