"""Predict tier counts, pages and physical compression of any thresholds from recorded statistics.

The prediction replays the cache's own policy on the recorded importance: the prefill split
(:func:`diffkv.core.policy.split_prefill` on the exact prefill scores), then for each decode step the page reservation
rule of ``memory.reserve``, the single-victim placement (:func:`diffkv.core.policy.place_decode`) and the score
accumulation, with the full-cache decode attention renormalized over the tokens the simulated cache retains.
Layers are independent, so a whole grid of per-layer thresholds is simulated at once (candidates x texts x heads
are one batch). What it cannot see: quantization error in the attention of the compressed cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffkv.core import bookkeeping, policy
from diffkv.core.config import DiffKVConfig
from diffkv.core.layout import plan_for_config

_FAR = 1 << 40  # pos of tokens not in a tier: never eligible as a victim


@dataclass
class Prediction:
    """Simulated end state for C candidates. n_high, n_low, pages: [C, layers, N, H] int64 (pages = both tiers);
    pruned_mass, low_mass: [C, layers] mean share of decode attention on pruned / low tokens (full-cache probs).
    fp16_bytes_per_head: fp16 K+V bytes of the tokens seen by one head; page_bytes: bytes per page."""

    n_high: torch.Tensor
    n_low: torch.Tensor
    pages: torch.Tensor
    pruned_mass: torch.Tensor
    low_mass: torch.Tensor
    tokens_seen: int
    fp16_bytes_per_head: int
    page_bytes: int

    def layer_bytes(self) -> torch.Tensor:
        """[C, layers] page bytes summed over texts and heads."""
        return self.pages.sum(dim=(2, 3)).double() * self.page_bytes

    def compression(self) -> torch.Tensor:
        """[C] physical compression: fp16 bytes of every (text, layer, head) / bytes of the pages held."""
        cells = self.pages[0].numel()
        return cells * self.fp16_bytes_per_head / self.layer_bytes().sum(1)

    def tier_fractions(self, c: int = 0) -> dict:
        cells = self.n_high[c].numel() * self.tokens_seen
        hi, lo = int(self.n_high[c].sum()), int(self.n_low[c].sum())
        return {"high": hi / cells, "low": lo / cells, "pruned": 1 - (hi + lo) / cells}


def simulate_layer(prefill_score, decode_gain, alpha_high, alpha_low, config: DiffKVConfig, tokens_per_page,
                   renormalize: bool = True):
    """Replay one layer for C candidate threshold pairs.

    prefill_score: [N, H, L]; decode_gain: [N, H, S, L + S]; alpha_high, alpha_low: [C] float.
    tokens_per_page: (N_hi, N_lo). Returns (n_high, n_low, pages) [C, N, H] and (pruned_mass, low_mass) [C].
    """
    if config.peak:  # the recorded prefill scores are sums over the window (hooks.py): no peaks to replay
        raise ValueError("the calibration predictor replays mean importance only; importance='peak' configs are "
                         "measured (quality.measure_quality), not predicted")
    n, h, length = prefill_score.shape
    steps, width = decode_gain.shape[2], decode_gain.shape[3]
    c = alpha_high.shape[0]
    k = c * n * h
    ah = alpha_high.double().repeat_interleave(n * h)  # [K]
    al = alpha_low.double().repeat_interleave(n * h)
    lengths = torch.full((k,), length, dtype=torch.int64)
    score0 = prefill_score.float().reshape(1, n * h, length).expand(c, -1, -1).reshape(k, 1, length)
    split = policy.split_prefill(score0, lengths, ah.float()[:, None, None], al.float()[:, None, None],
                                 config.recent_window, config.score_window, two_tier=config.two_tier,
                                 min_kept=config.min_kept, min_high=config.min_high)
    tier = torch.full((k, width), policy.PAD, dtype=torch.int8)
    tier[:, :length] = split.tier[:, 0]
    pos = torch.zeros(k, width, dtype=torch.int64)
    lag, compact = config.score_lag, config.compact_meta
    pos[:, :length] = policy.prefill_positions(lengths, length, config.score_window, lag).long()
    score = torch.zeros(k, width)  # as stored: sums, or compact means (bookkeeping), held in fp32
    prompt = bookkeeping.encode_prefill(score0[:, 0], pos[:, :length], lengths[:, None], lag, compact)
    score[:, :length] = prompt.float()
    n_hi, n_lo = split.n_high.view(k).long(), split.n_low.view(k).long()
    per_hi, per_lo = tokens_per_page
    pg_hi, pg_lo = -(-n_hi // per_hi), -(-n_lo // per_lo)
    everything = torch.full((k,), width, dtype=torch.int64)
    rows = torch.arange(k)
    pruned_mass, low_mass = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
    for s in range(steps):
        p = length + s
        # NOTE: same demand rule as memory.alloc.reserve_demand (may_demote=None): before placement, never freed
        pg_hi += n_hi >= pg_hi * per_hi
        if config.two_tier:
            pg_lo += (n_lo >= pg_lo * per_lo) & (n_hi >= config.recent_window)
        position = torch.full((k,), p, dtype=torch.int64)
        place = policy.place_decode(score, torch.where(tier == policy.HIGH, pos, _FAR), everything, score,
                                    torch.where(tier == policy.LOW, pos, _FAR), everything, position, ah, al,
                                    config.recent_window, two_tier=config.two_tier, lag=lag, compact=compact)
        case = torch.where(n_hi + n_lo + 1 <= config.recent_window, policy.APPEND, place.case)
        demote = (case == policy.DEMOTE_OVER_LOW) | (case == policy.DEMOTE_APPEND_LOW)
        victim = (case == policy.PRUNE_HIGH) | demote
        tier[rows[victim], place.high_slot[victim]] = torch.where(demote[victim], policy.LOW, policy.PRUNED).to(
            torch.int8)
        over = case == policy.DEMOTE_OVER_LOW
        tier[rows[over], place.low_slot[over]] = policy.PRUNED
        n_hi += case == policy.APPEND
        n_lo += case == policy.DEMOTE_APPEND_LOW
        tier[:, p], pos[:, p] = policy.HIGH, p
        if lag:  # score_after_window: the token leaving the recent window starts a fresh score
            score = torch.where((pos == p - lag) & (tier == policy.HIGH), 0.0, score)
        gain = decode_gain[:, :, s].float().reshape(1, n * h, width).expand(c, -1, -1).reshape(k, width)
        total = gain.sum(-1).clamp_min(1e-30)
        kept = gain * (tier >= policy.LOW)
        pruned_mass += (gain * (tier == policy.PRUNED)).sum(-1) / total
        low_mass += (gain * (tier == policy.LOW)).sum(-1) / total
        if renormalize:
            kept = kept * (total / kept.sum(-1).clamp_min(1e-30))[:, None]
        score = bookkeeping.updated(score, kept, p - pos, lag, compact).float()
    shape = (c, n, h)
    masses = [(m / max(steps, 1)).view(c, n * h).mean(1) for m in (pruned_mass, low_mass)]
    return (n_hi.view(shape), n_lo.view(shape), (pg_hi + pg_lo).view(shape), *masses)


def predict(stats, config: DiffKVConfig, alphas: torch.Tensor, renormalize: bool = True) -> Prediction:
    """Simulate C candidates. alphas: [C, layers, 2] (alpha_high, alpha_low) per candidate and recorded layer."""
    plan = plan_for_config(config, stats.meta["head_dim"])
    per_page = (plan.layout(config.high).tokens_per_page, plan.layout(config.low).tokens_per_page)
    if alphas.dim() != 3 or alphas.shape[1:] != (len(stats.layers), 2):
        raise ValueError(f"alphas must be [C, {len(stats.layers)}, 2], got {tuple(alphas.shape)}")
    outs = [simulate_layer(stats.prefill_score[:, i], stats.decode_gain[:, i], alphas[:, i, 0], alphas[:, i, 1],
                           config, per_page, renormalize) for i in range(len(stats.layers))]
    n_hi, n_lo, pages, pm, lm = (torch.stack(x, 1) for x in zip(*outs, strict=False))
    seen = stats.context + stats.steps
    return Prediction(n_hi, n_lo, pages, pm, lm, seen, seen * 4 * stats.meta["head_dim"], plan.page_bytes)


def config_alphas(config: DiffKVConfig, layers: list[int]) -> torch.Tensor:
    """[1, len(layers), 2] thresholds of ``config`` for the recorded ``layers`` (model layer indices)."""
    return torch.tensor([[config.alphas(i) for i in layers]], dtype=torch.float64)
