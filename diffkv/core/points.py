"""The two operating points of one configuration: the question is in the prompt, or it is not known yet.

A prompt prefilled with its question is scored by its own last queries (window scores, the paper's): they look at
what the question needs. A context compressed before its question exists (a shared system prompt or document, an
engine or vLLM shared prefix, ``DiffKVCache.for_context``, RULER's ask-after protocol) has no such queries: its
last queries are the chat template's end, which look at nothing the later question needs (on the shared-prefix
bench, window scores at the repeat run's bytes answer 1-12 of 32 questions, repeat scores 17;
benchmarks/serve/prefix/README.md). Such a context is scored by repeat scores (``prompt_scores="repeat"``, the
attention a re-read copy of it gives each token) with peak importance, at thresholds ``context_scale`` times the
window point's. :func:`context_point` turns a config into that point; every host that compresses a context before
its question calls it, so a user with one profile gets both without asking.

    context_point(DiffKVConfig())           # importance="peak", prompt_scores="repeat", thresholds x 64
"""

from __future__ import annotations

import dataclasses

from diffkv.core.checks import ConfigError
from diffkv.core.config import DiffKVConfig

SCORING_FIELDS = ("importance", "prompt_scores", "alpha_high", "alpha_low", "layer_alphas", "context_scale",
                  "min_kept", "min_high")


def scale_thresholds(cfg: DiffKVConfig, s: float) -> DiffKVConfig:
    """``cfg`` with its global and per-layer thresholds multiplied by ``s`` (alpha_low capped at 1, the config's
    limit for mean scores: pruning tokens that receive more than uniform attention; peak scores have no cap)."""
    if s == 1:
        return cfg
    cap = float("inf") if cfg.peak else 1.0
    layers = None if cfg.layer_alphas is None else tuple((h * s, min(low * s, cap)) for h, low in cfg.layer_alphas)
    return dataclasses.replace(cfg, alpha_high=cfg.alpha_high * s, alpha_low=min(cfg.alpha_low * s, cap),
                               layer_alphas=layers)


def context_point(cfg: DiffKVConfig) -> DiffKVConfig:
    """The point for a context compressed before its question: ``cfg`` itself when it already scores prompts by
    repeat scores or keeps every token in one tier (a paged fp16 cache: nothing to place), else ``cfg`` with
    ``importance="peak"``, ``prompt_scores="repeat"`` and every threshold times
    ``cfg.context_scale``. Everything that decides the storage (tiers, windows, pages, key transforms) is kept."""
    if cfg.prompt_scores == "repeat" or keeps_everything(cfg):
        return cfg
    return scale_thresholds(dataclasses.replace(cfg, importance="peak", prompt_scores="repeat"), cfg.context_scale)


def keeps_everything(cfg: DiffKVConfig) -> bool:
    """One tier and no threshold that prunes: every token is kept as it is, whatever its score."""
    lows = [cfg.alpha_low] if cfg.layer_alphas is None else [low for _, low in cfg.layer_alphas]
    return not cfg.two_tier and all(low == 0 for low in lows)


def check_same_storage(cfg: DiffKVConfig, point: DiffKVConfig, where: str = "") -> None:
    """ConfigError unless ``point`` stores as ``cfg`` does (it may differ only in :data:`SCORING_FIELDS`): a store
    holds one page layout, so a prefill may place its tokens by another point but never store them otherwise."""
    differ = [f.name for f in dataclasses.fields(cfg)
              if f.name not in SCORING_FIELDS and getattr(cfg, f.name) != getattr(point, f.name)]
    if differ:
        raise ConfigError(f"{where}a prefill's operating point may change only {', '.join(SCORING_FIELDS)} of the "
                          f"store's config; it changes {', '.join(differ)}")
