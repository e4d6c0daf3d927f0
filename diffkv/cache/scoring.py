"""How much each prompt token matters: the score that decides, at prefill, whether it is kept sharp, kept coarse or
dropped (docs/algorithm.md §4.1-4.3).

A scorer is a small object with one call, ``score(query, keys, valid, scaling, repeat_scores)``, returning one
number per prompt token and KV head (kvpress's "press" idea). :class:`WindowScorer` asks the last ``score_window``
queries how much attention each token gets; :class:`RepeatScorer` also keeps the attention a token got when the
prompt was read a second time; :class:`PooledScorer` lets each token take the best score of its neighbours, so
spans are kept or dropped whole. :func:`prompt_scorer` builds the chain a ``DiffKVConfig`` asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from diffkv.core import policy
from diffkv.ops import prefill_scores as prefill_ops

if TYPE_CHECKING:
    from diffkv.core.config import DiffKVConfig


class Scorer(Protocol):
    def score(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float,
              repeat_scores: torch.Tensor | None = None) -> torch.Tensor:
        """query: [B, H_q, L, D]; keys: [B, H_kv, L, D] post-RoPE; valid: [B, L] bool (False = left padding);
        repeat_scores: [B, H_kv, L] or None. Returns [B, H_kv, L] fp32, 0 at padding."""


@dataclass(frozen=True, slots=True)
class WindowScorer:
    """Attention from the last ``window`` prompt queries (``policy.prefill_scores``: its sum, or its max with
    ``peak``). ``triton``: the Triton two-pass kernels (``diffkv.ops.prefill_scores``, same scores within 1e-4),
    which never build the [B, H_q, W, L] logits; else the torch reference."""

    window: int
    peak: bool = False
    triton: bool = False

    def score(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float,
              repeat_scores: torch.Tensor | None = None) -> torch.Tensor:
        """query: [B, H_q, L, D]; keys: [B, H_kv, L, D]; valid: [B, L] bool. Returns [B, H_kv, L] fp32."""
        if self.triton:
            return prefill_ops.prefill_scores(query, keys, valid, scaling, self.window, backend="triton",
                                              peak=self.peak)
        return policy.prefill_scores(query, keys, valid, scaling, self.window, peak=self.peak)


@dataclass(frozen=True, slots=True)
class RepeatScorer:
    """A token keeps the larger of ``base``'s score and its repeat score (``prompt_scores="repeat"``: the peak
    attention it gets from a re-read copy of the prompt, ``diffkv.hf.repeat_scores``). ``where`` prefixes the
    error message (e.g. "layer 3: ")."""

    base: Scorer
    where: str = ""

    def score(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float,
              repeat_scores: torch.Tensor | None = None) -> torch.Tensor:
        """repeat_scores: [B, H_kv, L], required (ValueError otherwise). Returns [B, H_kv, L] fp32, 0 at padding."""
        b, h, length = keys.shape[:3]
        if repeat_scores is None or tuple(repeat_scores.shape) != (b, h, length):
            raise ValueError(f"{self.where}prompt_scores='repeat' needs repeat scores of shape "
                             f"{(b, h, length)} (diffkv.hf.repeat_scores, DiffKVCache.set_prompt_scores), got "
                             f"{None if repeat_scores is None else tuple(repeat_scores.shape)}")
        score = self.base.score(query, keys, valid, scaling, repeat_scores)
        return torch.maximum(score, repeat_scores.to(score.device, score.dtype) * valid[:, None, :])


@dataclass(frozen=True, slots=True)
class PooledScorer:
    """Each token's ``base`` score max-pooled over the ``kernel`` tokens centred on it (``policy.pool_scores``,
    ``DiffKVConfig.score_pool``): spans are kept or pruned whole."""

    base: Scorer
    kernel: int

    def score(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float,
              repeat_scores: torch.Tensor | None = None) -> torch.Tensor:
        """Returns [B, H_kv, L] fp32, 0 at padding."""
        return policy.pool_scores(self.base.score(query, keys, valid, scaling, repeat_scores), valid, self.kernel)


def prompt_scorer(config: DiffKVConfig, backend: str, *, where: str = "") -> Scorer:
    """The scorer chain ``config`` asks for: window scores (the Triton kernels when ``backend`` is "triton"), with
    ``prompt_scores="repeat"`` max'ed with the repeat scores, then pooled when ``score_pool > 1``. ``where``
    prefixes error messages."""
    scorer: Scorer = WindowScorer(config.score_window, config.peak, triton=backend == "triton")
    if config.prompt_scores == "repeat":
        scorer = RepeatScorer(scorer, where)
    if config.score_pool > 1:
        scorer = PooledScorer(scorer, config.score_pool)
    return scorer
