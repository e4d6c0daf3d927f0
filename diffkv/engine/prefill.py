"""Batched prefill of the serving engine: the requests admitted in a step go through the model in one forward.

The prompts are packed into one row without padding (input ids concatenated, position ids restarting at 0 for each
prompt); every attention layer attends causally within each prompt's own segment and hands each prompt's keys and
values to its own slot's compressor (:mod:`diffkv.engine.step_cache`), which stores them as a prefill of that
prompt alone would. The first token of each request is sampled from the logits at its own last prompt position.
The scheduler bounds a step's batch by a token budget (``max_prefill_tokens``, like vLLM's
``max_num_batched_tokens``; a longer prompt is prefilled alone, never split).

Failures: when the batched forward runs out of pages midway (the admission estimate was too optimistic) or raises
for any other reason (e.g. NaN keys in one prompt), every page it took is given back and the batch is prefilled
again one request at a time: a request whose pages do not fit goes back to the front of the queue, admitted at
its worst case next time (``Scheduler.requeue(worst_case=)``), and the requests after it in the batch go back
behind it, in order; a request whose prefill raises fails alone (:class:`Prefiller`). ``prefill="single"``
prefills one request per forward always (the path before batching, kept to measure against).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from diffkv.core.spans import word_starts
from diffkv.engine.chunks import Chunker
from diffkv.engine.outputs import Outputs
from diffkv.engine.request import Request, RequestEvent
from diffkv.engine.sampling import next_tokens
from diffkv.engine.step import Counters
from diffkv.engine.step_cache import StepCache, run_deferred
from diffkv.memory import PoolExhausted

PREFILL_MODES = ("batched", "single")
DEFAULT_MAX_PREFILL_TOKENS = 4096
# Most prompt tokens that ride in a step's decode forward (``Prefiller.pack``): their keys and values of every layer
# wait there until the forward ends (24 MiB at 1024 tokens for qwen2.5-0.5b in fp32, up to twice that with the
# groups' left padding); longer prompts, whose own arithmetic outweighs one more pass over the weights, keep a
# forward of their own.
MIXED_PREFILL_TOKENS = 1024


@dataclass(frozen=True)
class PackedPrompts:
    """Prompts that ride in the step's decode forward: ``ids`` of each of ``reqs`` (a first chunk for an
    ``"extend"`` prompt longer than a chunk), slots open, ``cache`` recording their stores in ``log``."""

    reqs: list[Request]
    ids: list[list[int]]
    cache: StepCache
    log: list

    @property
    def lengths(self) -> list[int]:
        return [len(x) for x in self.ids]


class Prefiller:
    """The prefill forwards of one engine. mode: "batched" or "single"; alone: each prompt scored and quantized
    alone (batch invariance); word_edges: the tokenizer's with ``score_spans`` (else None); model_call: the context
    every model call runs in; chunks: where a prompt longer than a chunk leaves the rest (``"extend"``)."""

    def __init__(self, model, cache, scheduler, outputs: Outputs, counters: Counters, chunks: Chunker, *,
                 mode: str, alone: bool, word_edges: torch.Tensor | None, model_call):
        self.model, self.cache, self.scheduler, self.outputs = model, cache, scheduler, outputs
        self.counters, self.chunks, self.mode, self.alone = counters, chunks, mode, alone
        self.word_edges, self.model_call = word_edges, model_call
        self.device = next(model.parameters()).device

    def run(self, reqs: list[Request]) -> list[RequestEvent]:
        """Prefill ``reqs`` (admitted, in queue order) and sample each one's next token."""
        if not reqs:
            return []
        start = time.perf_counter()
        try:
            if self.mode == "batched" and len(reqs) > 1:
                try:
                    return self._sampled(reqs, self._forward(reqs))
                except (PoolExhausted, ValueError, RuntimeError):  # give every page back; find the culprit alone
                    for r in reqs:
                        self.outputs.close(r)
                    self.counters.prefill_fallbacks += 1
            return self._each(reqs)
        finally:
            self.counters.prefill_seconds += time.perf_counter() - start

    def pack(self, reqs: list[Request]) -> PackedPrompts:
        """Open a slot for each of ``reqs`` and the cache of their rows in the step's decode forward; their stores
        wait for :meth:`stored`."""
        ids = [self.chunks.first_chunk(r, r.prompt_ids + r.output_ids) for r in reqs]
        for r, x in zip(reqs, ids, strict=True):
            r.slot = self.open_slot(x)
        self._count(reqs, ids, mixed=True)
        log: list = []
        cache = self.cache.prefill_cache([r.slot for r in reqs], [len(x) for x in ids], alone=self.alone, log=log)
        return PackedPrompts(reqs, ids, cache, log)

    def stored(self, packed: PackedPrompts, logits: torch.Tensor | None) -> list[RequestEvent]:
        """After the forward ``packed`` rode in: store each group of its prompts (a group whose store fails, out of
        pages or for NaN keys, gives its pages back and its prompts are prefilled again one at a time) and sample
        the first token of each stored one from ``logits`` [len(reqs), V] (None: the forward failed, every prompt
        is prefilled again)."""
        start = time.perf_counter()
        try:
            stored: set[int] = set()  # slots whose every layer is stored
            for group in ([] if logits is None else dict.fromkeys(t.slots for t, _ in packed.log)):
                try:
                    run_deferred(packed.log, group)
                    stored.update(group)
                except (PoolExhausted, ValueError, RuntimeError):
                    pass  # its pages go back with its slots below
            ok = [i for i, r in enumerate(packed.reqs) if r.slot in stored]
            again = [r for r in packed.reqs if r.slot not in stored]
            for r in again:
                self.outputs.close(r)
            events = []
            if ok:
                tokens = next_tokens(logits[ok].float(), [packed.reqs[i] for i in ok])
                events += self._sampled([packed.reqs[i] for i in ok], tokens)
            if again:
                self.counters.prefill_fallbacks += 1
                events += self._each(again)
            return events
        finally:
            self.counters.prefill_seconds += time.perf_counter() - start

    def _count(self, reqs: list[Request], ids: list[list[int]], mixed: bool = False) -> None:
        """Count a prefill of ``ids``: a forward of its own, or ``mixed`` into the step's decode forward."""
        if mixed:
            self.counters.mixed_prefills += 1
        else:
            self.counters.prefill_forwards += 1
        self.counters.prefilled_tokens += sum(len(x) for x in ids)
        self.counters.recomputed_tokens += sum(len(r.output_ids) for r in reqs)

    def _each(self, reqs: list[Request]) -> list[RequestEvent]:
        events: list[RequestEvent] = []
        for i, req in enumerate(reqs):
            try:
                tokens = self._forward([req])
            except PoolExhausted:  # a layer's allocate changed nothing; the layers before it are freed with the slot
                self.outputs.close(req)
                self.scheduler.requeue(reqs[i:], worst_case=req)  # it and the rest of the batch, at the front
                break
            except (ValueError, RuntimeError) as e:  # e.g. NaN keys: this request fails, the others go on
                events.append(self.outputs.finish(req, "error", f"prefill failed: {e}"))
                continue
            events += self._sampled([req], tokens)
        return events

    def _sampled(self, reqs: list[Request], tokens: list[int]) -> list[RequestEvent]:
        """The tokens sampled for ``reqs``, but for those that fed only a first chunk (nothing to sample yet)."""
        keep = [i for i, r in enumerate(reqs) if not self.chunks.pending(r)]
        return self.outputs.append([reqs[i] for i in keep], [tokens[i] for i in keep])

    def open_slot(self, ids: list[int]) -> int:
        """A new slot for a prompt of ``ids``; with ``score_spans`` its word starts go to the store
        (``diffkv.core.spans``), which pools the prompt's scores over its words."""
        slot = self.cache.open_slot()
        if self.word_edges is not None:
            self.cache.store.set_word_starts(slot, word_starts(torch.tensor(ids), self.word_edges))
        return slot

    @torch.inference_mode()
    def _forward(self, reqs: list[Request]) -> list[int]:
        """One model forward over the prompts of ``reqs`` packed into one row (each gets a slot); their next tokens."""
        # a preempted request recomputes what it had generated; a long prompt may send only its first chunk
        ids = [self.chunks.first_chunk(r, r.prompt_ids + r.output_ids) for r in reqs]
        lengths = [len(x) for x in ids]
        self._count(reqs, ids)
        for r, x in zip(reqs, ids, strict=True):
            r.slot = self.open_slot(x)
        dev = self.device
        packed = torch.tensor([[t for x in ids for t in x]], device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])[None]
        last = torch.tensor(lengths, device=dev).cumsum(0) - 1  # each prompt's last position in the row
        step_cache = self.cache.prefill_cache([r.slot for r in reqs], lengths, alone=self.alone)
        with self.model_call():
            out = self.model(input_ids=packed, past_key_values=step_cache, position_ids=positions, use_cache=True,
                             logits_to_keep=last)
        return next_tokens(out.logits[0].float(), reqs)
