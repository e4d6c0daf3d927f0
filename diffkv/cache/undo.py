"""Undo records of decode steps, so that draft tokens that moved older tokens can still be cropped exactly.

A decode step (docs/algorithm.md §4.4) writes its new token into high slot ``n_high`` (APPEND) or into the slot
``iL`` of the weakest high token, which it prunes (PRUNE_HIGH) or demotes into a low slot (``iR``, dropping that
low token: DEMOTE_OVER_LOW; or a new one: DEMOTE_APPEND_LOW). Before such a step :func:`record_step` computes the
same decision (``policy.place_decode``, the rule every backend implements bit-exactly) and copies the bytes of the
slots it will overwrite; for a call of at most :data:`SCORED_CALL` tokens (draft tokens to verify) also the score of
every token the step's query will attend to (the attention it adds to them). :func:`undo_step` writes them back and
restores the token counts: tokens, tiers and those scores are then exactly as before the step, so the tokens kept
after a crop are placed later as they would have been without the dropped ones (assisted decoding gives the tokens
of plain decoding, up to the model's own arithmetic: ``benchmarks/serve/batch_invariance.md``). A score copy costs
the score field's bytes per stored token per step; a longer call (a chat turn, a chunk) keeps none, and a crop of
its tokens leaves their queries' attention in the other tokens' scores.

Recorded only for multi-token calls (draft verification, chunks, turns), where a crop can follow; a single-token
step costs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffkv.core import policy
from diffkv.memory import HIGH_COL, LOW_COL

SCORED_CALL = 32  # calls of at most this many tokens (drafts to verify) keep score copies for an exact crop


def token_bytes(kv, tier: int, items: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Flat pool byte indices, int64 [M, T], of every byte of token ``index[m]`` of ``tier`` of ``items[m]``: its key
    and value codes, their meta, score and position (T = the tier's bytes per token)."""
    lay = kv.layouts[tier]
    page, slot = kv.tables.token_address(items, tier, index)
    segments = ((lay.key_offset, lay.key_row_bytes),
                (lay.key_meta_offset, lay.key_groups * lay.key_meta_fields * lay.meta_bytes),
                (lay.value_offset, lay.value_row_bytes),
                (lay.value_meta_offset, lay.value_groups * 2 * lay.meta_bytes),
                (lay.score_offset, lay.score_bytes), (lay.pos_offset, lay.pos_bytes))
    base = page[:, None] * lay.page_bytes
    return torch.cat([base + off + slot[:, None] * row + torch.arange(row, device=page.device)
                      for off, row in segments], 1)


@dataclass
class StepUndo:
    """What one decode step of one layer changed. items: int64 [K]; counts: int32 [K, 2] (n_high, n_low) before;
    row_slot, row_pos: per row, the sequence's slot and the step's position (host lists); hi_* / lo_*: the rows whose
    high / low slot was overwritten, the flat byte indices of that slot [M, T] and its bytes before [M, T];
    scores: uint8 [S, score bytes], the score of every token of every row before the step, in the order of
    :func:`score_bytes` (None: not kept)."""

    items: torch.Tensor
    counts: torch.Tensor
    row_slot: list[int]
    row_pos: list[int]
    hi_rows: torch.Tensor
    hi_index: torch.Tensor
    hi_bytes: torch.Tensor
    lo_rows: torch.Tensor
    lo_index: torch.Tensor
    lo_bytes: torch.Tensor
    scores: torch.Tensor | None

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.items, self.counts, self.hi_rows, self.hi_index, self.hi_bytes,
                                      self.lo_rows, self.lo_index, self.lo_bytes, self.scores) if t is not None)


def score_bytes(kv, items: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row int64 [S], flat byte index int64 [S, B]) of the score of every token of heads ``items`` (int64 [K])
    holding ``counts`` (int [K, 2]: n_high, n_low) tokens, both tiers; B: the score field's bytes (the tiers share
    it)."""
    rows, index = [], []
    for tier in (HIGH_COL, LOW_COL):
        lay, n = kv.layouts[tier], counts[:, tier].long()
        row = torch.repeat_interleave(torch.arange(len(items), device=items.device), n)
        within = torch.arange(len(row), device=items.device) - torch.repeat_interleave(n.cumsum(0) - n, n)
        page, slot = kv.tables.token_address(items[row], tier, within)
        base = page * lay.page_bytes + lay.score_offset + slot * lay.score_bytes
        rows.append(row)
        index.append(base[:, None] + torch.arange(lay.score_bytes, device=items.device))
    return torch.cat(rows), torch.cat(index)


def record_step(kv, comp, scores: bool) -> StepUndo:
    """Before ``comp.decode`` (a ``LayerCompressor``): the decision it will take and the bytes it will overwrite;
    with ``scores`` a copy of every score its query will add to."""
    cfg, items = kv.config, comp.items
    h = len(items) // len(comp.slots)
    position = comp.position.repeat_interleave(h)
    counts = kv.tables.tokens_flat[items].clone()
    n_hi, n_lo = counts[:, 0].long(), counts[:, 1].long()
    w_hi, w_lo = (int(x) + 1 for x in torch.stack([n_hi.max(), n_lo.max()]).tolist())
    hs, hp, _ = kv.read_meta(HIGH_COL, items, n_hi, w_hi, position)
    ls, lp, _ = kv.read_meta(LOW_COL, items, n_lo, w_lo, position)
    alpha_high, alpha_low = cfg.alphas(comp.layer_idx)
    place = policy.place_decode(hs, hp, n_hi, ls, lp, n_lo, position, alpha_high, alpha_low, cfg.recent_window,
                                two_tier=cfg.two_tier, lag=cfg.score_lag, compact=kv.compact, peak=cfg.peak)
    hi_rows = (place.case != policy.APPEND).nonzero().view(-1)
    lo_rows = (place.case == policy.DEMOTE_OVER_LOW).nonzero().view(-1)
    flat = kv.pool.data.view(-1)
    hi_index = token_bytes(kv, HIGH_COL, items[hi_rows], place.high_slot[hi_rows])
    lo_index = token_bytes(kv, LOW_COL, items[lo_rows], place.low_slot[lo_rows])
    pos = comp.position.tolist()
    return StepUndo(items, counts, [s for s in comp.slots for _ in range(h)], [p for p in pos for _ in range(h)],
                    hi_rows, hi_index, flat[hi_index], lo_rows, lo_index, flat[lo_index],
                    flat[score_bytes(kv, items, counts)[1]] if scores else None)


def undo_step(kv, step: StepUndo, rows: torch.Tensor) -> None:
    """Put back what ``step`` changed in ``rows`` (bool [K]: the rows to undo; the others stay as they are)."""
    flat = kv.pool.data.view(-1)
    if step.scores is not None:  # the tokens before the step sit where they sat (steps only write new slots)
        which, index = score_bytes(kv, step.items, step.counts)
        keep = rows[which]
        flat[index[keep]] = step.scores[keep]
    for index, data, which in ((step.hi_index, step.hi_bytes, step.hi_rows),
                               (step.lo_index, step.lo_bytes, step.lo_rows)):
        keep = rows[which]
        flat[index[keep]] = data[keep]
    kv.tables.tokens_flat[step.items[rows]] = step.counts[rows]
