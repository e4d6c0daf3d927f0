"""Base class of the cache layers that compute their own attention (DiffKV pages, eviction baselines, the
engine's per-step layers).

``update`` returns the new K/V unchanged and leaves a pending entry on the model's
:class:`~diffkv.hf.routing.Router`; the ``diffkv`` attention function then calls the layer's ``attend`` with the
query, so the layer can attend over what it stores (and store the new tokens) in one place.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from diffkv.hf.shape import KVShape


class RoutedLayer(CacheLayerMixin):
    """A full-attention layer reached through the router. Subclasses provide ``router`` (the model's
    :class:`~diffkv.hf.routing.Router`) and ``attend(module, query, key, value, attention_mask, scaling, **kw)``
    returning ``([B, q, H_q, D], None)``; ``phase`` is ``"prefill"`` for the first call and ``"extend"`` (one
    token or several) after, as :meth:`next_phase` decides."""

    is_sliding = False

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.processed = 0  # columns seen (incl. left padding): what generate() uses for positions
        self.phase: str | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def next_phase(self, q: int) -> str:
        """The phase of a call adding ``q`` tokens; raises ``NotImplementedError`` for what the layer cannot do."""
        if self.processed == 0:
            return "prefill"
        if q == 1:
            return "decode"
        raise NotImplementedError(f"{type(self).__name__}: adding {q} tokens to a filled cache (chunked prefill, "
                                  "assisted decoding, multi-turn reuse) is not supported")

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states: [B, H_kv, q, D] post-RoPE; returned unchanged (``attend`` reads the layer)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        self.phase = self.next_phase(q)
        self.router.expect(self.layer_idx, key_states, self)
        self.processed += q
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        raise NotImplementedError

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.processed + query_length, 0

    def get_seq_length(self) -> int:
        return self.processed

    def get_max_length(self) -> int:
        return -1


def cache_layers(shape: KVShape, full_layer: Callable[[int], CacheLayerMixin]) -> list[CacheLayerMixin]:
    """One layer per model layer: ``full_layer(i)`` for full attention, transformers' sliding-window layer (kept
    uncompressed: it never attends outside its window) for the sliding ones."""
    return [DynamicSlidingWindowLayer(sliding_window=shape.sliding_window) if t == "sliding_attention"
            else full_layer(i) for i, t in enumerate(shape.layer_types)]
