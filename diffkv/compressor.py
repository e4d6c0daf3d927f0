"""One layer of DiffKV: prefill compression and the decode step, over all (sequence, KV head) items at once.

Framework-agnostic (used by the transformers cache; an engine can drive it too). Data path per ARCHITECTURE.md:
prefill = importance from the last ``score_window`` queries -> tier split -> worst-case allocate -> quantize into
pages -> trim; decode = reserve -> placement (§4.4) -> demote / store the new token -> attention over both tiers
-> score accumulation.
"""

from __future__ import annotations

import torch

from diffkv import policy
from diffkv.attention import decode_attention
from diffkv.memory import HIGH, LOW, allocate, reserve, trim
from diffkv.paged_kv import PagedKV


class LayerCompressor:
    """DiffKV state of one layer for the sequences in ``slots`` (batch row b uses table slot ``slots[b]``)."""

    def __init__(self, kv: PagedKV, layer_idx: int, slots: list[int], num_kv_heads: int):
        self.kv, self.layer_idx, self.slots, self.num_kv_heads = kv, layer_idx, list(slots), num_kv_heads
        self.heads = kv.tables.select(self.slots, layers=[layer_idx])  # slot-major: item b * H + h
        self.position = torch.zeros(len(slots), dtype=torch.int64, device=kv.tables.device)  # tokens seen per seq

    @property
    def items(self) -> torch.Tensor:
        return self.heads.items

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        tok = self.kv.tables.tokens_flat[self.items].long()
        return tok[:, 0], tok[:, 1]

    def prefill(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                scaling: float) -> None:
        """Compress a prompt into pages.

        query: [B, H_q, L, D]; keys, values: [B, H_kv, L, D] post-RoPE; valid: [B, L] bool (False = left padding).
        """
        cfg, tables = self.kv.config, self.kv.tables
        b, h, length, _ = keys.shape
        lengths = valid.sum(1)
        score = policy.prefill_scores(query, keys, valid, scaling, cfg.score_window)
        split = policy.split_prefill(score, lengths, cfg.alpha_high, cfg.alpha_low, cfg.recent_window,
                                     cfg.score_window, two_tier=cfg.two_tier)
        allocate(self.kv.pool, tables, self.heads, lengths.tolist())
        tables.tokens_flat[self.items] = torch.stack([split.n_high, split.n_low], -1).view(-1, 2)
        pos = policy.prefill_positions(lengths, length, cfg.score_window)  # [B, L]
        grid = self.items.view(b, h)
        for tier, label in ((HIGH, policy.HIGH), (LOW, policy.LOW)):
            mask = split.tier == label  # [B, H, L]
            if tier == LOW and not cfg.two_tier:
                continue
            bi, hi, ti = mask.nonzero(as_tuple=True)
            index = (mask.cumsum(-1) - 1)[bi, hi, ti]
            self.kv.write(tier, grid[bi, hi], index, keys[bi, hi, ti], values[bi, hi, ti], score[bi, hi, ti],
                          pos[bi, ti], before_trim=True)
        trim(self.kv.pool, tables, self.heads)
        self.position = lengths.to(torch.int64)

    def decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        """One decode step. query: [B, H_q, D]; key, value: [B, H_kv, D] of the new token. Returns [B, H_q, D] fp32."""
        cfg, kv = self.kv.config, self.kv
        b, h, d = key.shape
        items = self.items
        reserve(kv.pool, kv.tables, self.heads)
        n_hi, n_lo = self.counts()
        w_hi, w_lo = (int(x) for x in torch.stack([n_hi.max(), n_lo.max()]).tolist())
        position = self.position.repeat_interleave(h)  # [K]
        hs, hp, _ = kv.read_meta(HIGH, items, n_hi, w_hi)
        ls, lp, _ = kv.read_meta(LOW, items, n_lo, w_lo)
        place = policy.place_decode(hs, hp, n_hi, ls, lp, n_lo, position, cfg.alpha_high, cfg.alpha_low,
                                    cfg.recent_window, two_tier=cfg.two_tier)
        demote = (place.case == policy.DEMOTE_OVER_LOW) | (place.case == policy.DEMOTE_APPEND_LOW)
        r = demote.nonzero(as_tuple=True)[0]
        if r.numel():
            kk, vv, ss, pp = kv.read_at(HIGH, items[r], place.high_slot[r])  # re-quantized from stored values
            kv.write(LOW, items[r], place.low_slot[r], kk, vv, ss, pp)
        append = place.case == policy.APPEND
        target = torch.where(append, n_hi, place.high_slot)
        zeros = torch.zeros(b * h, dtype=torch.float32, device=key.device)
        kv.write(HIGH, items, target, key.reshape(b * h, d), value.reshape(b * h, d), zeros, position.to(torch.int32))
        n_hi = n_hi + append.long()
        n_lo = n_lo + (place.case == policy.DEMOTE_APPEND_LOW).long()
        kv.tables.tokens_flat[items] = torch.stack([n_hi, n_lo], -1).to(torch.int32)
        w_hi, w_lo = (int(x) for x in torch.stack([n_hi.max(), n_lo.max()]).tolist())
        kh, vh, _, _, valid_h = kv.read(HIGH, items, n_hi, w_hi)
        kl, vl, _, _, valid_l = kv.read(LOW, items, n_lo, w_lo)
        m_hi, m = kh.shape[1], kh.shape[1] + kl.shape[1]
        keys = torch.cat([kh, kl], 1).view(b, h, m, d)
        values = torch.cat([vh, vl], 1).view(b, h, m, d)
        valid = torch.cat([valid_h, valid_l], 1).view(b, h, m)
        out, probs = decode_attention(query, keys, values, valid, scaling)
        gain = probs.view(b, h, -1, m).amax(2).view(b * h, m)  # max over the GQA group
        kv.add_scores(HIGH, items, n_hi, gain[:, :m_hi])
        kv.add_scores(LOW, items, n_lo, gain[:, m_hi:])
        self.position += 1
        return out
