"""A prompt prefix stored once in a :class:`~diffkv.cache.kv_store.KVStore` and read by many sequences (issue #45).

The prefix is prefilled into a slot of its own (the *source*), whose tokens are then frozen: every stored score
becomes :data:`FROZEN` (:func:`freeze_scores`), larger than any attention a token can receive, so the decode rule
(docs/algorithm.md §4.4) never picks a prefix token to prune or demote: a reader's decode steps place only its
own tokens, and the shared pages keep their bytes whoever reads them. A *reader* slot gets the source's pages with
:func:`share_prefix` (full pages by reference, the last partial page of the high tier copied, the low tier's shared
until the reader can demote a token of its own: :func:`copy_due`; ``diffkv.memory.sharing``) and continues with
``KVStore.extend`` / decode steps like any sequence. A prefix is prefilled with ``fill_pages`` (its last page of
each tier filled with its next-best tokens), so in most heads no page is partial and a reader copies nothing: it
costs the pages of its own tokens. A decode step adds attention to the scores of every token it reads, the prefix's
too; sums and peaks stay at ``FROZEN``, a compact mean decays towards the attention it gets, so the store freezes
them again after each step (``KVStore.refreeze``, also when an ``extend`` stops midway), which keeps every mean far
above any threshold.

``KVStore.release`` releases readers with ``release_shared`` and refuses a source that still has readers;
``KVStore.extend`` refuses a source that has readers (its frozen tokens would never be placed again).
Not supported: ``score_after_window`` (its window exit resets scores to 0) and crop logs over shared pages.
"""

from __future__ import annotations

import torch

from diffkv.memory import HIGH_COL, LOW_COL
from diffkv.memory.sharing import copy_partial, share

FROZEN = {torch.float32: 1e30, torch.float16: 6.0e4}  # a frozen token's stored score, by the score field's dtype


class Shares:
    """Which slot reads which prefix: ``of[reader] = (source slot, shared pages int32 [K, 2])`` (K: the reader's
    heads in the store's table layers, slot-major as ``tables.select``); ``lazy``: the readers that still share the
    prefix's partial low pages (:func:`copy_due`)."""

    def __init__(self) -> None:
        self.of: dict[int, tuple[int, torch.Tensor]] = {}
        self.lazy: set[int] = set()

    def drop(self, reader: int) -> torch.Tensor:
        """Forget ``reader``; returns its shared pages [K, 2] (for ``release_shared``)."""
        self.lazy.discard(reader)
        return self.of.pop(reader)[1]

    def readers(self, source: int) -> list[int]:
        return [r for r, (s, _) in self.of.items() if s == source]

    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.of.values())


def share_prefix(store, source: int, reader: int) -> int:
    """Give ``reader`` (an open slot holding nothing) the tokens of ``source`` in every table layer in use: it then
    holds ``store.seen[source]`` tokens and continues from there. Returns the pages copied (the partial ones).
    Raises ValueError (nothing changed) for an unsupported config, a reader that holds tokens, a source that holds
    none or is itself a reader, or :class:`~diffkv.memory.PoolExhausted` when the copies do not fit."""
    if store.config.score_lag:
        raise ValueError("shared prefixes need score_after_window=False (its window exit resets frozen scores)")
    if store.seen.get(reader, -1) != 0 or store.seen.get(source, 0) < 1 or source in store.shares.of:
        raise ValueError(f"share_prefix: slot {reader} must be open and empty and slot {source} must hold its own "
                         f"tokens (seen: {store.seen.get(reader)}, {store.seen.get(source)})")
    kv = store.kv
    src = kv.tables.select([source], layers=store.layers)
    dst = kv.tables.select([reader], layers=store.layers)
    result, shared = kv.with_room(share, kv.pool, kv.tables, src, dst, copy_low=False)
    for vectors in (kv.key_center, kv.key_scale):
        if vectors is not None:
            vectors[dst.items] = vectors[src.items]
    store.seen[reader] = store.seen[source]
    store.shares.of[reader] = (source, shared)
    store.shares.lazy.add(reader)
    return result.pages


def young(store, reader: int, position: int) -> bool:
    """Whether ``reader`` has no token of its own old enough to be demoted by the decode step of the token at
    ``position`` (age >= ``recent_window``, docs/algorithm.md §4.4; the prefix's tokens are frozen): its low
    tiers cannot grow at that step. False for a slot that reads no prefix."""
    source = store.shares.of.get(reader)
    return source is not None and position - store.seen[source[0]] < max(store.config.recent_window, 1)


def may_demote(store, heads, positions: list[int]) -> torch.Tensor | None:
    """``reserve``'s ``may_demote`` for a step of ``store`` adding the tokens at ``positions`` (one per slot of the
    ``HeadSet`` ``heads``): None (the tables' rule: a low page is taken ahead once a head holds ``recent_window``
    high tokens) unless a slot is :func:`young`: its low tiers cannot grow at that step, so no low page is taken for
    them. bool [K]."""
    fresh = [young(store, s, p) for s, p in zip(heads.slots, positions, strict=True)]
    if not any(fresh):
        return None
    tables = store.kv.tables
    old = torch.tensor([not y for y in fresh], device=tables.device)
    return old[heads.slot_index] & (tables.tokens_flat[heads.items, 0] >= store.config.recent_window)


def copy_due(store, slots: list[int], last: list[int]) -> int:
    """Before steps up to the token at position ``last[i]`` of each of ``slots``: every reader among them that
    still shares its prefix's partial low pages and may demote by then gets its own copies (``copy_partial``).
    Returns the pages copied; PoolExhausted leaves the readers not yet copied as they were."""
    kv, copied = store.kv, 0
    for slot, position in zip(slots, last, strict=True):
        if slot in store.shares.lazy and not young(store, slot, position):
            source, shared = store.shares.of[slot]
            heads = kv.tables.select([slot], layers=store.layers)
            result, shared = kv.with_room(copy_partial, kv.pool, kv.tables, heads, shared)
            store.shares.of[slot] = (source, shared)
            store.shares.lazy.discard(slot)
            copied += result.pages
    return copied


def freeze_scores(store, slot: int) -> None:
    """Set the stored score of every token ``slot`` holds (every table layer in use) to :data:`FROZEN`."""
    kv = store.kv
    items = kv.tables.select([slot], layers=store.layers).items
    counts = kv.tables.tokens_flat[items].long()  # [K, 2]
    value = FROZEN[kv.score_dtype]
    for tier in (HIGH_COL, LOW_COL):
        n = counts[:, tier]
        width = int(n.max()) if n.numel() else 0
        if width == 0:
            continue
        where = kv.score_index(tier, items, width)
        mask = torch.arange(where.shape[1], device=where.device)[None, :] < n[:, None]
        kv.write_scores(where[mask], torch.full((int(mask.sum()),), value, device=where.device))
