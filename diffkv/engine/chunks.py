"""Chunked prefill as scheduling (issue #44): a prompt longer than ``prefill_chunk`` tokens is prefilled over
several engine steps, so the running requests keep decoding while it arrives. One chunk per step, of the oldest
request with chunks left, in the step's decode forward (:mod:`diffkv.engine.mixed`; in a forward of its own when
nothing decodes, or for an ``"extend"`` chunk); the last chunk's logits give the first token, and the request
decodes from the next step on. Two ways to store the chunks (``Engine(chunked_prefill=...)``):

* ``"extend"``: the first chunk goes through the step's batched prefill like any prompt (compressed at once,
  nothing sampled); each later chunk is appended to the request's pages with ``KVStore.extend`` (n decode steps:
  every token placed by the decode rule; memory bounded by what the pages hold, but a chunk costs n sequential
  decode steps per layer, and its tokens are demoted rather than pruned).
* ``"deferred"``: every chunk is held at full precision (:class:`~diffkv.cache.staging.PromptStage`) and its
  queries attend over the prompt so far (causal SDPA; in fixed row blocks in the batch-invariant mode), each chunk
  as cheap as its share of a whole prefill; after the last chunk the whole prompt is stored with
  ``KVStore.prefill``, a few layers per step (about a chunk's work, so no step stalls the running requests): scored
  and split exactly as the prompt prefilled whole. Its first token (the last chunk's) is emitted when every layer
  is stored. The staged bytes are counted in the budget: pool pages taken (``PagePool.take_pages``) as the stage
  grows, given back as its layers are stored.

A chunk that does not fit in the pool sends the request back to the front of the queue (its pages freed), as a
prefill that does not fit does. What a prompt still owes between steps (pending tokens, its stage) is kept here, in
:class:`Chunker`, not in the request.
"""

from __future__ import annotations

import math
import time

import torch

from diffkv.cache.staging import PromptStage
from diffkv.engine.mixed import ChunkCache
from diffkv.engine.outputs import Outputs
from diffkv.engine.request import Request, RequestEvent
from diffkv.engine.sampling import next_tokens
from diffkv.engine.step import Counters, PromptProgress, PromptWork
from diffkv.memory import PoolExhausted

CHUNKED_PREFILL = ("extend", "deferred")


class Chunker:
    """The prompts of one engine that are fed over several steps. size: ``prefill_chunk`` (None: prompts are fed
    whole); mode: ``chunked_prefill``; model_call: the context every model call runs in (batch invariance);
    exact_rows: staged chunks attend in fixed row blocks (``PromptStage(blocked=)``: batch invariance); the others
    are the engine's parts."""

    def __init__(self, model, cache, scheduler, outputs: Outputs, counters: Counters, *, size: int | None,
                 mode: str, model_call, exact_rows: bool = False):
        self.model, self.cache, self.scheduler, self.outputs, self.counters = model, cache, scheduler, outputs, counters
        self.size, self.mode, self.model_call, self.exact_rows = size, mode, model_call, exact_rows
        self.device = next(model.parameters()).device
        self.progress: dict[Request, PromptProgress] = {}

    # ---- what a request owes ----
    def pending(self, req: Request) -> list[int]:
        """Prompt tokens of ``req`` still to feed ([] when none)."""
        p = self.progress.get(req)
        return p.pending if p is not None else []

    def stage(self, req: Request) -> PromptStage | None:
        p = self.progress.get(req)
        return p.stage if p is not None else None

    def busy(self, req: Request) -> bool:
        """Whether ``req`` is still being prefilled (tokens pending or a staged prompt not stored yet)."""
        return req in self.progress

    def set_pending(self, req: Request, ids: list[int]) -> None:
        """``ids`` of ``req`` are fed by later chunks (appended to its pages: a shared prefix's rest, or
        ``"extend"``)."""
        if ids:
            self.progress[req] = PromptProgress(pending=list(ids))

    def forget(self, req: Request) -> None:
        """Drop what ``req`` still owed and give its staged pages back (nothing to do without any)."""
        p = self.progress.pop(req, None)
        if p is not None and p.stage_pages is not None:
            self.cache.store.give_pages(p.stage_pages)

    # ---- planning ----
    def stage_long(self, reqs: list[Request], open_slot) -> tuple[list[Request], list[Request]]:
        """``"deferred"``: give each prompt of ``reqs`` longer than a chunk (and naming no shared prefix) a slot
        (``open_slot(ids)``) and an empty stage; its chunks come from the next steps on. Returns (staged, rest)."""
        if self.mode != "deferred" or self.size is None:
            return [], reqs
        staged, rest = [], []
        for req in reqs:
            ids = req.prompt_ids + req.output_ids
            if len(ids) <= self.size or req.prefix_tokens:
                rest.append(req)
                continue
            req.slot = open_slot(ids)
            self.progress[req] = PromptProgress(ids, PromptStage(self.cache.config.score_window,
                                                                 blocked=self.exact_rows))
            staged.append(req)
        return staged, rest

    def first_chunk(self, req: Request, ids: list[int]) -> list[int]:
        """The tokens of ``req`` its prefill forward takes; the rest waits for later chunks (``"extend"``)."""
        if self.size is None or len(ids) <= self.size:
            return ids
        self.set_pending(req, ids[self.size:])
        return ids[:self.size]

    def next_chunk(self, events: list[RequestEvent]) -> PromptWork | None:
        """The next chunk of the oldest running request that has one, its staged pages held (``"deferred"``); None
        when there is none or its pages are not free (then the request goes back to the queue, its events added to
        ``events``)."""
        req = next((r for r in self.scheduler.running if self.pending(r)), None)
        if req is None:
            return None
        p = self.progress[req]
        ids = p.pending if self.size is None else p.pending[:self.size]
        pos = (self.cache.store.seen[req.slot] if p.stage is None
               else len(req.prompt_ids) + len(req.output_ids) - len(p.pending))
        if p.stage is not None:
            try:
                self.hold_stage(req, len(ids))
            except PoolExhausted:
                events += self.failed(req)
                return None
        return PromptWork(req, ids, pos, p.stage, p.pending)

    def ready_to_store(self, chunk: PromptWork | None) -> Request | None:
        """The oldest staged prompt that is complete, or completed by ``chunk`` (its last chunk this step)."""
        return next((r for r in self.scheduler.running if self.stage(r) is not None
                     and (not self.pending(r) or (chunk is not None and chunk.req is r and chunk.last))), None)

    def hold_stage(self, req: Request, tokens: int = 0) -> None:
        """Hold pool pages that cover the stage of ``req`` once every staged layer holds ``tokens`` more (keys and
        values, plus the kept queries): take more, or give back what is no longer needed. Raises PoolExhausted,
        nothing taken, when they are not free."""
        store, p = self.cache.store, self.progress[req]
        size = next(self.model.parameters()).element_size()
        layers = len(p.stage.layers) or len(store.layers)  # the layers still staged (all before the first chunk)
        staged = p.stage.nbytes() + tokens * layers * store.num_kv_heads * self.cache.head_dim * 2 * size
        queries = layers * self.model.config.num_attention_heads * p.stage.score_window  # bound: the kept queries
        need = math.ceil((staged + queries * self.cache.head_dim * size) / store.page_bytes)
        held = 0 if p.stage_pages is None else p.stage_pages.numel()
        if need > held:
            more = store.take_pages(need - held, "chunked prefill (staged prompt)")
            p.stage_pages = more if p.stage_pages is None else torch.cat([p.stage_pages, more])
        elif need < held:
            store.give_pages(p.stage_pages[need:])
            p.stage_pages = p.stage_pages[:need]

    # ---- running ----
    def cache_for(self, work: PromptWork) -> ChunkCache:
        return ChunkCache(self.cache.router, self.cache.store, self.cache.full_layers, work.req.slot, work.stage)

    @torch.inference_mode()
    def run_alone(self, work: PromptWork) -> list[RequestEvent]:
        """Feed ``work`` in a forward of its own (no request decodes this step, or an ``"extend"`` chunk)."""
        start, dev = time.perf_counter(), self.device
        try:
            with self.model_call():
                out = self.model(input_ids=torch.tensor([work.ids], device=dev), use_cache=True, logits_to_keep=1,
                                 position_ids=torch.arange(work.pos, work.pos + len(work.ids), device=dev)[None],
                                 past_key_values=self.cache_for(work))
        except PoolExhausted:
            return self.failed(work.req)
        except (ValueError, RuntimeError) as e:
            return [self.outputs.finish(work.req, "error", f"chunked prefill failed: {e}")]
        finally:
            self.counters.prefill_seconds += time.perf_counter() - start
        return self.done(work, out.logits[:, -1])

    def done(self, work: PromptWork, logits: torch.Tensor) -> list[RequestEvent]:
        """After the forward that fed ``work``: logits [1, V] of its last token (the first output token when it was
        the prompt's last chunk)."""
        req, p = work.req, self.progress[work.req]
        self.counters.prefilled_tokens += len(work.ids)
        self.counters.prefill_chunks += 1
        p.pending = p.pending[len(work.ids):]
        if p.pending:
            return []
        token = next_tokens(logits.float(), [req])
        if p.stage is not None:  # emitted once the staged prompt is stored (store)
            p.held_token = token[0]
            return []
        del self.progress[req]
        return self.outputs.append([req], token)

    @torch.inference_mode()
    def store(self, req: Request) -> list[RequestEvent]:
        """Store a few layers of the staged prompt of ``req`` (complete: its last chunk ran): about as much work as
        a chunk, so no step stalls the running requests; when every layer is stored, its first token (sampled by
        the last chunk) is emitted and it decodes from the next step on."""
        p = self.progress.get(req)
        if p is None or p.stage is None or p.pending:  # failed or preempted since it was planned
            return []
        start, store, stage = time.perf_counter(), self.cache.store, p.stage
        layers = len(store.layers)
        per_step = max(1, math.ceil(layers * self.size / (len(req.prompt_ids) + len(req.output_ids))))
        try:
            for layer in sorted(stage.layers)[:per_step]:
                whole = stage.take(layer)
                store.prefill(layer, [req.slot], whole.padded_queries(), whole.keys, whole.values, whole.valid,
                              whole.scaling)
            if stage:
                self.hold_stage(req)  # the stored layers' staged pages go back (all of them below, when done)
        except PoolExhausted:
            return self.failed(req)
        finally:
            self.counters.prefill_seconds += time.perf_counter() - start
        if stage:
            return []
        self.forget(req)
        return self.outputs.append([req], [p.held_token])

    def failed(self, req: Request) -> list[RequestEvent]:
        """The pool cannot hold a chunk (or a staged prompt) now: start over later, at the worst case; a staged
        prompt that fails with nothing else running never fits."""
        if self.stage(req) is not None and self.scheduler.running == [req]:  # nothing else will give pages back
            return [self.outputs.finish(req, "error", "the KV pool cannot hold this prompt staged at full precision "
                                                      "(chunked_prefill='deferred'); raise the KV budget or use "
                                                      "chunked_prefill='extend'")]
        self.outputs.close(req)
        self.scheduler.requeue([req], worst_case=req)
        return []
