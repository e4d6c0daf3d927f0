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


def _slot_bytes(d: int) -> int:  # k, v fp32; score fp32; position, address int64; flag
    return 2 * d * 4 + 4 + 8 + 8 + 1


def _grown(width: int, cap: int) -> int:
    """Capacity for ``width`` columns: ``cap`` if it fits, else 1.25x rounded up to 64."""
    return cap if width <= cap else -(-int(width * 1.25) // 64) * 64


@dataclass(frozen=True, slots=True)
class MirrorStep:
    """Rows of a step's items: ``rows`` int64 [K]; ``span`` (r0, r1) when they are ``r0 .. r1-1`` in order (the
    window is then a view), else None; ``low0``: the first low-tier column; ``width``: columns this step covers,
    ``low0 + max n_low + 1`` (high tokens at ``0 .. n_high-1``, low token j at ``low0 + j``)."""

    rows: torch.Tensor
    span: tuple[int, int] | None
    low0: int
    width: int


_FIELDS = "kvspao"
_DTYPES = {"k": torch.float32, "v": torch.float32, "s": torch.float32, "p": torch.int64, "a": torch.int64,
           "o": torch.bool}


class _Bank:
    """The rows of one layer, both tiers in one column range, high tier first: ``k, v`` fp32 [R, C, D]; ``s``
    fp32, ``p`` int64 (token positions), ``a`` int64 (flat fp32 index of the token's score in the pool) and ``o``
    bool (the column holds a token) [R, C]. High token i is column i, low token j column ``caps[0] + j``. Columns
    not holding a token hold k = v = s = 0."""

    def __init__(self, head_dim: int, device):
        self.head_dim, self.device, self.num_rows, self.k, self.caps = head_dim, device, 0, None, (0, 0)
        self.spans: dict[tuple[int, ...], tuple[torch.Tensor, tuple[int, int] | None]] = {}
        self.alloc(0, (0, 0))

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    def nbytes(self, rows: int | None = None, caps: tuple[int, int] | None = None) -> int:
        rows, caps = self.capacity if rows is None else rows, caps or self.caps
        return rows * sum(caps) * _slot_bytes(self.head_dim)

    def alloc(self, rows: int, caps: tuple[int, int]) -> None:
        """(Re)allocate [rows, caps[0] + caps[1]], keeping the current rows (each tier moved to its place)."""
        old, old_caps = self.k, self.caps
        new = {n: torch.zeros(rows, sum(caps), *((self.head_dim,) if n in "kv" else ()), device=self.device,
                              dtype=_DTYPES[n]) for n in _FIELDS}
        if old is not None:
            r = min(rows, old.shape[0])
            for n in _FIELDS:
                src = getattr(self, n)
                new[n][:r, :old_caps[0]] = src[:r, :old_caps[0]]
                new[n][:r, caps[0]:caps[0] + old_caps[1]] = src[:r, old_caps[0]:]
        self.k, self.v, self.s, self.p, self.a, self.o = (new[n] for n in _FIELDS)
        self.caps = caps


class DenseMirror:
    """Dense copies of the pages, one :class:`_Bank` per layer (so a layer's window is as wide as its own
    tiers). Host side: ``row_of`` {item: row in its layer's bank} and ``counts`` {item: (n_high, n_low)} the
    row reflects (absent: stale, rebuilt from the pages on next use)."""

    def __init__(self, kv, budget_bytes: int):
        self.kv, self.budget, self.device = kv, budget_bytes, kv.tables.device
        self.head_dim = kv.layouts[HIGH].head_dim
        self.reset()

    def reset(self) -> None:
        """Forget every row and free the memory."""
        self.row_of: dict[int, int] = {}
        self.counts: dict[int, tuple[int, int]] = {}
        self.banks: dict[int, _Bank] = {}

    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self.banks.values())

    def invalidate(self, items: torch.Tensor) -> None:
        """Forget ``items`` (int [M], repeats allowed): their rows are rebuilt from the pages on next use."""
        if self.counts:
            for i in items.unique().tolist():
                self.counts.pop(i, None)

    def _plan(self, bank: _Bank, rows: int, caps: tuple[int, int]) -> int | None:
        """Rows to allocate in ``bank`` for ``rows`` in use (doubling while the budget allows), or None."""
        have, others = bank.capacity, self.nbytes() - bank.nbytes()
        for n in ((have,) if rows <= have else (max(rows, 2 * have), rows)):
            if others + bank.nbytes(n, caps) <= self.budget:
                return n
        return None

    def prepare(self, layer: int, keys: tuple[int, ...], items: torch.Tensor, counts: torch.Tensor):
        """Make the rows of ``items`` (int64 [K] of ``layer``; ``keys``: the same ids on the host) current for a
        step with ``counts`` int [K, 2] (n_high, n_low): assign rows, grow, rebuild stale rows from the pages.
        Returns ``(bank, MirrorStep)``, or None if the step does not fit the budget."""
        host = [tuple(c) for c in counts.tolist()]
        need = (max(c[0] for c in host) + 1, max(c[1] for c in host) + 1)
        bank = self.banks.get(layer) or self.banks.setdefault(layer, _Bank(self.head_dim, self.device))
        caps = tuple(_grown(w, c) for w, c in zip(need, bank.caps, strict=True))
        new_rows = [i for i in keys if i not in self.row_of]
        grow = bool(new_rows) or caps != bank.caps
        alloc = self._plan(bank, bank.num_rows + len(new_rows), caps) if grow else bank.capacity
        if alloc is None:  # over the budget: start over with this step's items only
            self.reset()
            bank = self.banks.setdefault(layer, _Bank(self.head_dim, self.device))
            new_rows, caps = list(keys), tuple(_grown(w, 0) for w in need)
            alloc = self._plan(bank, len(new_rows), caps)
            if alloc is None:
                return None
        for i in new_rows:
            self.row_of[i], bank.num_rows = bank.num_rows, bank.num_rows + 1
        if grow and (alloc != bank.capacity or caps != bank.caps):
            bank.alloc(alloc, caps)
        if keys not in bank.spans:
            rows = [self.row_of[i] for i in keys]
            span = (rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) else None
            bank.spans[keys] = (torch.tensor(rows, dtype=torch.int64, device=self.device), span)
        rows_t, span = bank.spans[keys]
        stale = [j for j, (i, c) in enumerate(zip(keys, host, strict=True)) if self.counts.get(i) != c]
        if stale:
            self._rebuild(bank, items[stale], rows_t[stale], counts[stale])
            self.counts.update((keys[j], host[j]) for j in stale)
        return bank, MirrorStep(rows_t, span, bank.caps[0], bank.caps[0] + need[1])

    def _rebuild(self, bank: _Bank, items: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """Rows ``rows`` [M] of ``bank`` := what the pages of ``items`` [M] hold (counts [M, 2])."""
        kv = self.kv
        for name in _FIELDS:
            getattr(bank, name)[rows] = 0
        for t in (HIGH, LOW):
            n = counts[:, t].long()
            width = int(n.max())
            if width == 0:
                continue
            keys, values, scores, pos, _ = kv.read(t, items, n, width)
            c = min(keys.shape[1], bank.caps[t])
            cols = slice(0, c) if t == HIGH else slice(bank.caps[0], bank.caps[0] + c)
            bank.k[rows, cols], bank.v[rows, cols] = keys[:, :c], values[:, :c]
            bank.s[rows, cols], bank.p[rows, cols] = scores[:, :c], pos[:, :c].long()
            bank.a[rows, cols] = kv.score_index(t, items, keys.shape[1])[:, :c]
            bank.o[rows, cols] = torch.arange(c, device=self.device)[None, :] < n[:, None]

    @staticmethod
    def window(bank: _Bank, step: MirrorStep):
        """(k, v [K, W, D], s, p, a, o [K, W]) of the step's rows, W = ``step.width``: views when the rows are a
        span (in-place updates reach the mirror), copies otherwise."""
        if step.span is not None:
            r0, r1 = step.span
            return tuple(getattr(bank, n)[r0:r1, :step.width] for n in _FIELDS)
        return tuple(getattr(bank, n)[step.rows, :step.width] for n in _FIELDS)

    @staticmethod
    def set_scores(bank: _Bank, step: MirrorStep, scores: torch.Tensor) -> None:
        """Mirror scores of the step's window := ``scores`` [K, W] (nothing to do when the window is a view)."""
        if step.span is None:
            bank.s[step.rows, :step.width] = scores

    @staticmethod
    def patch(bank: _Bank, rows: torch.Tensor, cols: torch.Tensor, keys, values, scores, positions, address) -> None:
        """Column ``cols[m]`` of row ``rows[m]`` := the given stored token ([M, D] / [M]); it now holds a token."""
        bank.k[rows, cols], bank.v[rows, cols] = keys, values
        bank.s[rows, cols], bank.p[rows, cols], bank.a[rows, cols] = scores, positions, address
        bank.o[rows, cols] = True

    def commit(self, keys: tuple[int, ...], counts: torch.Tensor) -> None:
        """Record that the rows of items ``keys`` now reflect ``counts`` int [K, 2]."""
        self.counts.update(zip(keys, map(tuple, counts.tolist()), strict=True))
