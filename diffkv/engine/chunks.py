"""Chunked prefill as scheduling (issue #44): a prompt longer than ``prefill_chunk`` tokens is prefilled over
several engine steps, so the running requests keep decoding while it arrives.

Its first chunk goes through the step's batched prefill like any prompt (compressed at once, nothing sampled);
each later step feeds the request's next chunk in a forward of its own, whose attention layers append it to the
request's pages with ``KVStore.extend`` (n decode steps: every token placed by the decode rule, the memory bounded
by what the pages hold); the last chunk's logits give the first token, and the request decodes from the next step
on. One chunk per step, of the oldest request with chunks left. A chunk that does not fit in the pool sends the
request back to the front of the queue (its pages freed), as a prefill that does not fit does.
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import Cache

from diffkv.engine.request import Request, RequestEvent
from diffkv.engine.sampling import next_tokens
from diffkv.hf.layer import RoutedLayer
from diffkv.memory import PoolExhausted


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


class ChunkCache(Cache):
    """The cache of one chunk's forward (full-attention models: every model layer is paged)."""

    def __init__(self, router, store, full_layers: list[int], slot: int):
        if len(full_layers) != len(store.layers):
            raise ValueError("chunked prefill needs every model layer paged (no sliding-window layers)")
        super().__init__(layers=[ExtendLayer(router, i, store, t, slot) for t, i in enumerate(full_layers)])


class ChunkMixin:
    """The chunk half of :class:`~diffkv.engine.engine.Engine` (which provides the model, cache, scheduler,
    ``prefill_chunk``, ``_append``, ``_finish`` and ``_close``)."""

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
        store = self.cache.store
        ids, pos = req.pending[:self.prefill_chunk], store.seen[req.slot]
        dev = self.device
        try:
            with self._model_call():
                out = self.model(input_ids=torch.tensor([ids], device=dev), use_cache=True, logits_to_keep=1,
                                 position_ids=torch.arange(pos, pos + len(ids), device=dev)[None],
                                 past_key_values=ChunkCache(self.cache.router, store, self.cache.full_layers,
                                                            req.slot))
        except PoolExhausted:  # the pool cannot hold the chunk now: start over later, at the worst case
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
