"""Chunked prefill as scheduling (issue #44): a prompt longer than ``prefill_chunk`` tokens is prefilled over
several engine steps, so the running requests keep decoding while it arrives. One chunk per step, of the oldest
request with chunks left, in a forward of its own; the last chunk's logits give the first token, and the request
decodes from the next step on. Two ways to store the chunks (``Engine(chunked_prefill=...)``):

* ``"extend"``: the first chunk goes through the step's batched prefill like any prompt (compressed at once,
  nothing sampled); each later chunk is appended to the request's pages with ``KVStore.extend`` (n decode steps:
  every token placed by the decode rule; memory bounded by what the pages hold, but a chunk costs n sequential
  decode steps per layer, and its tokens are demoted rather than pruned).
* ``"deferred"``: every chunk is held at full precision (:class:`~diffkv.cache.staging.PromptStage`), its queries
  attend over the prompt so far (causal SDPA), and the last chunk stores the whole prompt with ``KVStore.prefill``:
  scored and split exactly as the prompt prefilled whole, each chunk as cheap as its share of a whole prefill. The
  staged bytes are counted in the budget: pages taken off the pool (``PagePool.take_pages``) while the prompt is
  staged, given back before the last chunk's forward stores it (that forward holds the staged prompt uncounted,
  as a whole prefill holds its transient K/V).

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
    ``stage``; with the ``last`` chunk the whole prompt is stored in table layer ``table_layer`` of ``slot``."""

    def __init__(self, router, layer_idx: int, store, table_layer: int, slot: int, stage: PromptStage, last: bool):
        super().__init__(router, layer_idx, store, table_layer, slot)
        self.stage, self.last = stage, last

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """query: [1, H_q, n, D], the last n of the staged [1, H_kv, L, D]. Returns ([1, n, H_q, D], None)."""
        n = query.shape[2]
        staged = self.stage.add(self.table_layer, query, key, value,
                                torch.ones(1, n, dtype=torch.bool, device=key.device), scaling)
        cols = torch.arange(staged.keys.shape[2], device=key.device)
        out = F.scaled_dot_product_attention(query, staged.keys, staged.values, attn_mask=cols <= cols[-n:, None],
                                             scale=scaling, enable_gqa=True)
        if self.last:
            whole = self.stage.take(self.table_layer)
            self.store.prefill(self.table_layer, [self.slot], whole.padded_queries(), whole.keys, whole.values,
                               whole.valid, scaling)
        return out.transpose(1, 2), None


class ChunkCache(Cache):
    """The cache of one chunk's forward (full-attention models: every model layer is paged); with ``stage``, a
    staged chunk (``last``: the prompt's last)."""

    def __init__(self, router, store, full_layers: list[int], slot: int, stage: PromptStage | None = None,
                 last: bool = False):
        if len(full_layers) != len(store.layers):
            raise ValueError("chunked prefill needs every model layer paged (no sliding-window layers)")
        super().__init__(layers=[
            ExtendLayer(router, i, store, t, slot) if stage is None else StageLayer(router, i, store, t, slot, stage,
                                                                                    last)
            for t, i in enumerate(full_layers)])


class ChunkMixin:
    """The chunk half of :class:`~diffkv.engine.engine.Engine` (which provides the model, cache, scheduler,
    ``prefill_chunk``, ``chunked_prefill``, ``_append``, ``_finish`` and ``_close``)."""

    def _stage_long(self, reqs: list[Request]) -> list[Request]:
        """``"deferred"``: give each prompt of ``reqs`` longer than a chunk (and naming no shared prefix) a slot and
        an empty stage; its chunks go through :meth:`_next_chunk`. Returns the requests left for the prefill."""
        if self.chunked_prefill != "deferred" or self.prefill_chunk is None:
            return reqs
        rest = []
        for req in reqs:
            ids = req.prompt_ids + req.output_ids
            if len(ids) <= self.prefill_chunk or req.prefix_tokens:
                rest.append(req)
                continue
            req.slot, req.pending = self.cache.open_slot(), ids
            req.stage, req.stage_pages = PromptStage(self.cache.config.score_window), None
        return rest

    def _hold_stage(self, req: Request, tokens: int) -> None:
        """Take pages off the pool so that they cover the stage of ``req`` once it holds ``tokens`` more (keys and
        values of every layer, plus the kept queries). Raises PoolExhausted, nothing taken, when they are not free."""
        store, pool = self.cache.store, self.cache.kv.pool
        size = next(self.model.parameters()).element_size()
        staged = req.stage.nbytes() + tokens * len(store.layers) * store.num_kv_heads * self.cache.head_dim * 2 * size
        queries = len(store.layers) * self.model.config.num_attention_heads * req.stage.score_window
        need = math.ceil((staged + queries * self.cache.head_dim * size) / pool.page_bytes)
        held = 0 if req.stage_pages is None else req.stage_pages.numel()
        if need > held:
            more = pool.take_pages(need - held, "chunked prefill (staged prompt)")
            req.stage_pages = more if req.stage_pages is None else torch.cat([req.stage_pages, more])

    def _drop_stage(self, req: Request) -> None:
        """Forget the staged chunks of ``req`` and give their pages back (nothing to do without a stage)."""
        if req.stage is not None:
            if req.stage_pages is not None:
                self.cache.kv.pool.give_pages(req.stage_pages)
            req.stage, req.stage_pages = None, None

    def _first_chunk(self, req: Request, ids: list[int]) -> list[int]:
        """The tokens of ``req`` its first prefill forward takes; the rest waits in ``req.pending``."""
        if self.prefill_chunk is None or len(ids) <= self.prefill_chunk:
            req.pending = []
            return ids
        req.pending = ids[self.prefill_chunk:]
        return ids[:self.prefill_chunk]

    @torch.inference_mode()
    def _next_chunk(self, skip: list[Request]) -> list[RequestEvent]:
        """Feed the next chunk of the oldest running request that has one (not one of ``skip``, admitted now)."""
        req = next((r for r in self.scheduler.running if r.pending and r not in skip), None)
        if req is None:
            return []
        start = time.perf_counter()
        store, stage = self.cache.store, req.stage
        ids, last = req.pending[:self.prefill_chunk], len(req.pending) <= self.prefill_chunk
        pos = store.seen[req.slot] if stage is None else len(req.prompt_ids) + len(req.output_ids) - len(req.pending)
        dev = self.device
        try:
            if stage is not None:  # the last chunk's forward stores the prompt: the staged pages go back first
                self._hold_stage(req, len(ids)) if not last else self._drop_stage(req)
            with self._model_call():
                out = self.model(input_ids=torch.tensor([ids], device=dev), use_cache=True, logits_to_keep=1,
                                 position_ids=torch.arange(pos, pos + len(ids), device=dev)[None],
                                 past_key_values=ChunkCache(self.cache.router, store, self.cache.full_layers,
                                                            req.slot, stage, last))
        except PoolExhausted:  # the pool cannot hold the chunk now: start over later, at the worst case
            if stage is not None and self.scheduler.running == [req]:  # nothing else will give pages back
                return [self._finish(req, "error", "the KV pool cannot hold this prompt staged at full precision "
                                                   "(chunked_prefill='deferred'); raise the KV budget or use "
                                                   "chunked_prefill='extend'")]
            self._close(req)
            req.prefill_failed = True
            self.scheduler.requeue([req])
            return []
        except (ValueError, RuntimeError) as e:
            return [self._finish(req, "error", f"chunked prefill failed: {e}")]
        finally:
            self.prefill_seconds += time.perf_counter() - start
        self.prefilled_tokens += len(ids)
        self.prefill_chunks += 1
        req.pending = req.pending[len(ids):]
        return [] if req.pending else self._append([req], next_tokens(out.logits[:, -1].float(), [req]))
