"""A transformers ``Cache`` for one engine forward pass: hands each layer's K/V to that layer's compressor.

The engine runs the unmodified transformers model with ``past_key_values=StepCache(...)`` and explicit
``position_ids`` (ragged at decode: one position per sequence, no padding). Every layer's ``update`` registers
itself with the model's :class:`~diffkv.integrations.hf_attention.Router`; the ``diffkv`` attention function then
calls :meth:`StepLayer.attend`:

* ``prefill`` (one request, no padding): causal SDPA over the prompt, then the compressor stores it in pages;
* ``decode`` (the running requests, one token each): the compressor's decode step over the pages (pages were
  reserved beforehand for all layers at once by the backend).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from diffkv.compressor import LayerCompressor
from diffkv.integrations.hf_attention import Router, sdpa_attention_forward


class StepLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, router: Router, compressor: LayerCompressor, phase: str):
        super().__init__()
        self.router, self.compressor, self.phase = router, compressor, phase
        self.length = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states: [B, H_kv, q, D] post-RoPE; returned unchanged (attention reads the pages)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        if (self.phase == "decode" and q != 1) or self.length:
            raise RuntimeError(f"StepCache({self.phase}) got {q} tokens in call {self.length + 1}; "
                               "a StepCache serves exactly one forward pass")
        self.length = q
        self.router.expect(self.compressor.layer_idx, key_states, self)
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """query: [B, H_q, q, D]. Returns ([B, q, H_q, D], None)."""
        if self.phase == "prefill":
            kwargs.pop("is_causal", None)
            out, _ = sdpa_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=True,
                                            **kwargs)
            valid = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
            self.compressor.prefill(query, key, value, valid, scaling)
            return out, None
        out = self.compressor.decode(query[:, :, 0], key[:, :, 0], value[:, :, 0], scaling, reserved=True)
        return out.to(query.dtype).unsqueeze(1), None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the mask is not used: prefill is causal SDPA, decode reads its own pages

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class StepCache(Cache):
    """compressors: one :class:`LayerCompressor` per model layer, over the sequences of this pass."""

    def __init__(self, router: Router, compressors: list[LayerCompressor], phase: str):
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
        super().__init__(layers=[StepLayer(router, c, phase) for c in compressors])
