"""The scheduler-side bookkeeping of the DiffKV KV connector (:mod:`.connector`), free of vLLM so CI tests it:
which requests hold DiffKV pages (by first block id) and whether a new prompt fits the workers' pools.

A prompt is admitted when the workers' free pages, less what prompts admitted since their last report may take,
cover its worst case (every token in the high tier, a partial page per head and tier) plus one decode step of
every request holding pages. With nothing held and nothing promised it is always admitted (if it cannot fit even
then, its prefill fails with PoolExhausted). Before the first report, one prompt at a time.

:meth:`Admission.room_blocks` is the other half: the connector holds back vLLM's free blocks beyond it, so vLLM's
own preemption fires before running requests outgrow the pools.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolReport:
    """A worker's pool after a step: free pages, and a prompt of n tokens needing at most ``ceil(a * n) + b``
    pages (b is also the most pages one decode step adds to a request). Ranks combine to the tightest."""

    free_pages: int
    a: float
    b: int
    pages_per_token: float = 0.0  # observed: pages held / tokens of the requests holding them (0: none held)

    def combine(self, other: PoolReport) -> PoolReport:
        return PoolReport(min(self.free_pages, other.free_pages), max(self.a, other.a), max(self.b, other.b),
                          max(self.pages_per_token, other.pages_per_token))

    def prompt_pages(self, tokens: int) -> int:
        return math.ceil(self.a * tokens) + self.b


class Admission:
    def __init__(self) -> None:
        self.first: dict[str, int] = {}  # request id -> its first block id, while it holds pages
        self.report: PoolReport | None = None
        self.promised = 0  # pages of the prompts admitted since that report (1 before any report)

    def admit(self, tokens: int) -> bool:
        """May a prompt of ``tokens`` tokens start now? (True also records its pages as promised.)"""
        busy = bool(self.first or self.promised)
        if self.report is None:
            if busy:
                return False
            self.promised = 1
            return True
        need = self.report.prompt_pages(tokens)
        if busy and self.report.free_pages - self.promised - need < self.report.b * len(self.first):
            return False
        self.promised += need
        return True

    def reported(self, report: PoolReport) -> None:
        self.report, self.promised = report, 0

    def room_blocks(self, block_size: int) -> int | None:
        """How many more vLLM blocks of ``block_size`` tokens the pools can take, at the observed pages per token
        (the worst case before any is held), after every running request grows by one block: the most free blocks
        vLLM should see. None before the first report."""
        r = self.report
        if r is None:
            return None
        per_token = r.pages_per_token or r.a
        headroom = len(self.first) * (math.ceil(per_token * block_size) + r.b)
        return max(0, r.free_pages - headroom) // max(1, math.ceil(per_token * block_size))

    def step(self, ended_ids, started: dict[str, int]) -> list[int]:
        """Requests that ended (finished, aborted, preempted) and requests that started (id -> first block) this
        step; returns the first blocks whose pages the workers must release."""
        ended = [self.first.pop(r) for r in ended_ids if r in self.first]
        self.first.update(started)
        return ended
