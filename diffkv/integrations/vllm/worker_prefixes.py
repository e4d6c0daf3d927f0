"""Shared prefixes compressed once inside vLLM, worker side (issue #45; the scheduler side and the protocol are in
:mod:`.prefix_map`). Imports nothing from vLLM.

A prime request's prompt is ``prefix + bridge + prefix``. Its forward runs like any prompt's (causal attention
over itself, for its output); in every layer the first n rows (the prefix) are stored into a slot of their own,
scored by the peak attention the second copy's queries give them (``diffkv.hf.repeat_scores.copy_peaks``: the
repeat scores a transformers host computes in a separate pass) and placed by the config's context point
(``diffkv.core.points.context_point``: peak importance, repeat scores, its thresholds; any config). After the step
the prefix's scores are frozen (``diffkv.cache.prefix``) and it is held under its key. A reader gets its pages
with ``share_prefix`` (full pages by reference) and appends its own tokens like a later chunk of a prompt.
"""

from __future__ import annotations

import logging

import torch

from diffkv.cache.kv_store import KVStore
from diffkv.cache.prefix import freeze_scores, share_prefix
from diffkv.core.points import context_point
from diffkv.hf.repeat_scores import copy_peaks
from diffkv.integrations.vllm.prefix_map import Prime

logger = logging.getLogger(__name__)


class WorkerPrefixes:
    """The prefixes one worker's ``store`` holds (key -> slot), and the primes it expects (first vLLM block of a
    prime request -> :class:`Prime`) or is storing this step (slot -> Prime)."""

    def __init__(self, store: KVStore):
        self.store = store
        self.point = context_point(store.config)  # what a prime's tokens are placed by
        self.slots: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.expected: dict[int, Prime] = {}
        self.storing: dict[int, Prime] = {}

    def expect(self, primes: dict[int, Prime]) -> None:
        self.expected.update(primes)

    def forget(self, firsts) -> None:
        """Requests that ended: a prime among them that never ran is no longer expected."""
        for f in firsts:
            self.expected.pop(f, None)

    def open(self, first: int, total: int) -> int | None:
        """The slot for the prefix of the prime request whose first block is ``first`` (with ``total`` tokens in
        this step), or None when it is no prime. Raises RuntimeError for a prime split across steps."""
        prime = self.expected.pop(first, None)
        if prime is None:
            return None
        if total != prime.total:
            raise RuntimeError(f"a DiffKV prime of {prime.total} tokens arrived as {total} (chunked prefill split "
                               "it): raise --max-num-batched-tokens to at least its length")
        slot = self.store.open_slot()
        self.storing[slot] = prime
        return slot

    def store_prime(self, layer: int, slot: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scale: float) -> None:
        """query [1, H_q, T, D], key/value [1, H_kv, T, D] of the whole prime prompt: its first n tokens are
        stored into ``slot``, scored by the second copy."""
        prime = self.storing[slot]
        n = prime.tokens
        scores = copy_peaks(query[0], key[0], n, prime.copy_start, scale)[None]  # [1, H_kv, n]
        valid = torch.ones(1, n, dtype=torch.bool, device=key.device)
        self.store.prefill(layer, [slot], query[:, :, :n], key[:, :, :n], value[:, :, :n], valid, scale,
                           repeat_scores=scores, point=self.point, fill_pages=True)

    def finish(self) -> None:
        """Freeze the prefixes stored by the last step and hold them under their keys (idempotent)."""
        for slot, prime in self.storing.items():
            if prime.key in self.slots:  # primed again (dropped by the scheduler while still read here)
                if self.store.shares.readers(self.slots[prime.key]):
                    self.store.release([slot])  # the held one serves: same tokens, same scores
                    continue
                self._release(prime.key)
            freeze_scores(self.store, slot)
            self.slots[prime.key], self.tokens[prime.key] = slot, prime.tokens
        self.storing = {}

    def attach(self, reader: int, key: str) -> int:
        """Give ``reader`` (an open, empty slot) the prefix ``key``. Returns its tokens. Raises KeyError for a
        prefix this worker does not hold."""
        self.finish()
        if key not in self.slots:
            raise KeyError(f"DiffKV holds no prefix {key[:12]}: its prime did not run on this worker")
        share_prefix(self.store, self.slots[key], reader)
        return self.tokens[key]

    def drop(self, keys: list[str]) -> None:
        """Release the prefixes ``keys`` (a prefix still read is kept, with a warning)."""
        self.finish()
        for key in keys:
            if key not in self.slots:
                continue
            if self.store.shares.readers(self.slots[key]):
                logger.warning("DiffKV prefix %s is still read; not dropped", key[:12])
                continue
            self._release(key)

    def _release(self, key: str) -> None:
        self.store.release([self.slots.pop(key)])
        self.tokens.pop(key, None)

    def held_slots(self) -> list[int]:
        return list(self.slots.values()) + list(self.storing)
