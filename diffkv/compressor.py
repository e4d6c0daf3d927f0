"""One layer of DiffKV: prefill compression and the decode step, over all (sequence, KV head) items at once.

Framework-agnostic (used by the transformers cache; an engine can drive it too). Data path per ARCHITECTURE.md:
prefill = importance from the last ``score_window`` queries -> tier split -> worst-case allocate -> quantize into
pages -> trim; decode = reserve -> placement (§4.4) -> demote / store the new token -> attention over both tiers
-> score accumulation.
"""

from __future__ import annotations

import torch

from diffkv import policy
from diffkv.attention import decode_attention, decode_attention_gain
from diffkv.memory import HIGH, LOW, allocate, reserve, trim
from diffkv.ops import prefill_scores as prefill_ops
from diffkv.paged_kv import PagedKV
from diffkv.store_batch import TierWrite, store_batch_ref


class LayerCompressor:
    """DiffKV state of one layer for the sequences in ``slots`` (batch row b uses table slot ``slots[b]``)."""

    def __init__(self, kv: PagedKV, layer_idx: int, slots: list[int], num_kv_heads: int, *,
                 attention_backend: str = "auto"):
        if attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {attention_backend!r}")
        self.kv, self.layer_idx, self.slots, self.num_kv_heads = kv, layer_idx, list(slots), num_kv_heads
        # "auto": the Triton kernels read the pages directly on CUDA; the torch reference path on CPU.
        self.paged = attention_backend == "triton" or (attention_backend == "auto" and kv.pool.device.type == "cuda")
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
        if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
            raise ValueError(f"layer {self.layer_idx}: prompt keys/values contain NaN or Inf; cannot quantize them")
        lengths = valid.sum(1)
        if self.paged:  # the Triton two-pass kernels (same scores within 1e-4): no [B, H_q, W, L] logits
            score = prefill_ops.prefill_scores(query, keys, valid, scaling, cfg.score_window, backend="triton")
        else:
            score = policy.prefill_scores(query, keys, valid, scaling, cfg.score_window)
        if cfg.center_keys:  # one constant per head off every key: the softmax over tokens does not change
            # NOTE: the median, not the mean: a few outlier tokens (attention sinks) drag the mean far enough that
            # every other key gets a large offset and 4-bit keys break (measured: KL 1.1 vs 0.002 on qwen2.5).
            masked = keys.masked_fill(~valid[:, None, :, None], float("nan"))
            center = masked.nanmedian(dim=2).values.nan_to_num(0.0)  # [B, H, D] per-channel median of the prompt
            self.kv.set_key_center(self.items, center.reshape(b * h, -1))
            keys = keys - center[:, :, None, :]
        alpha_high, alpha_low = cfg.alphas(self.layer_idx)
        split = policy.split_prefill(score, lengths, alpha_high, alpha_low, cfg.recent_window,
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

    def decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, *,
               reserved: bool = False) -> torch.Tensor:
        """One decode step. query: [B, H_q, D]; key, value: [B, H_kv, D] of the new token. Returns [B, H_q, D] fp32.

        Decides placements from the stored scores, writes the demoted and the new token into their pages, attends
        over exactly the stored (quantized) cache and adds the probabilities to the scores. Three paths: the
        Triton kernels (CUDA); the dense mirror (``diffkv.mirror``, torch: no page read); the page-reading torch
        path when the mirror is disabled or over its budget (``PagedKV(mirror_budget_bytes=...)``).
        ``reserved``: the caller already reserved this step's pages for these heads (e.g. once for all layers).
        """
        kv, items = self.kv, self.items
        if not torch.isfinite(torch.stack([key, value])).all():
            raise ValueError(f"layer {self.layer_idx}: the new token's keys/values contain NaN or Inf")
        if not reserved:
            reserve(kv.pool, kv.tables, self.heads)
        if kv.config.center_keys:
            key = kv.centered_keys(items, key.reshape(-1, key.shape[-1])).view(key.shape)
        if self.paged:
            return self._decode_paged(query, key, value, scaling)
        mirror = kv.dense_mirror()
        if mirror is not None:
            counts = kv.tables.tokens_flat[items]
            prepared = mirror.prepare(self.layer_idx, self._keys(), items, counts)
            if prepared is not None:
                return self._decode_dense(mirror, *prepared, counts, query, key, value, scaling)
        return self._decode_pages(query, key, value, scaling)

    def _decode_pages(self, query, key, value, scaling):
        """The torch decode step reading each tier's pages once (widened by one token for this step) and patching
        the dense copies with what the pages now hold. Same arguments and result as :meth:`decode`."""
        kv = self.kv
        b, h, d = key.shape
        items, k = self.items, b * h
        n_hi, n_lo = self.counts()
        w_hi, w_lo = (int(x) + 1 for x in torch.stack([n_hi.max(), n_lo.max()]).tolist())
        kh, vh, sh, ph, _ = kv.read(HIGH, items, n_hi, w_hi)
        kl, vl, sl, pl, _ = kv.read(LOW, items, n_lo, w_lo)
        place, position = self._place(sh, ph, n_hi, sl, pl, n_lo)
        r = self._demoted(place)
        if r.numel():  # re-quantize the victim from its stored high-precision values into the low tier
            src, dst = place.high_slot[r], place.low_slot[r]
            kl[r, dst], vl[r, dst] = kv.write(LOW, items[r], dst, kh[r, src], vh[r, src], sh[r, src], ph[r, src],
                                              return_stored=True)
        target = torch.where(place.case == policy.APPEND, n_hi, place.high_slot)
        zeros = torch.zeros(k, dtype=torch.float32, device=key.device)
        rows = torch.arange(k, device=key.device)
        kh[rows, target], vh[rows, target] = kv.write(HIGH, items, target, key.reshape(k, d), value.reshape(k, d),
                                                      zeros, position.to(torch.int32), return_stored=True)
        n_hi, n_lo = self._commit_counts(place, n_hi, n_lo)
        m_hi, m = kh.shape[1], kh.shape[1] + kl.shape[1]
        tiers = []
        for keys, values, count in ((kh, vh, n_hi), (kl, vl, n_lo)):
            valid = torch.arange(keys.shape[1], device=key.device)[None, :] < count[:, None]
            tiers.append((keys.view(b, h, -1, d), values.view(b, h, -1, d), valid.view(b, h, -1)))
        out, probs = decode_attention(query, tiers, scaling)
        gain = probs.view(b, h, -1, m).amax(2).view(k, m)  # max over the GQA group
        kv.add_scores(HIGH, items, n_hi, gain[:, :m_hi])
        kv.add_scores(LOW, items, n_lo, gain[:, m_hi:])
        self.position += 1
        return out

    def _decode_dense(self, mirror, bank, step, counts, query, key, value, scaling):
        """The torch decode step over the dense mirror (``diffkv.mirror``): no page is read. Placement from the
        mirrored scores; the demoted and new tokens stored in one pass (``diffkv.store_batch``) and patched into the
        mirror as the pages now decode them; attention over both tiers; scores added in the mirror and written
        back to the pages. counts: int32 [K, 2] (n_high, n_low) before the step."""
        kv, cfg = self.kv, self.kv.config
        b, h, d = key.shape
        items, rows, k, low0, width = self.items, step.rows, b * h, step.low0, step.width
        n = counts.long()
        n_hi, n_lo = n[:, 0], n[:, 1]
        keys, values, scores, pos, address, holds = mirror.window(bank, step)
        position = self.position.repeat_interleave(self.num_kv_heads)  # [K] index of the new token
        alpha_high, alpha_low = cfg.alphas(self.layer_idx)
        weakest = policy.weakest_split(scores, pos, holds, position, cfg.recent_window, low0)
        append, demote, low_slot, low_append = policy.decode_moves(
            *weakest, n_hi, n_lo, position, alpha_high, alpha_low, cfg.recent_window, two_tier=cfg.two_tier)
        target = torch.where(append, n_hi, weakest[1])
        writes = [self._tier_write(HIGH, items, target, key.reshape(k, d), value.reshape(k, d),
                                   torch.zeros(k, dtype=torch.float32, device=key.device), position)]
        r = demote.nonzero().view(-1)
        if r.numel():  # re-quantize the victim from its stored high-precision values into the low tier
            src, dst = weakest[1][r], low_slot[r]
            writes.append(self._tier_write(LOW, items[r], dst, keys[r, src], values[r, src], scores[r, src],
                                           pos[r, src]))
            rows, target = torch.cat([rows, rows[r]]), torch.cat([target, dst + low0])
        stored_k, stored_v = store_batch_ref(kv.pool.data, [w for w, _, _ in writes], meta_dtype=kv.meta_dtype,
                                             raw_dtype=kv.raw_dtype)
        cat = torch.cat if len(writes) > 1 else (lambda xs: xs[0])
        mirror.patch(bank, rows, target, stored_k, stored_v, cat([w.scores for w, _, _ in writes]),
                     cat([p for _, _, p in writes]), cat([a for _, a, _ in writes]))
        new_counts = torch.stack([n_hi + append, n_lo + low_append], -1)
        kv.tables.tokens_flat[items] = new_counts.to(torch.int32)
        mirror.commit(self._keys(), new_counts)
        if step.span is None:  # the window was a copy: take it again with the new tokens
            keys, values, scores, pos, address, holds = mirror.window(bank, step)
        out, gain = decode_attention_gain(query, [(keys.view(b, h, width, d), values.view(b, h, width, d))],
                                          holds.view(b, h, width), scaling)
        scores = scores.add_(gain)  # 0 where no token
        mirror.set_scores(bank, step, scores)
        kv.write_scores(address[holds], scores[holds])
        self.position += 1
        return out

    def _keys(self) -> tuple[int, ...]:
        """The items as host ints (the mirror's keys), computed once."""
        if getattr(self, "_item_keys", None) is None:
            self._item_keys = tuple(self.items.tolist())
        return self._item_keys

    def _tier_write(self, tier, items, index, keys, values, scores, positions):
        """(TierWrite of token ``index`` [M] of ``tier`` of ``items`` [M], the flat fp32 pool index of its score [M],
        positions int64 [M]): what the store and the mirror patch need."""
        lay, tables = self.kv.layouts[tier], self.kv.tables
        per = lay.tokens_per_page
        col = index // per if tier == HIGH else (tables.width - 1) - index // per
        page, slot = tables.rows[items, col].long(), index % per
        address = page * (lay.page_bytes // 4) + (lay.score_offset // 4) + slot  # NOTE: both multiples of 4
        return TierWrite(lay, keys, values, page, slot, scores, positions.to(torch.int32)), address, positions

    def _decode_paged(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """The decode step with the Triton kernels: placement and stores fused in one launch
        (``diffkv.ops.place_store``, from the stored scores only), attention and the score update straight from the
        pages (``diffkv.ops.paged_attention``). Same arguments and result as decode."""
        from diffkv.ops.paged_attention import paged_decode_attention
        from diffkv.ops.place_store import place_store

        kv = self.kv
        b, h, d = key.shape
        k = b * h
        position = self.position.repeat_interleave(self.num_kv_heads)  # [K] index of the new token
        n_hi, n_lo = place_store(kv, self.items, key.reshape(k, d), value.reshape(k, d), position,
                                 *kv.config.alphas(self.layer_idx), backend="triton")
        out, _ = paged_decode_attention(query, kv.pool.data, kv.tables, self.items, n_hi, n_lo, kv.layouts, scaling,
                                        meta_dtype=kv.meta_dtype, raw_dtype=kv.raw_dtype, update_scores=True,
                                        return_gain=False, backend="triton")
        self.position += 1
        return out

    def _place(self, high_score, high_pos, n_hi, low_score, low_pos, n_lo):
        """Decode placement (ALGORITHM.md §4.4) from the stored scores/positions [K, M] of each tier.
        Returns the placement and the new token's position [K]."""
        cfg = self.kv.config
        position = self.position.repeat_interleave(self.num_kv_heads)  # [K] index of the new token
        alpha_high, alpha_low = cfg.alphas(self.layer_idx)
        place = policy.place_decode(high_score, high_pos, n_hi, low_score, low_pos, n_lo, position, alpha_high,
                                    alpha_low, cfg.recent_window, two_tier=cfg.two_tier)
        return place, position

    @staticmethod
    def _demoted(place: policy.DecodePlacement) -> torch.Tensor:
        """Items whose weakest high token moves to the low tier this step: int64 [R]."""
        demote = (place.case == policy.DEMOTE_OVER_LOW) | (place.case == policy.DEMOTE_APPEND_LOW)
        return demote.nonzero(as_tuple=True)[0]

    def _commit_counts(self, place: policy.DecodePlacement, n_hi: torch.Tensor, n_lo: torch.Tensor):
        """New (n_high, n_low) [K] after the placement, written to the tables."""
        n_hi = n_hi + (place.case == policy.APPEND).long()
        n_lo = n_lo + (place.case == policy.DEMOTE_APPEND_LOW).long()
        self.kv.tables.tokens_flat[self.items] = torch.stack([n_hi, n_lo], -1).to(torch.int32)
        return n_hi, n_lo
