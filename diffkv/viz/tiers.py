"""Which tokens a :class:`~diffkv.integrations.transformers.DiffKVCache` keeps: tier counts and per-token tier maps.

Tier values are ``diffkv.core.tiers.Tier`` labels: 0 pruned, 1 low, 2 high (-1: a layer the cache does not compress,
e.g. a Gemma-3 sliding-window layer).

Counts per (layer, KV head) come straight from the page tables (:func:`tier_fractions`). *Which* token sits in which
tier needs more than the pages hold: a page stores each token's ``pos`` (its score's origin, docs/algorithm.md
§4.1), which for the prompt is ``max(t, n - score_window)`` — every prompt token older than the score window shares
one value. :func:`track_tiers` therefore watches the cache from its prefill on: it records the prefill split each
layer stored (the one ``LayerCompressor.prefill`` returns, handed to ``DiffKVLayer.prefill_listeners``; so it knows
the token of every page slot after prefill), keeps the stored keys of those slots, and at
:meth:`TierTracker.tier_map` time reads the pages again: a high-tier slot still holding
the shared ``pos`` was never overwritten; a low-tier slot is the same token while its stored key is unchanged, and a
token demoted there during decoding is matched to the high-tier key it was re-quantized from.
"""

from __future__ import annotations

import torch

from diffkv.core import policy
from diffkv.core.bookkeeping import full_positions
from diffkv.memory import HIGH_COL, LOW_COL

PRUNED, LOW, HIGH = policy.PRUNED, policy.LOW, policy.HIGH
TIER_NAMES = {HIGH: "high", LOW: "low", PRUNED: "pruned"}


def _diffkv_layers(cache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if getattr(layer, "filled", False)]


def tier_fractions(cache, batch_index: int | None = None) -> torch.Tensor:
    """Fraction of the tokens seen that each (layer, KV head) keeps in each tier.

    Returns float32 [num_layers, num_kv_heads, 3] in the order (high, low, pruned), summed over the batch when
    ``batch_index`` is None; NaN for layers the cache does not compress. Read from the page tables: the same counts
    as ``cache.stats()`` (``tier_fractions_per_layer`` is this averaged over heads).
    """
    out = torch.full((cache.num_layers, cache.num_kv_heads, 3), float("nan"))
    layers = _diffkv_layers(cache)
    if cache.kv is None or not layers or not cache.slots:
        return out
    rows = list(range(len(cache.slots))) if batch_index is None else [batch_index]
    tok = cache.store.tier_tokens([cache.slots[r] for r in rows], layers).cpu()  # [L', H, 2]
    seen = float(cache.seen_tokens()[rows].sum())
    hi, lo = tok[..., 0].float() / seen, tok[..., 1].float() / seen
    out[layers] = torch.stack([hi, lo, 1 - hi - lo], -1)
    return out


class _Snapshot:
    """One layer's state right after prefill, per item (b * H + h): slot -> token and the stored keys, per tier."""

    def __init__(self, tiers, lengths, tokens, pos, keys):
        self.tiers = tiers  # int8 [B, H, L] the prefill split (-1 padding), left-padded columns
        self.lengths = lengths  # [B] valid prompt tokens
        self.tokens = tokens  # {tier: [K] list of int64 [n] token index (among valid tokens) per slot}
        self.pos = pos  # {tier: [K] list of int64 [n] stored pos per slot}
        self.keys = keys  # {tier: [K] list of fp32 [n, D] stored (dequantized) keys per slot}


class TierTracker:
    """Follows a DiffKVCache from its prefill on; :meth:`tier_map` gives the tier of every token of a sequence.

    Built by :func:`track_tiers` before the cache sees its prompt. Keeps, per compressed layer and KV head, the
    prompt's tier split (as the cache stored it) and the dequantized keys stored at prefill (4 * head_dim bytes per
    prompt token and head).
    """

    def __init__(self, cache):
        from diffkv.integrations.transformers import DiffKVLayer

        if cache.kv is not None:
            raise ValueError("track_tiers(cache) must be called before the cache receives its prompt")
        self.cache = cache
        self._snap: dict[int, _Snapshot] = {}
        for layer in cache.layers:
            if isinstance(layer, DiffKVLayer):
                layer.prefill_listeners.append(self._snapshot)

    def _snapshot(self, layer, split: policy.PrefillSplit) -> None:
        """Right after ``layer`` stored its prompt: ``split`` is what it stored (tier int8 [B, H, L], -1 padding)."""
        comp, idx = layer.compressor, layer.layer_idx
        kv, cfg = comp.kv, comp.kv.config
        b, h, length = split.tier.shape
        lengths = (split.tier[:, 0] != policy.PAD).sum(-1)  # [B] valid prompt tokens (padding is on the left)
        n_hi, n_lo = split.n_high.view(-1).long(), split.n_low.view(-1).long()  # [B * H] what the tiers hold
        pos = policy.prefill_positions(lengths, length, cfg.score_window).long()  # [B, L], before any lag
        t = torch.arange(length, device=lengths.device)[None, :] - (length - lengths[:, None])  # index among valid
        tokens, stored_pos, keys = {}, {}, {}
        for tier, label, count in ((HIGH_COL, HIGH, n_hi), (LOW_COL, LOW, n_lo)):
            width = max(int(count.max()), 1)
            k = kv.read(tier, comp.items, count, width)[0].cpu()
            tokens[tier], stored_pos[tier], keys[tier] = [], [], []
            for item in range(b * h):
                row, head = divmod(item, h)
                cols = (split.tier[row, head] == label).nonzero(as_tuple=True)[0]
                tokens[tier].append(t[row, cols].cpu())
                stored_pos[tier].append(pos[row, cols].cpu())
                keys[tier].append(k[item, : cols.numel()].clone())
        self._snap[idx] = _Snapshot(split.tier.cpu(), lengths.cpu(), tokens, stored_pos, keys)

    def prefill_map(self, batch_index: int = 0) -> torch.Tensor:
        """int8 [num_layers, num_kv_heads, prompt tokens]: the tier each prompt token got at prefill."""
        snap = self._first()
        n = int(snap.lengths[batch_index])
        out = torch.full((self.cache.num_layers, self.cache.num_kv_heads, n), -1, dtype=torch.int8)
        for idx, s in self._snap.items():
            out[idx] = s.tiers[batch_index, :, s.tiers.shape[-1] - n:]
        return out

    def tier_map(self, batch_index: int = 0) -> torch.Tensor:
        """int8 [num_layers, num_kv_heads, tokens seen]: 2 high, 1 low, 0 pruned, by original position (prompt
        tokens first, then the decoded ones; -1 for layers the cache does not compress). The counts per (layer,
        head) equal the cache's tier counts."""
        snap = self._first()
        cache = self.cache
        seq = int(cache.seen_tokens()[batch_index])
        h = cache.num_kv_heads
        out = torch.full((cache.num_layers, h, seq), -1, dtype=torch.int8)
        w = cache.config.score_window
        prompt, lag = int(snap.lengths[batch_index]), cache.config.score_lag
        shared = prompt - w  # the pos every prompt token older than the window shares
        for idx, s in self._snap.items():
            comp = cache.layers[idx].compressor
            items = comp.items.view(-1, h)[batch_index]
            n = cache.store.head_tokens(items)
            final = {}
            for tier in (HIGH_COL, LOW_COL):
                k, _, _, p, _ = cache.kv.read(tier, items, n[:, tier], max(int(n[:, tier].max()), 1))
                p = p.long().cpu()
                if cache.kv.compact:  # positions kept mod 2^16
                    p = full_positions(torch.tensor(seq), p, True)
                if lag:  # score_after_window stores old prompt tokens lag earlier (policy.prefill_positions)
                    p = torch.where(p < prompt - lag, p + lag, p)
                final[tier] = (k.cpu(), p, n[:, tier].cpu())
            for head in range(h):
                out[idx, head] = self._head_row(s, batch_index * h + head, head, final, seq, shared)
        return out

    @staticmethod
    def _head_row(s: _Snapshot, item: int, head: int, final, seq: int, shared: int) -> torch.Tensor:
        row = torch.zeros(seq, dtype=torch.int8)
        kh, ph, nh = (x[head] for x in final[HIGH_COL])
        ph, kh = ph[:nh], kh[:nh]
        exact = ph != shared
        row[ph[exact]] = HIGH
        for i in (~exact).nonzero(as_tuple=True)[0].tolist():  # never overwritten: new tokens have pos >= n
            row[s.tokens[HIGH_COL][item][i]] = HIGH
        kl, pl, nl = (x[head] for x in final[LOW_COL])
        pl, kl = pl[:nl], kl[:nl]
        exact = pl != shared
        row[pl[exact]] = LOW
        tok0, key0 = s.tokens[LOW_COL][item], s.keys[LOW_COL][item]
        moved = []
        for j in (~exact).nonzero(as_tuple=True)[0].tolist():
            if j < len(tok0) and torch.equal(kl[j], key0[j]):
                row[tok0[j]] = LOW  # the token stored there at prefill
            else:
                moved.append(j)
        if moved:  # old prompt tokens demoted during decoding: match each to the high-tier key it came from
            tok_h, pos_h, key_h = (x[item] for x in (s.tokens[HIGH_COL], s.pos[HIGH_COL], s.keys[HIGH_COL]))
            cand = ((pos_h == shared) & (row[tok_h] != HIGH)).nonzero(as_tuple=True)[0]
            if len(cand) < len(moved):
                raise RuntimeError(f"{len(moved)} demoted tokens but only {len(cand)} candidates")
            dist = torch.cdist(kl[moved].float(), key_h[cand].float())
            for _ in moved:
                flat = int(dist.argmin())
                r, c = divmod(flat, dist.shape[1])
                row[tok_h[cand[c]]] = LOW
                dist[r, :], dist[:, c] = float("inf"), float("inf")
        return row

    def _first(self) -> _Snapshot:
        if not self._snap:
            raise RuntimeError("the tracked cache has not received a prompt yet")
        return next(iter(self._snap.values()))


def track_tiers(cache) -> TierTracker:
    """Start following ``cache`` (a fresh DiffKVCache, before its prompt): returns the :class:`TierTracker`.

        cache = DiffKVCache(model, cfg)
        tracker = track_tiers(cache)
        model.generate(ids, past_key_values=cache, ...)
        tracker.tier_map()   # int8 [layers, kv_heads, tokens]: 2 high, 1 low, 0 pruned
    """
    return TierTracker(cache)
