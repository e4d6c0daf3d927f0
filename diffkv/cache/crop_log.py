"""What makes ``KVStore.crop`` safe: the token counts of every head before each of the newest steps.

Dropping the newest ``n`` tokens of a sequence is exact only if the steps that stored them moved nothing else: each
was an APPEND (docs/algorithm.md §4.4, case 0: the new token took the next high slot, no older token was pruned or
demoted). Then every head's high count grew by exactly ``n``, its low count did not change, and the ``n`` newest
tokens are the ``n`` top high slots, in order. An APPEND is the only case with that count change (PRUNE_HIGH and
DEMOTE_OVER_LOW keep both counts, DEMOTE_APPEND_LOW adds a low token), so comparing counts proves it.

The log keeps, per table layer, the counts of every head of every slot before each of the ``depth`` newest
positions (a ring indexed by position mod ``depth``), written by the layer itself just before it stores a token.
Steps of multi-token calls (draft verification in assisted decoding) also leave undo records
(:mod:`diffkv.cache.undo`): their tokens can be dropped even when the steps pruned or demoted older tokens.
"""

from __future__ import annotations

import torch

from diffkv.cache.undo import StepUndo, undo_step


class CropLog:
    """Counts before each of the ``depth`` newest tokens of up to ``max_slots`` sequences.

    counts: per table layer, int32 [depth, max_slots * H, 2] (n_high, n_low per head, row ``slot * H + h``).
    logged: slot -> the positions whose counts are in the ring (host ints, the newest ``depth`` at most).
    """

    def __init__(self, layers: list[int], max_slots: int, num_kv_heads: int, depth: int, device):
        if depth < 1:
            raise ValueError(f"a crop log needs a depth of at least one token, got {depth}")
        self.depth, self.num_kv_heads = depth, num_kv_heads
        self.counts = {i: torch.zeros(depth, max_slots * num_kv_heads, 2, dtype=torch.int32, device=device)
                       for i in layers}
        self.logged: dict[int, list[int]] = {}
        self.steps: dict[int, list[StepUndo]] = {i: [] for i in layers}  # undo records, oldest first
        self.undoable: dict[int, set[int]] = {}  # slot -> positions every layer has an undo record of
        self._cols: dict[tuple[int, ...], torch.Tensor] = {}  # the ring's columns of the last set of slots

    def nbytes(self) -> int:
        return (sum(t.nbytes for t in self.counts.values()) + sum(t.nbytes for t in self._cols.values())
                + sum(r.nbytes() for v in self.steps.values() for r in v))

    def positions(self, slots: list[int], starts: list[int], n: int, drafts: bool = False) -> None:
        """Note that ``slots`` are about to store positions ``starts[b] .. starts[b] + n - 1`` (host side, once a
        step); with n > 1, or ``drafts``, the layers add an undo record per token (:meth:`add_step`)."""
        for slot, start in zip(slots, starts, strict=True):
            kept = [p for p in self.logged.get(slot, []) if p < start] + list(range(start, start + n))
            self.logged[slot] = kept[-self.depth:]
            old = {p for p in self.undoable.get(slot, set()) if start - self.depth <= p < start}
            recorded = range(max(start, start + n - self.depth), start + n) if n > 1 or drafts else range(0)
            self.undoable[slot] = old | set(recorded)
        oldest = min(starts, default=0) - self.depth
        for layer, steps in self.steps.items():
            self.steps[layer] = [r for r in steps if max(r.row_pos) >= oldest]

    def add_step(self, layer: int, step: StepUndo) -> None:
        self.steps[layer].append(step)

    def can_undo(self, slot: int, seen: int, n: int) -> bool:
        """Whether every one of the ``n`` newest positions of ``slot`` has undo records."""
        return n <= self.depth and set(range(seen - n, seen)) <= self.undoable.get(slot, set())

    def undo(self, kv, first: dict[int, int]) -> None:
        """Undo, newest first, every recorded step of slot s at positions >= ``first[s]``; those records go."""
        for layer, steps in self.steps.items():
            kept = []
            for step in reversed(steps):
                rows = [slot in first and pos >= first[slot] for slot, pos in zip(step.row_slot, step.row_pos,
                                                                                  strict=True)]
                if any(rows):
                    undo_step(kv, step, torch.tensor(rows, device=step.items.device))
                    for slot, pos, done in zip(step.row_slot, step.row_pos, rows, strict=True):
                        if not done:  # another sequence's row of a record that goes: no longer undoable
                            self.undoable.get(slot, set()).discard(pos)
                else:
                    kept.append(step)
            self.steps[layer] = kept[::-1]
        for slot, start in first.items():
            self.undoable[slot] = {p for p in self.undoable.get(slot, set()) if p < start}

    def prefilled(self, layer: int, slots: list[int], lengths: torch.Tensor, n_high: torch.Tensor,
                  n_low: torch.Tensor) -> None:
        """A prefill stored prompts of ``lengths`` (int [B]) tokens with ``n_high``, ``n_low`` (int [B, H]) per head.
        Its ``recent_window`` newest tokens are always high and the newest of its high slots, in order
        (docs/algorithm.md §4.3), so the counts before each of them are known: logged for the ``depth`` newest."""
        lengths = lengths.to(n_high.device, torch.int64)
        for back in range(1, self.depth + 1):  # the token ``back`` places from the end
            pos = lengths - back  # [B]
            keep = pos >= 0
            before = torch.stack([n_high - back, n_low], -1).to(torch.int32)  # [B, H, 2]
            idx = keep.nonzero().view(-1)
            if len(idx):
                self.record(layer, [slots[i] for i in idx.tolist()], pos[idx], before[idx].reshape(-1, 2))
        if layer == min(self.counts):
            for slot, n in zip(slots, lengths.tolist(), strict=True):
                self.logged[slot] = list(range(max(n - self.depth, 0), n))

    def record(self, layer: int, slots: list[int], positions: torch.Tensor, counts: torch.Tensor) -> None:
        """Counts of ``layer``'s heads before the token at ``positions`` is stored. positions: int64 [B] (device);
        counts: int32 [B * H, 2] (slot-major, as the layer's compressor orders its items)."""
        h = self.num_kv_heads
        rows = (positions % self.depth).repeat_interleave(h)  # [B * H]
        key = tuple(slots)
        cols = self._cols.get(key)
        if cols is None:  # built once per set of slots: no host -> device copy per layer and step
            cols = (torch.tensor(slots, dtype=torch.int64, device=positions.device)[:, None] * h
                    + torch.arange(h, device=positions.device)).reshape(-1)
            self._cols = {key: cols}
        self.counts[layer][rows, cols] = counts

    def check(self, slot: int, seen: int, n: int, now: dict[int, torch.Tensor]) -> None:
        """Raise ValueError unless dropping the ``n`` newest of ``seen`` tokens of ``slot`` is exact.
        now: table layer -> int32 [H, 2], the slot's current counts per head."""
        first, n = seen - int(n), int(n)
        if n > self.depth:
            raise ValueError(f"crop of {n} tokens: only the {self.depth} newest tokens (the recent window) can be "
                             "dropped; older ones have been placed among the tiers and cannot be taken back")
        if first not in self.logged.get(slot, []):
            raise ValueError(f"crop of {n} tokens reaches past the recent window of the prompt stored at prefill "
                             "(those tokens were split among the tiers at once and cannot be taken back)")
        h = self.num_kv_heads
        for layer, current in now.items():
            before = self.counts[layer][first % self.depth, slot * h:(slot + 1) * h]
            grew = current.long() - before.long()
            if not (bool((grew[:, 0] == n).all()) and bool((grew[:, 1] == 0).all())):
                raise ValueError(f"crop of {n} tokens: at layer {layer} the single-token steps that stored them also "
                                 "moved older tokens (pruned or demoted them to make room), which cannot be undone. "
                                 "Feed tokens that may be cropped in one multi-token call (its steps keep undo "
                                 "records), as assisted decoding does")

    def forget(self, slot: int, positions_from: int) -> None:
        """Positions from ``positions_from`` on are no longer stored (after a crop) or the slot is gone (-1)."""
        if positions_from < 0:
            self.logged.pop(slot, None)
            self.undoable.pop(slot, None)
            for layer, steps in self.steps.items():
                self.steps[layer] = [r for r in steps if slot not in r.row_slot]
        else:
            self.logged[slot] = [p for p in self.logged.get(slot, []) if p < positions_from]
