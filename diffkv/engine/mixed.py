"""One model forward for a step's decodes, its prefills and a prompt chunk (issue #61): the prompts' tokens and
the running requests' new tokens are packed into one row, so the model's weights are read once per step instead of
once per kind of work (vLLM's and nano-vllm's mixed batches).

Packed row: the admitted prompts (each from position 0), then the chunk's ``n`` tokens (positions ``pos .. pos + n
- 1``), then one token per decoding request (its own position). Each model layer's attention splits the row again:
the prompts' rows attend causally within each prompt (the prefill's :class:`~diffkv.engine.step_cache.StepLayer`),
the chunk's join the staged prompt and attend over it (:class:`StageLayer`), the decode rows go to the step's decode
(pages reserved beforehand, :meth:`KVStore.decode`). Nothing that rides along may fail halfway and leave the decodes
half done: a staged chunk's pages are held before the forward, and the prompts' stores are recorded and run after it
(``DeferredTarget``: a prompt whose store fails is retried or failed alone); an ``"extend"`` chunk allocates as it
goes and keeps its own forward.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from diffkv.cache.staging import PromptStage
from diffkv.engine.step_cache import LayerTarget, StepCache
from diffkv.hf.layer import RoutedLayer
from diffkv.hf.routing import Router


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
        valid = torch.ones(1, query.shape[2], dtype=torch.bool, device=key.device)
        return self.stage.attend(self.table_layer, query, key, value, valid, scaling), None


class ChunkCache(Cache):
    """The cache of one chunk's forward (full-attention models: every model layer is paged); with ``stage``, a
    staged chunk."""

    def __init__(self, router, store, full_layers: list[int], slot: int, stage: PromptStage | None = None):
        if len(full_layers) != len(store.layers):
            raise ValueError("chunked prefill needs every model layer paged (no sliding-window layers)")
        super().__init__(layers=[ExtendLayer(router, i, store, t, slot) if stage is None
                                 else StageLayer(router, i, store, t, slot, stage) for t, i in enumerate(full_layers)])


class MixedLayer(RoutedLayer):
    """Model layer ``layer_idx`` of a mixed forward: the row's first tokens go to ``heads`` in order (each a layer
    of a prompt cache and its token count: the packed prefill, then the chunk), the others to ``decode`` (the
    step's :class:`~diffkv.engine.step_cache.LayerTarget`)."""

    def __init__(self, router: Router, layer_idx: int, heads: list[tuple[RoutedLayer, int]], decode: LayerTarget):
        super().__init__(layer_idx)
        self.router, self.heads, self.decode = router, heads, decode
        self.n = sum(n for _, n in heads)

    def next_phase(self, q: int) -> str:
        if self.processed or q <= self.n:
            raise RuntimeError(f"a mixed forward takes {self.n} prompt tokens and at least one decode token in one "
                               f"call, got {q} after {self.processed}")
        return "mixed"

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """query: [1, H_q, n + B, D]; key, value: [1, H_kv, n + B, D]. Returns ([1, n + B, H_q, D], None)."""
        outs, s = [], 0
        for layer, n in self.heads:
            outs.append(layer.attend(module, query[:, :, s:s + n], key[:, :, s:s + n], value[:, :, s:s + n], None,
                                     scaling)[0])
            s += n
        rows = [x[0, :, s:].transpose(0, 1) for x in (query, key, value)]  # [B, H, D] each
        out = self.decode.decode(*rows, scaling)  # [B, H_q, D] fp32
        return torch.cat([*outs, out.to(query.dtype)[None]], dim=1), None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the mask is not used: each part attends over what it holds

    def get_seq_length(self) -> int:
        return 0


class MixedCache(Cache):
    """The cache of one mixed forward: ``decode`` (the step's decode :class:`StepCache`, full-attention layers only)
    and ``heads`` (each a prompt cache, one layer per model layer, and its token count, in row order) joined layer
    by layer."""

    def __init__(self, router: Router, decode: StepCache, heads: list[tuple[Cache, int]]):
        if any(len(decode.layers) != len(c.layers) for c, _ in heads) or any(
                not hasattr(layer, "compressors") or layer.is_sliding for layer in decode.layers):
            raise ValueError("a mixed forward needs every model layer paged (no sliding-window layers)")
        super().__init__(layers=[MixedLayer(router, i, [(c.layers[i], n) for c, n in heads], d.compressors[0])
                                 for i, d in enumerate(decode.layers)])
