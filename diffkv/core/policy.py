"""DiffKV token-importance policy, torch reference, batched over all (sequence, KV head) items of a layer.

Importance (docs/algorithm.md §4.1): ``score[t]`` accumulates the attention probability token t receives, taken as the
max over the query heads of its GQA group. Unlike the published code (max-of-sums at prefill, sum-of-maxes at
decode; docs/algorithm.md §7.2) we use **one aggregation everywhere: the sum over queries of the per-query max over
the group**, ``score[t] = sum_q max_{h in group} p_{h,q}(t)``, because that is what decode can accumulate one step at
a time.
``pos[t]`` is set so that ``p - pos[t]`` is the number of queries that have contributed, hence
``mean[t] = score[t] / (p - pos[t])`` is the average attention received, compared with ``alpha / n``.

``lag`` (``DiffKVConfig.score_lag``, beyond the paper): with ``lag = recent_window`` > 0 a decode score counts only
the attention received from age ``lag`` on. The score of the token whose age reaches ``lag`` is reset to 0 before
the step's attention (:func:`window_exits`), ``mean = score / (age - lag)`` and a token is a victim candidate from
age ``lag + 1``. Prompt tokens already past the window get ``pos - lag`` (:func:`prefill_positions`), so their
prefill scores keep their query counts.

Tiers: the labels of :class:`~diffkv.core.tiers.Tier`, PRUNED (0), LOW (1), HIGH (2); PAD (-1) marks padding
positions of a left-padded batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffkv.core.bookkeeping import means
from diffkv.core.tiers import Tier

PAD, PRUNED, LOW, HIGH = Tier.PAD, Tier.PRUNED, Tier.LOW, Tier.HIGH
APPEND, PRUNE_HIGH, DEMOTE_OVER_LOW, DEMOTE_APPEND_LOW = 0, 1, 2, 3
_INF = float("inf")


def prefill_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    score_window: int,
    peak: bool = False,
) -> torch.Tensor:
    """Importance of every prompt token from the last ``score_window`` queries (causal, padding-aware).

    queries: [B, H_q, L, D] (post-RoPE); keys: [B, H_kv, L, D]; valid: [B, L] bool (False = left padding) or None.
    Returns ``score`` [B, H_kv, L] fp32: sum over the window's queries of the max over the group of the softmax
    probability (peak: the max over the window's queries instead of the sum); 0 at padding positions. Materializes
    [B, H_q, W, L] fp32 logits (W = min(score_window, L)).
    """
    b, hq, length, _ = queries.shape
    hkv = keys.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    w = min(score_window, length)
    q = queries[:, :, length - w:].float()
    k = keys.float().repeat_interleave(hq // hkv, dim=1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, H_q, W, L]
    qpos = torch.arange(length - w, length, device=q.device)
    mask = torch.arange(length, device=q.device)[None, :] <= qpos[:, None]  # [W, L] causal
    mask = mask[None, None].expand(b, 1, w, length)
    if valid is not None:
        mask = mask & valid[:, None, None, :] & valid[:, None, length - w:, None]
    logits = logits.masked_fill(~mask, -_INF)
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # padding query rows are all -inf -> 0
    probs = probs.view(b, hkv, hq // hkv, w, length).amax(dim=2)
    return probs.amax(dim=2) if peak else probs.sum(dim=2)


def prefill_positions(lengths: torch.Tensor, total: int, score_window: int, lag: int = 0) -> torch.Tensor:
    """``pos`` of prompt tokens: ``max(t, n - W)`` with t the token's index among the valid tokens.

    lengths: [B] valid (unpadded) prompt lengths; total: padded length L. Returns [B, L] int32 (left-padded
    layout: valid token t of sequence b sits at column ``L - n_b + t``; padding columns get -1).
    lag > 0: tokens older than ``lag`` get ``max(t, n - W) - lag`` (their count stays ``p - max(t, n - W)``), the
    others ``t`` (their score restarts at age ``lag``).
    """
    col = torch.arange(total, device=lengths.device)[None, :]
    t = col - (total - lengths[:, None])
    pos = torch.maximum(t, lengths[:, None] - score_window)
    if lag:
        pos = torch.where(lengths[:, None] - t > lag, pos - lag, t)
    return torch.where(t >= 0, pos, -1).to(torch.int32)


def pool_scores(score: torch.Tensor, valid: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each prompt token's score as the max over the ``kernel`` tokens centred on it (``DiffKVConfig.score_pool``).

    score: [B, H_kv, L] fp32, >= 0 (left-padded, 0 at padding); valid: [B, L] bool. Returns [B, H_kv, L] fp32, 0 at
    padding; a window reaching past either end of the prompt takes the max of what is there. kernel: odd, >= 1
    (1 returns ``score`` itself).
    """
    if kernel == 1:
        return score
    b, h, length = score.shape
    pooled = torch.nn.functional.max_pool1d(score.reshape(b * h, 1, length), kernel, stride=1, padding=kernel // 2)
    return pooled.view(b, h, length) * valid[:, None, :]


@dataclass(frozen=True, slots=True)
class PrefillSplit:
    """tier: [B, H_kv, L] int8 in {PAD, PRUNED, LOW, HIGH}; n_high, n_low: [B, H_kv] int32."""

    tier: torch.Tensor
    n_high: torch.Tensor
    n_low: torch.Tensor


def split_prefill(
    score: torch.Tensor,
    lengths: torch.Tensor,
    alpha_high: float,
    alpha_low: float,
    recent_window: int,
    score_window: int,
    two_tier: bool = True,
    peak: bool = False,
    min_kept: float = 0.0,
    min_high: float = 0.0,
    fill_pages: tuple[int, int] | None = None,
) -> PrefillSplit:
    """Classify prompt tokens into tiers (docs/algorithm.md §4.2-4.3).

    score: [B, H_kv, L] from :func:`prefill_scores` (left-padded); lengths: [B] valid prompt lengths.
    ``mean = score / min(n - t, W)``; pruned if ``mean < alpha_low / n``, low if ``< alpha_high / n``, else high; the
    ``recent_window`` newest tokens are always high, and a prompt of at most ``recent_window`` tokens is kept
    whole. With one tier, tokens that are not pruned are high. peak: ``score`` holds peaks, compared as they are.
    min_kept: the floor of kept tokens per (sequence, head), a fraction of its prompt (beyond the paper): while a
    row keeps fewer than ``ceil(min_kept * n)``, its best-scored pruned tokens are kept in the low tier (high with
    one tier), ties at the floor's score included. min_high: the same floor on the high tier (its best-scored low or
    pruned tokens are moved up). fill_pages: (high, low) tokens per page, for a prompt that nothing will follow in
    its pages (a frozen shared prefix): each row's partly filled last page of a tier is filled with its best-scored
    tokens of the tiers below (:func:`fill_last_pages`), so the prefix keeps more at no page cost.
    """
    b, h, total = score.shape
    col = torch.arange(total, device=score.device)[None, :]
    t = col - (total - lengths[:, None])  # index among valid tokens, negative for padding
    base = lengths.clamp_min(1).to(torch.float32)[:, None, None]
    seen = torch.clamp(lengths[:, None] - t, max=score_window).clamp_min(1).to(torch.float32)
    mean = score.float() if peak else score.float() / seen[:, None, :]
    alpha_high = alpha_high if two_tier else alpha_low
    tier = torch.full_like(score, HIGH, dtype=torch.int8)
    tier = torch.where(mean < alpha_high / base, torch.tensor(LOW, dtype=torch.int8), tier)
    tier = torch.where(mean < alpha_low / base, torch.tensor(PRUNED, dtype=torch.int8), tier)
    recent = (lengths[:, None] - t <= recent_window)[:, None, :]
    tier = torch.where(recent, torch.tensor(HIGH, dtype=torch.int8), tier)
    tier = torch.where((t < 0)[:, None, :], torch.tensor(PAD, dtype=torch.int8), tier)
    if min_kept > 0:
        tier = _keep_floor(tier, mean, lengths, min_kept, LOW if two_tier else HIGH)
    if min_high > 0:
        tier = _keep_floor(tier, mean, lengths, min_high, HIGH)
    if fill_pages is not None:
        tier = fill_last_pages(tier, mean, fill_pages if two_tier else fill_pages[:1])
    n_high = (tier == HIGH).sum(-1, dtype=torch.int32)
    n_low = (tier == LOW).sum(-1, dtype=torch.int32)
    return PrefillSplit(tier, n_high, n_low)


def _keep_floor(tier: torch.Tensor, mean: torch.Tensor, lengths: torch.Tensor, fraction: float,
                into: int) -> torch.Tensor:
    """``tier`` [B, H, L] with the best-scored tokens below tier ``into`` of each row moved to ``into`` until at least
    ``ceil(fraction * n)`` of its n valid tokens are at ``into`` or above (:func:`split_prefill`'s ``min_kept``,
    ``min_high``). mean: [B, H, L]."""
    valid = tier != PAD
    need = torch.ceil(lengths.to(torch.float64) * fraction).to(torch.int64).clamp(max=tier.shape[-1])  # [B]
    ranked = torch.where(valid, mean, -math.inf).sort(-1, descending=True).values  # [B, H, L]
    floor = ranked.gather(-1, (need - 1).clamp_min(0)[:, None, None].expand(*tier.shape[:2], 1))  # [B, H, 1]
    lift = (tier != PAD) & (tier < into) & (mean >= floor) & (need > 0)[:, None, None]
    return torch.where(lift, torch.tensor(into, dtype=torch.int8), tier)


def fill_last_pages(tier: torch.Tensor, mean: torch.Tensor, per_page: tuple[int, ...]) -> torch.Tensor:
    """``tier`` [B, H, L] with each row's last page of each tier filled: high first, then low, ``per_page[i]``
    tokens per page of tier ``(HIGH, LOW)[i]``. A row whose tier holds n tokens gets its ``ceil(n / N) * N - n``
    best-scored tokens of the tiers below lifted into it (fewer when the row has fewer); a tier holding no token
    stays empty. No tier takes a page more than before (low only loses tokens to high before it is filled).
    mean: [B, H, L], the importance the tokens were split by."""
    valid = tier != PAD
    rank_of = torch.arange(tier.shape[-1], device=tier.device).expand_as(tier)
    for into, n in zip((HIGH, LOW), per_page, strict=False):  # one tier: high only
        below = valid & (tier < into)
        held = (tier == into).sum(-1, keepdim=True)  # [B, H, 1]
        room = torch.minimum(-(-held // n) * n - held, below.sum(-1, keepdim=True))
        order = torch.where(below, mean, -math.inf).argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, rank_of)  # 0 = the best-scored token below ``into``
        tier = torch.where(below & (rank < room), torch.tensor(into, dtype=tier.dtype), tier)
    return tier


@dataclass(frozen=True, slots=True)
class DecodePlacement:
    """Per item: ``case`` in {APPEND, PRUNE_HIGH, DEMOTE_OVER_LOW, DEMOTE_APPEND_LOW}, the high victim slot
    ``high_slot`` (where the new token goes unless APPEND; -1 otherwise) and the low slot ``low_slot`` that
    receives the demoted token (-1 unless demoting). All [N] int64."""

    case: torch.Tensor
    high_slot: torch.Tensor
    low_slot: torch.Tensor


def _weakest(score, pos, count, position, recent_window, lag, compact, peak=False):
    """argmin of the importance (mean or peak) over eligible slots. score/pos: [N, S]; count: [N]; position: [N].
    -> (min [N], idx [N])."""
    slot = torch.arange(score.shape[1], device=score.device)[None, :]
    age = position[:, None] - pos.to(position.dtype)
    eligible = (slot < count[:, None]) & (age >= max(recent_window, lag + 1))
    mean = torch.where(eligible, means(score, age, lag, compact, peak), _INF)
    if mean.shape[1] == 0:
        return torch.full_like(position, _INF, dtype=score.dtype), torch.zeros_like(position)
    m, idx = mean.min(dim=1)
    return m, idx


def place_decode(
    high_score: torch.Tensor,
    high_pos: torch.Tensor,
    n_high: torch.Tensor,
    low_score: torch.Tensor,
    low_pos: torch.Tensor,
    n_low: torch.Tensor,
    position: torch.Tensor,
    alpha_high: float,
    alpha_low: float,
    recent_window: int,
    two_tier: bool = True,
    lag: int = 0,
    compact: bool = False,
    peak: bool = False,
) -> DecodePlacement:
    """The single-victim decode rule of docs/algorithm.md §4.4 for N items at once, before the new token's attention.

    high_score/high_pos: [N, S_hi] score and pos of the high slots (slots >= n_high are ignored); low_*: [N, S_lo];
    n_high, n_low: [N]; position: [N] index of the new token (= tokens processed before it, the threshold base n).
    With one tier there is no demotion: a weak token is pruned and replaced. lag: see the module docstring.
    compact: the scores are already means (``DiffKVConfig.compact_meta``, ``diffkv.core.bookkeeping``).
    peak: the scores are peaks (``DiffKVConfig.importance``), compared as they are.
    """
    position = position.to(torch.int64)
    high_mean, high_slot_min = _weakest(high_score.float(), high_pos, n_high, position, recent_window, lag, compact,
                                        peak)
    if two_tier:
        low_mean, low_slot_min = _weakest(low_score.float(), low_pos, n_low, position, recent_window, lag, compact,
                                          peak)
    else:
        low_mean, low_slot_min = torch.full_like(high_mean, _INF), torch.zeros_like(high_slot_min)
    return decide_decode(high_mean, high_slot_min, low_mean, low_slot_min, n_high, n_low, position, alpha_high,
                         alpha_low, recent_window, two_tier)


def decide_decode(high_mean, high_slot_min, low_mean, low_slot_min, n_high, n_low, position, alpha_high: float,
                  alpha_low: float, recent_window: int, two_tier: bool = True) -> DecodePlacement:
    """The decision of docs/algorithm.md §4.4 (the paper's mL, iL, mR, iR) from the weakest high token's mean score
    and slot and the weakest low token's, all [N] (low_mean = inf without a low tier); position: [N] int64. See
    :func:`place_decode`."""
    base = position.clamp_min(1).to(torch.float32)
    prune_thr = alpha_low / base
    quant_thr = (alpha_high if two_tier else alpha_low) / base
    short = (n_high + n_low + 1) <= recent_window
    prune_high = (high_mean < prune_thr) & (high_mean < low_mean)
    demote = ~prune_high & (high_mean < quant_thr)
    over_low = demote & (low_mean < prune_thr)
    case = torch.full_like(position, APPEND)
    case = torch.where(prune_high, PRUNE_HIGH, case)
    case = torch.where(demote, torch.where(over_low, DEMOTE_OVER_LOW, DEMOTE_APPEND_LOW), case)
    case = torch.where(short, APPEND, case)
    high_slot = torch.where(case == APPEND, -1, high_slot_min)
    appended = n_low.to(low_slot_min.dtype)
    low_slot = torch.where(case == DEMOTE_OVER_LOW, low_slot_min, torch.where(case == DEMOTE_APPEND_LOW, appended, -1))
    return DecodePlacement(case, high_slot, low_slot)


def window_exits(pos: torch.Tensor, count: torch.Tensor, position: torch.Tensor, lag: int) -> torch.Tensor:
    """Which tokens reach age ``lag`` at this step (their scores restart): bool [N, S]; none when lag is 0.

    pos: [N, S] positions of the high slots (slots >= count ignored); count, position: [N]. Such tokens are high
    (a token is a victim candidate only from age ``lag + 1``); in a cache there is at most one per item (decode and
    in-window prompt tokens have distinct positions, older prompt tokens are stored ``lag`` earlier).
    """
    slot = torch.arange(pos.shape[1], device=pos.device)[None, :]
    hit = (slot < count[:, None]) & (position.to(torch.int64)[:, None] - pos.to(torch.int64) == lag)
    return hit & (lag > 0)


def accumulate_scores(score: torch.Tensor, probs: torch.Tensor, num_kv_groups: int) -> torch.Tensor:
    """``score[t] += max over the GQA group of p(t)`` for one decode query.

    score: [B, H_kv, T]; probs: [B, H_q, T] softmax probabilities (0 at empty slots). Returns the new score.
    """
    b, hq, t = probs.shape
    return score + probs.view(b, hq // num_kv_groups, num_kv_groups, t).amax(dim=2).to(score.dtype)
