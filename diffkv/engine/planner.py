"""The engine's scheduling half (issue #61): everything a step decides before its first forward, as one frozen
:class:`~diffkv.engine.step.Step`.

In this order: the running requests that decode reserve this step's pages for every layer and head in one
prefix-sum pass, the newest running request preempted while they do not fit (:class:`Planner`); unless one was,
the queue's head is admitted while it fits (``Scheduler.admit``; with none, held prefixes no request reads are
evicted, least recently used first); a long prompt admitted now is staged (``"deferred"``: a slot and an empty
stage); the next chunk of the oldest request with one is taken (a prompt staged now may start at once), its staged
pages held; the oldest complete staged prompt (or the one this chunk completes) is stored after the forward.
Pages are taken here (reservation, held stages, slots of staged prompts) so that nothing the step's forwards need
can be taken by another part of the same step.
"""

from __future__ import annotations

from diffkv.engine.chunks import Chunker
from diffkv.engine.outputs import Outputs
from diffkv.engine.request import Request, RequestEvent
from diffkv.engine.scheduler import Scheduler
from diffkv.engine.step import Counters, Step
from diffkv.memory import PoolExhausted


class Planner:
    """Builds each step of one engine. open_slot: a new slot for a prompt (``Prefiller.open_slot``); prefix: the
    engine's ``PrefixCache`` or None; compression: the physical compression stored now (None: unknown)."""

    def __init__(self, scheduler: Scheduler, cache, chunks: Chunker, outputs: Outputs, counters: Counters,
                 open_slot, prefix, *, max_prefill_tokens: int):
        self.scheduler, self.cache, self.chunks, self.outputs = scheduler, cache, chunks, outputs
        self.counters, self.open_slot, self.prefix = counters, open_slot, prefix
        self.max_prefill_tokens = max_prefill_tokens

    def plan(self, events: list[RequestEvent], compression: float | None = None) -> Step:
        """This step (see the module docstring); the events of requests it ends (no pages even alone, a staged
        prompt that cannot be held) are added to ``events``."""
        running = [r for r in self.scheduler.running if r.slot is not None and not self.chunks.busy(r)]
        decodes, preempted = self._reserve(running, events)
        fresh = [] if preempted else self._admit(compression)  # the pool is over-committed: admit nothing (vLLM)
        staged, rest = self.chunks.stage_long(fresh, self.open_slot)
        prefixed = [r for r in rest if r.prefix_tokens] if self.prefix is not None else []
        chunk = self.chunks.next_chunk(events)
        return Step(decodes=tuple(decodes), chunk=chunk, prefills=tuple(r for r in rest if r not in prefixed),
                    prefixed=tuple(prefixed), staged=tuple(r for r in staged if chunk is None or r is not chunk.req),
                    store=self.chunks.ready_to_store(chunk), preempted=tuple(preempted))

    def _reserve(self, batch: list[Request], events: list[RequestEvent]) -> tuple[list[Request], list[Request]]:
        """Reserve the step's pages for ``batch``, preempting the newest running requests until it fits. Returns
        (the batch that decodes, the preempted)."""
        preempted: list[Request] = []
        while batch:
            try:
                self.cache.reserve_step([r.slot for r in batch])
                return batch, preempted
            except PoolExhausted:
                if len(self.scheduler.running) == 1:
                    events.append(self.outputs.finish(batch[0], "error", "the KV pool cannot hold this request's "
                                                                         "tokens even alone; raise the KV budget"))
                    return [], preempted
                victim = self.scheduler.preempt_newest()
                self.outputs.close(victim)
                self.counters.preemptions += 1
                preempted.append(victim)
                batch = [r for r in batch if r is not victim]
        return batch, preempted

    def _admit(self, compression: float | None) -> list[Request]:
        """The requests to prefill now (``Scheduler.admit``); with none, held prefixes no request reads are
        evicted, least recently used first, until one is admitted or none is left."""
        while True:
            fresh = self.scheduler.admit(compression, self.max_prefill_tokens)
            if fresh or not self.scheduler.waiting or self.prefix is None or not self.prefix.evict_one():
                return fresh
