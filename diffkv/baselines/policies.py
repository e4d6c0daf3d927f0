"""Eviction policies for :class:`~diffkv.baselines.eviction.EvictionCache`: H2O, SnapKV, StreamingLLM.

Each is a small :class:`EvictionPolicy` at a token budget ``ratio`` (fraction of seen tokens kept). To compare at
equal memory with DiffKV, set ``ratio = 1 / DiffKV's physical compression`` (see ``diffkv.eval.methods``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffkv.baselines.eviction import EvictionPolicy, attention_probs

_QUERY_CHUNK = 256


class H2OPolicy(EvictionPolicy):
    """Heavy-Hitter Oracle. Based on Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
    Large Language Models" (NeurIPS 2023): keep the ``recent_fraction`` of the budget as the most recent tokens and
    the rest as the tokens with the largest *accumulated* attention (summed over every query so far and over the
    query heads of a GQA group); one token is evicted per decode step once the budget is reached.
    """

    name = "h2o"
    accumulates = True
    score_bytes = 4  # one fp32 accumulated score per kept (token, head)

    def __init__(self, ratio: float, recent_fraction: float = 0.5):
        super().__init__(ratio)
        if not 0.0 <= recent_fraction <= 1.0:
            raise ValueError(f"recent_fraction must be in [0, 1], got {recent_fraction!r}")
        self.recent_fraction = recent_fraction

    def prefill_scores(self, query, keys, valid, scaling) -> torch.Tensor:
        """Column sums of the causal softmax over all valid prompt queries. Returns [B, H_kv, L] fp32."""
        b, h, length, _ = keys.shape
        total = torch.zeros(b, query.shape[1], length, device=keys.device)
        mask = valid[:, None, :]
        for s in range(0, length, _QUERY_CHUNK):
            p = attention_probs(query[:, :, s:s + _QUERY_CHUNK], keys, scaling, key_mask=mask, causal_from=s)
            p = p * valid[:, None, s:s + _QUERY_CHUNK, None]  # padded queries vote nothing
            total += p.sum(2)
        return total.view(b, h, -1, length).sum(2)

    def protected(self, pos, seen, keep) -> torch.Tensor:
        recent = torch.floor(keep.double() * self.recent_fraction).long()
        return pos >= (seen - recent)[:, None, None]


class SnapKVPolicy(EvictionPolicy):
    """SnapKV. Based on Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (2024): the last
    ``window`` prompt queries (observation window) vote for prefix tokens (softmax weights summed over the window,
    averaged over the GQA group), votes are smoothed by 1-D max pooling of width ``kernel``, the top-voted prefix
    tokens plus the window are kept. Only the prompt is compressed; decode tokens are all kept (as published).
    """

    name = "snapkv"
    decode_eviction = False

    def __init__(self, ratio: float, window: int = 32, kernel: int = 7):
        super().__init__(ratio)
        if window < 1 or kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"need window >= 1 and an odd kernel >= 1, got window={window}, kernel={kernel}")
        self.window, self.kernel = window, kernel

    def min_keep(self) -> int:
        return self.window

    def prefill_scores(self, query, keys, valid, scaling) -> torch.Tensor:
        b, h, length, _ = keys.shape
        w = min(self.window, length)
        p = attention_probs(query[:, :, -w:], keys, scaling, key_mask=valid[:, None, :], causal_from=length - w)
        votes = p.sum(2).view(b, h, -1, length).mean(2)  # [B, H_kv, L]
        return F.max_pool1d(votes, self.kernel, stride=1, padding=self.kernel // 2)

    def protected(self, pos, seen, keep) -> torch.Tensor:
        return pos >= (seen - self.window)[:, None, None]


class StreamingLLMPolicy(EvictionPolicy):
    """StreamingLLM. Based on Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024):
    keep the first ``sinks`` tokens (attention sinks) and the most recent tokens, evicting the oldest others.
    """

    name = "streamingllm"

    def __init__(self, ratio: float, sinks: int = 4):
        super().__init__(ratio)
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks!r}")
        self.sinks = sinks

    def min_keep(self) -> int:
        return self.sinks + 1

    def protected(self, pos, seen, keep) -> torch.Tensor:
        return (pos >= 0) & (pos < self.sinks)

    def priority(self, score, pos) -> torch.Tensor:
        return pos.float()  # newest first
