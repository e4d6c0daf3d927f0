"""Dense mirror of the pages for the torch decode path: what each (item, tier) decodes to, kept across steps.

The pages stay the source of truth. The mirror holds, per head item and tier, the fp32 keys/values exactly as
the pages decode them, the scores, positions and the pool address of each token's score, so a decode step reads
no page: it patches the mirror at the (at most two) tokens it writes per item and writes the scores back.
Items are mapped to mirror rows on first use (``row_of``); rows are never reassigned, so any compressor over any
slot set finds the same rows. A row is trusted only while its recorded ``(n_high, n_low)`` equals the tables'
counts; every write that does not go through the decode path (prefill, the Triton path) invalidates its items,
so a released and re-prefilled slot is rebuilt from its pages. Memory is bounded by ``budget_bytes``: past it
the mirror is reset, and a step that alone exceeds it runs on the page-reading path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffkv.memory import HIGH, LOW



def _slot_bytes(d: int) -> int:  # k, v fp32; score fp32; position, address int64
    return 2 * d * 4 + 4 + 8 + 8


def _grown(width: int, cap: int) -> int:
    """Capacity for ``width`` columns: ``cap`` if it fits, else 1.25x rounded up to 64."""
    return cap if width <= cap else -(-int(width * 1.25) // 64) * 64


@dataclass(frozen=True, slots=True)
class MirrorStep:
    """Rows of a step's items: ``rows`` int64 [K]; ``span`` (r0, r1) when they are ``r0 .. r1-1`` in order (the
    tiers are then views), else None; ``width`` (high, low): columns this step needs (max count + 1)."""

    rows: torch.Tensor
    span: tuple[int, int] | None
    width: tuple[int, int]


class DenseMirror:
    """Per-row dense copies of both tiers: ``k[t], v[t]`` fp32 [R, C_t, D]; ``s[t]`` fp32, ``p[t]`` int64 (token
    positions) and ``a[t]`` int64 (flat fp32 index of the token's score in the pool) [R, C_t]. Slots at or past a
    row's count hold 0 (k, v, s)."""

    def __init__(self, kv, budget_bytes: int):
        t = kv.tables
        self.kv, self.budget, self.head_dim, self.device = kv, budget_bytes, kv.plan.layout(kv.config.high).head_dim, t.device
        self.row_of = torch.full((t.num_items,), -1, dtype=torch.int64, device=self.device)
        self.item_counts = torch.full((t.num_items, 2), -1, dtype=torch.int32, device=self.device)
        self.num_rows = 0
        self._alloc(0, (0, 0))

    def _alloc(self, rows: int, caps: tuple[int, int]) -> None:
        old = getattr(self, "k", None)
        d, dev = self.head_dim, self.device
        new = {n: [torch.zeros(rows, c, *((d,) if n in "kv" else ()), dtype=torch.int64 if n in "pa"
                               else torch.float32, device=dev) for c in caps] for n in "kvspa"}
        if old is not None:
            for n in "kvspa":
                for t in (HIGH, LOW):
                    src = getattr(self, n)[t]
                    new[n][t][:src.shape[0], :src.shape[1]] = src
        self.k, self.v, self.s, self.p, self.a = (new[n] for n in "kvspa")
        self.caps = caps

    def nbytes(self, rows: int, caps: tuple[int, int]) -> int:
        return rows * sum(caps) * _slot_bytes(self.head_dim)

    def _plan_rows(self, rows: int, caps: tuple[int, int]) -> int | None:
        """Rows to allocate for ``rows`` in use (doubling while the budget allows); None if they do not fit."""
        have = self.k[HIGH].shape[0]
        for n in ((have,) if rows <= have else (max(rows, 2 * have), rows)):
            if self.nbytes(n, caps) <= self.budget:
                return n
        return None

    def invalidate(self, items: torch.Tensor) -> None:
        """Forget ``items`` (int [M], repeats allowed): their rows are rebuilt from the pages on next use."""
        self.item_counts[items] = -1

    def reset(self) -> None:
        self.row_of.fill_(-1)
        self.item_counts.fill_(-1)
        self.num_rows = 0
        self.k = None
        self._alloc(0, (0, 0))

    def prepare(self, items: torch.Tensor, counts: torch.Tensor) -> MirrorStep | None:
        """Make the rows of ``items`` (int64 [K]) current for a step with ``counts`` int [K, 2] (n_high, n_low):
        assign rows, grow, rebuild stale rows from the pages. None if the step does not fit the budget."""
        stale = (self.item_counts[items] != counts).any(1)
        host = torch.cat([counts.amax(0).long(), stale.any().view(1).long(), self.row_of[items]]).tolist()
        width, any_stale, rows = (host[0] + 1, host[1] + 1), host[2], host[3:]
        new_rows = sum(r < 0 for r in rows)
        caps = tuple(_grown(w, c) for w, c in zip(width, self.caps, strict=True))
        alloc = self._plan_rows(self.num_rows + new_rows, caps)
        if alloc is None:  # over the budget: start over with this step's items only
            self.reset()
            rows, new_rows, any_stale = [-1] * len(rows), len(rows), 1
            caps = tuple(_grown(w, 0) for w in width)
            alloc = self._plan_rows(new_rows, caps)
            if alloc is None:
                return None
        if new_rows:
            missing = [i for i, r in enumerate(rows) if r < 0]
            for i, r in zip(missing, range(self.num_rows, self.num_rows + new_rows), strict=True):
                rows[i] = r
            self.num_rows += new_rows
            self.row_of[items[missing]] = torch.tensor([rows[i] for i in missing], dtype=torch.int64,
                                                       device=self.device)
        if alloc != self.k[HIGH].shape[0] or caps != self.caps:
            self._alloc(alloc, caps)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        if any_stale:
            stale = (self.item_counts[items] != counts).any(1)
            self._rebuild(items[stale], rows_t[stale], counts[stale])
        r0 = rows[0]
        span = (r0, r0 + len(rows)) if rows == list(range(r0, r0 + len(rows))) else None
        return MirrorStep(rows_t, span, width)

    def _rebuild(self, items: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """Rows ``rows`` [M] := what the pages of ``items`` [M] hold (counts [M, 2])."""
        kv = self.kv
        for t in (HIGH, LOW):
            n = counts[:, t].long()
            width = int(n.max())
            for name in "kvspa":
                getattr(self, name)[t][rows] = 0
            if width == 0:
                continue
            keys, values, scores, pos, _ = kv.read(t, items, n, width)
            c = min(keys.shape[1], self.caps[t])
            self.k[t][rows, :c], self.v[t][rows, :c] = keys[:, :c], values[:, :c]
            self.s[t][rows, :c], self.p[t][rows, :c] = scores[:, :c], pos[:, :c].long()
            self.a[t][rows, :c] = kv.score_index(t, items, keys.shape[1])[:, :c]
        self.item_counts[items] = counts.to(torch.int32)

    def tier(self, t: int, step: MirrorStep):
        """(k, v [K, W, D], s, p, a [K, W]) of tier ``t`` for the step's rows, W = ``step.width[t]``: views when the
        rows are a span (in-place updates reach the mirror), copies otherwise."""
        w = step.width[t]
        if step.span is not None:
            r0, r1 = step.span
            return tuple(getattr(self, n)[t][r0:r1, :w] for n in "kvspa")
        return tuple(getattr(self, n)[t][step.rows, :w] for n in "kvspa")

    def set_scores(self, t: int, step: MirrorStep, scores: torch.Tensor) -> None:
        """Mirror scores of tier ``t`` := ``scores`` [K, W] (no-op for span steps whose views were updated)."""
        if step.span is None:
            self.s[t][step.rows, :scores.shape[1]] = scores

    def patch(self, t: int, rows: torch.Tensor, index: torch.Tensor, keys, values, scores, positions, address) -> None:
        """Token ``index[m]`` of row ``rows[m]`` of tier ``t`` := the given stored values ([M, D] / [M])."""
        self.k[t][rows, index], self.v[t][rows, index] = keys, values
        self.s[t][rows, index], self.p[t][rows, index], self.a[t][rows, index] = scores, positions.long(), address

    def commit(self, items: torch.Tensor, counts: torch.Tensor) -> None:
        self.item_counts[items] = counts.to(torch.int32)
