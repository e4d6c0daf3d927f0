"""Deferred chunked prefill: a prompt that arrives in chunks is held at full precision and stored in pages only
when it is complete, so it is scored and split exactly as if it had been prefilled whole (issue #44, design (a)).

Per layer it keeps the keys and values of every chunk so far and the queries of the last ``score_window`` prompt
tokens (the only ones the prefill scores use, docs/algorithm.md §4.1), plus ``spare`` more so that the newest
``spare`` tokens can be dropped (:meth:`PromptStage.crop`: draft tokens that came with the prompt). The price is
memory: until the prompt is complete it holds the uncompressed prompt of every layer (:meth:`PromptStage.nbytes`,
counted by the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffkv.ops.row_blocks import blocked_attention


@dataclass
class Staged:
    """One layer's prompt so far. keys, values: [B, H_kv, L, D]; queries: [B, H_q, min(W, L), D], the newest;
    valid: [B, L] bool (False = left padding); scaling: the attention scale."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    valid: torch.Tensor
    scaling: float

    def padded_queries(self) -> torch.Tensor:
        """[B, H_q, L, D]: the kept queries at the end, zeros before (``LayerCompressor.prefill`` reads only the last
        ``score_window`` columns)."""
        b, hq, w, d = self.queries.shape
        head = self.queries.new_zeros(b, hq, self.keys.shape[2] - w, d)
        return torch.cat([head, self.queries], 2)


class PromptStage:
    """Chunks of prompts not yet stored, by model layer. blocked: :meth:`attend` computes rows in fixed blocks of
    positions (bits independent of the chunking; default); False: one causal SDPA per chunk (faster on long
    chunks, bits may depend on the chunk size: the engine outside its batch-invariant mode)."""

    def __init__(self, score_window: int, spare: int = 0, blocked: bool = True):
        self.score_window, self.spare, self.blocked = score_window, spare, blocked
        self.layers: dict[int, Staged] = {}

    def __bool__(self) -> bool:
        return bool(self.layers)

    def add(self, layer: int, query, key, value, valid, scaling: float) -> Staged:
        """Append a chunk. query: [B, H_q, n, D]; key, value: [B, H_kv, n, D]; valid: [B, n] bool (left padding
        may run over several chunks). Returns the layer's prompt so far (for the chunk's attention)."""
        old = self.layers.get(layer)
        if old is None:
            staged = Staged(key, value, query[:, :, -self.score_window - self.spare:], valid, scaling)
        else:
            joined = torch.cat([old.valid, valid], 1)
            if bool((joined[:, :-1] & ~joined[:, 1:]).any()):
                raise ValueError("a chunk of a prompt holds padding after tokens; prompts may be left-padded only")
            staged = Staged(torch.cat([old.keys, key], 2), torch.cat([old.values, value], 2),
                            torch.cat([old.queries, query], 2)[:, :, -self.score_window - self.spare:], joined, scaling)
        self.layers[layer] = staged
        return staged

    def attend(self, layer: int, query, key, value, valid, scaling: float,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Append a chunk (:meth:`add`) and attend its queries over the layer's prompt so far, causally (``allowed``:
        bool [B, 1, n, L] instead, True = attend); with ``blocked`` rows in fixed blocks of positions so that a row's
        bits do not depend on the chunking or on what came with it (``blocked_attention``). The one staged
        attention of every host (the transformers cache and the engine). Returns [B, n, H_q, D]."""
        staged = self.add(layer, query, key, value, valid, scaling)
        if self.blocked:
            return blocked_attention(query, staged.keys, staged.values, allowed, scaling)
        n, cols = query.shape[2], torch.arange(staged.keys.shape[2], device=key.device)
        mask = cols <= cols[-n:, None] if allowed is None else allowed
        out = torch.nn.functional.scaled_dot_product_attention(query, staged.keys, staged.values, attn_mask=mask,
                                                               scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)

    def take(self, layer: int) -> Staged:
        """The layer's whole prompt, no longer held here (its queries cut to the last ``score_window``)."""
        staged = self.layers.pop(layer)
        staged.queries = staged.queries[:, :, -self.score_window:]
        return staged

    def crop(self, n: int) -> None:
        """Drop the newest ``n`` tokens of every layer's prompt (at most ``spare``; ValueError, nothing changed)."""
        if any(n > min(self.spare, s.keys.shape[2] - 1) for s in self.layers.values()):
            raise ValueError(f"crop of {n} staged tokens: at most {self.spare} (the recent window) can be dropped, "
                             "and not the whole prompt")
        for s in self.layers.values():
            s.keys, s.values, s.valid = s.keys[:, :, :-n], s.values[:, :, :-n], s.valid[:, :-n]
            s.queries = s.queries[:, :, :-n]

    def nbytes(self) -> int:
        return sum(t.nbytes for s in self.layers.values() for t in (s.keys, s.values, s.queries, s.valid))
