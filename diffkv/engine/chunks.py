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
  queries attend over the prompt so far (causal SDPA), each chunk as cheap as its share of a whole prefill; after
  the last chunk the whole prompt is stored with ``KVStore.prefill``, a few layers per step (about a chunk's work,
  so no step stalls the running requests): scored and split exactly as the prompt prefilled whole. Its first token
  (the last chunk's) is emitted when every layer is stored. The staged bytes are counted in the budget: pool pages
  taken (``PagePool.take_pages``) as the stage grows, given back as its layers are stored.

A chunk that does not fit in the pool sends the request back to the front of the queue (its pages freed), as a
prefill that does not fit does.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from diffkv.cache.staging import PromptStage
from diffkv.engine.mixed import ChunkWork
from diffkv.engine.request import Request, RequestEvent
from diffkv.engine.sampling import next_tokens
from diffkv.hf.layer import RoutedLayer
from diffkv.memory import PoolExhausted

CHUNKED_PREFILL = ("extend", "deferred")


class ExtendLayer(RoutedLayer):
    """Model layer ``layer_idx`` of a chunk's forward: its K/V go to table layer ``table_layer`` of ``slot``."""

    def __init__(self, router, layer_idx: int, store, table_layer: int, slot: int):
        super().__init__(layer_idx)
        self.router, self.store, self.table_layer, self.slot = router, store, table_layer, slot

    def next_phase(self, q: int) -> str:
        if self.processed:
            raise RuntimeError("a chunk's cache serves exactly one forward pass")
        return "extend"

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """query: [1, H_q, n, D]. Returns ([1, n, H_q, D], None)."""
        out = self.store.extend(self.table_layer, [self.slot], query, key, value, scaling)
        return out.to(query.dtype).transpose(1, 2), None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the mask is not used: the pages and the causal order of extend are the attention

    def get_seq_length(self) -> int:
        return 0


class StageLayer(ExtendLayer):
    """Model layer ``layer_idx`` of a staged chunk's forward (``"deferred"``): the chunk joins the prompt staged in
    ``stage`` (table layer ``table_layer``) and its queries attend over the staged prompt."""

    def __init__(self, router, layer_idx: int, store, table_layer: int, slot: int, stage: PromptStage):
        super().__init__(router, layer_idx, store, table_layer, slot)
        self.stage = stage

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """query: [1, H_q, n, D], the last n of the staged [1, H_kv, L, D]. Returns ([1, n, H_q, D], None)."""
        n = query.shape[2]
        staged = self.stage.add(self.table_layer, query, key, value,
                                torch.ones(1, n, dtype=torch.bool, device=key.device), scaling)
        cols = torch.arange(staged.keys.shape[2], device=key.device)
        out = F.scaled_dot_product_attention(query, staged.keys, staged.values, attn_mask=cols <= cols[-n:, None],
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None


class ChunkCache(Cache):
    """The cache of one chunk's forward (full-attention models: every model layer is paged); with ``stage``, a
    staged chunk."""

    def __init__(self, router, store, full_layers: list[int], slot: int, stage: PromptStage | None = None):
        if len(full_layers) != len(store.layers):
            raise ValueError("chunked prefill needs every model layer paged (no sliding-window layers)")
        super().__init__(layers=[ExtendLayer(router, i, store, t, slot) if stage is None
                                 else StageLayer(router, i, store, t, slot, stage) for t, i in enumerate(full_layers)])


class ChunkMixin:
    """The chunk half of :class:`~diffkv.engine.engine.Engine` (which provides the model, cache, scheduler,
    ``prefill_chunk``, ``chunked_prefill``, ``_append``, ``_finish`` and ``_close``)."""

    def _stage_long(self, reqs: list[Request]) -> list[Request]:
        """``"deferred"``: give each prompt of ``reqs`` longer than a chunk (and naming no shared prefix) a slot and
        an empty stage; its chunks go through :meth:`_take_chunk`. Returns the requests left for the prefill."""
        if self.chunked_prefill != "deferred" or self.prefill_chunk is None:
            return reqs
        rest = []
        for req in reqs:
            ids = req.prompt_ids + req.output_ids
            if len(ids) <= self.prefill_chunk or req.prefix_tokens:
                rest.append(req)
                continue
            req.slot, req.pending = self._open_slot(ids), ids
            req.stage, req.stage_pages = PromptStage(self.cache.config.score_window), None
        return rest

    def _hold_stage(self, req: Request, tokens: int = 0) -> None:
        """Hold pool pages that cover the stage of ``req`` once every staged layer holds ``tokens`` more (keys and
        values, plus the kept queries): take more, or give back what is no longer needed. Raises PoolExhausted,
        nothing taken, when they are not free."""
        store = self.cache.store
        size = next(self.model.parameters()).element_size()
        layers = len(req.stage.layers) or len(store.layers)  # the layers still staged (all before the first chunk)
        staged = req.stage.nbytes() + tokens * layers * store.num_kv_heads * self.cache.head_dim * 2 * size
        queries = layers * self.model.config.num_attention_heads * req.stage.score_window  # bound: the kept queries
        need = math.ceil((staged + queries * self.cache.head_dim * size) / store.page_bytes)
        held = 0 if req.stage_pages is None else req.stage_pages.numel()
        if need > held:
            more = store.take_pages(need - held, "chunked prefill (staged prompt)")
            req.stage_pages = more if req.stage_pages is None else torch.cat([req.stage_pages, more])
        elif need < held:
            store.give_pages(req.stage_pages[need:])
            req.stage_pages = req.stage_pages[:need]

    @torch.inference_mode()
    def _store_staged(self) -> list[RequestEvent]:
        """Store a few layers of the oldest staged prompt that is complete (its last chunk ran): about as much work
        as a chunk, so no step stalls the running requests; when every layer is stored, its first token (sampled
        by the last chunk) is emitted and it decodes from the next step on."""
        req = next((r for r in self.scheduler.running if r.stage is not None and not r.pending), None)
        if req is None:
            return []
        start, store, stage = time.perf_counter(), self.cache.store, req.stage
        layers = len(store.layers)
        per_step = max(1, math.ceil(layers * self.prefill_chunk / (len(req.prompt_ids) + len(req.output_ids))))
        try:
            for layer in sorted(stage.layers)[:per_step]:
                whole = stage.take(layer)
                store.prefill(layer, [req.slot], whole.padded_queries(), whole.keys, whole.values, whole.valid,
                              whole.scaling)
            if stage:
                self._hold_stage(req)  # the stored layers' staged pages go back (all of them below, when done)
        except PoolExhausted:
            return self._chunk_failed(req)
        finally:
            self.prefill_seconds += time.perf_counter() - start
        if stage:
            return []
        self._drop_stage(req)
        return self._append([req], [req.held_token])

    def _chunk_failed(self, req: Request) -> list[RequestEvent]:
        """The pool cannot hold a chunk (or a staged prompt) now: start over later, at the worst case; a staged
        prompt that fails with nothing else running never fits."""
        if req.stage is not None and self.scheduler.running == [req]:  # nothing else will give pages back
            return [self._finish(req, "error", "the KV pool cannot hold this prompt staged at full precision "
                                               "(chunked_prefill='deferred'); raise the KV budget or use "
                                               "chunked_prefill='extend'")]
        self._close(req)
        req.prefill_failed = True
        self.scheduler.requeue([req])
        return []

    def _drop_stage(self, req: Request) -> None:
        """Forget the staged chunks of ``req`` and give their pages back (nothing to do without a stage)."""
        if req.stage is not None:
            if req.stage_pages is not None:
                self.cache.store.give_pages(req.stage_pages)
            req.stage, req.stage_pages = None, None

    def _first_chunk(self, req: Request, ids: list[int]) -> list[int]:
        """The tokens of ``req`` its first prefill forward takes; the rest waits in ``req.pending``."""
        if self.prefill_chunk is None or len(ids) <= self.prefill_chunk:
            req.pending = []
            return ids
        req.pending = ids[self.prefill_chunk:]
        return ids[:self.prefill_chunk]

    def _take_chunk(self, skip: list[Request], events: list[RequestEvent]) -> ChunkWork | None:
        """The next chunk of the oldest running request that has one (not one of ``skip``, admitted now), its
        staged pages held (``"deferred"``); None when there is none or its pages are not free (then the request
        goes back to the queue, its events added to ``events``)."""
        req = next((r for r in self.scheduler.running if r.pending and r not in skip), None)
        if req is None:
            return None
        stage = req.stage
        ids = req.pending if self.prefill_chunk is None else req.pending[:self.prefill_chunk]
        pos = (self.cache.store.seen[req.slot] if stage is None
               else len(req.prompt_ids) + len(req.output_ids) - len(req.pending))
        if stage is not None:
            try:
                self._hold_stage(req, len(ids))
            except PoolExhausted:
                events += self._chunk_failed(req)
                return None
        return ChunkWork(req, ids, pos, stage)

    def _chunk_cache(self, work: ChunkWork) -> ChunkCache:
        return ChunkCache(self.cache.router, self.cache.store, self.cache.full_layers, work.req.slot, work.stage)

    @torch.inference_mode()
    def _run_chunk(self, work: ChunkWork) -> list[RequestEvent]:
        """Feed ``work`` in a forward of its own (no request decodes this step, or an ``"extend"`` chunk)."""
        start, dev = time.perf_counter(), self.device
        try:
            with self._model_call():
                out = self.model(input_ids=torch.tensor([work.ids], device=dev), use_cache=True, logits_to_keep=1,
                                 position_ids=torch.arange(work.pos, work.pos + len(work.ids), device=dev)[None],
                                 past_key_values=self._chunk_cache(work))
        except PoolExhausted:
            return self._chunk_failed(work.req)
        except (ValueError, RuntimeError) as e:
            return [self._finish(work.req, "error", f"chunked prefill failed: {e}")]
        finally:
            self.prefill_seconds += time.perf_counter() - start
        return self._chunk_done(work, out.logits[:, -1])

    def _chunk_done(self, work: ChunkWork, logits: torch.Tensor) -> list[RequestEvent]:
        """After the forward that fed ``work``: logits [1, V] of its last token (the first output token when it was
        the prompt's last chunk)."""
        req = work.req
        self.prefilled_tokens += len(work.ids)
        self.prefill_chunks += 1
        req.pending = req.pending[len(work.ids):]
        if req.pending:
            return []
        token = next_tokens(logits.float(), [req])
        if work.stage is not None:  # emitted once the staged prompt is stored (_store_staged)
            req.held_token = token[0]
            return []
        return self._append([req], token)
